"""Issue 29, items 1, 2 and 12: the numbers a signed inference node puts in its rows are claims.

- item 1: a group id's batch and problem numbers are bounded by the trainer's ``Assignment``
  before any problem is drawn (``p99999999999`` drew 10**11 problems: the trainer hung);
- item 12: a rollout batch answers one batch id the trainer allows, once; a node cannot pick its
  problems by picking batch numbers per group;
- item 2: a GRPO step holds at most ``rows_per_step`` rows in whole groups, and its micro-batches
  at most ``micro_batch_tokens`` padded tokens, whatever the rows' lengths.

Hostile batches go through a node's own writer, signed with its own trusted key, into its own
bucket of the real SeaweedFS, as in tests/integration/test_rollouts_intake.py.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import ManifestError
from pulsenet.nodes.feed import next_step
from pulsenet.rl.answers import answer_id
from pulsenet.rl.grpo import micro_batches
from pulsenet.rl.prompts import byte_codec
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.tasks import Assignment, TaskConfig, assign_problems, build_task, group_id
from pulsenet.rollouts.demand import Demand, assigned
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import Site, intake, make_rows, make_sites

SEED = 0


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)


def _grouped(node: str, version: int, groups: list[str], g: int = 3) -> list[Rollout]:
    """Valid rows (make_rows) with the given group ids, ``g`` rows per group."""
    rows = make_rows(node, version, groups=len(groups), g=g)
    return [dataclasses.replace(r, group=groups[i // g]) for i, r in enumerate(rows)]


# --- item 1: every number of a group id is bounded before any work --------------------------------


@pytest.mark.timeout(30)  # 7876ec8 drew 10**11 problems here: it never returned
def test_a_huge_problem_number_is_refused_before_anything_is_drawn() -> None:
    task = build_task(TaskConfig(task="arith"), seed=SEED)
    prompter = task.prompter(byte_codec())
    rescorer = Rescorer(task, prompter, seed=SEED)
    honest = assign_problems(task, node="i0", version=0, seed=SEED, n=2, batch=0)
    row = Rollout(
        group=group_id("i0", 0, 0, 1), prompt_ids=tuple(prompter.encode(honest[1].prompt)), completion_ids=(49,),
        logprobs=(-1.0,), reward=0.0, version=0, model_digest="0" * 64, node="i0", seed=0,
    )  # fmt: skip
    hostile = [
        dataclasses.replace(row, group="i0-v0-b0-p99999999999"),
        dataclasses.replace(row, group="i0-v0-b99999999999-p0"),
        dataclasses.replace(row, group="i0-v0-b0-p" + "9" * 5000),  # int() of it alone raised on 7876ec8
    ]
    t0 = time.monotonic()
    out = rescorer.rescore([row, *hostile])
    assert time.monotonic() - t0 < 5
    assert [why for _, why in out.rejected] == ["out_of_assignment", "out_of_assignment", "group"]
    assert len(out.rows) == 1 and rescorer.stats.nodes["i0"].rejected == {"out_of_assignment": 2, "group": 1}
    task.close()


# --- items 1 and 12 at the intake: one batch id, within bounds, answered once -----------------------


async def test_batches_answer_one_allowed_batch_id_once_also_after_a_restart(sites: list[Site]) -> None:
    a = Assignment(batches_per_version=4, prompts_per_batch=8, max_group_rows=6)
    check = functools.partial(answer_id, a)
    node, v = sites[0].node, 5
    w = sites[0].writer()
    await w.start()
    sent = {
        "ok b0": _grouped(node, v, [group_id(node, v, 0, 0), group_id(node, v, 0, 3)]),
        "batch_repeated": _grouped(node, v, [group_id(node, v, 0, 1)]),  # b0 again, another problem
        "out_of_assignment p": _grouped(node, v, [group_id(node, v, 1, 99_999_999_999)]),
        "out_of_assignment b": _grouped(node, v, [group_id(node, v, 4, 0)]),  # b < 4 only
        # the choose-your-problems attack of 7876ec8: one group per batch number of the node's choosing
        "mixed_batches": _grouped(node, v, [group_id(node, v, b, 0) for b in (1, 2, 3)]),
        "group_id": _grouped(node, v, [group_id("inf-b", v, 2, 0)]),  # another node's
        "group_size": _grouped(node, v, [group_id(node, v, 2, 0)], g=7),  # more rows than a step
        "ok b3": _grouped(node, v, [group_id(node, v, 3, 7)]),
    }
    for rows in sent.values():
        await w.write(rows)
    ti = intake(sites, refusals_to_distrust=0)  # each refusal here is a strike: these count refusals only
    ti.answer_of = check
    assert await ti.poll(v) == 2
    refused = ti.stats.rejected_by_node[node]
    assert refused == {"batch_repeated": 1, "out_of_assignment": 2, "mixed_batches": 1, "group_id": 1, "group_size": 1}
    taken = ti.take(v)
    assert sorted(b.answer for b in taken) == ["v5-b0", "v5-b3"]
    assert await ti.poll(v) == 0 and ti.stats.rejected_by_node[node] == refused  # never fetched again

    # a restarted trainer (its consumed record): b0 and b3 stay answered, the refused stay refused
    await w.write(_grouped(node, v, [group_id(node, v, 3, 1)]))
    again = intake(sites, refusals_to_distrust=0)
    again.answer_of = check
    again.skip_consumed(ti.consumed())
    assert await again.poll(v) == 0 and len(again) == 0
    # The new b3; the refused repeat, group ids and mixed batch were strikes, kept in the consumed
    # record: not fetched (nor counted) again. The numbers out of bounds are refused again.
    assert again.stats.rejected_by_node[node] == {"batch_repeated": 1, "out_of_assignment": 2}


def test_the_demand_signs_the_assignment_and_nodes_take_the_smallest() -> None:
    d = Demand(trainer="t0", version=3, max_staleness=2, participants=("t0",), grants={"i0": 8}, taken={},
               batches_per_version=4, prompts_per_batch=8, seq=1)  # fmt: skip
    back = Demand.from_body(d.to_body())
    assert (back.batches_per_version, back.prompts_per_batch) == (4, 8)
    e = dataclasses.replace(d, trainer="t1", participants=("t1",), batches_per_version=16, prompts_per_batch=2)
    assert assigned([back, e], "i0") == (4, 2) and assigned([back], "i1") is None
    for bad in (0, 1 << 40, "4"):
        with pytest.raises(ManifestError):
            Demand.from_body({**d.to_body(), "batches_per_version": bad})
    old = {k: x for k, x in d.to_body().items() if k not in ("batches_per_version", "prompts_per_batch")}
    with pytest.raises(ManifestError):
        Demand.from_body({**old, "schema": 1})


# --- item 2: the padded shape of a step is bounded by configuration --------------------------------


def _issue_rows(short: int = 1024, long_tokens: int = 396) -> list[Rollout]:
    """The issue's batch: ``short`` one-token rows in groups of 8, and one row of ``long_tokens``."""
    rows = []
    for i in range(short):
        rows.append(Rollout(group=f"g{i // 8}", prompt_ids=(49, 43, 50, 61), completion_ids=(51,), logprobs=(-1.0,),
                            reward=float(i % 2), version=0, model_digest="d", node="i0", seed=i))  # fmt: skip
    n = long_tokens - 4
    rows.append(Rollout(group="long", prompt_ids=(49, 43, 50, 61), completion_ids=(51,) * n, logprobs=(-1.0,) * n,
                        reward=1.0, version=0, model_digest="d", node="i0", seed=0))  # fmt: skip
    return rows


