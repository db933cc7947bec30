"""The trainer node: verified rollouts in, GRPO steps, a new policy version out over PULSESync.

One asyncio loop (``TrainerNode.run``) with, in one TaskGroup:

- the rollout intake polling every trusted inference node's store (its own task, so downloads and
  verification overlap the GRPO step, which runs in a thread);
- the training loop: take fresh batches until a step's worth of rows is there, one GRPO step,
  checkpoint (atomically, before publishing: a restart then republishes what it had not), publish
  the BF16 state as the next version;
- the consumers' signed status objects, read every ``consumer_poll_s``: the slowest live inference
  node goes to ``/status`` and bounds the publisher's retention (nodes/consumers.py).

With one trainer the policy version is the optimizer step. Restart-safe: a SIGKILLed trainer
resumes from its checkpoint with the same command; the publisher resumes from what its own key
signed in the store.

With peers (``loco_store``), each round is a PULSELoCo round (``pulsenet.loco``) whose inner loop
is H GRPO steps on this trainer's share of the rollouts (``rl.inner.GRPOInner``; the intake
partitions batches among the round's trainers, so none is trained on twice), and the policy
version is the round. **Every trainer publishes every version to its own channel**: the global
weights are bit-identical across trainers, so the versions (and digests) agree, inference follows
any trusted channel, and losing a trainer, even the first, never stalls inference while a quorum
of trainers goes on. It costs each trainer one patch upload per round, and needs no election.

Under ``torchrun`` (several GPUs or processes at one site: docs/distributed.md) this node runs on
rank 0 only and speaks for the site (``site=True``): the GRPO steps, in both modes, are
data-parallel over the ranks (``rl.distributed.Site``: each rollout batch goes to every rank with
its step), restores and weight loads reach every rank, and everything else (store, intake,
PULSELoCo exchange, publishing, checkpoints, status) stays here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pulsenet.errors import ConfigError
from pulsenet.fsutil import atomic_path
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.nodes.consumers import ConsumerTracker, poll_consumers
from pulsenet.nodes.status import NodeState
from pulsenet.rl.distributed import Site, SiteGRPOInner
from pulsenet.rl.grpo import GRPOConfig, GRPOMetrics, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rollouts import RolloutIntake, RolloutIntakeConfig, RolloutSource
from pulsenet.store.base import ObjectStore
from pulsenet.sync.publisher import Publisher, PublisherConfig, PublishRecord

log = logging.getLogger(__name__)
CHECKPOINT = "trainer.pt"
CONSUMED = "consumed.json"
"""PULSELoCo mode: the rollout batches trained on up to the last closed round (``_save_consumed``)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """A trainer node. Settings: the [trainer] table of --config FILE, then PULSENET_<FIELD>, then --field."""

    id: str = "t0"
    """This trainer's id."""
    run: str = "default"
    """Run id: part of every signature's context, shared by all nodes of one run."""
    store: str = ""
    """This site's own store URL: its PULSESync channel is published here."""
    key: Path = Path("keys/t0.key")
    """This site's Ed25519 signing key (its public half goes to inference nodes and peers)."""
    inference: list[str] = field(default_factory=list)
    """Rollout sources as ID=STORE_URL, one per inference node (read-only credentials suffice)."""
    trust_inference: list[str] = field(default_factory=list)
    """Inference public keys as ID=PATH (or PATH named ID.key.pub): a node's slot takes only its key."""
    channel: str = "policy"
    """PULSESync channel name inside this store."""
    model: str = "tiny"
    """Initial policy: tiny (warmed up, cached under cache_dir) or smollm2."""
    warmup_steps: int = 250
    """Tiny model only: supervised warm-up steps before v0 (250: sampled reward ~0.6; tests use fewer)."""
    cache_dir: Path | None = None
    """Where the tiny warm-up is cached (keyed by everything it depends on); None: ~/.cache/pulsenet."""
    steps: int = 20
    """Policy versions to train and publish (optimizer steps); the node exits after the last."""
    rows_per_step: int = 32
    """Completions (rollout rows) per GRPO step at least; whole batches are taken."""
    max_staleness: int = 2
    """Largest trainer version minus rollout version trained on (older batches are dropped)."""
    anchor_every: int = 10
    """A full anchor every this many versions, patches in between."""
    keep_anchors: int = 2
    """Retention: the newest this many anchors and every version after the oldest of them."""
    checkpoint_every: int = 1
    """Local resume point every this many steps (always written before publishing)."""
    seed: int = 0
    """Seeds the warm-up and the trainer's generators."""
    state_dir: Path = Path("state/t0")
    """Checkpoints and caches of this node."""
    status_host: str = "127.0.0.1"
    """Address of /healthz, /status, /metrics."""
    status_port: int = 0
    """Port of /healthz, /status, /metrics (0: a free one)."""
    stuck_after_s: float = 900.0
    """/healthz answers 503 when the loop has made no progress for this long."""
    consumer_bound: int = 50
    """Retention keeps the chain from a live inference node's version (its signed status object)
    when it is at most this many versions behind; further behind, it takes the newest anchor."""
    consumer_ttl_s: float = 120.0
    """A consumer whose status object has not changed for this long (trainer's clock) holds nothing."""
    consumer_poll_s: float = 5.0
    """Time between reads of the inference nodes' status objects."""
    loco_store: str = ""
    """The PULSELoCo run's store, writable by every trainer of the run; empty: a lone trainer
    that publishes after every optimizer step."""
    peers: list[str] = field(default_factory=list)
    """PULSELoCo trainer public keys as ID=PATH (this trainer's own included)."""
    inner_steps: int = 8
    """PULSELoCo: GRPO steps per round (H); each round publishes one policy version."""
    min_quorum: int | None = None
    """PULSELoCo: trainers whose payloads a round needs at least (None: a majority)."""
    round_deadline_s: float = 120.0
    """PULSELoCo: how long a round waits for peers' payloads before going on with a quorum."""
    outer_lr: float = 0.7
    """PULSELoCo: outer Nesterov learning rate, the same on every trainer of the run (DiLoCo's 0.7;
    1 with outer_momentum 0 is plain averaging, what ``pulsenet up`` runs: docs/rl.md)."""
    outer_momentum: float = 0.9
    """PULSELoCo: outer Nesterov momentum, the same on every trainer of the run (DiLoCo's 0.9)."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(lr=1e-3))
    """The GRPO step (lr 1e-3 suits the tiny model; 3e-6 for real models)."""
    device: str = "cpu"
    """Where the GRPO steps run: cpu, cuda (under torchrun each rank on cuda:LOCAL_RANK, alone
    cuda:0) or cuda:N. Overrides grpo.device. Weights leave for the store through the CPU either way."""

    def grpo_config(self) -> GRPOConfig:
        """``grpo`` on this node's ``device``."""
        return replace(self.grpo, device=self.device)


