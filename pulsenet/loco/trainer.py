"""The PULSELoCo round, top to bottom: one trainer node's part in it (DiLoCo, Douillard et al.
2023, with PULSE's sparse exchange, arXiv 2602.03839; spec and safety arguments: docs/loco.md).

Per round r, from the agreed global state (θ_{r-1}, m_{r-1}) and this trainer's error feedback e
(:meth:`LocoTrainer.run_round` reads exactly like this)::

    0. behind?   rounds/r/record exists without us -> catch up from the store     recovery.py
    1. train     H inner steps from θ_{r-1}            the caller's inner phase, or SelfTraining.train
    2. encode    s = e + θ_{r-1} - θ_local, visibility gate, payload     update.encode (thread)
       publish   payload, then its signed manifest                       update.publish (task)
    3. collect   peers' payloads as their manifests appear; the round    collect.py
                 record, written first-writer-wins or followed
    4. apply     mean of the record's payloads, outer Nesterov step:     algorithm (thread)
                 θ_r, m_r; e keeps what was not sent                     update.settle
    5. agree     publish digest(θ_r, m_r), compare with the participants';
                 outside the majority: rebuild from the store            recovery.py
    6. persist   local resume point (atomic), every few rounds to the store,
                 the agreed global state every ``state_every`` rounds    persist.py (background)

With ``overlap`` (the one-round-delayed outer step) step 1 of round r+1 runs while steps 3-4 of
round r run, and its progress is re-based onto θ_r (``overlap.py``): the same
:meth:`LocoTrainer.run_round`. A failed attempt is retried by the next call (``progress.Attempts``).

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
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec import payload as wire
from pulsenet.errors import ConfigError, RoundError
from pulsenet.fsutil import fresh_scratch
from pulsenet.loco import algorithm as alg
from pulsenet.loco import persist, recovery, update
from pulsenet.loco.collect import Collector, DecodedPayloads
from pulsenet.loco.config import LocoConfig, RoundReport
from pulsenet.loco.documents import Record, RoundStore
from pulsenet.loco.inner import InnerLoop, SelfTraining
from pulsenet.loco.overlap import Ahead
from pulsenet.loco.progress import Attempts, LocoStats, Progress, retrying
from pulsenet.loco.state import GlobalState, TrainerState
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)

T = TypeVar("T")
InnerPhase = Callable[[int], Awaitable[list[float]]]
"""``train(r)``: round r's H inner steps from the weights the inner loop holds; one loss per step taken."""
PhaseHook = Callable[[str, int], AbstractAsyncContextManager[object]]
"""``on_phase(phase, round)``: entered around each phase's work (see the module docstring)."""


