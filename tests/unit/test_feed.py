"""The trainer's feed (nodes/feed.py) against a real intake, without a trainer node: a failed step's
batches stay in the consumed record (a restarted intake skips them), ready rows that went stale are
counted, and a step holds whole groups. Batches are i0's, signed with its trusted key into its own
``LocalStore`` (tests/support/peer.py's ``batch_rows``)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from pulsenet.errors import RolloutRowError
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.feed import StepFeed
from pulsenet.nodes.rounds import load_consumed, save_consumed
from pulsenet.nodes.status import NodeState
from pulsenet.rl.answers import answer_id
from pulsenet.rl.replay import ReplayStats
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.tasks import Assignment, build_task
from pulsenet.rollouts import (
    RolloutIntake,
    RolloutIntakeConfig,
    RolloutSource,
    RolloutWriter,
    RolloutWriterConfig,
)
from pulsenet.rollouts.intake import ANSWERED
from tests.support.peer import RUN, TASK, Site, batch_rows

pytestmark = pytest.mark.timeout(120)

DIGEST = "d" * 64
ASSIGN = Assignment(16, 64, max_group_rows=8)


class Harness:
    """A real intake reading i0's store, a feed on it, and the consumed record in ``tmp``."""

    def __init__(self, net: Site, tmp: Path, *, rows_per_step: int = 8, max_staleness: int = 3) -> None:
        self.path = tmp / "consumed.json"
        self.intake = RolloutIntake(
            [RolloutSource("i0", net.store("i0"), net.trusted("i0"))],
            {0: DIGEST}.get,
            RolloutIntakeConfig(run=RUN, max_staleness=max_staleness),
            answer_of=functools.partial(answer_id, ASSIGN),
        )
        task = build_task(TASK, seed=0)
        self.state = NodeState(role="trainer", node_id="t0")
        self.feed = StepFeed(
            self.intake,
            rescorer=Rescorer(task, task.prompter(text_codec("tiny")), seed=0, assignment=ASSIGN),
            replayer=None,
            digests={0: DIGEST},
            record_consumed=lambda: save_consumed(self.path, 0, self.intake.consumed()),
            state=self.state,
            rows_per_step=rows_per_step,
            run=RUN,
        )

    def restarted(self, net: Site, tmp: Path) -> Harness:
        """A new intake and feed given what the consumed record kept (as ``Rounds.start`` does)."""
        again = Harness(net, tmp)
        kept = load_consumed(self.path, 0, "t0")
        assert kept is not None
        again.intake.skip_consumed(kept)
        return again


def _writer(net: Site) -> RolloutWriter:
    return RolloutWriter(net.store("i0"), net.keys["i0"], "i0", RolloutWriterConfig(run=RUN, max_staleness=3))


def _batches(consumed: dict[str, int]) -> set[str]:
    return {k for k in consumed if not k.startswith(ANSWERED) and ":" not in k}


async def test_a_failed_steps_batches_stay_in_the_consumed_record_and_a_restart_skips_them(tmp_path: Path) -> None:
    net = Site(tmp_path, "i0")
    writer = _writer(net)
    for b in (0, 1):
        await writer.write(batch_rows(0, DIGEST, b))
    h = Harness(net, tmp_path)
    assert await h.intake.poll(0) == 2

    step = await h.feed.next(0, give_up_s=0)
    assert len(step.rows) == 8 and len(step.batches) == 1 and step.staleness == [0]
    assert all(r.group.startswith(step.batches[0].group_prefix) for r in step.rows)  # qualified group ids
    failed = step.batches[0].batch_id
    await h.feed.failed(step, RuntimeError("injected"))
    assert h.feed.stats.failed_steps == 1 and "injected" in (h.state.last_error or "")
    assert h.intake.stats.rejected_by_node["i0"] == {"step_failed": 1}
    assert failed in _batches(load_consumed(h.path, 0, "t0") or {})  # durable before it was counted

    # A restarted intake (what the record kept) takes a new batch, never the failed one (first in
    # sequence order, so taken were it not in the record).
    again = h.restarted(net, tmp_path)
    await writer.write(batch_rows(0, DIGEST, 2))
    await again.intake.poll(0)
    step = await again.feed.next(0, give_up_s=0)
    assert len(step.batches) == 1 and step.batches[0].batch_id not in (failed, *_batches(h.intake.consumed()))
    assert again.intake.stats.taken == 1
    # Batch 1, accepted but never taken before the restart, is not in the record: taken now, not lost.
    second = await again.feed.next(0, give_up_s=0)
    assert len(second.batches) == 1 and second.batches[0].batch_id not in (failed, step.batches[0].batch_id)
    assert not (await again.feed.next(0, give_up_s=0)).rows  # nothing else to take: gives up


