"""The PULSELoCo round, top to bottom: one trainer node's part in it (DiLoCo, Douillard et al.
2023, with PULSE's sparse exchange, arXiv 2602.03839; spec and safety arguments: docs/loco.md).

Per round r, from the agreed global state (θ_{r-1}, m_{r-1}) and this trainer's error feedback e
(:meth:`LocoTrainer.run_round` reads exactly like this)::

    0. behind?   rounds/r/record exists without us -> catch up from the store
    1. train     H inner steps from θ_{r-1}            the caller's inner phase, or SelfTraining.train
    2. encode    s = e + θ_{r-1} - θ_local, visibility gate, payload     algorithm, payload (thread)
       publish   payload, then its signed manifest                       background task
    3. collect   peers' payloads as their manifests appear; the round    collect.py
                 record, written first-writer-wins or followed
    4. apply     mean of the record's payloads, outer Nesterov step:     algorithm (thread)
                 θ_r, m_r; e keeps what was not sent
    5. agree     publish digest(θ_r, m_r), compare with the participants';
                 outside the majority: rebuild from the store            recovery.py
    6. persist   local resume point (atomic), every few rounds to the store,
                 the agreed global state every ``state_every`` rounds    background tasks

With ``overlap`` (the one-round-delayed outer step) step 1 of round r+1 runs while steps 3-4 of
round r run, and its progress is re-based onto θ_r: the same :meth:`LocoTrainer.run_round`.

What trains is an :class:`~pulsenet.loco.inner.InnerLoop` (supervised, GRPO: ``pulsenet.rl.inner``).
Who drives it is the caller's choice, the way torchft's DiLoCo makes the outer sync a step the
training loop calls: ``await trainer.run(rounds)`` lets the round run ``SelfTraining.train`` itself (a
benchmark, ``pulsenet loco train``); a node that owns its data (the trainer daemon) opens
``trainer.session()`` and calls ``await trainer.next_round(train)`` once per round, where
``train(r)`` is its own inner phase (H steps on batches it took, in a thread) returning the losses;
the round never calls back into its caller for data, and the caller reads how it goes from plain
records: ``trainer.progress`` (phase, round, whom it waits for, the store's last answer) and
``trainer.stats`` (counters), ``loco/progress.py``. Store outages are waited out, never counted as
failures; own uploads retry until they land (docs/loco.md §6, "Outages").
Each step's work is entered through ``on_phase(name, round)``, an optional async context manager
factory: a benchmark shares cores and times phases with it (``pulsenet.bench.loco_phases``), a
test injects a straggler. Phases: ``inner``, ``encode``, ``upload``, ``collect``, ``apply``,
``agree``, ``persist`` (each tagged with its round; the overlapped ``inner`` with the next round),
and CPU work outside a round's path: ``rebase``, ``adopt``, ``replay``. Compute phases never nest,
and I/O phases (``upload``, ``collect``, ``agree``) contain no compute phase other than ``adopt``
and ``replay``, so a hook may hold a lock across a compute phase. The store documents are
``documents.py``; ``algorithm`` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec import payload as wire
from pulsenet.errors import (
    ConfigError,
    ManifestError,
    PulsenetError,
    RoundError,
    RoundTimeout,
    StoreError,
    VerificationError,
)
from pulsenet.loco import algorithm as alg
from pulsenet.loco import persist, recovery
from pulsenet.loco.collect import Collector, DecodedPayloads
from pulsenet.loco.config import LocoConfig, RoundReport
from pulsenet.loco.documents import Record, RoundStore, first_error
from pulsenet.loco.inner import InnerLoop, SelfTraining
from pulsenet.loco.progress import LocoStats, Progress, retrying, transient
from pulsenet.loco.state import GlobalState, TrainerState
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id
from pulsenet.store.base import ObjectStore, backoff_delay

log = logging.getLogger(__name__)

T = TypeVar("T")
InnerPhase = Callable[[int], Awaitable[list[float]]]
"""``train(r)``: round r's H inner steps from the weights the inner loop holds; one loss per step taken."""
PhaseHook = Callable[[str, int], AbstractAsyncContextManager[object]]
"""``on_phase(phase, round)``: entered around each phase's work (see the module docstring)."""


