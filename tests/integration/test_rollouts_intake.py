"""Issue 21 at the intake: nothing a signed inference node sends can crash, stall or poison a trainer.

Each defect is sent the way a compromised or buggy node would: through its own writer, signed with
its own trusted key, into its own bucket of the real SeaweedFS. The trainer must refuse it with a
counted reason per node, never fetch it again, and never hand it to a GRPO step; and the queue
stays bounded in memory and shared fairly between nodes.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import tracemalloc

import pytest
import torch

from pulsenet.codec.rollout import (
    MAX_TOKEN_ID,
    Rollout,
    RolloutColumns,
    decode_batch,
    decode_columns,
    encode_batch,
)
from pulsenet.errors import ConfigError, RolloutRowError
from pulsenet.rl.grpo import group_advantages
from pulsenet.rollouts import REASONS, ROW_REASONS, RolloutIntake, RowLimits, check_rows
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import DIGESTS, Site, intake, make_rows, make_sites

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)

VOCAB = 50_000  # make_rows draws token ids below this


def _one(rows: list[Rollout], i: int = 0, **change: object) -> list[Rollout]:
    return [dataclasses.replace(r, **change) if j == i else r for j, r in enumerate(rows)]


def defects(node: str, version: int) -> dict[str, list[Rollout]]:
    """One batch per defect of issue 21 (items 1, 2, 4) and the logprob bounds, each otherwise valid."""
    rows = make_rows(node, version, groups=2, g=3)
    r0 = rows[0]
    other_prompt = tuple((t + 1) % VOCAB for t in r0.prompt_ids)
    return {
        "token_range": _one(rows, 1, completion_ids=(*rows[1].completion_ids[:-1], VOCAB)),
        "empty_row": _one(rows, 0, prompt_ids=()),
        "group_prompts": _one(rows, 1, prompt_ids=other_prompt),  # rows 0 and 1 share a group
        "reward_range": _one(rows, 2, reward=1e300),  # finite in float64, inf in float32
        "row_too_long": _one(rows, 0, completion_ids=(7,) * (1 << 20), logprobs=(-0.5,) * (1 << 20)),
        "logprob_range": _one(rows, 1, logprobs=(0.25,) * len(rows[1].completion_ids)),
    }


# --- row limits, no store ----------------------------------------------------------------------


def test_check_rows_names_each_defect_and_passes_valid_rows() -> None:
    limits = RowLimits(vocab_size=VOCAB)
    check_rows(decode_columns(encode_batch(make_rows("inf-a", 3, groups=4, g=5))), limits)
    for reason, rows in defects("inf-a", 3).items():
        with pytest.raises(RolloutRowError) as e:
            check_rows(decode_columns(encode_batch(rows)), limits)
        assert e.value.reason == reason, (reason, str(e.value))
    rows = make_rows("inf-a", 3)
    for change, limit, reason in (
        (dict(completion_ids=()), limits, "empty_row"),
        (dict(logprobs=(-81.0,) * len(rows[0].logprobs)), limits, "logprob_range"),
        (dict(reward=2.0), RowLimits(reward_min=0.0, reward_max=1.0), "reward_range"),
        (dict(reward=-0.5), RowLimits(reward_min=0.0, reward_max=1.0), "reward_range"),
        (dict(prompt_ids=(1,) * 40), RowLimits(max_prompt_tokens=39), "row_too_long"),
        (dict(prompt_ids=(1,) * 40), RowLimits(max_row_tokens=40), "row_too_long"),
    ):
        if "completion_ids" in change:
            change["logprobs"] = ()
        with pytest.raises(RolloutRowError) as e:
            check_rows(decode_columns(encode_batch(_one(rows, 0, **change))), limit)
        assert e.value.reason == reason
    assert set(ROW_REASONS) <= set(REASONS)


def test_group_prompt_check_compares_every_token() -> None:
    """A group whose rows differ in one prompt token anywhere is refused; interleaved groups that
    each keep one prompt pass (the vectorised comparison against each group's first row)."""
    rng = random.Random(5)
    rows = make_rows("inf-a", 1, groups=6, g=4)
    rng.shuffle(rows)  # groups interleaved, first rows anywhere
    cols = decode_columns(encode_batch(rows))
    check_rows(cols, RowLimits())
    for _ in range(20):
        i = rng.randrange(len(rows))
        p = list(rows[i].prompt_ids)
        k = rng.randrange(len(p))
        p[k] = (p[k] + 1) % VOCAB
        with pytest.raises(RolloutRowError, match=r"mixes different prompts|two lengths"):
            check_rows(decode_columns(encode_batch(_one(rows, i, prompt_ids=tuple(p)))), RowLimits())


def test_row_limits_from_the_model_and_refusing_nonsense() -> None:
    lim = RowLimits.for_model(vocab_size=49_152, context_tokens=2048, reward_range=(0.0, 1.0), max_completion_tokens=256)
    assert (lim.vocab_size, lim.max_prompt_tokens, lim.max_completion_tokens, lim.max_row_tokens) == (
        49_152, 2047, 256, 2048,
    )  # fmt: skip
    assert (lim.reward_min, lim.reward_max) == (0.0, 1.0)
    for bad in (
        dict(vocab_size=0),
        dict(vocab_size=MAX_TOKEN_ID + 2),
        dict(reward_min=1.0, reward_max=0.0),
        dict(reward_max=float("inf")),
        dict(reward_max=1e300),
        dict(logprob_min=0.0),
        dict(max_prompt_tokens=0),
    ):
        with pytest.raises(ConfigError):
            RowLimits(**bad)


def test_a_queued_token_costs_arrays_not_python_objects() -> None:
    """Issue 21 item 5: decoded rows are arrays. Measured (tracemalloc) on 64 rows of 128 prompt +
    384 completion tokens: ~7 bytes per token kept, where ``decode_batch``'s Rollout tuples keep ~65."""
    rng = random.Random(0)
    rows = []
    for gi in range(8):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(128))
        for _ in range(8):
            rows.append(
                dataclasses.replace(
                    make_rows("inf-a", 1, groups=1, g=1)[0],
                    group=f"g{gi}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(VOCAB) for _ in range(384)),
                    logprobs=(-1.5,) * 384,
                )
            )
    data = encode_batch(rows)
    tokens = 64 * 512

    def kept(decode) -> float:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            out = decode(data)
            gc.collect()
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert len(out) == 64
        return used / tokens

    columns, objects = kept(decode_columns), kept(decode_batch)
    assert columns < 10 < 40 < objects, (columns, objects)
    assert decode_columns(data).nbytes / tokens < 10


