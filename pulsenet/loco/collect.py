"""The collect phase of a round: who takes part, decided once, by whoever writes the record first.

While its own payload uploads, a trainer polls the store. Each poll reads ``rounds/<r>/record``
(if it exists, it decides the round: follow it), lists the members and reads the manifest of
every member not seen yet. A verified manifest starts a task that fetches the payload, checks its
size and SHA-256, decodes it against the model's shapes and validates it. When every started
task is done and either ``workers_expected`` payloads are in or the deadline has passed with a
quorum of valid ones, the trainer proposes a record (create-only). Losing that race is normal:
it then reads and follows the winner's record. Why this is safe: docs/loco.md, "Participant-set
agreement".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import (
    ManifestError,
    PayloadError,
    PulsenetError,
    RoundError,
    StoreError,
    VerificationError,
)
from pulsenet.loco import algorithm as alg
from pulsenet.loco.config import MODES, LocoConfig
from pulsenet.loco.documents import Manifest, Record, RoundStore, all_of
from pulsenet.signed import ObjectRef

log = logging.getLogger(__name__)

SCREEN_SLACK = 1.001
"""A reader re-applies the norm screen to a record's set with this much room (norms are sums of
squares, computed in a different order on another machine)."""
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


class Collector:
    """One trainer's collect phase, and the loader of payloads that records name (also used by replay)."""

    def __init__(
        self,
        rs: RoundStore,
        config: LocoConfig,
        shapes: Mapping[str, tuple[int, ...]],
        cache: DecodedPayloads | None = None,
    ) -> None:
        self.rs, self.config, self.shapes, self.cache = rs, config, dict(shapes), cache
        self.id = rs.id
        self.mode = MODES[config.mode]

    async def collect(
        self, r: int, upload: asyncio.Task[tuple[bytes, ObjectRef]], base: Base, base_digest: str
    ) -> tuple[Record, dict[str, wire.Payload]]:
        """The round's record and the decoded payload of every participant it names.

        ``upload`` is our own publish task (returning the bytes that stand in the store and their
        reference); ``base`` the global weights we trained from (payloads are decoded against
        them) and ``base_digest`` the digest of that state (goes into a proposal).
        """
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline, give_up = loop.time() + cfg.deadline_s, loop.time() + cfg.round_timeout_s
        ctx = _Context(r, base, base_digest)
        fetches: dict[str, asyncio.Task[Entry]] = {self.id: asyncio.create_task(self._own_entry(ctx, upload))}
        unreadable: dict[
            str, str
        ] = {}  # members whose manifest failed verification, why: warned once, skipped
        try:
            while True:
                try:
                    record = await self._poll_once(ctx, fetches, unreadable, deadline)
                except StoreError as e:  # a transient store failure costs a poll, not the round
                    log.warning("%s: round %d: store error while polling: %s", self.id, r, e)
                    record = None
                if record is not None:
                    break
                if loop.time() >= give_up:
                    raise RoundError(
                        f"round {r}: no quorum of {cfg.quorum} valid payloads within {cfg.round_timeout_s:g} s "
                        f"(have {sorted(fetches)})"
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
            return record, await self._record_payloads(record, ctx.base, ctx.base_digest, fetches)
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
        return await self._record_payloads(record, base, base_digest, {})

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
            else await self._decode(await self.rs.fetch(ref), ref, base, base_digest)
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
    ) -> Record | None:
        """One look at the store: the round's record if it exists (or we just wrote it), else None."""
        r = ctx.round
        record = await self.read_record(r)
        if record is not None:
            self._log_follow(r, record)
            return record
        for tid in await self.rs.members():
            if tid not in fetches and tid not in unreadable:
                manifest = await self._try_manifest(tid, r, unreadable)
                if manifest is not None:
                    fetches[tid] = asyncio.create_task(self._fetch_entry(ctx, manifest.payload))
        if not all(t.done() for t in fetches.values()):
            return None
        proposal = self._proposal(r, fetches, ctx.base_digest, unreadable)
        complete = len(fetches) >= self.config.expected
        if proposal is None or not (complete or asyncio.get_running_loop().time() >= deadline):
            return None
        record, won = await self.rs.propose_record(proposal)
        if won:
            log.info("%s: round %d: wrote the record %s", self.id, r, sorted(record.participants))
        else:
            self._log_follow(r, record)
        return record

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

    async def _try_manifest(self, tid: str, r: int, unreadable: dict[str, str]) -> Manifest | None:
        """``tid``'s verified manifest, or None: one member's bad or unreachable manifest never stops
        the poll from reading the others'."""
        try:
            return await self.rs.read_manifest(tid, r)
        except (ManifestError, VerificationError) as e:
            # unverifiable (planted, foreign, malformed, oversized): that trainer is out this round, loudly
            log.warning("%s: round %d: ignoring %s's manifest: %s", self.id, r, tid, e)
            unreadable[tid] = f"{type(e).__name__}: {str(e)[:300]}"
        except StoreError as e:  # transient: try this member again next poll
            log.warning("%s: round %d: store error reading %s's manifest: %s", self.id, r, tid, e)
        return None

    def _proposal(
        self,
        r: int,
        fetches: Mapping[str, asyncio.Task[Entry]],
        base_digest: str,
        unreadable: Mapping[str, str] | None = None,
    ) -> Record | None:
        """The record this trainer would write now, or None if it would not reach the quorum.
        ``unreadable``: members whose manifest could not be used, and why (recorded as unavailable)."""
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
        cfg = self.config
        # To a fixed point: what remains passes the screen on its own, as every reader checks.
        while outsized := alg.screen_norms(norms, factor=cfg.norm_factor, min_payloads=cfg.norm_min_payloads):
            for tid, why in outsized.items():
                rejected[tid] = f"PayloadError: {why}"
                del refs[tid], norms[tid]
        if len(refs) < cfg.quorum:
            return None
        return Record(
            round=r, writer=self.id, participants=refs, rejected=rejected, unavailable=unavailable,
            base_digest=base_digest,
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
        return await self._judge(ctx, await self.rs.fetch(ref), ref)

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
        self, record: Record, base: Base, base_digest: str | None, fetches: Mapping[str, asyncio.Task[Entry]]
    ) -> dict[str, wire.Payload]:
        """The decoded payload of every participant the record names, reusing fetches already done;
        RoundError if one cannot be used or the set fails the norm screen."""

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
            except PulsenetError as e:
                raise RoundError(
                    f"round {record.round}: cannot use participant {tid}'s payload named by the record: {e}"
                ) from e

        tids = sorted(record.participants)
        judged = await all_of(one(t) for t in tids)  # one failure cancels the rest
        norms = {t: norm for t, (_, norm) in zip(tids, judged, strict=True)}
        # Writers screen to a fixed point (_proposal), so an honest record passes this with room
        # for a last-bit difference in a norm; a record that averages an outsized payload does not.
        cfg = self.config
        outsized = alg.screen_norms(
            norms, factor=cfg.norm_factor * SCREEN_SLACK, min_payloads=cfg.norm_min_payloads
        )
        if outsized:
            raise RoundError(
                f"round {record.round}: {record.writer}'s record averages payloads the norm screen rejects: {outsized}"
            )
        return {t: payload for t, (payload, _) in zip(tids, judged, strict=True)}