@dataclass(slots=True)
class _Sent:
    """Round r's update as published: what collecting, applying and settling it need."""

    round: int
    report: RoundReport
    own: wire.Payload
    new_error: alg.StateDict | None
    data: bytes
    reproduced: bool = True
    """False when an earlier, different payload of ours stands in the store (a restarted trainer)."""


class LocoTrainer:
    """A PULSELoCo (or DiLoCo) trainer. ``await trainer.run(rounds)`` takes part until that round is done.

    Why ~40 methods: one (or two) per step of the round in the module docstring, so that
    :meth:`run_round` reads as that list and each step's ordering hazards sit beside its code. What
    stands alone lives beside it as functions over plain inputs: agreement, repair, joining and
    catch-up in ``recovery.py``, resume points and uploads in ``persist.py``, collecting in
    ``collect.py``, the maths in ``algorithm.py``.
    """

    def __init__(
        self,
        trainer_id: str,
        store: ObjectStore,
        key: Ed25519PrivateKey,
        keys: Mapping[str, Ed25519PublicKey],
        inner: InnerLoop,
        config: LocoConfig,
        *,
        state_dir: Path | None = None,
        on_phase: PhaseHook | None = None,
        payload_cache: DecodedPayloads | None = None,
    ) -> None:
        self.config = config = config.for_trainers(len(keys))
        self.rs = RoundStore(store, trainer_id, key, keys, config.timeouts, run=config.run)
        self.id = self.rs.id
        own = self.rs.keys.get(self.id)
        if own is None or key_id(own) != key_id(key.public_key()):
            raise ConfigError(
                f"trainer {self.id!r}: its private key must be the one the trainer keys give for {self.id!r} "
                f"(have {sorted(self.rs.keys)}); peers accept its documents only under that key"
            )
        self.inner = inner
        """The H local steps (``loco.inner``): supervised, GRPO, or a test's."""
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.on_phase = on_phase
        self.cache = payload_cache
        """Decoded payloads shared by the trainers of one process (a benchmark's), or None."""
        self.state: GlobalState | None = None
        self.error: alg.StateDict | None = None
        self.digest = ""
        self.reports: list[RoundReport] = []
        self.collector: Collector | None = None
        self.background = persist.Background(self.id)
        """Uploads beside the rounds; in the ``session``'s TaskGroup while one is open."""
        self._failures = 0
        self._waits = 0
        """Round attempts in a row that ended because the store or the peers were away (not counted
        as failures: they set the backoff before the next attempt)."""
        self._carried: list[float] | None = None
        """``overlap``: the losses of the next round's inner phase, already trained (``run_round``)."""
        self._last: frozenset[str] | None = None
        """The participants of the last round we applied or caught up to (None: not known yet): a
        trainer not among them is absent, waited for ``absent_wait_s`` unless it says it joins."""
        self._pending: _Sent | None = None
        """The published update of a round whose attempt failed: the next attempt at that round
        collects again with it instead of training again (synchronous rounds)."""
        self.progress = Progress(trainer=self.id)
        """What the trainer is doing now, whom it waits for, how the store answers (read it, e.g.
        for ``/healthz``: ``progress.describe()``, ``progress.store_unreachable``)."""
        self.stats = LocoStats()
        """Counters over the trainer's life (rounds, exclusions by reason, void rounds, store failures)."""
        self.trust = recovery.Trust()
        """Whose digests count in the vote, and whether our state was kept unverified (``recovery``)."""

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self, rounds: int) -> list[RoundReport]:
        """Start (or resume) and take part until the global state has reached ``rounds``, the inner
        loop training each round itself (``SelfTraining.train``)."""
        async with self.session():
            while self.round < rounds:
                await self.next_round(until=rounds)
        return self.reports

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[LocoTrainer]:
        """Start (or resume) the trainer and hold the lifetime of its background uploads.

        Background uploads live in a TaskGroup for the whole session: a typed store error in one is
        logged (``persist.Background``), anything else fails the session, as itself, rather than vanishing.
        Leaving the session waits for the uploads in flight (``drain``).
        """
        try:
            async with asyncio.TaskGroup() as group:
                self.background.group = group
                if self.state is None:
                    await self.start()
                try:
                    yield self
                except BaseException:
                    # Failing or cancelled (a node stopping): uploads that retry through an outage
                    # must not hold the exit; what they were writing is rewritten on the next run.
                    self.background.cancel()
                    raise
                await self.drain()
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        finally:
            self.background.group = None

    async def next_round(self, train: InnerPhase | None = None, *, until: int | None = None) -> RoundReport | None:
        """One round inside a ``session``: its report (trained, or caught up from the store), or None
        if it failed. ``train``: the caller's inner phase (default ``SelfTraining.train``); ``until``:
        the run's last round, which the ``overlap`` mode needs to know whether to train ahead.

        Anything the store holds that cannot be used (unreachable, unverifiable, malformed) fails
        the round, typed: it is logged and counted, and the next call finds the round's record (or
        not) and catches up from the store. ``max_round_failures`` failures in a row re-raise."""
        before = len(self.reports)
        await self._attempt(self.run_round(train, last=until))
        if len(self.reports) == before:
            return None
        self.progress.enter("idle", self.round + 1)
        return self.reports[-1]

    async def _attempt(self, round_: Awaitable[T]) -> T | None:
        """Run one attempt at a round. An outage (a transient store failure, or no quorum in time
        while the store answers) is waited out with a growing backoff and never counted; anything
        the store holds that cannot be used is counted, and ``max_round_failures`` in a row re-raise."""
        r = self.round + 1
        try:
            result = await round_
        except (RoundError, StoreError, ManifestError, VerificationError) as e:
            self.stats.rounds_failed += 1
            if isinstance(e, RoundTimeout) or transient(e):
                self.stats.rounds_timed_out += isinstance(e, RoundTimeout)
                self._waits += 1
                delay = backoff_delay(self._waits - 1, self.config.retry_base_s, self.config.retry_cap_s)
                log.warning(
                    "%s: round %d not done (%s: %s); trying again in %.1f s (attempt %d)",
                    *(self.id, r, type(e).__name__, e, delay, self._waits + 1),
                )
                if transient(e):
                    self.progress.store_failed(e)
                    self.stats.store_failures += 1
                self.progress.enter("backoff", r, f"{type(e).__name__}: {str(e)[:300]}")
                await asyncio.sleep(delay)
                return None
            self._failures += 1
            log.error(
                "%s: round %d failed (%d in a row): %s: %s",
                *(self.id, r, self._failures, type(e).__name__, e),
            )
            if self._failures >= self.config.max_round_failures:
                raise
            self.progress.enter("backoff", r, f"{type(e).__name__}: {str(e)[:300]}")
            await self._collector.sleep()
            return None
        self._failures = self._waits = 0
        return result

    async def _retry(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """A store call that must land: retried through transient failures (``progress.retrying``)."""
        return await retrying(
            call, f"{self.id}: {what}", base_s=self.config.retry_base_s, cap_s=self.config.retry_cap_s,
            progress=self.progress, stats=self.stats,
        )  # fmt: skip

    async def start(self) -> None:
        """Load the newest resume point (local disk or own store checkpoint) or genesis; join the run."""
        if (resumed := await persist.load_resume_point(self.inner, self.state_dir, self.rs, self._retry)) is not None:
            self.state, self.error = resumed.global_, resumed.error
        else:
            self.state = await asyncio.to_thread(lambda: GlobalState.genesis(self.inner.state_fp32()))
            self.error = (
                {n: torch.zeros_like(t) for n, t in self.state.theta.items()} if self.config.sparse else None
            )
        assert self.state is not None
        self.collector = Collector(
            self.rs, self.config, self.state.shapes(), self.cache, progress=self.progress, stats=self.stats
        )
        self.digest = await asyncio.to_thread(self.state.digest)
        await self._retry(self.rs.join, "announcing ourselves (members/)")
        await recovery.wait_for_members(
            self.rs, self.config.expected, wait_s=self.config.join_wait_s, sleep=self._collector.sleep,
            progress=self.progress, stats=self.stats,
        )  # fmt: skip
        if self.round == 0 and (theirs := await recovery.genesis(self.rs, self._state, self.digest, self._retry)):
            await self._adopt(*theirs)
        log.info("%s: starting at round %d, digest %s", self.id, self.round, self.digest[:16])
        self.progress.enter("idle", self.round + 1)

    async def drain(self) -> None:
        """Wait for background uploads (checkpoints, global states) to finish; re-raise an
        unexpected failure of one (typed store errors were logged)."""
        await self.background.drain()

    @property
    def round(self) -> int:
        return self.state.round if self.state is not None else 0

    @property
    def _state(self) -> GlobalState:
        if self.state is None:
            raise RoundError("the trainer has not started: call start() or run()")
        return self.state

    @property
    def _collector(self) -> Collector:
        if self.collector is None:
            raise RoundError("the trainer has not started: call start() or run()")
        return self.collector

    # --- the round ----------------------------------------------------------------------------

    async def run_round(self, train: InnerPhase | None = None, *, last: int | None = None) -> RoundReport:
        """One round: every step below runs from θ_{r-1} to θ_r in order. ``train``: the caller's
        inner phase (default: ``SelfTraining.train`` in a thread).

        With ``overlap`` and r < ``last`` (the run's last round), round r+1's inner phase runs while
        round r is collected and applied, then its progress is re-based onto θ_r (``_train_ahead``,
        ``_rebase``); the next call publishes it without training again. Nothing is carried over
        after a repair, a catch-up or a failure: the next round then trains from θ. Where the work
        may run beside the inner thread: docs/loco.md.
        """
        r = self.round + 1
        carried, self._carried = self._carried, None
        if (behind := await self._behind(r)) is not None:  # 0. decided without us: catch up
            return behind
        await self._announce_joining(r)
        if (sent := self._resumed(r)) is None:  # (a failed attempt already published round r)
            sent = await self._train_and_encode(r, train, carried)  # 1-2. H inner steps; pseudo-gradient, payload
        report = sent.report
        upload = asyncio.create_task(self._publish(sent))  #    publish it (background)
        ahead: asyncio.Task[list[float]] | None = None
        base: alg.StateDict = {}
        try:
            if self.config.overlap and last is not None and r < last:
                base, ahead = await self._train_ahead(r, train)  # 1. of round r+1, beside 3-4
            # collect and apply touch neither the local model nor the inner optimizer
            record, payloads = await self._collect(sent, upload)  # 3. the record and its payloads
            await self._apply(sent, record, payloads, load_local=ahead is None)  # 4. outer step: θ_r
        except BaseException:
            # An upload still retrying is abandoned (safe: see _collect); a thread cannot be cancelled
            upload.cancel()
            await asyncio.gather(upload, *([ahead] if ahead is not None else []), return_exceptions=True)
            if ahead is not None:
                await self._load_theta("adopt", r)
            raise
        trained_ahead = await self._landed(ahead, r)
        # agree and persist only after the inner phase ahead: a repair loads θ into the local model,
        # and the resume point reads the inner optimizer and RNG, which the inner thread was using
        theta_before = self._state.theta
        digests = await self._agree(record, report)  # 5. digests; repair if we diverged
        await self._persist(r, digests)  # 6. resume point, checkpoint, global state
        await self._report(report)
        if ahead is not None:
            self._carried = await self._rebase(r, base, trained_ahead, theta_before)
        return report

    async def _train_and_encode(self, r: int, train: InnerPhase | None, carried: list[float] | None) -> _Sent:
        """Steps 1-2: round r's inner phase (or the losses of the one trained ahead) and its update."""
        report = self._open_report(r)
        if carried is not None:  # trained while the previous round was exchanged
            losses, report.overlapped = carried, True
        else:
            losses = await self._train(r, train)
        sent = await self._encode(r, report, losses)
        if not self.config.overlap:
            # Synchronous rounds only: an overlapped round's local weights hold the next inner
            # phase's progress by the time an attempt fails, so it trains again from θ.
            self._pending = sent
        return sent

    def _resumed(self, r: int) -> _Sent | None:
        """Round r's update from an earlier attempt that published it, if any (its payload stands
        in the store; training again would only spend data and be replaced by it)."""
        sent, self._pending = self._pending, None
        if sent is None or sent.round != r:
            return None
        log.info("%s: round %d: collecting again with the payload already made", self.id, r)
        self._pending = sent
        return sent

    async def _train_ahead(self, r: int, train: InnerPhase | None) -> tuple[alg.StateDict, asyncio.Task[list[float]]]:
        """``overlap``: start round r+1's inner phase from the local weights now; the weights it
        starts from (to re-base its progress later) and its task."""
        async with self._phase("rebase", r + 1):
            base = await asyncio.to_thread(self.inner.state_fp32)
        return base, asyncio.create_task(self._train(r + 1, train))

    async def _landed(self, ahead: asyncio.Task[list[float]] | None, r: int) -> list[float] | None:
        """The losses of round r+1's inner phase run ahead; None if none ran or it failed (logged)."""
        if ahead is None:
            return None
        try:
            return await ahead
        except (PulsenetError, RuntimeError) as e:
            log.error("%s: round %d's overlapped inner phase failed: %s", self.id, r + 1, e)
            return None

    async def _rebase(
        self, r: int, base: alg.StateDict, losses: list[float] | None, theta_before: alg.StateDict
    ) -> list[float] | None:
        """Move the progress trained ahead from ``base`` onto θ_r; its losses, carried to the next
        round, or None when it failed or a repair adopted another θ (round r+1 then starts afresh)."""
        if losses is None or self._state.theta is not theta_before:  # failed, or a repair adopted θ
            await self._load_theta("adopt", r + 1)  # start r+1 afresh from θ
            return None
        local, theta = await asyncio.to_thread(self.inner.parameters), self._state.theta
        async with self._phase("rebase", r + 1):
            await asyncio.to_thread(lambda: self.inner.load_state_fp32(alg.rebase(local, base, theta)))
        return losses

    # --- 0. behind? ---------------------------------------------------------------------------

    async def _announce_joining(self, r: int) -> None:
        """Back after a round decided without us (or not knowing: a start): say we train round r, so
        that peers wait for our payload until the deadline again. Best effort: if it fails they may
        close r without us, and we catch up and say it again for the next round."""
        if self._last is not None and self.id in self._last:
            return
        try:
            await self.rs.announce_joining(r)
        except StoreError as e:
            log.warning("%s: round %d: could not announce that we join: %s", self.id, r, e)

    async def _behind(self, r: int) -> RoundReport | None:
        """If round r was decided without us, catch up from the store and return that report."""
        existing = await self._collector.read_record(r)
        if existing is not None and self.id not in existing.participants:
            self._pending = None  # decided without us: that update is not needed any more
            target, ignored = await self.rs.latest_record_round(known=r)
            self.stats.ignored_names += ignored
            return await self.catch_up(target)
        # A record that already includes us means we published this round and died before saving
        # it: redo the round (same state, RNG and data give the same payload) so that the error
        # feedback and inner optimizer come out exactly as if we had never stopped.
        return None

    def _open_report(self, r: int) -> RoundReport:
        if self.cache is not None:
            self.cache.evict_before(r)  # peers still on an older round fall back to the store
        return RoundReport(round=r, trainer=self.id)

    # --- 1. train -----------------------------------------------------------------------------

    async def _train(self, r: int, train: InnerPhase | None = None) -> list[float]:
        """Round r's H inner steps from the weights the inner loop holds; their losses."""
        async with self._phase("inner", r):
            if train is not None:
                return await train(r)
            if not isinstance(self.inner, SelfTraining):
                raise TypeError(f"{type(self.inner).__name__} does not train itself: pass next_round its inner phase")
            return await asyncio.to_thread(self.inner.train, self.config.inner_steps)

    # --- 2. encode and publish ----------------------------------------------------------------

    async def _encode(self, r: int, report: RoundReport, losses: list[float]) -> _Sent:
        """Pseudo-gradient, gate and payload bytes against θ_{r-1}.

        Sparse values are coded relative to the round's base weights, which every receiver holds;
        DiLoCo's dense payload stays raw FP32 bits under zstd (the baseline as specified).
        """
        cfg, state = self.config, self._state
        report.loss, report.steps = (float(np.mean(losses)) if losses else None), len(losses)
        local = await asyncio.to_thread(self.inner.parameters)  # a copy or a gather on a GPU or a site
        async with self._phase("encode", r):
            own, new_error = await asyncio.to_thread(
                alg.make_update, state.theta, local, self.error,
                round=r, sparse=cfg.sparse, gate_scale=cfg.gate_scale,
            )  # fmt: skip
            data = await asyncio.to_thread(wire.encode, own, state.theta if cfg.sparse else None)
        report.sent, report.total, report.payload_bytes = own.sent, own.total, len(data)
        if not cfg.sparse:
            own = wire.Payload(r, own.mode, {})  # dense values are a full model copy: keep only the bytes
        return _Sent(r, report, own, new_error, data)

    async def _publish(self, sent: _Sent) -> tuple[bytes, ObjectRef]:
        """Upload payload + manifest, retried through store outages until they land (the round's
        collect cancels this when the round is decided without us); returns the payload bytes that
        stand in the store (normally ours)."""
        r, data, report = sent.round, sent.data, sent.report
        base_digest = self.digest
        async with self._phase("upload", r):
            manifest, fresh = await self._retry(
                lambda: self.rs.publish_payload(
                    r, data, mode=self.config.mode, sent=report.sent, total=report.total, base_digest=base_digest
                ),
                f"round {r}: uploading our payload",
            )
        if fresh or manifest.payload.sha256 == hashlib.sha256(data).hexdigest():
            return data, manifest.payload
        # A restarted trainer redid a round it had already published and got different bits: the
        # stored payload is the one peers see (``alg.settle_error`` accounts for it).
        log.warning(
            "%s: round %d was already published with a different payload; the stored one stands", self.id, r
        )
        stored = await self._retry(lambda: self.rs.fetch(manifest.payload), f"round {r}: reading our stored payload")
        return stored, manifest.payload

    # --- 3. collect ---------------------------------------------------------------------------

    async def _collect(
        self, sent: _Sent, upload: asyncio.Task[tuple[bytes, ObjectRef]]
    ) -> tuple[Record, dict[str, wire.Payload]]:
        """The round's record and the decoded payload of every participant it names; our upload is
        awaited whatever happens (a manifest may already name the payload: never abandon it half way)."""
        r, report = sent.round, sent.report
        async with self._phase("collect", r):
            try:
                # Only a full round's payload is a reference for the others' norms: one of 1 step
                # in 8 measured up to 9x smaller than its honest peers' (docs/loco.md §4).
                full = report.steps >= self.config.inner_steps
                absent = frozenset(self.rs.keys) - self._last - {self.id} if self._last is not None else frozenset()
                record, payloads = await self._collector.collect(
                    r, upload, self._state.theta, self.digest, own_reference=full, absent=absent
                )
            finally:
                # Decided (or failed): an upload still retrying is abandoned. Safe mid-put: the payload
                # key is content-addressed and the manifest create-only; a record that names our
                # payload needed our manifest, so nothing that matters is left half done.
                if not upload.done():
                    log.warning("%s: round %d: abandoning our payload's upload (still retrying)", self.id, r)
                    upload.cancel()
                (published,) = await asyncio.gather(upload, return_exceptions=True)
        if isinstance(published, PulsenetError):
            log.error("%s: round %d: publishing our payload failed: %s", self.id, r, published)
        self._last = frozenset(record.participants)
        ours = record.participants.get(self.id)
        if ours is not None:
            # The record names the payload of ours that stands in the store: ours, or the one an
            # earlier run published (``alg.settle_error`` then accounts for that one).
            sent.reproduced = ours.sha256 == await asyncio.to_thread(lambda: hashlib.sha256(sent.data).hexdigest())
        self.stats.count_round(record, self.id, self.config.expected)
        report.participants = sorted(record.participants)
        report.rejected = dict(record.rejected)
        report.included = ours is not None
        report.record_writer = record.writer
        report.norms = dict(self._collector.last_norms)
        report.weights_norm = self._collector.last_weights_norm
        return record, payloads

    # --- 4. apply -----------------------------------------------------------------------------

    async def _apply(
        self, sent: _Sent, record: Record, payloads: Mapping[str, wire.Payload], *, load_local: bool
    ) -> None:
        """Average the record's payloads, take the outer step (θ_r, m_r) and settle the error feedback.
        ``load_local``: also reset the local model to θ_r (not while an overlapped inner phase runs)."""
        state, cfg = self._state, self.config
        async with self._phase("apply", sent.round):
            void = await asyncio.to_thread(
                alg.apply_round, state.theta, state.momentum, payloads, lr=cfg.outer_lr, mu=cfg.outer_momentum
            )
            if void is not None:
                self._void(sent.round, void, record)
                sent.report.void = void
            state.round = sent.round
            self._pending = None
            if load_local:
                await asyncio.to_thread(self.inner.load_state_fp32, state.theta)
            self.digest = await asyncio.to_thread(state.digest)
        if sent.new_error is None or void is not None:  # a void round drops our update, like a rejection
            return
        if self.id in record.rejected:
            # Judged invalid (non-finite, outsized): carrying it as error feedback would poison every
            # later round, so this round's local progress is dropped and e stays as it was.
            log.error(
                "%s: round %d: our own payload was rejected (%s); dropping this round's update",
                *(self.id, sent.round, record.rejected[self.id]),
            )
            return
        included = self.id in record.participants
        stored = payloads[self.id] if included and not sent.reproduced else None
        self.error = alg.settle_error(sent.new_error, sent.own, included=included, stored=stored)

    def _void(self, r: int, why: str, record: Record) -> None:
        """A round whose outer step would have made θ or m non-finite: nothing was applied. Every
        trainer (and every replay) computes the same bits from the same record, so all decide alike
        and stay on the last good state together; one that differs has diverged, and the digest
        check repairs it."""
        self.stats.rounds_void += 1
        log.error(
            "%s: round %d: VOID: %s (record by %s, participants %s); nothing applied, θ and m stay as they were",
            *(self.id, r, why, record.writer, sorted(record.participants)),
        )

    # --- 5. agree or repair ------------------------------------------------------------------

    async def _agree(self, record: Record, report: RoundReport) -> dict[str, str]:
        """Publish our digest, compare it with the participants' and repair if we diverged
        (``recovery``); the digests that count if every participant's was seen, else {} (only a
        trainer that saw them all may judge itself the global state's writer)."""
        r = record.round
        async with self._phase("agree", r):
            # In the background, retried until it lands: peers judge without ours if it is late, and
            # a published state needs its participants' digests later (recovery.vouched).
            self.background.spawn(recovery.publish_digest(self.rs, r, self.digest, self._retry), f"digest of round {r}")
            heard, complete = await recovery.gather_digests(
                self.rs, record, self.digest, wait_s=self.config.digest_wait_s, sleep=self._collector.sleep,
                progress=self.progress, stats=self.stats,
            )  # fmt: skip
            settled = await recovery.settle(
                r, self.id, heard, self.trust, self.stats,
                lambda: self._rebuild(r, max_replay=self.config.repair_replay),
            )  # fmt: skip
            report.agreed = settled.unanimous
            if settled.adopt is not None:
                await self._adopt(*settled.adopt)
                report.repaired = True
        report.digest = self.digest
        return settled.digests if complete else {}

    @property
    def distrusted(self) -> dict[str, int]:
        """Trainers left out of the digest vote, by the round that showed it (``recovery.Trust``)."""
        return self.trust.distrusted

    def trust_issues(self) -> str | None:
        """Why the digest agreement is not whole, in words for ``/healthz`` (None: it is)."""
        return self.trust.issues()

    # --- 6. persist ---------------------------------------------------------------------------

    async def _persist(self, r: int, digests: Mapping[str, str]) -> None:
        """The local resume point (atomic) now; the store copies in the background."""
        cfg = self.config
        async with self._phase("persist", r):
            path = await persist.save_local(self.state_dir, self._trainer_state)
            snap = (
                await persist.snapshot(path, self._trainer_state)
                if cfg.checkpoint_every and r % cfg.checkpoint_every == 0
                else None
            )
            holders = sorted(t for t, d in digests.items() if d == self.digest)
            # One global-state writer per round: the lowest-id trainer holding the majority digest.
            writer = holders and holders[0] == self.id and 2 * len(holders) > len(digests)
            state = await asyncio.to_thread(self._state.copy) if r % cfg.state_every == 0 and writer else None
        if snap is not None:
            self.background.spawn(persist.upload_checkpoint(self.rs, r, snap, self._retry), f"checkpoint {r}")
        if state is not None:
            self.background.spawn(persist.publish_state(self.rs, state, self.digest, self._retry), f"global state {r}")
        if (keep := cfg.retention) is not None and r % cfg.state_every == 0 and r > keep:
            self.background.spawn(persist.retain(self.rs, r - keep, r), f"retention before {r - keep}")

    # --- catch-up and repair --------------------------------------------------------------------

    async def catch_up(self, target: int) -> RoundReport:
        """Bring the global state to round ``target`` from the store (replay and/or a published state), then verify."""
        start = self.round
        log.warning(
            "%s: behind: at round %d while the run has reached %d; catching up from the store",
            *(self.id, start, target),
        )
        self.progress.enter("catch-up", target)
        state = await recovery.catch_up_state(
            self._state, target, self.rs, self._collector.load_record, self._replay_apply, quorum=self.config.quorum
        )
        await self._adopt(state, await asyncio.to_thread(state.digest))
        report = RoundReport(round=target, trainer=self.id, caught_up_from=start + 1)
        record = await self._collector.read_record(target)
        self._last = frozenset(record.participants) if record is not None else None
        if record is not None:
            report.participants = sorted(record.participants)
            report.rejected = dict(record.rejected)
            report.record_writer = record.writer
            await self._persist(target, await self._agree(record, report))
        return await self._report(report)

    async def _rebuild(self, target: int, *, max_replay: int | None = None) -> GlobalState:
        return await recovery.rebuild(
            target,
            self.rs,
            self._state.shapes(),
            self._collector.load_record,
            self._replay_apply,
            quorum=self.config.quorum,
            max_replay=max_replay,
        )

    async def _replay_apply(self, state: GlobalState, payloads: Mapping[str, wire.Payload]) -> None:
        """A recorded round's outer step on ``state``, in place: the same call as step 4 (void alike)."""
        async with self._phase("replay", state.round + 1):
            void = await asyncio.to_thread(
                alg.apply_round, state.theta, state.momentum, payloads,
                lr=self.config.outer_lr, mu=self.config.outer_momentum,
            )  # fmt: skip
        if void is not None:
            log.error("%s: replaying round %d: VOID: %s; nothing applied", self.id, state.round + 1, void)

    async def _adopt(self, state: GlobalState, digest: str) -> None:
        self.state = state
        self.digest = digest
        await self._load_theta("adopt", state.round)

    async def _load_theta(self, phase: str, r: int) -> None:
        """Reset the inner loop's weights to the global θ."""
        async with self._phase(phase, r):
            await asyncio.to_thread(self.inner.load_state_fp32, self._state.theta)

    # --- persistence (persist.py) ---------------------------------------------------------------

    def _trainer_state(self) -> TrainerState:
        return TrainerState(self._state, self.error, self.inner.checkpoint())

    # --- helpers ------------------------------------------------------------------------------

    async def _report(self, report: RoundReport) -> RoundReport:
        self.reports.append(report)
        self.stats.rounds += 1
        return report

    def _phase(self, name: str, r: int) -> AbstractAsyncContextManager[object]:
        """Entered around each phase's work (``on_phase``; see the module docstring); sets ``progress``
        (the round's path only: work beside it, such as an overlapped inner phase, does not)."""
        if name not in ("rebase", "replay") and not (name == "inner" and r > self.round + 1):
            self.progress.enter(name, r)
        return self.on_phase(name, r) if self.on_phase is not None else contextlib.nullcontext()
