"""The trainer's feed: rollout batches taken from the intake, replayed, re-scored, cut into steps.

``StepFeed.next(version, give_up_s)`` is the one way a GRPO step gets its rows::

    take a batch (intake) -> replay a share of its rows under its version's weights (rl/replay.py)
      -> re-score every row with the trainer's own task (rl/rescore.py)
      -> its groups join the ready queue -> whole groups off the front, up to ``rows_per_step``

and ``StepFeed.failed(step, err)`` is what a step that raised reports back: its batches are dropped
and kept in the consumed record. Every batch the feed will not train on ends in the intake's
consumed record (``intake.refused`` / ``intake.failed``, then ``record_consumed``), so a restart
never takes it again: the record has this one writer on the trainer's side.

Its counters are one record (``FeedStats``) that /status and the version event read. It knows
nothing of rounds or publishing: the trainer (nodes/trainer.py) hands it the version it is at.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import overload

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import PulsenetError, RolloutRowError
from pulsenet.nodes.status import NodeState
from pulsenet.rl.draw import DrawId
from pulsenet.rl.replay import Replayer, ReplayRow
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.tasks import parse_group_id
from pulsenet.rollouts import RolloutBatch, RolloutIntake
from pulsenet.rollouts.intake import REWARD_MISMATCH

log = logging.getLogger(__name__)

Ready = collections.deque[tuple[RolloutBatch, list[Rollout]]]
"""Re-scored groups, each with its batch, taken but not yet stepped on."""


@dataclass(slots=True)
class FeedStats:
    """The feed's counters (the version event's ``totals`` read them)."""

    failed_steps: int = 0
    """GRPO steps that raised; their batches were dropped (``StepFeed.failed``)."""
    stale_rows: int = 0
    """Ready rows that went stale before a step could take them."""


@dataclass(slots=True)
class Step:
    """The rows of one GRPO step and what gathering them cost."""

    rows: list[Rollout]
    """Whole groups, at most ``rows_per_step`` rows (empty: gave up waiting)."""
    batches: list[RolloutBatch]
    """The batches the rows come from."""
    replay_s: float = 0.0
    """Seconds replaying the batches taken while gathering this step (part of the wait)."""
    staleness: list[int] = field(default_factory=list)
    """Trainer version minus batch version of each batch taken for it that replay did not refuse."""


class StepFeed:
    """Batches from ``intake`` to GRPO steps (see the module docstring).

    ``replayer``: None with replay off; ``rescorer`` is used only with ``rescore``;
    ``digests``: the published digest per version (a batch's draw keys name it);
    ``record_consumed``: makes the intake's consumed record durable (the rounds' checkpoint);
    ``state``: the node's /status record (a beat while waiting, errors of failed steps)."""

    def __init__(
        self,
        intake: RolloutIntake,
        *,
        rescorer: Rescorer,
        replayer: Replayer | None,
        digests: dict[int, str],
        record_consumed: Callable[[], None],
        state: NodeState,
        rows_per_step: int,
        run: str,
        rescore: bool = True,
        name: str = "t0",
    ) -> None:
        self.intake, self.rescorer, self.replayer, self.digests = intake, rescorer, replayer, digests
        self.record_consumed, self.state = record_consumed, state
        self.rows_per_step, self.run, self.rescore, self.name = rows_per_step, run, rescore, name
        self.stats = FeedStats()
        self._ready: Ready = collections.deque()
        """A batch with more than ``rows_per_step`` rows feeds several steps."""

    async def next(self, version: int, give_up_s: float | None) -> Step:
        """The rows of the next GRPO step at trainer ``version``: re-scored groups left from
        batches taken before first (those gone stale dropped and counted), then fresh batches;
        what there is once ``give_up_s`` passes with no more coming (None: wait as long as it
        takes)."""
        floor = version - self.intake.config.max_staleness
        while self._ready and self._ready[0][0].version < floor:
            self.stats.stale_rows += len(self._ready.popleft()[1])
        step = Step([], [])
        await self._take_rows(version, give_up_s, step)
        step.rows, step.batches = next_step(self._ready, self.rows_per_step)
        return step

    async def failed(self, step: Step, e: Exception) -> None:
        """A GRPO step raised: its batches are dropped (they stay in the consumed record, so a
        restart does not take them again), counted per node (``step_failed``) and logged; the feed
        goes on. (Under torchrun the other ranks fail the same step and the job ends: the intake's
        checks are what stand between a hostile batch and a rank group.)"""
        self.state.error(e)
        dropped = {b.batch_id for b in step.batches}  # their groups still waiting go with them
        self._ready = collections.deque((b, g) for b, g in self._ready if b.batch_id not in dropped)
        self.intake.failed(step.batches, f"{type(e).__name__}: {e}")
        await asyncio.to_thread(self.record_consumed)  # a restart before the round closes skips them too
        self.stats.failed_steps += 1  # counted once it is durable: a watcher that sees the count may stop the node
        log.error("%s: a GRPO step failed on %s: %s: %s", self.name, [b.batch_id for b in step.batches], type(e).__name__, e)

    async def _take_rows(self, version: int, give_up_s: float | None, step: Step) -> None:
        """Fresh batches, re-scored into ``_ready``, until it holds a step's worth of rows (whole
        batches, no more than needed), or ``give_up_s`` passes with no more coming."""
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        while sum(len(g) for _, g in self._ready) < self.rows_per_step:
            more = self.intake.take(version, max_batches=1)
            if more:
                batch = more[0]
                rows = await self._vetted(batch, step)
                if rows is None:  # refused by replay
                    await asyncio.to_thread(self.record_consumed)  # never taken again, also after a restart
                    continue
                step.staleness.append(version - batch.version)
                if not rows:
                    self.intake.refused(batch, "rescore", "no row passed re-scoring")
                    await asyncio.to_thread(self.record_consumed)  # never taken again, also after a restart
                    continue
                groups: dict[str, list[Rollout]] = {}
                for row in rows:
                    groups.setdefault(row.group, []).append(row)
                self._ready.extend((batch, g) for g in groups.values())
                continue
            if len(self.intake):
                continue  # the queue held only stale batches: dropped, look again
            self.state.beat()  # waiting for rollouts is progress of a kind
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

    async def _vetted(self, batch: RolloutBatch, step: Step) -> list[Rollout] | None:
        """``batch``'s rows for a GRPO step, replayed (rl/replay.py: rows drawn now, replayed under
        the batch's version's weights) and re-scored, in one trip to a thread; None if it was
        refused (whole, counted per node and reason): by replay, or for a reward that disagrees
        with the trainer's (``reward_mismatch``; both are strikes, rollouts/trust.py). A batch
        whose version this trainer does not hold (published before a restart) is dropped as
        ``unverifiable``, not held against its node."""
        replayer = self.replayer
        if replayer is not None and not replayer.holds(batch.version):
            replayer.stats.unverifiable += 1
            self.intake.refused(batch, "unverifiable", f"v{batch.version}'s weights are not held here (a restart)")
            return None
        try:
            refusal, seconds, rows = await asyncio.to_thread(self._replay_and_rescore, batch)
        except PulsenetError as e:  # the intake's batch check makes this unreachable; if a batch still
            # trips replay or re-scoring, it is refused and recorded, never a crash at every restart
            self.intake.refused(batch, "step_failed", f"{type(e).__name__}: {e}")
            return None
        if replayer is not None:
            replayer.stats.seconds += seconds
            step.replay_s += seconds
        if refusal is None:
            return rows
        self.intake.refused(batch, *refusal)
        return None

    def _replay_and_rescore(self, batch: RolloutBatch) -> tuple[tuple[str, str] | None, float, list[Rollout]]:
        """In a thread: the refusal (reason, detail) if replay or re-scoring refused the batch,
        replay's seconds, and the re-scored rows. The seconds are the replay's own work, timed
        here: the trip to the thread is the re-score's, which has always made it."""
        seconds = 0.0
        if self.replayer is not None:
            t0 = time.perf_counter()
            rows = ReplayRows(batch, self.run, self.digests[batch.version])
            strikes = self.intake.trust.strikes.get(batch.node, 0)  # a struck node's batches: every row
            verdict = self.replayer.check(batch.version, rows, node=batch.node, strikes=strikes)
            seconds = time.perf_counter() - t0
            if not verdict.ok:
                return (verdict.reason or "replay_token", f"row {verdict.row}: {verdict.detail}"), seconds, []
        rows, refusal = self._rescore(batch)
        return refusal, seconds, rows

    def _rescore(self, batch: RolloutBatch) -> tuple[list[Rollout], tuple[str, str] | None]:
        """The batch's rows with this trainer's own rewards (``rl.rescore``: a row whose group or
        prompt is not the one its node was assigned is dropped), each group id then qualified with
        its node and batch; and ``reward_mismatch`` if a row's claimed reward is not the
        trainer's (an honest node's always is: the same deterministic function, float64 on the
        wire), unless the trainer's own reward failed on it."""
        if not self.rescore:
            return batch.rows, None
        out = self.rescorer.rescore(batch.columns.to_rows())
        lies = [d for d in out.disagreements if not d.excused]
        if lies:
            d = lies[0]
            why = (
                f"{len(lies)} rows claim rewards the trainer does not compute "
                f"(first: {d.group} claims {d.claimed:.6g}, the trainer's is {d.computed:.6g})"
            )
            return [], (REWARD_MISMATCH, why)
        return [replace(r, group=batch.group_prefix + r.group) for r in out.rows], None