class LocoTrainer:
    """A PULSELoCo (or DiLoCo) trainer. ``await trainer.run(rounds)`` takes part until that round is done.

    A round driver: :meth:`run_round` reads as the list in the module docstring, one call per step,
    and each step's method holds the trainer's state and its ordering hazards; the work of a step
    lives beside it: our update (encode, publish, settle) in ``update.py``, the inner phase run
    ahead in ``overlap.py``, collecting in ``collect.py``, the maths in ``algorithm.py``,
    agreement, repair, joining and catch-up in ``recovery.py``, resume points and uploads in
    ``persist.py``, attempts and retries in ``progress.py``.
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
        self.scratch = Path(state_dir) / "tmp" if state_dir is not None else None
        """Our temporary files (global states, checkpoints on their way up): emptied at ``start``."""
        self.rs = RoundStore(store, trainer_id, key, keys, config.timeouts, run=config.run, scratch_dir=self.scratch)
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
        self._carried: list[float] | None = None
        """``overlap``: the losses of the next round's inner phase, already trained (``run_round``)."""
        self._last: frozenset[str] | None = None
        """The participants of the last round we applied or caught up to (None: not known yet): a
        trainer not among them is absent, waited for ``absent_wait_s`` unless it says it joins."""
        self._pending: update.Sent | None = None
        """The published update of a round whose attempt failed: the next attempt at that round
        collects again with it instead of training again (synchronous rounds)."""
        self.progress = Progress(trainer=self.id)
        """What the trainer is doing now, whom it waits for, how the store answers (read it, e.g.
        for ``/healthz``: ``progress.describe()``, ``progress.store_unreachable``)."""
        self.stats = LocoStats()
        """Counters over the trainer's life (rounds, exclusions by reason, void rounds, store failures)."""
        self.trust = recovery.Trust()
        """Whose digests count in the vote (``trust.distrusted``), and whether our state was kept
        unverified; ``trust.issues()`` says it in words for ``/healthz`` (``recovery``)."""
        self.attempts = Attempts(self.id, config, self.progress, self.stats)
        """Failures and outages in a row, and the backoff between attempts (``progress``)."""

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
        """Start (or resume) the trainer and hold the lifetime of its background uploads
        (``persist.Background.running``): a typed store error in one is logged, anything else fails
        the session, as itself, rather than vanishing. Leaving the session waits for the uploads in
        flight; failing or cancelled (a node stopping), it cancels them."""
        async with self.background.running():
            if self.state is None:
                await self.start()
            yield self

    async def next_round(self, train: InnerPhase | None = None, *, until: int | None = None) -> RoundReport | None:
        """One round inside a ``session``: its report (trained, or caught up from the store), or None
        if it failed. ``train``: the caller's inner phase (default ``SelfTraining.train``); ``until``:
        the run's last round, which the ``overlap`` mode needs to know whether to train ahead.

        Anything the store holds that cannot be used (unreachable, unverifiable, malformed) fails
        the round, typed: it is logged and counted, and the next call finds the round's record (or
        not) and catches up from the store. ``max_round_failures`` failures in a row re-raise
        (``progress.Attempts``)."""
        before = len(self.reports)
        await self.attempts.run(self.round + 1, self.run_round(train, last=until), self._collector.sleep)
        if len(self.reports) == before:
            return None
        self.progress.enter("idle", self.round + 1)
        return self.reports[-1]

    async def start(self) -> None:
        """Load the newest resume point (local disk or own store checkpoint) or genesis; join the run."""
        if self.scratch is not None:
            await asyncio.to_thread(fresh_scratch, self.scratch)
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

    # --- the round ----------------------------------------------------------------------------

    async def run_round(self, train: InnerPhase | None = None, *, last: int | None = None) -> RoundReport:
        """One round: every step below runs from θ_{r-1} to θ_r in order. ``train``: the caller's
        inner phase (default: ``SelfTraining.train`` in a thread).

        With ``overlap`` and r < ``last`` (the run's last round), round r+1's inner phase runs while
        round r is collected and applied, then its progress is re-based onto θ_r (``overlap.Ahead``);
        the next call publishes it without training again. Nothing is carried over after a repair,
        a catch-up or a failure: the next round then trains from θ.
        """
        r = self.round + 1
        carried, self._carried = self._carried, None
        if (behind := await self._behind(r)) is not None:  # 0. decided without us: catch up
            return behind
        if self._last is None or self.id not in self._last:  # back (or starting): peers wait for us again
            await recovery.announce_joining(self.rs, r)
        sent, self._pending = self._pending, None
        if sent is None or sent.round != r:
            sent = await self._encode(r, train, carried)  # 1-2. H inner steps; pseudo-gradient, payload
        else:  # a failed attempt published round r: training again would only spend data
            log.info("%s: round %d: collecting again with the payload already made", self.id, r)
        # Kept for the next attempt if this one fails, in synchronous rounds only: an overlapped
        # round's local weights then hold the next inner phase's progress, so it trains again from θ.
        self._pending = None if self.config.overlap else sent
        report = sent.report
        upload = asyncio.create_task(  # publish it (background)
            update.publish(self.rs, sent, self.digest, mode=self.config.mode, retry=self._retry, phase=self._phase)
        )
        ahead: Ahead | None = None
        try:
            if self.config.overlap and last is not None and r < last:  # 1. of round r+1, beside 3-4:
                ahead = await Ahead.start(self.id, r, self.inner, lambda n: self._train(n, train), self._phase)
            record, payloads = await self._collect(sent, upload)  # 3. the record and its payloads
            await self._apply(sent, record, payloads, load_local=ahead is None)  # 4. outer step: θ_r
        except BaseException:
            # An upload still retrying is abandoned (safe: see update.finish); a thread cannot be cancelled
            upload.cancel()
            await asyncio.gather(upload, *([ahead.task] if ahead is not None else []), return_exceptions=True)
            if ahead is not None:
                await self._load_theta("adopt", r)
            raise
        if ahead is not None:
            # agree and persist only after the inner phase ahead: a repair loads θ into the local
            # model, and the resume point reads the inner optimizer and RNG, which it was using
            await ahead.landed()
        theta = self._state.theta
        digests = await self._agree(record, report)  # 5. digests; repair if we diverged
        await self._persist(r, digests)  # 6. resume point, checkpoint, global state
        self._report(report)
        if ahead is not None:
            self._carried = await ahead.rebase(self._state.theta, repaired=self._state.theta is not theta)
        return report

    # --- 0. behind? ---------------------------------------------------------------------------

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

    # --- 1-2. train, encode -------------------------------------------------------------------

    async def _encode(self, r: int, train: InnerPhase | None, carried: list[float] | None) -> update.Sent:
        """Round r's inner phase (or the losses of the one trained ahead, ``carried``), then its
        update against θ_{r-1} (``update.encode``)."""
        if self.cache is not None:
            self.cache.evict_before(r)  # peers still on an older round fall back to the store
        report = RoundReport(round=r, trainer=self.id)
        if carried is not None:  # trained while the previous round was exchanged
            losses, report.overlapped = carried, True
        else:
            losses = await self._train(r, train)
        report.loss, report.steps = (float(np.mean(losses)) if losses else None), len(losses)
        local = await asyncio.to_thread(self.inner.parameters)  # a copy or a gather on a GPU or a site
        async with self._phase("encode", r):
            return await asyncio.to_thread(
                update.encode, report, self._state.theta, local, self.error,
                sparse=self.config.sparse, gate_scale=self.config.gate_scale,
            )  # fmt: skip

    async def _train(self, r: int, train: InnerPhase | None = None) -> list[float]:
        """Round r's H inner steps from the weights the inner loop holds; their losses."""
        async with self._phase("inner", r):
            if train is not None:
                return await train(r)
            if not isinstance(self.inner, SelfTraining):
                raise TypeError(f"{type(self.inner).__name__} does not train itself: pass next_round its inner phase")
            return await asyncio.to_thread(self.inner.train, self.config.inner_steps)

    # --- 3. collect ---------------------------------------------------------------------------

    async def _collect(
        self, sent: update.Sent, upload: asyncio.Task[tuple[bytes, ObjectRef]]
    ) -> tuple[Record, dict[str, wire.Payload]]:
        """The round's record and the decoded payload of every participant it names (``collect.py``);
        our upload is awaited whatever happens (``update.finish``)."""
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
                await update.finish(upload, self.id, r)
        self._last = frozenset(record.participants)
        self.stats.count_round(record, self.id, self.config.expected)
        report.follow(record)
        report.included = self.id in record.participants
        report.norms = dict(self._collector.last_norms)
        report.weights_norm = self._collector.last_weights_norm
        return record, payloads

    # --- 4. apply -----------------------------------------------------------------------------

    async def _apply(
        self, sent: update.Sent, record: Record, payloads: Mapping[str, wire.Payload], *, load_local: bool
    ) -> None:
        """Average the record's payloads, take the outer step (θ_r, m_r) and settle the error feedback.
        ``load_local``: also reset the local model to θ_r (not while an overlapped inner phase runs)."""
        state, cfg, r = self._state, self.config, sent.round
        async with self._phase("apply", r):
            void = await asyncio.to_thread(
                alg.apply_round, state.theta, state.momentum, payloads, lr=cfg.outer_lr, mu=cfg.outer_momentum
            )
            if void is not None:
                # Nothing applied. Every trainer (and every replay) computes the same bits from the
                # same record, so all decide alike and stay on the last good state together; one that
                # differs has diverged, and the digest check repairs it.
                self.stats.rounds_void += 1
                sent.report.void = void
                log.error(
                    "%s: round %d: VOID: %s (record by %s, participants %s); nothing applied, θ and m stay as they were",
                    *(self.id, r, void, record.writer, sorted(record.participants)),
                )
            state.round = r
            self._pending = None
            if load_local:
                await asyncio.to_thread(self.inner.load_state_fp32, state.theta)
            self.digest = await asyncio.to_thread(state.digest)
        if (error := update.settle(sent, record, payloads, self.id, void)) is not None:
            self.error = error

    async def _replay_apply(self, state: GlobalState, payloads: Mapping[str, wire.Payload]) -> None:
        """A recorded round's outer step on ``state``, in place: the same call as step 4 (void alike)."""
        async with self._phase("replay", state.round + 1):
            void = await asyncio.to_thread(
                alg.apply_round, state.theta, state.momentum, payloads,
                lr=self.config.outer_lr, mu=self.config.outer_momentum,
            )  # fmt: skip
        if void is not None:
            log.error("%s: replaying round %d: VOID: %s; nothing applied", self.id, state.round + 1, void)

    # --- 5. agree or repair ------------------------------------------------------------------

    async def _agree(self, record: Record, report: RoundReport) -> dict[str, str]:
        """Publish our digest, compare it with the participants' and repair if we diverged
        (``recovery``); the digests that count if every participant's was seen, else {} (only a
        trainer that saw them all may judge itself the global state's writer)."""
        r, cfg = record.round, self.config
        async with self._phase("agree", r):
            # In the background, retried until it lands: peers judge without ours if it is late, and
            # a published state needs its participants' digests later (recovery.vouched).
            self.background.spawn(recovery.publish_digest(self.rs, r, self.digest, self._retry), f"digest of round {r}")
            heard, complete = await recovery.gather_digests(
                self.rs, record, self.digest, wait_s=cfg.digest_wait_s, sleep=self._collector.sleep,
                progress=self.progress, stats=self.stats,
            )  # fmt: skip
            settled = await recovery.settle(
                r, self.id, heard, self.trust, self.stats,
                lambda: recovery.rebuild(
                    r, self.rs, self._state.shapes(), self._collector.load_record, self._replay_apply,
                    quorum=cfg.quorum, max_replay=cfg.repair_replay,
                ),
            )  # fmt: skip
            report.agreed = settled.unanimous
            if settled.adopt is not None:
                await self._adopt(*settled.adopt)
                report.repaired = True
        report.digest = self.digest
        return settled.digests if complete else {}

    # --- 6. persist ---------------------------------------------------------------------------

    async def _persist(self, r: int, digests: Mapping[str, str]) -> None:
        """The local resume point (atomic) now; the store copies in the background (``persist.py``)."""
        cfg = self.config

        def current() -> TrainerState:
            return TrainerState(self._state, self.error, self.inner.checkpoint())

        async with self._phase("persist", r):
            path = await persist.save_local(self.state_dir, current)
            due = cfg.checkpoint_every and r % cfg.checkpoint_every == 0
            snap = await persist.snapshot(path, current, self.scratch) if due else None
            writer = r % cfg.state_every == 0 and persist.writes_state(digests, self.id, self.digest)
            state = await asyncio.to_thread(self._state.copy) if writer else None
        if snap is not None:
            self.background.spawn(persist.upload_checkpoint(self.rs, r, snap, self._retry), f"checkpoint {r}")
        if state is not None:
            self.background.spawn(persist.publish_state(self.rs, state, self.digest, self._retry), f"global state {r}")
        if (keep := cfg.retention) is not None and r % cfg.state_every == 0 and r > keep:
            self.background.spawn(persist.retain(self.rs, r - keep, r), f"retention before {r - keep}")

    # --- catch-up -------------------------------------------------------------------------------

    async def catch_up(self, target: int) -> RoundReport:
        """Bring the global state to round ``target`` from the store (replay and/or a published
        state: ``recovery.catch_up_state``), then verify it like a round of our own (steps 5-6)."""
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
            report.follow(record)
            await self._persist(target, await self._agree(record, report))
        return self._report(report)

    async def _adopt(self, state: GlobalState, digest: str) -> None:
        self.state = state
        self.digest = digest
        await self._load_theta("adopt", state.round)

    async def _load_theta(self, phase: str, r: int) -> None:
        """Reset the inner loop's weights to the global θ."""
        async with self._phase(phase, r):
            await asyncio.to_thread(self.inner.load_state_fp32, self._state.theta)

    # --- helpers ------------------------------------------------------------------------------

    async def _retry(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """A store call that must land: retried through transient failures (``progress.retrying``)."""
        return await retrying(
            call, f"{self.id}: {what}", base_s=self.config.retry_base_s, cap_s=self.config.retry_cap_s,
            progress=self.progress, stats=self.stats,
        )  # fmt: skip

    def _report(self, report: RoundReport) -> RoundReport:
        self.reports.append(report)
        self.stats.rounds += 1
        return report

    def _phase(self, name: str, r: int) -> AbstractAsyncContextManager[object]:
        """Entered around each phase's work (``on_phase``; see the module docstring); sets ``progress``
        (the round's path only: work beside it, such as an overlapped inner phase, does not)."""
        if name not in ("rebase", "replay") and not (name == "inner" and r > self.round + 1):
            self.progress.enter(name, r)
        return self.on_phase(name, r) if self.on_phase is not None else contextlib.nullcontext()

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
