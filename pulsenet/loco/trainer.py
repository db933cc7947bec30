"""One PULSELoCo trainer node: H local steps, publish a payload, agree on the round, outer step, verify.

The loop, per round r (the protocol and its safety argument: docs/loco.md)::

    behind? (rounds/r/record exists without us) -> catch up from the store, go to the newest round
    inner phase   H AdamW steps from θ_{r-1}                                 (thread)
    encode        s = e + θ - θ_local, gate, payload bytes                   (thread)
    publish       payload, then its signed manifest                          (background task)
    collect       peers' payloads as their manifests appear; the round's     (collect.py)
                  record, written first-writer-wins or followed
    apply         mean of the record's payloads, outer Nesterov step         (thread)
    verify        publish the digest of (θ, m), compare with the participants';
                  outside the majority: rebuild from the store               (recovery.py)
    persist       local resume point (atomic), every few rounds to the store,
                  the agreed global state every ``state_every`` rounds

With ``overlap`` (the one-round-delayed outer step) the inner phase of round r+1 runs in a task
while round r is collected and applied, and is re-based onto θ_r afterwards
(:meth:`LocoTrainer.run_round_overlapped`).

This module owns the node's mutable state; ``algorithm`` is pure, ``round`` speaks to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.errors import (
    ConfigError,
    ManifestError,
    PulsenetError,
    RoundError,
    StoreError,
    VerificationError,
)
from pulsenet.loco import algorithm as alg
from pulsenet.loco import payload as wire
from pulsenet.loco import recovery
from pulsenet.loco.collect import Collector, PayloadCache
from pulsenet.loco.config import LocoConfig, RoundReport
from pulsenet.loco.inner import InnerLoop
from pulsenet.loco.round import ObjectRef, Record, RoundStore, first_error
from pulsenet.loco.state import GlobalState, TrainerState
from pulsenet.signing import key_id
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)
_AHEAD: contextvars.ContextVar[bool] = contextvars.ContextVar("pulseloco_ahead", default=False)
"""Set in the task that trains the next round ahead (``overlap``): its waits for shared cores are
not the current round's, so they stay out of the phase clock."""

STATE_FILE = "state.pt"
Hook = Callable[["LocoTrainer", RoundReport], Awaitable[None] | None]


@dataclass(slots=True)
class _Pending:
    """A round whose payload is out: what closing it needs."""

    round: int
    report: RoundReport
    own: wire.Payload
    new_error: alg.StateDict | None
    data: bytes
    upload: asyncio.Task[tuple[bytes, ObjectRef]]
    t_ready: float


