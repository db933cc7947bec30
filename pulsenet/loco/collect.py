"""The collect phase of a round: who takes part, decided once, by whoever writes the record first.

While its own payload uploads, a trainer polls the store. Each poll reads ``rounds/<r>/record``
(if it exists, it decides the round: follow it) and the manifest of every trusted trainer not seen
yet: GETs only, never a LIST (the dearest request class), so an idle poll costs one GET for the
record and one per missing peer, each a 404 with no body until the document is written. (A
conditional GET would not save more: these documents are create-only, absent until written and
never changed after.) A verified manifest starts a task that fetches the payload, checks its
size and SHA-256, decodes it against the model's shapes and validates it. When every started
task is done and either ``workers_expected`` payloads are in or the deadline has passed with a
quorum of valid ones, the trainer proposes a record (create-only). Losing that race is normal:
it then reads and follows the winner's record. Why this is safe: docs/loco.md, "Participant-set
agreement".

Waiting is never silent: ``progress`` says whose payload is missing and since when, and a line is
logged every ``progress_log_s``. A store that stops answering costs polls, never the round: the
round gives up (``RoundTimeout``) only once ``round_timeout_s`` has passed *and* the store has
answered every poll for the last ``deadline_s`` (peers' uploads retry when it comes back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import (
    ManifestError,
    PayloadError,
    PulsenetError,
    RoundError,
    RoundTimeout,
    StoreError,
    VerificationError,
)
from pulsenet.loco import algorithm as alg
from pulsenet.loco.config import MODES, LocoConfig
from pulsenet.loco.documents import Manifest, Record, RoundStore
from pulsenet.loco.progress import LocoStats, Progress, transient
from pulsenet.runtime import all_of
from pulsenet.signed import ObjectRef

log = logging.getLogger(__name__)

Entry = tuple[wire.Payload, float, ObjectRef]
"""A judged payload: decoded, validated, its L2 norm, and the object it came from."""


Base = Mapping[str, torch.Tensor]
"""The global FP32 weights θ a round starts from: sparse payloads code their values relative to them."""


class DecodedPayloads(Protocol):
    """Decoded payloads by (object, base digest), shared by the trainers of one process (a benchmark:
    ``pulsenet.bench.loco_phases.SharedPayloads``), so that N simulated trainers hold one decoded
    copy of each payload instead of N. Sound because payloads are content-addressed and never
    mutated once decoded, and their values depend only on the bytes and the base weights, named by
    the digest of the global state they belong to. Bytes put into the store are unaffected."""

    async def get(self, ref: ObjectRef, base_digest: str) -> wire.Payload | None: ...

    def put(self, ref: ObjectRef, base_digest: str, payload: wire.Payload) -> None: ...

    def evict_before(self, round_: int) -> None:
        """Forget payloads of rounds before ``round_`` (called as a trainer opens that round)."""
        ...


@dataclass(frozen=True, slots=True)
class _Context:
    """What one collect phase decodes and judges against."""

    round: int
    base: Base
    base_digest: str
    weights_norm: float
    """‖θ‖ of ``base``: the absolute bound on any payload's norm."""
    own_reference: bool
    """Our own payload is a reference for the others' norms (we trained this round)."""
    absent: frozenset[str] = frozenset()
    """Trainers not in the previous round's record: waited for ``absent_wait_s`` unless joining."""
    joining: set[str] = field(default_factory=set)
    """Of those, the ones that announced they train this round (waited for until the deadline)."""
    warned: set[str] = field(default_factory=set)
    """Members whose manifest the store failed to serve this round (warned once)."""


