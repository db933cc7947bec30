"""The trainer node: verified rollouts in, GRPO rounds, a new policy version out over PULSESync.

The loop, top to bottom (``TrainerNode._train``)::

    while version < steps:
        report = rounds.next_round(inner_phase)      # H GRPO steps on rollouts this loop takes,
                                                     # then the round closes (alone, or PULSELoCo)
        publish the round's BF16 weights as the next version, emit its VersionEvent

around it, in one TaskGroup: the rollout intake polling every trusted inference node's store (so
downloads and verification overlap the GRPO steps, which run in a thread), and the consumers'
signed status objects, read every ``consumer_poll_s`` (the slowest live inference node bounds the
publisher's retention: nodes/consumers.py).

The loop owns the data: ``_inner_phase`` takes each step's rows from the feed (nodes/feed.py:
batches from the intake, replayed and re-scored) and hands them to the GRPO step itself; the
round (``nodes/rounds.py``) only runs that phase and closes. A lone trainer's round is one step
with no exchange (its version is the optimizer step); with peers (``loco_store``) it is a
PULSELoCo round of H steps on this trainer's share of the rollouts (the intake partitions
batches among the round's trainers), and the version is the round. **Every trainer publishes
every version to its own channel**: the global weights are bit-identical across trainers, so the
versions (and digests) agree, inference follows any trusted channel, and losing a trainer, even
the first, never stalls inference while a quorum of trainers goes on.

Restart-safe: a SIGKILLed trainer resumes with the same command from its resume point and from
what its own key signed in the store; a stop abandons the round in hand (nothing it wrote is
visible unless complete). Under ``torchrun`` (docs/distributed.md) this node runs on rank 0 of the
trainer's rank group: every GRPO step, weight read and restore goes to all ranks
(``rl.distributed.GroupGRPOInner``); store, intake, exchange, publishing and status stay here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pulsenet import runtime
from pulsenet.errors import PolicyError
from pulsenet.loco import RoundReport
from pulsenet.nodes.config import TrainerConfig
from pulsenet.nodes.consumers import ConsumerTracker, poll_consumers
from pulsenet.nodes.events import EVENTS_FILE, EventLog, VersionEvent, published_event
from pulsenet.nodes.feed import StepFeed
from pulsenet.nodes.memory import trainer_probe
from pulsenet.nodes.rounds import Published, Rounds, finite
from pulsenet.nodes.status import NodeState
from pulsenet.rl.eval import Evaluator
from pulsenet.rl.grpo import GRPOMetrics
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import check_layout_matches
from pulsenet.rl.replay import Replayer
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.tasks import Assignment, Task
from pulsenet.rollouts import RolloutIntake, RolloutSource
from pulsenet.rollouts.demand import Demand, DemandWriter
from pulsenet.store.base import ObjectStore
from pulsenet.sync.publisher import Publisher
from pulsenet.tracking import Tracker

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RoundTally:
    """What this trainer did in the round in hand (its GRPO steps, the batches they took, where the
    time went), tallied as the round runs; its version event is built from it. Not ``RoundReport``
    (how the round closed: round number, participants, payload bytes) nor ``Rounds`` (what closes a
    round: alone or PULSELoCo)."""

    steps: list[GRPOMetrics] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    batches: int = 0
    wait_s: float = 0.0
    """Waiting for rollouts."""
    train_s: float = 0.0
    """In GRPO steps."""
    exchange_s: float = 0.0
    """Closing the round: with PULSELoCo the exchange with the peers, alone a checkpoint."""
    replay_s: float = 0.0
    """Replaying taken batches' rows (not in ``wait_s``, though it runs while a step's rows are gathered)."""


class TrainerNode:
    """One trainer: ``await node.run(stop)`` trains and publishes until ``config.steps`` versions.

    Built by ``nodes/build.py`` (``build_trainer`` / ``compose_trainer``), which makes every
    component; this class keeps them and drives the loop."""

    def __init__(
        self,
        config: TrainerConfig,
        *,
        state: NodeState,
        policy: GRPOInner,
        task: Task,
        assignment: Assignment,
        publisher: Publisher,
        intake: RolloutIntake,
        digests: dict[int, str],
        rounds: Rounds,
        demand: DemandWriter,
        rescorer: Rescorer,
        replayer: Replayer | None,
        evaluator: Evaluator | None,
        tracker: Tracker,
        consumers: ConsumerTracker,
        sources: list[RolloutSource],
        stores: dict[str, ObjectStore],
    ) -> None:
        self.config = config
        self.state = state
        """What /status and /metrics show (its counters are the components' own, live)."""
        self.policy = policy
        """The GRPO model this node trains (under torchrun rank 0's ``GroupGRPOInner``)."""
        self.task = task
        self.assignment = assignment
        """The batch ids and problem numbers a node may answer (signed into the demand record)."""
        self.publisher = publisher
        self.intake = intake
        self.digests = digests
        """Published model digest per version: what a rollout batch must have been served with
        (the intake checks every batch against it)."""
        self.rounds = rounds
        self.demand = demand
        """This trainer's signed demand record: what the inference nodes should generate for it."""
        self.rescorer = rescorer
        """Re-scores every row with this trainer's own rewards; the nodes' reward column is advisory."""
        self.replayer = replayer
        """Replays rows under the weights of their version before they are trained on (rl/replay.py);
        None with ``replay.enabled`` off."""
        self.evaluator = evaluator
        self.tracker = tracker
        self.consumers = consumers
        self.sources = sources
        self.stores = stores
        """Every store this node talks to, by name: their request counts and health go to /metrics, /healthz."""
        self.events = EventLog(Path(config.state_dir) / EVENTS_FILE)
        self.version = -1
        self._round = RoundTally()
        self._rollout_bytes = 0
        """Rollout bytes downloaded when the last version was published."""
        self.feed = StepFeed(
            intake,
            rescorer=rescorer,
            replayer=replayer,
            digests=digests,
            record_consumed=rounds.record_consumed,
            state=state,
            rows_per_step=config.rows_per_step,
            run=config.run,
            rescore=config.rescore,
            name=config.id,
        )
        """Taken batches, replayed and re-scored, cut into steps (nodes/feed.py)."""
        self.state.memory = trainer_probe(self)  # /status memory: what each holder holds (nodes/memory.py)

    # --- lifecycle --------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        done = asyncio.Event()  # the intake and the consumers stop with training, however it ends
        try:
            await self.start()
            await self.demand.start()
            async with self.rounds.session(), asyncio.TaskGroup() as tg:
                tg.create_task(self.intake.run(lambda: self.version, done))
                tg.create_task(self.demand.run(self._demand, done))
                tg.create_task(self._follow_consumers(done))
                tg.create_task(self._watch_rounds(done))
                try:
                    await self._train(stop)
                finally:
                    done.set()
        finally:
            await self.publisher.close(flush_timeout=60)
            await asyncio.to_thread(self.task.close)  # the reward worker process
            self.tracker.close()

    async def start(self) -> None:
        """Resume (the round's resume point, what this key published) and publish what is not out
        yet: v0 on a new channel, or a round closed but not published before a crash."""
        await self.publisher.start()  # rebuilds the newest version its key signed, if any
        published: Published = None
        if self.publisher.version is not None:
            assert self.publisher.state is not None
            # a model that does not fit its own channel (another config since) stops here, named
            check_layout_matches(self.policy.grpo.local.model.config, self.publisher.state, what="this trainer's channel")
            published = (self.publisher.version, self.publisher.state)
            if self.replayer is not None:  # rows of older versions are unverifiable after a restart
                self.replayer.remember(*published)
        at = await self.rounds.start(published)
        # rollouts served by the versions still within the staleness bound stay acceptable
        self.digests.update(await self.publisher.recent_digests(self.config.intake.max_staleness + 1))
        if published is None or published[0] < at:
            self.version = -1 if published is None else published[0]
            await self.publish_version(RoundReport(round=at, trainer=self.config.id), RoundTally())
        else:
            self.version = published[0]
            self.state.version, self.state.digest = self.version, self.digests.get(self.version)
            if self.version != at:  # rounds already published are caught up through, not republished
                log.warning("%s: policy v%d at round %d", self.config.id, self.version, at)
        self.state.round = at
        log.info("%s: at v%d", self.config.id, self.version, extra={"round": at})

    # --- the loop ---------------------------------------------------------------------------------

    async def _train(self, stop: asyncio.Event) -> None:
        """Rounds until ``steps`` versions are out; a stop abandons the round in hand."""
        while self.version < self.config.steps and not stop.is_set():
            self._round = rnd = RoundTally()
            t0 = time.perf_counter()
            report = await runtime.unless_stopped(self.rounds.next_round(self._inner_phase), stop)
            if report is None:  # stopped, or the round failed (logged by the round; retried)
                continue
            if report.round <= self.version:  # caught up through a round already published
                continue
            rnd.exchange_s = time.perf_counter() - t0 - rnd.wait_s - rnd.train_s - rnd.replay_s
            await self.publish_version(report, rnd)

    async def _inner_phase(self, r: int) -> list[float]:
        """Round r's H GRPO steps, each on rows this loop takes from the feed; their losses."""
        rnd = self._round
        for _ in range(self.rounds.inner_steps):
            t0 = time.perf_counter()
            step = await self.feed.next(self.version, self.rounds.step_wait_s)
            rnd.replay_s += step.replay_s
            rnd.batches += len(step.staleness)
            rnd.staleness += step.staleness
            rnd.wait_s += time.perf_counter() - t0 - step.replay_s
            if not step.rows:
                break  # gave up waiting: the round goes on with the steps it made
            t0 = time.perf_counter()
            try:
                metrics = await asyncio.to_thread(self.policy.step, step.rows)
            except Exception as e:  # rows the intake let through but the step cannot take: drop them
                await self.feed.failed(step, e)
                continue
            finally:
                rnd.train_s += time.perf_counter() - t0
            rnd.steps.append(metrics)
        await asyncio.to_thread(self.policy.end_phase)
        return [m.loss for m in rnd.steps]

    def _demand(self) -> Demand:
        """What this trainer will take next: a step's rows outstanding (a lone trainer publishes after
        each), two steps' under PULSELoCo (H steps per version, refilled as they are taken); shared
        among the inference nodes that are live (their signed status objects), all of them until
        one has been seen."""
        live = {c.node for c in self.consumers.live()} or None
        rows = self.config.rows_per_step * (1 if self.rounds.inner_steps == 1 else 2)
        a = self.assignment
        return self.intake.demand(self.version, rows, live=live, assignment=(a.batches_per_version, a.prompts_per_batch))

    async def publish_version(self, report: RoundReport, rnd: RoundTally) -> VersionEvent | None:
        """Publish the round's weights as the next version and emit its event. Non-finite weights
        never leave the node: they are logged and counted, and the version is not published (the
        rounds guard against them first: ``LocalRounds``, PULSELoCo's apply; this is the last line)."""
        t0 = time.perf_counter()
        state = await asyncio.to_thread(self.policy.bf16_state)
        if not await asyncio.to_thread(finite, state):
            e = PolicyError(f"round {report.round}: non-finite weights; not published, v{self.version} stays")
            log.error("%s: %s", self.config.id, e)
            self.state.error(e)
            return None
        previous = self.publisher.state
        sparsity = None if previous is None else await asyncio.to_thread(unchanged_fraction, previous, state)
        record = await self.publisher.publish_now(state, step=self.version + 1)
        published_at = time.time()
        self.version = record.version
        self.digests[record.version] = record.digest
        if self.replayer is not None:
            self.replayer.remember(record.version, state)
        for v in [v for v in self.digests if v < record.version - self.config.intake.max_staleness - 1]:
            del self.digests[v]
        publish_s = time.perf_counter() - t0
        downloaded, totals = self.intake.stats.bytes_downloaded, self._totals()
        result = None
        if self.evaluator is not None and record.version % self.config.eval_every == 0:
            result = await asyncio.to_thread(self.evaluator.evaluate, record.version, state, record.digest)
        event = published_event(
            node=self.config.id,
            version=record.version,
            digest=record.digest,
            round=report.round,
            patch=record.kind,
            wait_s=rnd.wait_s,
            train_s=rnd.train_s,
            exchange_s=rnd.exchange_s,
            replay_s=rnd.replay_s,
            publish_s=publish_s,
            pulsesync_bytes=sum(record.payload_bytes.values()),
            full_bytes=record.full_bytes,
            pulseloco_bytes=report.payload_bytes,
            model_numel=report.total,
            rollout_bytes=downloaded - self._rollout_bytes,
            steps=[m.as_dict() for m in rnd.steps],
            staleness=rnd.staleness,
            batches=rnd.batches,
            totals=totals,
            sparsity=sparsity,
            participants=list(report.participants),
            at=published_at,
            eval=None if result is None else result.as_dict(),
            eval_s=None if result is None else result.wall_s,
        )
        self._rollout_bytes = downloaded
        self.state.memory.refresh()  # between steps: /status counts the weights' holders now
        self.state.record(self.events.emit(event))
        self.tracker.log(event.as_dict(), step=event.version)
        return event

    def _totals(self) -> dict[str, float]:
        s = self.intake.stats
        return {
            "rows_accepted": s.rows_accepted,
            "batches_accepted": s.accepted,
            "batches_taken": s.taken,
            "batches_rejected": sum(s.rejected.values()),
            "stale_in_flight": s.stale_in_flight,
            "stale_queued": s.stale_queued,
            "rollout_bytes": s.bytes_downloaded,
            "failed_steps": self.feed.stats.failed_steps,
            "stale_rows": self.feed.stats.stale_rows,
            **{f"rejected:{node}:{why}": n for node, reasons in s.rejected_by_node.items() for why, n in reasons.items()},
        }

    async def _follow_consumers(self, done: asyncio.Event) -> None:
        """Read the inference nodes' status objects: retention keeps what the slowest live one needs."""
        times: dict[str, str] = {}

        async def step() -> None:  # store errors are handled per consumer (``poll_consumers``)
            await poll_consumers(self.consumers, self.sources, run=self.config.run, times=times)
            self.publisher.keep_from = self.consumers.keep_from(self.version)
            self.state.slowest_consumer = self.consumers.slowest(self.version)

        await runtime.every(self.config.consumer_poll_s, done, step)

    async def _watch_rounds(self, done: asyncio.Event) -> None:
        """What ``/healthz`` reports as degraded: a peer or the store holding the round up (no I/O)."""
        async def step() -> None:
            self.state.degraded = self.rounds.degraded()

        await runtime.every(1.0, done, step)
        self.state.degraded = None


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