def test_micro_batches_bound_the_padded_tokens() -> None:
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in _issue_rows()]
    cuts = micro_batches(range(len(lengths)), lengths, None, 4096)
    assert sorted(i for rows, _ in cuts for i in rows) == list(range(len(lengths)))  # every row once, in order
    assert all(len(rows) * w <= 4096 for rows, w in cuts)
    assert all(w == max(lengths[i] for i in rows) for rows, w in cuts)
    assert max(len(rows) for rows, _ in micro_batches(range(10), [3] * 10, 4, 4096)) == 4
    assert micro_batches([0], [9000], None, 4096) == [([0], 9000)]  # one row longer than the budget: alone


def test_a_taken_batch_is_split_into_steps_of_whole_groups() -> None:
    from pulsenet.rollouts import RolloutBatch

    rows = _issue_rows()
    batch = RolloutBatch(manifest=None, columns=None, batch_id="i0/x")  # type: ignore[arg-type]
    groups: dict[str, list[Rollout]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    ready = collections.deque((batch, g) for g in groups.values())
    steps = []
    while ready:
        step, batches = next_step(ready, 32)
        assert [b.batch_id for b in batches] == ["i0/x"]
        steps.append(step)
    assert all(len(s) <= 32 for s in steps) and sum(len(s) for s in steps) == len(rows)
    where = {r.group: {k for k, s in enumerate(steps) for x in s if x.group == r.group} for r in rows}
    assert all(len(ks) == 1 for ks in where.values())  # no group split over two steps


STEP_SCRIPT = r"""
import json, resource, sys, time, torch
from pulsenet.codec.rollout import Rollout
from pulsenet.rl import build_tiny_model
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
torch.set_num_threads(2)
trainer = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3))
def row(group, n, reward, seed):
    return Rollout(group=group, prompt_ids=(49, 43, 50, 61), completion_ids=(51,) * n, logprobs=(-1.0,) * n,
                   reward=reward, version=0, model_digest="d", node="i0", seed=seed)
rows = [row(f"g{i // 8}", 1, float(i % 2), i) for i in range(1024)] + [row("long", 396 - 4, 1.0, 0)]
trainer.step(rows[:8])  # the allocator's first use is not what is measured
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.monotonic()
m = trainer.step(rows)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"grew_mib": grew / 1024, "wall": time.monotonic() - t0, "rows": m.completions}))
"""


@pytest.mark.timeout(300)
def test_a_step_on_the_issues_batch_stays_small() -> None:
    """1024 one-token rows and one of 396 tokens in one GRPO step with the default settings: on
    7876ec8 every row was padded to 396 tokens and the whole batch went through one forward."""
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"step on 1025 rows (one of 396 tokens): peak RSS grew {r['grew_mib']:.0f} MiB in {r['wall']:.1f} s")
    assert r["rows"] == 1025 and r["grew_mib"] < 400, r