class Collector:
    """One trainer's collect phase, and the loader of payloads that records name (also used by replay)."""

    def __init__(
        self,
        rs: RoundStore,
        config: LocoConfig,
        shapes: Mapping[str, tuple[int, ...]],
        cache: DecodedPayloads | None = None,
        *,
        progress: Progress | None = None,
        stats: LocoStats | None = None,
    ) -> None:
        self.rs, self.config, self.shapes, self.cache = rs, config, dict(shapes), cache
        self.max_payload = wire.max_size(self.shapes)
        """The largest valid payload for this model (``payload.max_size``): a signed size above it
        is refused before a byte is read."""
        self.id = rs.id
        self.mode = MODES[config.mode]
        self.screen = alg.NormScreen(config.norm_factor, config.norm_weights_factor, config.norm_min_payloads)
        self.progress = progress if progress is not None else Progress(trainer=self.id)
        self.stats = stats if stats is not None else LocoStats()
        self._weights_norm: tuple[str, float] = ("", 0.0)
        """(base digest, ‖θ‖) of the last base judged against."""
        self.last_norms: dict[str, float] = {}
        """Norms of the payloads the last record loaded named (reports)."""
        self.last_weights_norm = 0.0

    async def weights_norm(self, base: Base, base_digest: str | None) -> float:
        """‖θ‖ of ``base`` (in a thread; remembered by digest: a round needs it once)."""
        if base_digest is not None and self._weights_norm[0] == base_digest:
            return self._weights_norm[1]
        norm = await asyncio.to_thread(alg.weights_norm, base)
        if base_digest is not None:
            self._weights_norm = (base_digest, norm)
        return norm

    async def collect(
        self,
        r: int,
        upload: asyncio.Task[tuple[bytes, ObjectRef]],
        base: Base,
        base_digest: str,
        *,
        own_reference: bool = True,
        absent: frozenset[str] = frozenset(),
    ) -> tuple[Record, dict[str, wire.Payload]]:
        """The round's record and the decoded payload of every participant it names.

        ``absent``: trainers that were not in the previous round's record. Once our payload is in,
        the round waits ``absent_wait_s`` for them, not ``deadline_s``, unless one announces that it
        trains this round (``RoundStore.is_joining``): a trainer that is down delays one round by the
        deadline, not every round, and one that comes back is waited for again.

        ``upload`` is our own publish task (returning the bytes that stand in the store and their
        reference); ``base`` the global weights we trained from (payloads are decoded against
        them) and ``base_digest`` the digest of that state (goes into a proposal).
        ``own_reference``: our payload is a fair reference for the others' norms (we trained the
        full H steps this round; a short round's payload is smaller, so we judge by the median and
        ‖θ‖ alone).
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline, give_up, next_log = start + cfg.deadline_s, start + cfg.round_timeout_s, start + cfg.progress_log_s
        last_failure = -math.inf
        ctx = _Context(r, base, base_digest, await self.weights_norm(base, base_digest), own_reference, absent)
        early = start + min(cfg.absent_wait_s, cfg.deadline_s)
        fetches: dict[str, asyncio.Task[Entry]] = {self.id: asyncio.create_task(self._own_entry(ctx, upload))}
        unreadable: dict[
            str, str
        ] = {}  # members whose manifest failed verification, why: warned once, skipped
        try:
            while True:
                try:
                    record = await self._poll_once(ctx, fetches, unreadable, deadline, early)
                    self.progress.store_ok()
                except StoreError as e:  # a store failure costs a poll, not the round
                    log.warning("%s: round %d: store error while polling: %s", self.id, r, e)
                    self.progress.store_failed(e)
                    self.stats.store_failures += 1
                    last_failure, record = loop.time(), None
                if record is not None:
                    break
                now = loop.time()
                missing = self._missing(fetches, unreadable)
                pending = [t for t, task in sorted(fetches.items()) if not task.done()]
                self.progress.wait(missing + pending, self._why_waiting(missing, pending, now >= deadline))
                if now >= next_log:
                    next_log = now + cfg.progress_log_s
                    log.warning(
                        "%s: round %d: still collecting after %.0f s: %s; store %s",
                        *(self.id, r, now - start, self.progress.describe(),
                          "unreachable" if self.progress.store_unreachable else "answering"),
                    )  # fmt: skip
                if now >= give_up and now - last_failure >= cfg.deadline_s:
                    raise RoundTimeout(
                        f"round {r}: no quorum of {cfg.quorum} valid payloads within {cfg.round_timeout_s:g} s "
                        f"(have {sorted(fetches)}, waiting for {missing + pending})"
                    )
                await self.sleep()
            for tid, why in sorted(record.rejected.items()):
                log.warning("%s: round %d: payload of %s rejected: %s", self.id, r, tid, why)
            for tid, why in sorted(record.unavailable.items()):
                log.warning("%s: round %d: payload of %s unavailable: %s", self.id, r, tid, why)
            if record.base_digest and record.base_digest != base_digest:
                log.warning(
                    "%s: round %d: record writer %s trained from base %s, ours is %s",
                    *(self.id, r, record.writer, record.base_digest[:16], base_digest[:16]),
                )
            own = self._own_norm(ctx, fetches)
            return record, await self._record_payloads(record, ctx.base, ctx.base_digest, fetches, own_norm=own)
        finally:
            for t in fetches.values():
                t.cancel()
            await asyncio.gather(*fetches.values(), return_exceptions=True)

    async def load_record(
        self, record: Record, base: Base, base_digest: str | None = None
    ) -> dict[str, wire.Payload]:
        """The payloads a record names, each fetched, bound to its owner's manifest, validated and
        decoded against ``base``, and screened as a whole (replays and repairs; base_digest None:
        no cache)."""
        return await self._record_payloads(record, base, base_digest, {}, own_norm=None)

    def _why_waiting(self, missing: list[str], pending: list[str], past_deadline: bool) -> str:
        quorum = self.config.quorum
        if self.id in pending:
            return "our own payload is not in the store yet (its upload retries)"
        if missing and not past_deadline:
            return f"waiting for every trainer's payload until the deadline (quorum {quorum})"
        if missing:
            return f"past the deadline without a quorum of {quorum} valid payloads"
        return "fetching and checking payloads"

    def _own_norm(self, ctx: _Context, fetches: Mapping[str, asyncio.Task[Entry]]) -> float | None:
        """Our own payload's norm if it is a reference this round (trained, valid), else None."""
        task = fetches.get(self.id)
        if not ctx.own_reference or task is None or not task.done() or task.cancelled() or task.exception():
            return None
        return task.result()[1]

    async def _load(self, ref: ObjectRef, base: Base, base_digest: str | None) -> tuple[wire.Payload, float]:
        """A payload a record names, and its norm, from the store or the cache.

        The record's writer judged it, but a record is only as good as its writer's key: the
        payload must be the one its owner's own signed manifest names (a record cannot speak for
        another trainer), and for its round and mode, with finite values.
        """
        parsed = self.rs.layout.parse_payload(ref.key)
        if parsed is None:
            raise ManifestError(f"{ref.key}: not a payload key")
        tid, r = parsed
        manifest = await self.rs.read_manifest(tid, r)
        if manifest is None or manifest.payload != ref:
            raise VerificationError(
                f"{ref.key}: not the payload that {tid}'s signed round-{r} manifest names"
            )
        cached = await self._cached(ref, base_digest)
        payload = (
            cached
            if cached is not None
            else await self._decode(await self._fetch(ref), ref, base, base_digest)
        )
        return payload, await asyncio.to_thread(alg.validate, payload, round=r, mode=self.mode)

    async def sleep(self) -> None:
        """One poll interval, jittered x0.5-1.5 so trainers do not poll in lockstep."""
        await asyncio.sleep(self.config.poll_s * random.uniform(0.5, 1.5))

    # --- one poll -----------------------------------------------------------------------------

    async def _poll_once(
        self,
        ctx: _Context,
        fetches: dict[str, asyncio.Task[Entry]],
        unreadable: dict[str, str],
        deadline: float,
        early: float,
    ) -> Record | None:
        """One look at the store: the round's record if it exists (or we just wrote it), else None.
        A round closes on a quorum once every trainer's payload is in, past the deadline, or past
        ``early`` when every trainer still missing is absent and not joining."""
        r = ctx.round
        record = await self.read_record(r)
        if record is not None:
            self._log_follow(r, record)
            return record
        for tid in self._missing(fetches, unreadable):  # every trusted trainer: no LIST of members/ per poll
            manifest = await self._try_manifest(tid, r, unreadable, ctx.warned)
            if manifest is not None:
                fetches[tid] = asyncio.create_task(self._fetch_entry(ctx, manifest.payload))
        if not all(t.done() for t in fetches.values()):
            return None
        proposal = self._proposal(ctx, fetches, unreadable)
        complete = len(fetches) >= self.config.expected
        now = asyncio.get_running_loop().time()
        if proposal is None or not (
            complete or now >= deadline or (now >= early and await self._only_absent(ctx, fetches, unreadable))
        ):
            return None
        record, won = await self.rs.propose_record(proposal)
        if won:
            log.info("%s: round %d: wrote the record %s", self.id, r, sorted(record.participants))
        else:
            self._log_follow(r, record)
        return record

    def _missing(self, fetches: Mapping[str, object], unreadable: Mapping[str, str]) -> list[str]:
        """Trusted trainers whose payload this round has neither arrived nor been ruled unreadable."""
        return [t for t in sorted(self.rs.keys) if t not in fetches and t not in unreadable]

    async def _only_absent(
        self, ctx: _Context, fetches: Mapping[str, asyncio.Task[Entry]], unreadable: Mapping[str, str]
    ) -> bool:
        """Whether every trainer still missing is absent and has not announced it joins (one signed
        GET per such trainer per poll, from ``early`` on; a joining one is waited for from then on)."""
        missing = self._missing(fetches, unreadable)
        for tid in missing:
            if tid not in ctx.absent or tid in ctx.joining:
                return False
            try:
                joining = await self.rs.is_joining(tid, ctx.round)
            except ManifestError as e:  # planted or malformed: that trainer has not said it joins
                log.warning("%s: round %d: ignoring %s's joining document: %s", self.id, ctx.round, tid, e)
                joining = False
            if joining:
                log.info("%s: round %d: %s is back and joins this round; waiting for it", self.id, ctx.round, tid)
                ctx.joining.add(tid)
                return False
        if missing:
            log.info("%s: round %d: closing without %s (absent last round, not joining)", self.id, ctx.round, missing)
        return True

    async def read_record(self, r: int) -> Record | None:
        """Round r's record, if written; RoundError if what stands there cannot be followed.

        A record that fails verification (planted, foreign, malformed) or names fewer than a quorum
        occupies the create-only key for good: the round cannot complete, and says so as a
        RoundError (retried, then fatal) rather than any other exception.
        """
        try:
            record = await self.rs.read_record(r)
        except ManifestError as e:
            raise RoundError(f"round {r}: the round record in the store cannot be used: {e}") from e
        if record is not None and len(record.participants) < self.config.quorum:
            raise RoundError(
                f"round {r}: the record by {record.writer} names {len(record.participants)} participants, "
                f"fewer than the quorum of {self.config.quorum}"
            )
        return record

    def _log_follow(self, r: int, record: Record) -> None:
        if record.writer != self.id:
            log.info(
                "%s: round %d: following %s's record %s",
                self.id,
                r,
                record.writer,
                sorted(record.participants),
            )

    async def _try_manifest(
        self, tid: str, r: int, unreadable: dict[str, str], warned: set[str]
    ) -> Manifest | None:
        """``tid``'s verified manifest, or None: one member's bad or unreachable manifest never stops
        the poll from reading the others'."""
        try:
            return await self.rs.read_manifest(tid, r)
        except (ManifestError, VerificationError) as e:
            # unverifiable (planted, foreign, malformed, oversized): that trainer is out this round, loudly
            log.warning("%s: round %d: ignoring %s's manifest: %s", self.id, r, tid, e)
            unreadable[tid] = f"{type(e).__name__}: {str(e)[:300]}"
        except StoreError as e:  # transient: try this member again next poll (warned once a round)
            if tid not in warned:
                warned.add(tid)
                log.warning("%s: round %d: store error reading %s's manifest (retrying each poll): %s", self.id, r, tid, e)
        return None

    def _proposal(
        self,
        ctx: _Context,
        fetches: Mapping[str, asyncio.Task[Entry]],
        unreadable: Mapping[str, str] | None = None,
    ) -> Record | None:
        """The record this trainer would write now, or None if it would not reach the quorum.
        ``unreadable``: members whose manifest could not be used, and why (recorded as unavailable)."""
        r = ctx.round
        norms: dict[str, float] = {}
        refs: dict[str, ObjectRef] = {}
        rejected: dict[str, str] = {}
        unavailable: dict[str, str] = dict(unreadable or {})
        for tid, task in sorted(fetches.items()):
            exc = task.exception()
            if exc is None:
                _, norms[tid], refs[tid] = task.result()
            elif isinstance(exc, PayloadError):
                rejected[tid] = f"{type(exc).__name__}: {exc}"
            elif isinstance(exc, PulsenetError):  # store, signature or hash failures: not the payload's fault
                unavailable[tid] = f"{type(exc).__name__}: {exc}"
            else:
                raise exc
        # To a fixed point: what remains passes the screen on its own, as every reader checks.
        own = self.id if ctx.own_reference else None
        for tid, why in self.screen.exclude(norms, own=own, weights_norm=ctx.weights_norm).items():
            rejected[tid] = f"PayloadError: {why}"
            del refs[tid], norms[tid]
        if len(refs) < self.config.quorum:
            return None
        return Record(
            round=r, writer=self.id, participants=refs, rejected=rejected, unavailable=unavailable,
            base_digest=ctx.base_digest,
        )  # fmt: skip

    # --- fetching and judging payloads ------------------------------------------------------------

    async def _own_entry(self, ctx: _Context, upload: asyncio.Task[tuple[bytes, ObjectRef]]) -> Entry:
        """Our own payload, judged exactly like a peer's: decoded from the bytes we published."""
        data, ref = await asyncio.shield(upload)  # cancelling this entry must not cancel the upload
        return await self._judge(ctx, data, ref)

    async def _fetch_entry(self, ctx: _Context, ref: ObjectRef) -> Entry:
        cached = await self._cached(ref, ctx.base_digest)
        if cached is not None:
            return cached, await asyncio.to_thread(alg.validate, cached, round=ctx.round, mode=self.mode), ref
        return await self._judge(ctx, await self._fetch(ref), ref)

    async def _fetch(self, ref: ObjectRef) -> bytes:
        """A payload's bytes, read only if the size its sender signed fits the model: a valid
        payload is never larger than ``max_payload``, so a claim above it is the sender's fault
        (a PayloadError: rejected and counted) and costs no read. The store reads at most the
        signed size (``fetch_object``)."""
        if ref.size > self.max_payload:
            raise PayloadError(
                f"{ref.key}: {ref.size} bytes claimed, more than the {self.max_payload} bytes of the "
                f"largest valid payload for this model"
            )
        return await self.rs.fetch(ref)

    async def _judge(self, ctx: _Context, data: bytes, ref: ObjectRef) -> Entry:
        """Decode (format, shapes, index bounds) and validate (round, mode, finite values); returns the norm."""
        payload = await self._decode(data, ref, ctx.base, ctx.base_digest)
        norm = await asyncio.to_thread(alg.validate, payload, round=ctx.round, mode=self.mode)
        return payload, norm, ref

    async def _cached(self, ref: ObjectRef, base_digest: str | None) -> wire.Payload | None:
        """The shared decoded copy, if any."""
        if self.cache is None or base_digest is None:
            return None
        return await self.cache.get(ref, base_digest)

    async def _decode(self, data: bytes, ref: ObjectRef, base: Base, base_digest: str | None) -> wire.Payload:
        payload = await asyncio.to_thread(wire.decode, data, self.shapes, base)
        if self.cache is not None and base_digest is not None:
            self.cache.put(ref, base_digest, payload)
        return payload

    async def _record_payloads(
        self,
        record: Record,
        base: Base,
        base_digest: str | None,
        fetches: Mapping[str, asyncio.Task[Entry]],
        *,
        own_norm: float | None,
    ) -> dict[str, wire.Payload]:
        """The decoded payload of every participant the record names, reusing fetches already done;
        RoundError if one cannot be used or the set fails the reader's check (``NormScreen.refuse``,
        against ``own_norm``, our own payload's norm this round if it is a reference). A store that
        cannot serve one right now raises its transient StoreError as itself: the round is retried,
        not counted against the record."""

        async def one(tid: str) -> tuple[wire.Payload, float]:
            ref = record.participants[tid]
            task = fetches.get(tid)
            if task is not None:
                with contextlib.suppress(PulsenetError):
                    payload, norm, got = await task
                    if got == ref:
                        return payload, norm
            try:
                return await self._load(ref, base, base_digest)
            except StoreError as e:
                if transient(e):
                    raise
                raise RoundError(
                    f"round {record.round}: cannot use participant {tid}'s payload named by the record: {e}"
                ) from e
            except PulsenetError as e:
                raise RoundError(
                    f"round {record.round}: cannot use participant {tid}'s payload named by the record: {e}"
                ) from e

        tids = sorted(record.participants)
        judged = await all_of(one(t) for t in tids)  # one failure cancels the rest
        norms = {t: norm for t, (_, norm) in zip(tids, judged, strict=True)}
        # Writers screen to a fixed point (_proposal), so an honest record passes this with room
        # for a writer that judged against its own norm; a record that averages an absurd payload does not.
        weights_norm = await self.weights_norm(base, base_digest)
        self.last_norms, self.last_weights_norm = norms, weights_norm
        outsized = self.screen.refuse(norms, own=own_norm, weights_norm=weights_norm)
        if outsized:
            raise RoundError(
                f"round {record.round}: {record.writer}'s record averages payloads the norm screen rejects: {outsized}"
            )
        return {t: payload for t, (payload, _) in zip(tids, judged, strict=True)}