class LocoTrainer:
    """A PULSELoCo (or DiLoCo) trainer. ``await trainer.run(rounds)`` takes part until that round is done."""

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
        compute: asyncio.Semaphore | None = None,
        on_round: Hook | None = None,
        payload_cache: PayloadCache | None = None,
    ) -> None:
        self.config = config
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
        self.compute = compute
        """Shared by trainers in one process (benchmarks) so their heavy phases take turns on the cores."""
        self.on_round = on_round
        self.cache = payload_cache
        self.state: GlobalState | None = None
        self.error: alg.StateDict | None = None
        self.digest = ""
        self.reports: list[RoundReport] = []
        self.collector: Collector | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._group: asyncio.TaskGroup | None = None
        """The lifetime of background uploads while ``run`` runs: an unexpected failure in one fails the run."""
        self._failures = 0
        self._queued_s = 0.0
        self._ahead_queued_s = 0.0  # the same, for the inner phase trained ahead (overlap)

    # --- lifecycle ----------------------------------------------------------------------------

    async def run(self, rounds: int) -> list[RoundReport]:
        """Start (or resume) and take part until the global state has reached ``rounds``.

        Background uploads live in a TaskGroup for the whole call: a typed store error in one is
        logged (``_spawn``), anything else fails the run, as itself, rather than vanishing.
        """
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                try:
                    await self._run(rounds)
                finally:
                    await self.drain()
        except BaseExceptionGroup as eg:
            raise first_error(eg) from None
        finally:
            self._group = None
        return self.reports

    async def _run(self, rounds: int) -> None:
        if self.state is None:
            await self.start()
        carried: tuple[list[float], float] | None = None
        while self.round < rounds:
            try:
                if self.config.overlap:
                    carried = await self.run_round_overlapped(rounds, carried)
                else:
                    await self.run_round()
                self._failures = 0
            except (RoundError, StoreError, ManifestError, VerificationError) as e:
                # Anything the store holds that cannot be used (unreachable, unverifiable, malformed)
                # fails the round, typed; the next iteration finds the round's record (or not) and
                # catches up from the store.
                carried = None
                self._failures += 1
                log.error(
                    "%s: round %d failed (%d in a row): %s: %s",
                    *(self.id, self.round + 1, self._failures, type(e).__name__, e),
                )
                if self._failures >= self.config.max_round_failures:
                    raise
                await self._collector.sleep()

    async def start(self) -> None:
        """Load the newest resume point (local disk or own store checkpoint) or genesis; join the run."""
        if await self._load_resume_point() is None:
            self.state = await asyncio.to_thread(GlobalState.genesis, self.inner.state_fp32())
            self.error = (
                {n: torch.zeros_like(t) for n, t in self.state.theta.items()} if self.config.sparse else None
            )
        assert self.state is not None
        self.collector = Collector(self.rs, self.config, self.state.shapes(), self.cache)
        self.digest = await asyncio.to_thread(self.state.digest)
        await self.rs.join()
        await self._wait_for_members()
        if self.round == 0:
            await self._agree_genesis()
        log.info("%s: starting at round %d, digest %s", self.id, self.round, self.digest[:16])

    async def drain(self) -> None:
        """Wait for background uploads (checkpoints, global states) to finish; re-raise an
        unexpected failure of one (typed store errors were logged by ``_spawn``)."""
        while self._background:
            tasks = list(self._background)
            await asyncio.wait(tasks)
            self._background.difference_update(tasks)
            for t in tasks:
                if not t.cancelled() and (e := t.exception()) is not None:
                    raise e

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

    # --- one round ----------------------------------------------------------------------------

    async def run_round(self) -> RoundReport:
        r = self.round + 1
        if (behind := await self._behind(r)) is not None:
            return behind
        report, t0, queued = self._open_report(r)
        losses = await self.inner_phase(r)
        pending = await self._publish_update(r, report, losses, t0)
        record = await self._close_round(pending, load_local=True)
        return await self._finish(record, report, queued)

    async def run_round_overlapped(
        self, rounds: int, carried: tuple[list[float], float] | None
    ) -> tuple[list[float], float] | None:
        """One round with the one-round-delayed outer step (``config.overlap``): the next round's
        inner phase runs while this round is exchanged and applied, then its progress is re-based
        onto the new θ. ``carried``: (losses, seconds) of this round's inner phase if the previous
        call already ran it (the local weights are then re-based); returns the next round's, or None
        when nothing was carried over (the last round, or a repair, catch-up or failure: the next
        round then trains from θ). Where the work may run beside the inner thread: docs/loco.md."""
        r = self.round + 1
        if (await self._behind(r)) is not None:
            return None  # caught up: the local weights were reset to the adopted θ
        report, t0, queued = self._open_report(r)
        losses = carried[0] if carried is not None else await self.inner_phase(r)
        pending = await self._publish_update(r, report, losses, t0)
        if carried is not None:  # trained while the previous round was exchanged
            report.overlapped, report.inner_s = True, carried[1]
        ahead: asyncio.Task[tuple[list[float], float]] | None = None
        base: alg.StateDict = {}
        if r < rounds:
            base = await self._heavy(self.inner.state_fp32)
            ahead = asyncio.create_task(self._train_ahead(r + 1))
        try:
            # collect, apply and settle touch neither the local model nor the inner optimizer
            record = await self._close_round(pending, load_local=ahead is None)
        except BaseException:
            if ahead is not None:
                await asyncio.gather(ahead, return_exceptions=True)  # a thread cannot be cancelled
                await self._heavy(self.inner.load_state_fp32, self._state.theta)
            raise
        nxt = None
        if ahead is not None:
            try:
                nxt = await ahead
            except (PulsenetError, RuntimeError) as e:
                log.error("%s: round %d's overlapped inner phase failed: %s", self.id, r + 1, e)
        # verify and persist only now: a repair loads θ into the local model, and the resume point
        # reads the inner optimizer and RNG, which the inner thread was using
        theta_before = self._state.theta
        await self._finish(record, report, queued)
        if ahead is None:
            return None
        if nxt is None or self._state.theta is not theta_before:  # failed, or a repair adopted θ
            await self._heavy(self.inner.load_state_fp32, self._state.theta)  # start r+1 afresh from θ
            return None
        local = self.inner.parameters()
        await self._heavy(lambda: self.inner.load_state_fp32(alg.rebase(local, base, self._state.theta)))
        return nxt

    async def _train_ahead(self, r: int) -> tuple[list[float], float]:
        """Round r's inner phase, run while round r-1 is exchanged; returns its losses and its time."""
        _AHEAD.set(True)
        t = time.perf_counter()
        queued = self._ahead_queued_s
        losses = await self.inner_phase(r)
        return losses, time.perf_counter() - t - (self._ahead_queued_s - queued)

    async def _behind(self, r: int) -> RoundReport | None:
        """If round r was decided without us, catch up from the store and return that report."""
        existing = await self._collector.read_record(r)
        if existing is not None and self.id not in existing.participants:
            return await self.catch_up(await self.rs.latest_record_round())
        # A record that already includes us means we published this round and died before saving
        # it: redo the round (same state, RNG and data give the same payload) so that the error
        # feedback and inner optimizer come out exactly as if we had never stopped.
        return None

    def _open_report(self, r: int) -> tuple[RoundReport, float, float]:
        if self.cache is not None:
            self.cache.evict_before(r)  # peers still on an older round fall back to the store
        return RoundReport(round=r, trainer=self.id), self._clock(), self._queued_s

    async def _publish_update(self, r: int, report: RoundReport, losses: list[float], t0: float) -> _Pending:
        """Pseudo-gradient, gate and payload against θ_{r-1}; the upload starts in the background."""
        cfg, state = self.config, self._state
        report.loss = float(np.mean(losses)) if losses else None
        t1 = self._clock()
        local = self.inner.parameters()
        own, new_error = await self._heavy(
            alg.make_update,
            state.theta,
            local,
            self.error,
            round=r,
            sparse=cfg.sparse,
            gate_scale=cfg.gate_scale,
        )
        data = await self._heavy(self.encode_payload, own)
        t2 = self._clock()
        report.inner_s, report.encode_s = t1 - t0, t2 - t1
        report.sent, report.total, report.payload_bytes = own.sent, own.total, len(data)
        if not cfg.sparse:
            own = wire.Payload(r, own.mode, {})  # dense values are a full model copy: keep only the bytes
        upload = asyncio.create_task(self._publish(r, data, report))
        return _Pending(r, report, own, new_error, data, upload, t2)

    async def _close_round(self, p: _Pending, *, load_local: bool) -> Record:
        """Collect the round, take the outer step, settle the error feedback; θ becomes θ_r.
        ``load_local``: also reset the local model to θ (not while an overlapped inner phase runs)."""
        state, r, report = self._state, p.round, p.report
        try:
            record, payloads = await self._collector.collect(r, p.upload, state.theta, self.digest)
        finally:
            # Never abandon our own upload half way: a manifest may already name the payload.
            (published,) = await asyncio.gather(p.upload, return_exceptions=True)
        stood = p.data
        if isinstance(published, PulsenetError):
            log.error("%s: round %d: publishing our payload failed: %s", self.id, r, published)
        elif isinstance(published, BaseException):
            raise published
        else:
            stood = published[0]
        t3 = self._clock()
        report.wait_s = t3 - p.t_ready - report.upload_s

        await self._apply(state, payloads)
        state.round = r
        if load_local:
            await self._heavy(self.inner.load_state_fp32, state.theta)
        self.digest = await asyncio.to_thread(state.digest)
        if p.new_error is not None:
            self.error = self._settle_error(record, p.own, p.new_error, payloads, reproduced=stood is p.data)
        report.apply_s = self._clock() - t3
        report.participants = sorted(record.participants)
        report.rejected = dict(record.rejected)
        report.included = self.id in record.participants
        report.record_writer = record.writer
        return record

    async def _finish(self, record: Record, report: RoundReport, queued: float) -> RoundReport:
        t4 = self._clock()
        await self._finish_round(record, report)
        report.verify_s = self._clock() - t4
        report.queued_s = self._queued_s - queued
        return await self._report(report)

    async def inner_phase(self, round_: int) -> list[float]:
        """H inner steps from the current global weights; returns the losses. Tests override to inject faults."""
        return await self._heavy(self._train_inner)

    def encode_payload(self, payload: wire.Payload) -> bytes:
        """The bytes to publish for ``payload``. Tests override to inject malformed or poisoned payloads.

        Sparse values are coded relative to the round's base weights, which every receiver holds;
        DiLoCo's dense payload stays raw FP32 bits under zstd (the baseline as specified).
        """
        return wire.encode(payload, self._state.theta if self.config.sparse else None)

    def _train_inner(self) -> list[float]:
        return self.inner.train(self.config.inner_steps)

    async def _publish(self, r: int, data: bytes, report: RoundReport) -> tuple[bytes, ObjectRef]:
        """Upload payload + manifest; returns the payload bytes that stand in the store (normally ours)."""
        t = time.perf_counter()
        manifest, fresh = await self.rs.publish_payload(
            r, data, mode=self.config.mode, sent=report.sent, total=report.total, base_digest=self.digest
        )
        report.upload_s = time.perf_counter() - t
        if fresh or manifest.payload.sha256 == hashlib.sha256(data).hexdigest():
            return data, manifest.payload
        # A restarted trainer redid a round it had already published and got different bits: the
        # stored payload is the one peers see (_settle_error accounts for it).
        log.warning(
            "%s: round %d was already published with a different payload; the stored one stands", self.id, r
        )
        return await self.rs.fetch(manifest.payload), manifest.payload

    def _settle_error(
        self,
        record: Record,
        own: wire.Payload,
        new_error: alg.StateDict,
        payloads: Mapping[str, wire.Payload],
        *,
        reproduced: bool,
    ) -> alg.StateDict:
        """The error feedback after the round, given what the record did with our payload."""
        r = record.round
        if self.id in record.rejected:
            # Judged invalid (non-finite, outsized): carrying it as error feedback would poison every
            # later round, so this round's local progress is dropped and e stays as it was.
            log.error(
                "%s: round %d: our own payload was rejected (%s); dropping this round's update",
                *(self.id, r, record.rejected[self.id]),
            )
            return self.error  # type: ignore[return-value]
        if self.id not in record.participants:
            alg.unsend(new_error, own)  # merely late: the whole update stays as error feedback
        elif not reproduced:
            # An earlier, different payload of ours was averaged: account for it, not for this one.
            alg.unsend(new_error, own)
            alg.subtract_sent(new_error, payloads[self.id])
        return new_error

    async def _apply(self, state: GlobalState, payloads: Mapping[str, wire.Payload]) -> None:
        """Average ``payloads`` into ``state`` and take the outer step, in place (the same call everywhere)."""
        await self._heavy(
            alg.apply_round,
            state.theta,
            state.momentum,
            payloads,
            lr=self.config.outer_lr,
            mu=self.config.outer_momentum,
        )

    # --- verify and persist -------------------------------------------------------------------

    async def _finish_round(self, record: Record, report: RoundReport) -> None:
        """Publish and compare digests (repairing if we diverged), then persist."""
        digests, complete = await self._verify(record, report)
        report.digest = self.digest
        # Only a trainer that saw every participant's digest may judge itself the state provider.
        await self._persist(record.round, digests if complete else {})

    async def _verify(self, record: Record, report: RoundReport) -> tuple[dict[str, str], bool]:
        """Publish our digest, gather the participants', and rebuild from the store if we are the odd one out."""
        r = record.round
        try:
            stood = await self.rs.publish_digest(r, self.digest)
            if stood != self.digest:
                log.error("%s: round %d: an earlier run of ours published digest %s", self.id, r, stood[:16])
        except StoreError as e:  # peers will judge without ours; we still check theirs
            log.error("%s: round %d: could not publish our digest: %s", self.id, r, e)
        digests, complete = await self._gather_digests(record)
        verdict = recovery.judge(digests, self.id)
        if verdict.unanimous:
            return digests, complete
        report.agreed = False
        if verdict.ours_agreed:
            log.warning(
                "%s: round %d: trainers %s diverged from the majority digest %s; they must repair",
                *(self.id, r, verdict.odd, self.digest[:16]),
            )
            return digests, complete
        log.error(
            "%s: round %d: DIGEST MISMATCH: ours %s, %s; rebuilding the agreed state from the store",
            *(self.id, r, self.digest[:16], {t: d[:16] for t, d in sorted(digests.items()) if t != self.id}),
        )
        state = await self._rebuild(r)
        digest = await asyncio.to_thread(state.digest)
        if verdict.agreed is not None and digest != verdict.agreed:
            raise RoundError(
                f"round {r}: rebuilt state {digest[:16]} still differs from the majority {verdict.agreed[:16]}"
            )
        if digest == self.digest:
            log.error(
                "%s: round %d: the store's chain agrees with our state %s; peers must repair",
                self.id,
                r,
                digest[:16],
            )
            return digests, complete
        await self._adopt(state, digest)
        report.repaired = True
        log.error(
            "%s: round %d: REPAIRED: adopted the agreed state %s from the store", self.id, r, digest[:16]
        )
        digests[self.id] = digest
        return digests, complete

    async def _gather_digests(self, record: Record) -> tuple[dict[str, str], bool]:
        """Our digest and the participants' that arrive within ``digest_wait_s``; and whether all did."""
        r, loop = record.round, asyncio.get_running_loop()
        until = loop.time() + self.config.digest_wait_s
        digests = {self.id: self.digest}
        waiting = [t for t in sorted(record.participants) if t != self.id]
        while waiting:
            for tid in list(waiting):
                try:
                    d = await self.rs.read_digest(tid, r)
                except StoreError as e:
                    log.warning("%s: round %d: store error reading %s's digest: %s", self.id, r, tid, e)
                    continue
                except ManifestError as e:
                    log.warning("%s: round %d: unverifiable digest from %s: %s", self.id, r, tid, e)
                    waiting.remove(tid)
                    continue
                if d is not None:
                    digests[tid] = d
                    waiting.remove(tid)
            if not waiting or loop.time() >= until:
                break
            await self._collector.sleep()
        if waiting:
            log.warning(
                "%s: round %d: no digest from %s within %g s", self.id, r, waiting, self.config.digest_wait_s
            )
        return digests, not waiting

    async def _persist(self, r: int, digests: Mapping[str, str]) -> None:
        cfg = self.config
        path = await self._save_local()
        if cfg.checkpoint_every and r % cfg.checkpoint_every == 0:
            self._spawn(self._upload_checkpoint(r, await self._snapshot(path)), f"checkpoint {r}")
        holders = sorted(t for t, d in digests.items() if d == self.digest)
        if r % cfg.state_every == 0 and holders and holders[0] == self.id and 2 * len(holders) > len(digests):
            # One writer per round: the lowest-id trainer holding the majority digest.
            snapshot = await self._heavy(self._state.copy)
            self._spawn(self._publish_state(snapshot, self.digest), f"global state {r}")
        if cfg.retain_rounds is not None and r % cfg.state_every == 0 and r > cfg.retain_rounds:
            self._spawn(self._retain(r - cfg.retain_rounds), f"retention before {r - cfg.retain_rounds}")

    # --- catch-up and repair --------------------------------------------------------------------

    async def catch_up(self, target: int) -> RoundReport:
        """Bring the global state to round ``target`` from the store (replay and/or a published state), then verify."""
        start = self.round
        log.warning(
            "%s: behind: at round %d while the run has reached %d; catching up from the store",
            *(self.id, start, target),
        )
        t0 = time.perf_counter()
        state = None
        if not [c for c in await self.rs.state_rounds() if start < c <= target]:
            # No newer published state: replaying from our own (verified) state is cheapest.
            with contextlib.suppress(RoundError, StoreError, VerificationError):
                state = self._state.copy()
                await recovery.replay(state, target, self.rs, self._collector.load_record, self._apply)
        if state is None or state.round != target:
            state = await self._rebuild(target)
        await self._adopt(state, await asyncio.to_thread(state.digest))
        report = RoundReport(round=target, trainer=self.id, caught_up_from=start + 1)
        report.apply_s = time.perf_counter() - t0
        record = await self._collector.read_record(target)
        if record is not None:
            report.participants = sorted(record.participants)
            report.rejected = dict(record.rejected)
            report.record_writer = record.writer
            await self._finish_round(record, report)
        return await self._report(report)

    async def _rebuild(self, target: int) -> GlobalState:
        return await recovery.rebuild(
            target,
            self.rs,
            self._state.shapes(),
            self._collector.load_record,
            self._apply,
            quorum=self.config.quorum,
        )

    async def _adopt(self, state: GlobalState, digest: str) -> None:
        self.state = state
        self.digest = digest
        await self._heavy(self.inner.load_state_fp32, state.theta)

    async def _agree_genesis(self) -> None:
        """Round 0: the first trainer publishes its initial state; everyone else must hold the same."""
        ref = await self.rs.read_state_ref(0)
        if ref is None:
            ref = await self.rs.publish_state(self._state, self.digest)
        if ref.digest != self.digest:
            log.warning(
                "%s: initial weights (digest %s) differ from the run's genesis state %s by %s; adopting it",
                *(self.id, self.digest[:16], ref.digest[:16], ref.writer),
            )
            await self._adopt(await self.rs.fetch_state(ref, self._state.shapes()), ref.digest)

    async def _wait_for_members(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.config.join_wait_s
        while len(members := await self.rs.members()) < self.config.workers_expected:
            if loop.time() >= until:
                log.warning(
                    "%s: only %s joined within %g s; starting anyway",
                    self.id,
                    members,
                    self.config.join_wait_s,
                )
                return
            await self._collector.sleep()

    # --- persistence ----------------------------------------------------------------------------

    def _trainer_state(self) -> TrainerState:
        return TrainerState(self._state, self.error, self.inner.checkpoint())

    async def _save_local(self) -> Path | None:
        if self.state_dir is None:
            return None
        path = self.state_dir / STATE_FILE
        await self._heavy(self._trainer_state().save, path)
        return path

    async def _load_resume_point(self) -> TrainerState | None:
        candidates: list[TrainerState] = []
        shapes = {n: tuple(p.shape) for n, p in self.inner.parameters().items()}
        if self.state_dir is not None and (self.state_dir / STATE_FILE).exists():
            candidates.append(await asyncio.to_thread(TrainerState.load, self.state_dir / STATE_FILE, shapes))
        remote = await self.rs.latest_checkpoint()
        if remote is not None and (not candidates or remote[0] > candidates[0].global_.round):
            with tempfile.TemporaryDirectory(prefix="pulseloco-ckpt-") as tmp:
                path = Path(tmp) / STATE_FILE
                await self.rs.fetch_checkpoint(remote[1], path)
                candidates.append(await asyncio.to_thread(TrainerState.load, path, shapes))
        if not candidates:
            return None
        ts = max(candidates, key=lambda s: s.global_.round)
        try:
            self.inner.load_state_fp32(ts.global_.theta)
            self.inner.restore(ts.inner)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as e:  # torch says no more
            raise VerificationError(f"resume point of round {ts.global_.round} does not fit: {e}") from e
        self.state, self.error = ts.global_, ts.error
        log.warning("%s: resumed from round %d", self.id, ts.global_.round)
        return ts

    async def _snapshot(self, path: Path | None) -> Path:
        """A private copy of the resume point, taken now (the next round mutates the live state)."""
        snap = Path(tempfile.mkdtemp(prefix="pulseloco-ckpt-")) / STATE_FILE
        if path is None:  # no local state dir: the store copy is the only resume point
            await self._heavy(self._trainer_state().save, snap)
        else:
            try:
                os.link(path, snap)  # the inode stays ours even after the next round replaces path
            except OSError:
                await asyncio.to_thread(shutil.copyfile, path, snap)
        return snap

    async def _upload_checkpoint(self, r: int, snap: Path) -> None:
        try:
            await self.rs.publish_checkpoint(r, snap)
        finally:
            shutil.rmtree(snap.parent, ignore_errors=True)

    async def _publish_state(self, state: GlobalState, digest: str) -> None:
        ref = await self.rs.publish_state(state, digest)
        log.info("%s: published the global state of round %d (%s)", self.id, state.round, ref.digest[:16])

    async def _retain(self, before: int) -> None:
        n = await self.rs.delete_own_before(before)
        log.info("%s: retention deleted %d own objects before round %d", self.id, n, before)

    # --- helpers ------------------------------------------------------------------------------

    async def _report(self, report: RoundReport) -> RoundReport:
        self.reports.append(report)
        if self.on_round is not None:
            result = self.on_round(self, report)
            if asyncio.iscoroutine(result):
                await result
        return report

    async def _heavy(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run CPU-heavy work in a thread, taking turns with in-process peers if ``compute`` is shared."""
        if self.compute is None:
            return await asyncio.to_thread(fn, *args, **kwargs)
        t = time.perf_counter()
        async with self.compute:
            if _AHEAD.get():
                self._ahead_queued_s += time.perf_counter() - t
            else:
                self._queued_s += time.perf_counter() - t
            return await asyncio.to_thread(fn, *args, **kwargs)

    def _clock(self) -> float:
        """Seconds, not counting time spent queued for shared cores (so phase times mean work)."""
        return time.perf_counter() - self._queued_s

    def _spawn(self, coro: Awaitable[None], what: str) -> None:
        """Run ``coro`` in the background: in ``run``'s TaskGroup (an unexpected exception fails the
        run), else tracked until ``drain`` awaits it and re-raises such an exception."""

        async def guarded() -> None:
            try:
                await coro
            except (PulsenetError, OSError) as e:  # a store or disk failure: logged, the next round retries
                log.error("%s: background %s failed: %s: %s", self.id, what, type(e).__name__, e)

        task = (
            self._group.create_task(guarded()) if self._group is not None else asyncio.create_task(guarded())
        )
        self._background.add(task)
        task.add_done_callback(self._forget_if_ok)

    def _forget_if_ok(self, task: asyncio.Task[None]) -> None:
        """A finished background task is dropped unless it failed: ``drain`` must still see that."""
        if not task.cancelled() and task.exception() is None:
            self._background.discard(task)