async def test_ready_rows_that_go_stale_are_dropped_and_counted(tmp_path: Path) -> None:
    """A batch of two groups feeds two steps of 4 rows; once the trainer's version passes the
    staleness bound, the group still waiting is dropped as ``stale_rows``, not stepped on."""
    net = Site(tmp_path, "i0")
    await _writer(net).write(batch_rows(0, DIGEST, 0))
    h = Harness(net, tmp_path, rows_per_step=4, max_staleness=1)
    await h.intake.poll(0)
    first = await h.feed.next(0, give_up_s=0)
    assert len(first.rows) == 4 and len({r.group for r in first.rows}) == 1  # one whole group
    later = await h.feed.next(2, give_up_s=0)  # v0 rows at trainer v2: past max_staleness 1
    assert not later.rows and h.feed.stats.stale_rows == 4


async def test_a_reward_that_disagrees_with_the_trainers_refuses_the_batch_as_a_strike(tmp_path: Path) -> None:
    """Issue 38: re-scoring replaced a lied reward silently. An honest node computes the same
    deterministic reward (float64 on the wire), so one row claiming another refuses its batch
    (``reward_mismatch``), a strike against the node kept in the consumed record; the node's honest
    batches are still taken."""
    net = Site(tmp_path, "i0")
    writer = _writer(net)
    honest = batch_rows(0, DIGEST, 0)
    lie = 0.5 if honest[0].reward != 0.5 else 0.25  # inside the task's range: the intake lets it by
    await writer.write(batch_rows(0, DIGEST, 0, reward=lie))
    await writer.write(batch_rows(0, DIGEST, 1))
    h = Harness(net, tmp_path)
    assert await h.intake.poll(0) == 2
    step = await h.feed.next(0, give_up_s=0)
    assert len(step.rows) == 8 and len(step.batches) == 1
    assert h.intake.stats.rejected_by_node["i0"] == {"reward_mismatch": 1}
    assert step.staleness == [0]  # the refused batch is not one the step took
    assert h.intake.trust.strikes == {"i0": 1}
    kept = load_consumed(h.path, 0, "t0") or {}
    assert kept.get("strikes:i0") == 1 and len(_batches(kept)) == 1  # durable: the refused batch


class _RaisingReplayer:
    """A fault injector in the replayer's place: its check raises what a batch the intake's checks
    missed would make replay raise (the ``g0`` defect of issue 38)."""

    def __init__(self) -> None:
        self.stats = ReplayStats()

    def holds(self, version: int) -> bool:
        return True

    def check(self, *a: object, **kw: object) -> None:
        raise RolloutRowError("group_id", "injected: a group id replay cannot read")


async def test_a_batch_that_makes_replay_raise_is_refused_and_recorded_not_a_crash(tmp_path: Path) -> None:
    """Issue 38: a batch that trips replay is refused (``step_failed``) and kept in the consumed
    record, so the trainer neither dies on it nor takes it again after a restart."""
    net = Site(tmp_path, "i0")
    await _writer(net).write(batch_rows(0, DIGEST, 0))
    h = Harness(net, tmp_path)
    h.feed.replayer = _RaisingReplayer()  # type: ignore[assignment]  # the injected fault
    await h.intake.poll(0)
    step = await h.feed.next(0, give_up_s=0)
    assert not step.rows
    assert h.intake.stats.rejected_by_node["i0"] == {"step_failed": 1}
    assert len(_batches(load_consumed(h.path, 0, "t0") or {})) == 1  # durable: never taken again