class TrainerNode:
    """One trainer: ``await node.run(stop)`` trains and publishes until ``config.steps`` versions."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        store: ObjectStore,
        key: Any,
        sources: list[RolloutSource],
        model: torch.nn.Module,
        loco_store: ObjectStore | None = None,
        site: bool = False,
    ) -> None:
        """``site``: this process is rank 0 of a ``torchrun`` site (docs/distributed.md): the
        default process group is up, the other ranks run ``pulsenet.rl.distributed.serve_rank``,
        and every GRPO step, weight load and restore here runs on all of them."""
        self.config = c = config
        self.state = NodeState(role="trainer", node_id=c.id)
        self.grpo = GRPOTrainer(model, c.grpo_config())
        self.site = Site(grpo=self.grpo) if site else None
        self.publisher = Publisher(
            store,
            key,
            PublisherConfig(channel=c.channel, run=c.run, anchor_every=c.anchor_every, keep_anchors=c.keep_anchors),
        )
        self.digests: dict[int, str] = {}
        """Published model digest per version: what a rollout batch must have been served with."""
        self.intake = RolloutIntake(
            sources,
            self.digests.get,
            RolloutIntakeConfig(run=c.run, max_staleness=c.max_staleness, interval_s=0.5),
            trainer_id=c.id,
            participants=tuple(sorted(self._peer_keys())) if loco_store is not None else None,
        )
        self.loco: LocoTrainer | None = None
        if loco_store is not None:
            peers = self._peer_keys()
            self.loco = LocoTrainer(
                c.id,
                loco_store,
                key,
                peers,
                SiteGRPOInner(self.site, self._next_batch) if self.site else GRPOInner(self.grpo, self._next_batch),
                LocoConfig(
                    run=c.run,
                    inner_steps=c.inner_steps,
                    outer_lr=c.outer_lr,
                    outer_momentum=c.outer_momentum,
                    workers_expected=len(peers),
                    min_quorum=c.min_quorum,
                    deadline_s=c.round_deadline_s,
                ),
                state_dir=Path(c.state_dir) / "loco",
            )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.sources = sources
        self.consumers = ConsumerTracker(bound=c.consumer_bound, ttl_s=c.consumer_ttl_s)
        self.version = -1
        self.history: list[dict[str, Any]] = []
        """One entry per published version: metrics, bytes, timings."""
        self._round_versions: list[int] = []

    # --- lifecycle --------------------------------------------------------------------------------

    def _peer_keys(self) -> dict:
        keys = trainer_keys(self.config.peers)
        if self.config.id not in keys:
            raise ConfigError(f"trainer {self.config.id!r}: peers must list its own public key too (ID=PATH)")
        return keys

    async def start(self) -> None:
        """Resume from the local checkpoint and the store; publish the initial policy as v0 if new."""
        await self.publisher.start()  # rebuilds the newest version its key signed, if any
        if self.loco is not None:
            await self._start_loco()
            return
        published = self.publisher.version
        ckpt = await asyncio.to_thread(self._load_checkpoint)
        if ckpt is not None:
            restore = self.site.restore_checkpoint if self.site else self.grpo.local.restore
            await asyncio.to_thread(restore, ckpt["local"])
            self.digests.update(ckpt["digests"])
            self.intake.skip_consumed(ckpt.get("consumed", {}))  # trained on before the restart
        if published is None or (ckpt is not None and ckpt["version"] == published + 1):
            # A new channel, or a step checkpointed but not yet published: publish it now.
            self.version = -1 if published is None else published
            await self._publish(await asyncio.to_thread(self._bf16_state), None)
        else:
            if ckpt is None or ckpt["version"] != published:
                # No usable checkpoint for the published version: continue from the published
                # weights (BF16) with a fresh optimizer rather than fork the chain.
                log.warning("%s: no checkpoint for v%d: continuing from the published weights", self.config.id, published)
                assert self.publisher.state is not None
                load = self.site.load_state_fp32 if self.site else self.grpo.local.load_state_fp32
                await asyncio.to_thread(load, {n: t.float() for n, t in self.publisher.state.items()})
            self.version = published
            self.digests.update(await self.publisher.recent_digests(self.config.max_staleness + 1))
        self.state.version, self.state.digest = self.version, self.digests.get(self.version)
        log.info("%s: at v%d", self.config.id, self.version)

    async def _start_loco(self) -> None:
        """Join the PULSELoCo run (resume or genesis agreement), then publish what is not yet out:
        v0 is the agreed genesis, version r the global weights after round r."""
        assert self.loco is not None
        await self.loco.start()  # loads the agreed θ into the inner model
        published = self.publisher.version
        if published is None or published < self.loco.round:
            self.version = -1 if published is None else published
            await self._publish(await asyncio.to_thread(self._bf16_state), None)
        else:
            self.version = published
            # rollouts served by the versions still within the staleness bound stay acceptable
            self.digests.update(await self.publisher.recent_digests(self.config.max_staleness + 1))
        consumed = await asyncio.to_thread(self._load_consumed, self.loco.round)
        if consumed is not None:
            self.intake.skip_consumed(consumed)
        if self.version != self.loco.round:
            log.warning("%s: policy v%d at PULSELoCo round %d", self.config.id, self.version, self.loco.round)
        self.state.version, self.state.digest, self.state.round = self.version, self.digests.get(self.version), self.loco.round

    async def run(self, stop: asyncio.Event) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), stop
        await self.start()
        done = asyncio.Event()  # the intake stops with training, however training ends

        async def train() -> None:
            try:
                await self._train(stop)
            finally:
                done.set()

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self.intake.run(lambda: self.version, done))
                tg.create_task(train())
                tg.create_task(self._follow_consumers(done))
        finally:
            await self.publisher.close(flush_timeout=60)

    async def _follow_consumers(self, done: asyncio.Event) -> None:
        """Read the inference nodes' status objects: retention keeps what the slowest live one needs."""
        times: dict[str, str] = {}
        while not done.is_set():
            await poll_consumers(self.consumers, self.sources, run=self.config.run, times=times)
            self.publisher.keep_from = self.consumers.keep_from(self.version)
            self.state.slowest_consumer = self.consumers.slowest(self.version)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.consumer_poll_s):
                    await done.wait()

    # --- the loop ---------------------------------------------------------------------------------

    async def _train(self, stop: asyncio.Event) -> None:
        if self.loco is not None:
            return await self._train_rounds(stop)
        c = self.config
        while self.version < c.steps and not stop.is_set():
            rows, versions = await self._collect(stop)
            if rows is None:
                return
            t0 = time.perf_counter()
            step = self.site.grpo_step if self.site else self.grpo.step
            metrics: GRPOMetrics = await asyncio.to_thread(step, rows)
            step_s = time.perf_counter() - t0
            state = await asyncio.to_thread(self._bf16_state)
            if (self.version + 1) % c.checkpoint_every == 0 or self.version + 1 == c.steps:
                await asyncio.to_thread(self._save_checkpoint, self.version + 1)
            record = await self._publish(state, metrics)
            self.history[-1].update(
                step_s=step_s, staleness=[self.version - 1 - v for v in versions], rows=len(rows)
            )
            h = self.history[-1]
            event = {
                "event": "step",
                "version": record.version,
                "reward": metrics.reward_mean,
                "staleness": max(h["staleness"], default=0),
                "rows": len(rows),
                "rollout_bytes": self.intake.stats.bytes_downloaded,
                "step_s": round(step_s, 3),
            }  # one JSON log line per step: what ``pulsenet up`` builds its per-round history from
            log.info("%s: v%d reward %.3f (%d rows)", c.id, record.version, metrics.reward_mean, len(rows), extra=event)

    async def _train_rounds(self, stop: asyncio.Event) -> None:
        """PULSELoCo rounds until ``steps`` rounds; a stop abandons the round in hand (nothing it
        wrote is visible unless complete: payloads before their create-only manifests)."""
        assert self.loco is not None
        loco = self.loco

        async def run_rounds() -> None:
            async with loco.session():
                while loco.round < self.config.steps:
                    report = await loco.next_round()
                    if report is not None:
                        await self._after_round(loco, report)

        rounds = asyncio.create_task(run_rounds())
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({rounds, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not rounds.done():
                rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rounds

    def _next_batch(self) -> list | None:
        """The GRPO inner loop's rows for one step, from the worker thread the round trains in.

        A trainer whose share of the rollouts is thin (the partition is by hash) gives up waiting
        after half a round deadline, so it still takes part in the round with the steps it made
        (possibly none: its payload is then its error feedback) instead of falling out of it."""
        assert self._loop is not None and self._stop is not None
        wait = self._collect(self._stop, give_up_s=self.config.round_deadline_s / 2)
        rows, versions = asyncio.run_coroutine_threadsafe(wait, self._loop).result()
        if rows is not None:
            self._round_versions.extend(versions)
        return rows

    async def _after_round(self, loco: LocoTrainer, report: Any) -> None:
        """A round closed with the agreed θ loaded into the model: publish it as the next version."""
        await asyncio.to_thread(self._save_consumed, report.round, self.intake.consumed())
        if report.round <= self.version:  # caught up through a round already published
            return
        steps = self.grpo_inner_metrics()
        record = await self._publish(await asyncio.to_thread(self._bf16_state), steps[-1] if steps else None)
        self.history[-1].update(
            round=report.round,
            participants=report.participants,
            payload_bytes=report.payload_bytes,
            sent=report.sent,
            total=report.total,
            staleness=[record.version - 1 - v for v in self._round_versions],
            rows=sum(m.completions for m in steps),
            reward=sum(m.reward_mean for m in steps) / len(steps) if steps else None,
        )
        self._round_versions = []
        self.state.round = report.round
        self.state.bytes["pulseloco"] += report.payload_bytes
        h = self.history[-1]
        dense = 4 * report.total  # one FP32 pseudo-gradient: what a DiLoCo worker sends per round
        event = {
            "event": "step",
            "version": record.version,
            "round": report.round,
            "reward": h["reward"],
            "staleness": max(h["staleness"], default=0),
            "rows": h["rows"],
            "rollout_bytes": self.intake.stats.bytes_downloaded,
            "loco_bytes": report.payload_bytes,
            "diloco_bytes": dense,
            "ddp_bytes": dense * self.config.inner_steps,  # a dense gradient every inner step
        }  # per worker per round, the PULSE paper's measure; read by ``pulsenet up``
        log.info("%s: round %d -> v%d", self.config.id, report.round, record.version, extra=event)

    def grpo_inner_metrics(self) -> list[GRPOMetrics]:
        assert self.loco is not None
        return list(self.loco.inner.metrics)  # type: ignore[attr-defined]

    async def _collect(self, stop: asyncio.Event, give_up_s: float | None = None) -> tuple[list | None, list[int]]:
        """Take fresh batches until a step's worth of rows; (None, []) if stopped first, or if
        ``give_up_s`` passes with no rows (what rows there are then make a smaller step)."""
        rows: list = []
        versions: list[int] = []
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        while len(rows) < self.config.rows_per_step:
            for b in self.intake.take(self.version, max_batches=1):  # whole batches, no more than needed
                rows.extend(b.rows)
                versions.append(b.version)
            if len(rows) >= self.config.rows_per_step:
                break
            if len(self.intake):
                continue
            self.state.beat()
            if deadline is not None and time.monotonic() > deadline:
                return (rows or None), versions
            try:
                async with asyncio.timeout(0.2):
                    await stop.wait()
                return None, []
            except TimeoutError:
                continue
        return rows, versions

    async def _publish(self, state: dict[str, torch.Tensor], metrics: GRPOMetrics | None) -> PublishRecord:
        previous = self.publisher.state
        sparsity = None if previous is None else await asyncio.to_thread(unchanged_fraction, previous, state)
        record = await self.publisher.publish_now(state, step=self.version + 1)
        self.version = record.version
        self.digests[record.version] = record.digest
        for v in [v for v in self.digests if v < record.version - self.config.max_staleness - 1]:
            del self.digests[v]
        entry = {
            "version": record.version,
            "kind": record.kind,
            "digest": record.digest,
            "bytes": sum(record.payload_bytes.values()),
            "full_bytes": record.full_bytes,
            "sparsity": sparsity,
            "metrics": metrics.as_dict() if metrics is not None else None,
        }
        self.history.append(entry)
        log.info(
            "%s: published v%d (%s, %d B of %d)",
            self.config.id,
            record.version,
            record.kind,
            entry["bytes"],
            record.full_bytes,
            extra={
                "event": "published",
                **{k: v for k, v in entry.items() if k != "metrics"},
                "reward": metrics.reward_mean if metrics is not None else None,
                "rollout_bytes": self.intake.stats.bytes_downloaded,
            },
        )
        s = self.state
        s.version, s.digest = record.version, record.digest
        s.bytes["pulsesync"] += entry["bytes"]
        s.bytes["rollouts"] = self.intake.stats.bytes_downloaded
        s.rollouts["consumed"] = self.intake.stats.rows_accepted
        s.rollouts["rejected"] = sum(self.intake.stats.rejected.values())
        s.rollouts["dropped_in_flight"] = self.intake.stats.stale_in_flight
        s.rollouts["dropped_queued"] = self.intake.stats.stale_queued
        if metrics is not None:
            s.reward = metrics.reward_mean
            s.staleness = max(self.intake.stats.staleness, default=0)
        s.beat()
        return record

    def _bf16_state(self) -> dict[str, torch.Tensor]:
        """The weights to publish (in a thread: a copy of the model, and on a site a gather every rank joins)."""
        return self.site.bf16_state() if self.site else self.grpo.bf16_state()

    # --- local resume point -------------------------------------------------------------------------

    def _save_checkpoint(self, version: int) -> None:
        path = Path(self.config.state_dir) / CHECKPOINT
        with atomic_path(path, 0o600) as tmp:
            local = self.site.checkpoint() if self.site else self.grpo.local.checkpoint()
            state = {"version": version, "local": local, "digests": dict(self.digests), "consumed": self.intake.consumed()}
            torch.save(state, tmp)

    def _save_consumed(self, round_: int, consumed: dict[str, int]) -> None:
        """PULSELoCo: the rollout batches trained on up to round ``round_`` (the resume point's)."""
        path = Path(self.config.state_dir) / CONSUMED
        with atomic_path(path, 0o600) as tmp:
            tmp.write_text(json.dumps({"round": round_, "consumed": consumed}))

    def _load_consumed(self, round_: int) -> dict[str, int] | None:
        """The batches ``_save_consumed`` kept for round ``round_``; None (logged) if it has no such
        record: a crash between the round's resume point and this file, or a foreign file. Then the
        batches of round ``round_`` that are still fresh may be trained on once more."""
        path = Path(self.config.state_dir) / CONSUMED
        try:
            data = json.loads(path.read_text())
            if data["round"] == round_:
                return {str(k): int(v) for k, v in data["consumed"].items()}
            why = f"it is for round {data['round']}"
        except FileNotFoundError:
            return None if round_ == 0 else self._no_consumed(round_, "there is none")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = f"unreadable: {e}"
        return self._no_consumed(round_, why)

    def _no_consumed(self, round_: int, why: str) -> None:
        log.warning("%s: no record of the batches trained on up to round %d (%s)", self.config.id, round_, why)
        return None

    def _load_checkpoint(self) -> dict[str, Any] | None:
        path = Path(self.config.state_dir) / CHECKPOINT
        if not path.is_file():
            return None
        try:  # our own file on local disk; a torn or foreign one is ignored, not fatal
            ckpt = torch.load(path, weights_only=False)
            return ckpt if {"version", "local", "digests"} <= set(ckpt) else None
        except (OSError, RuntimeError, EOFError, ValueError, KeyError, TypeError, AttributeError, pickle.UnpicklingError) as e:
            log.error("%s: checkpoint %s unusable (%s): ignored", self.config.id, path, e)
            return None


def unchanged_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Fraction of weights whose bits did not change from ``old`` to ``new`` (the update's sparsity)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    same = total = 0
    for name, t in new.items():
        o = old.get(name)
        total += t.numel()
        if o is not None and o.shape == t.shape and o.dtype == t.dtype:
            # Compare bits, not values: -0.0 vs 0.0 and NaNs count as they are stored.
            bits = ints[t.element_size()]
            same += int((o.reshape(-1).view(bits) == t.reshape(-1).view(bits)).sum())
    return same / total if total else 1.0