# --- items 1 and 12 on a real trainer node (tests/unit/test_signed_peer.py's harness) ----------------


@pytest.mark.timeout(240)
async def test_a_trainer_refuses_a_huge_group_number_and_a_repeated_batch_and_not_again_after_a_restart(tmp_path: Path) -> None:
    """On 7876ec8 one row ``i0-v0-b0-p99999999999`` hung the trainer's re-scoring (10**11 problems
    drawn) and was taken again after every restart; a node's second answer of one batch id was
    trained on. Now both are refused at intake, counted for the node, and the node trains on."""
    from tests.support.peer import Site as PeerSite
    from tests.support.peer import Trainer, batch_rows

    net = PeerSite(tmp_path, "t0", "i0")
    first = Trainer(net, tmp_path / "t0", steps=2)

    async def feed(_: asyncio.Task) -> None:
        d0 = first.node.digests[0]
        hostile = [dataclasses.replace(r, group="i0-v0-b0-p99999999999") for r in batch_rows(0, d0, 0)[:4]]
        await first.writer.write(hostile)  # seq 0
        await first.writer.write(batch_rows(0, d0, 1))  # seq 1: honest
        await first.writer.write(batch_rows(0, d0, 1))  # seq 2: batch b1 answered again
        await first.writer.write(batch_rows(0, d0, 2))  # seq 3: honest

    await first.run(feed)
    n = first.node
    assert first.refused == {"out_of_assignment": 1, "batch_repeated": 1}, first.refused
    assert [v for v, _ in first.published] == [0, 1, 2] and n.feed.stats.failed_steps == 0
    assert n.state.rejected["i0"] == first.refused  # /status, /metrics

    second = Trainer(net, tmp_path / "t0", steps=3)

    async def feed_more(_: asyncio.Task) -> None:
        d0 = second.node.digests[0]
        await second.writer.write(batch_rows(0, d0, 2))  # b2 again, after the restart
        await second.writer.write(batch_rows(0, d0, 3))

    await second.run(feed_more)
    # The repeat refused before the restart is a strike in the consumed record: never fetched again.
    assert second.refused == {"out_of_assignment": 1, "batch_repeated": 1}, second.refused
    assert [v for v, _ in second.published] == [3]