class ReplayRows(Sequence[ReplayRow]):
    """A batch's rows with their public draw keys, as replay reads them: completion ``i`` of a group is the group's ``i``-th row
    in the batch's order, its problem index and batch number from its group id (the intake checked
    them against the assignment: ``rl.answers.BatchCheck``). A row is made, and its key hashed, only when read:
    replay reads the rows it picked (a quarter of a batch by default), not all of them."""

    def __init__(self, batch: RolloutBatch, run: str, digest: str) -> None:
        cols = batch.columns  # the group ids as the node wrote them (``rows`` qualifies them)
        self._columns, self._run, self._digest = cols, run, digest
        self._groups = []
        for g in cols.groups:
            parsed = parse_group_id(g)
            if parsed is None or parsed[:2] != (batch.node, batch.version):  # the intake refuses such rows first
                raise RolloutRowError("group_id", f"group id {g[:120]!r} is not one of {batch.node} v{batch.version}")
            self._groups.append(parsed)
        self._group = cols.group.tolist()
        seen: dict[int, int] = {}
        self._completion = []
        for g in self._group:
            seen[g] = seen.get(g, -1) + 1
            self._completion.append(seen[g])

    def __len__(self) -> int:
        return len(self._group)

    @overload
    def __getitem__(self, i: int) -> ReplayRow: ...
    @overload
    def __getitem__(self, i: slice) -> list[ReplayRow]: ...
    def __getitem__(self, i: int | slice) -> ReplayRow | list[ReplayRow]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        c = self._columns
        node, version, b, k = self._groups[self._group[i]]
        p0, p1 = int(c.prompt_offsets[i]), int(c.prompt_offsets[i + 1])
        c0, c1 = int(c.completion_offsets[i]), int(c.completion_offsets[i + 1])
        key = DrawId(self._run, self._digest, node, version, b, k, self._completion[i]).key()
        return ReplayRow(
            tuple(c.prompt_ids[p0:p1].tolist()), tuple(c.completion_ids[c0:c1].tolist()),
            tuple(c.logprobs[c0:c1].tolist()), key,
        )  # fmt: skip


def next_step(ready: Ready, rows_per_step: int) -> tuple[list[Rollout], list[RolloutBatch]]:
    """Whole groups off the front of ``ready`` up to ``rows_per_step`` rows (one group at least:
    the intake refuses groups larger than a step), and the batches they come from: the rows of
    one GRPO step, whose padded shape is then at most ``rows_per_step`` x the model's context."""
    rows: list[Rollout] = []
    batches: dict[str, RolloutBatch] = {}
    while ready and (not rows or len(rows) + len(ready[0][1]) <= rows_per_step):
        batch, group = ready.popleft()
        rows += group
        batches[batch.batch_id] = batch
    return rows, list(batches.values())