# --- at the intake, over the real store --------------------------------------------------------


async def test_each_defect_is_refused_per_node_and_never_fetched_again(sites: list[Site]) -> None:
    a, b = sites
    wa, wb = a.writer(), b.writer()
    for rows in defects(a.node, 4).values():
        await wa.write(rows)
    good_a = await wa.write(make_rows(a.node, 4, seed=7))
    good_b = await wb.write(make_rows(b.node, 4, seed=8))
    ti = intake(sites, limits=RowLimits(vocab_size=VOCAB))
    assert await ti.poll(4) == 2
    want = {reason: 1 for reason in defects(a.node, 4)}
    assert ti.stats.rejected == want
    assert ti.stats.rejected_by_node == {a.node: want}
    downloaded = ti.stats.bytes_downloaded
    assert await ti.poll(4) == 0  # remembered: not fetched, not counted again
    assert ti.stats.rejected == want and ti.stats.bytes_downloaded == downloaded
    taken = ti.take(4)
    assert {(x.node, x.manifest.seq) for x in taken} == {(a.node, good_a.seq), (b.node, good_b.seq)}


async def test_reused_group_ids_cannot_change_another_nodes_advantages(sites: list[Site]) -> None:
    """Issue 21 item 1: node b (and node a itself, in a second batch) reuse node a's group id with
    other prompts and rewards. Groups are qualified by node and batch, so the step's advantages for
    a's rows are the ones a's batch alone gives, and no group mixes prompts."""
    a, b = sites

    def batch(node: str, seed: int, reward: float | None = None) -> list[Rollout]:
        rows = make_rows(node, 2, groups=1, g=4, seed=seed)
        return [dataclasses.replace(r, group="g0", reward=reward if reward is not None else r.reward) for r in rows]

    mine = batch(a.node, 1)
    mine = [dataclasses.replace(r, reward=float(i)) for i, r in enumerate(mine)]  # rewards 0, 1, 2, 3
    await a.writer().write(mine)
    await a.writer().write(batch(a.node, 2, reward=100.0))
    await b.writer().write(batch(b.node, 3, reward=-100.0))
    ti = intake(sites)
    assert await ti.poll(2) == 3
    rows = [r for x in ti.take(2) for r in x.rows]
    groups = {}
    for r in rows:
        groups.setdefault(r.group, set()).add(r.prompt_ids)
    assert len(groups) == 3 and all(len(p) == 1 for p in groups.values())  # one prompt per group
    index = {g: i for i, g in enumerate(groups)}
    adv = group_advantages(
        torch.tensor([r.reward for r in rows]), torch.tensor([index[r.group] for r in rows])
    )
    of_a = [float(x) for r, x in zip(rows, adv, strict=True) if r.node == a.node and r.reward < 50]
    assert of_a == [-1.5, -0.5, 0.5, 1.5]


async def test_a_failed_step_drops_its_batch_for_good(sites: list[Site]) -> None:
    """Issue 21 "a failed step never kills the node": the trainer reports the batch with
    ``failed``; it is counted for its node and never queued again, also after a restart."""
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 3, seed=1))
    await w.write(make_rows(a.node, 3, seed=2))
    ti = intake(sites)
    assert await ti.poll(3) == 2
    first, second = ti.take(3)
    ti.failed(first, "IndexError: index out of range in self")
    assert ti.stats.rejected == {"step_failed": 1}
    assert ti.stats.rejected_by_node == {a.node: {"step_failed": 1}}
    assert first.batch_id in ti.consumed()
    await ti.poll(3)
    assert len(ti) == 0
    restarted = intake(sites)
    restarted.skip_consumed(ti.consumed())
    assert await restarted.poll(3) == 0 and len(restarted) == 0
    assert second.batch_id in ti.consumed()


async def test_queue_budgets_leave_the_rest_in_the_store(sites: list[Site]) -> None:
    """Issue 21 item 5: the queue holds at most its token and byte budgets; what does not fit is
    fetched by a later poll once ``take`` made room, and a batch that can never fit is refused."""
    a = sites[0]
    w = a.writer()
    sent = [await w.write(make_rows(a.node, 5, groups=2, g=4, seed=s)) for s in range(6)]
    most = max(m.tokens for m in sent)
    budget = 2 * most + most // 2
    ti = intake(sites, max_queued_tokens=budget)
    await ti.poll(5)
    assert 2 <= len(ti) < 6 and ti.stats.queued_tokens <= budget and ti.stats.deferred >= 1
    got = {x.manifest.seq for x in ti.take(5)}
    while len(got) < 6:
        assert await ti.poll(5) >= 1
        assert ti.stats.queued_tokens <= budget
        got |= {x.manifest.seq for x in ti.take(5)}
    assert got == {m.seq for m in sent} and ti.stats.rejected == {}
    # the byte budget the same way (judged before download from the manifest's counts)
    bound = max(RolloutColumns.bound_nbytes(rows=m.rows, groups=m.groups, tokens=m.tokens) for m in sent)
    ti = intake(sites, max_queued_bytes=2 * bound + bound // 2)
    await ti.poll(5)
    assert 2 <= len(ti) < 6 and 0 < ti.stats.queued_bytes <= ti.config.max_queued_bytes
    # and a batch over a whole budget is refused unread
    ti = intake(sites, max_queued_tokens=min(m.tokens for m in sent) - 1)
    assert await ti.poll(5) == 0
    assert ti.stats.rejected == {"too_large": 6} and ti.stats.bytes_downloaded == 0


async def test_one_node_cannot_starve_another(sites: list[Site]) -> None:
    """Issue 21 item 7: node a keeps 12 valid batches listed, node b 3; a queue of 6 takes 3 of each
    (before, the first source filled it and b got none), and b's are all in after two polls."""
    a, b = sites
    for s in range(12):
        await a.writer().write(make_rows(a.node, 1, seed=s))
    for s in range(3):
        await b.writer().write(make_rows(b.node, 1, seed=s))
    ti = intake(sites, max_queued=6)
    assert await ti.poll(1) == 6
    by_node = [x.node for x in ti.take(1)]
    assert by_node.count(a.node) == 3 and by_node.count(b.node) == 3
    ti = RolloutIntake([b.source(), a.source()], DIGESTS.get, ti.config)  # b listed first: a still gets its share
    await ti.poll(1)
    assert [x.node for x in ti.take(1)].count(a.node) == 3
    assert ti.stats.taken_by_node == {a.node: 3, b.node: 3}


async def test_take_hands_out_the_newest_fresh_batches_first(sites: list[Site]) -> None:
    """Issue 23: a trainer takes the newest fresh batch that fits, not the oldest, so what it
    trains on is as fresh as the queue allows; older ones are taken when nothing newer waits."""
    a, b = sites
    for v in (3, 5, 4):
        await a.writer().write(make_rows(a.node, v, seed=v))
        await b.writer().write(make_rows(b.node, v, seed=v))
    ti = intake(sites, max_staleness=2)
    assert await ti.poll(5) == 6
    assert [x.version for x in ti.take(5, max_batches=2)] == [5, 5]
    assert [x.version for x in ti.take(5, max_batches=3)] == [4, 4, 3]
    assert ti.stats.staleness == {0: 2, 1: 2, 2: 1}
    assert [x.version for x in ti.take(6)] == []  # the last v3 went stale in the queue
    assert ti.stats.stale_queued == 1
