"""Hostile inference nodes against a real trainer with replay on (issue 30, item 4).

A real ``TrainerNode`` (tests/test_signed_peer.py's ``Trainer``, replay on) takes rollouts from two
nodes on ``LocalStore`` buckets: i0, honest (its rows sampled here by a ``TorchEngine`` serving the
trainer's published state, with the public draw keys of ``ReplayRows``), and i1, a real
``InferenceNode`` playing one behaviour of nodes/hostile.py. Every batch of i1 the behaviour
touched is refused under a replay reason, counted for i1; none of i0's is (0 false refusals).
Withholding publishes honest rows: replay passes them, and what is left is the gap in i1's batch
numbers (counting them per node is the intake's, issue 30 item 2). docs/rollouts.md, "Adversaries and what catches them".
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.engines.torch_engine import TorchEngine
from pulsenet.errors import ConfigError
from pulsenet.nodes.build import compose_inference
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.hostile import BEHAVIOURS, HostileConfig
from pulsenet.nodes.hostile_rows import REWORKS
from pulsenet.nodes.inference import InferenceNode
from pulsenet.rl.draw import DrawId
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.tasks import assign_problems, build_task, group_id
from pulsenet.rollouts import RolloutWriter, RolloutWriterConfig
from pulsenet.rollouts.intake import ANSWER_REASONS, ANSWERED, REPLAY_REASONS, REWARD_MISMATCH
from pulsenet.sync import SubscriberConfig
from tests.support.peer import RUN, TASK, Site, Trainer, stop_node
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(180)

PROMPTS, G = 2, 4
"""Per batch: 8 rows, the trainer's ``rows_per_step``: one batch per step."""
VERSIONS = 3


class _Trained(GRPOInner):
    """The GRPO step, recording (node, version) of every row it trains on. ``move``: then scale each
    weight by 1 + move·N(0, 1) (seeded), so consecutive versions differ as a learning run's do: on
    arith the tiny model earns no reward, GRPO's advantages are 0 and its versions barely move."""

    def __init__(self, grpo: Any, move: float = 0.0) -> None:
        super().__init__(grpo)
        self.rows: list[tuple[str, int]] = []
        self.move, self.gen = move, torch.Generator().manual_seed(0)

    def step(self, batch: Any) -> Any:
        self.rows += [(r.node, r.version) for r in batch]
        metrics = super().step(batch)
        if self.move:
            with torch.no_grad():
                for p in self.grpo.local.model.parameters():
                    p.mul_(1 + self.move * torch.randn(p.shape, generator=self.gen))
        return metrics


def _honest(t: Trainer, version: int, batch: int = 0) -> list[Rollout]:
    """i0's batch ``batch`` at ``version``: sampled with the trainer's own copy of the version's
    weights and the public draw keys (run, digest, node, version, batch, problem, completion)."""
    task, text = build_task(TASK, seed=0), text_codec("tiny")
    try:
        prompter = task.prompter(text)
        problems = assign_problems(task, node="i0", version=version, seed=0, n=PROMPTS, batch=batch)
        assert t.node.replayer is not None
        digest = t.node.digests[version]
        engine = TorchEngine.from_state(
            t.grpo.local.model.config, t.node.replayer.versions.state(version), digest, version=version, decode=text.decode
        )
        prompts = [prompter.encode(p.prompt) for p in problems for _ in range(G)]
        keys = tuple(DrawId(RUN, digest, "i0", version, batch, k, i).key() for k in range(PROMPTS) for i in range(G))
        gens = engine.generate(prompts, replace(prompter.sampling_params(), draws=keys))  # type: ignore[arg-type]
        texts = [prompter.completion_text(g.completion_ids) for g in gens]
        rewards = task.score_texts([p for p in problems for _ in range(G)], texts).total
        return [
            g.to_rollout(group=group_id("i0", version, batch, j // G), reward=r, node="i0")
            for j, (g, r) in enumerate(zip(gens, rewards, strict=True))
        ]
    finally:
        task.close()


def _looked_at(t: Trainer, node: str) -> int:
    """Batches of ``node`` the trainer has decided on (taken, then trained on or refused by replay; or refused earlier)."""
    s = t.node.intake.stats
    early = sum(n for r, n in s.rejected_by_node.get(node, {}).items() if r not in REPLAY_REASONS)
    return s.taken_by_node.get(node, 0) + early


async def _run(
    tmp_path: Path, behaviour: str, *, batches_per_version: int = 1, move: float = 0.0, versions: int = VERSIONS
) -> tuple[Trainer, InferenceNode, _Trained, list[int]]:
    """A trainer making ``versions`` versions; at each, it decides on i1's batch(es) first, then
    gets i0's honest batch (unless i1's moved it on already: an untouched batch is trained on).
    Returns the trainer, i1, its GRPO step and the versions of i0's batches."""
    net = Site(tmp_path, "t0", "t1", "i0", "i1")
    policies: list[_Trained] = []

    def policy(grpo: Any) -> _Trained:
        policies.append(_Trained(grpo, move))
        return policies[-1]

    t = Trainer(net, tmp_path / "t0", steps=versions, replay=True, nodes=("i0", "i1"), policy=policy)
    with torch.no_grad():  # a peaked policy, as trained ones are (tests/test_replay.py): a random init is
        t.grpo.local.model.model.embed_tokens.weight.mul_(4.0)  # near-uniform, within the CDF tolerance of a mild cheat
    hostile = compose_inference(
        InferenceConfig(
            id="i1", run=RUN, prompts=PROMPTS, group_size=G, batches_per_version=batches_per_version, max_staleness=3,
            state_dir=tmp_path / "i1", subscribe=SubscriberConfig(interval_s=0.1), status_every_s=5.0, hostile=behaviour,
        ),
        store=net.store("i1"), policy_stores=[net.store("t0")], trusted=net.trusted("t0"),
        key=net.keys["i1"], task=build_task(TASK, seed=0), text=text_codec("tiny"),
    )  # fmt: skip
    writer = RolloutWriter(net.store("i0"), net.keys["i0"], "i0", RolloutWriterConfig(run=RUN, max_staleness=3))
    written: list[int] = []

    async def feed(task: asyncio.Task[Any]) -> None:
        stop = asyncio.Event()
        node = asyncio.create_task(hostile.run(stop))
        try:
            for v in range(versions):
                if t.node.version != v:  # i1's untouched batch made this version
                    continue
                def decided(v: int = v) -> bool:  # i1 made its batches at v, the trainer decided on all it published
                    made = (
                        hostile._batches_at.get(v, 0) >= batches_per_version
                        and _looked_at(t, "i1") >= hostile.writer.stats.batches
                    )
                    gone = "i1" in t.node.intake.trust.distrusted  # its batches are no longer looked at
                    return made or gone or t.node.version != v or node.done()

                await wait_until(decided, 60, f"i1's batches at v{v}", task=task)
                if node.done():
                    await node
                if t.node.version == v:
                    await writer.write(_honest(t, v))
                    written.append(v)
                    await wait_until(lambda v=v: t.node.version != v, 60, f"v{v + 1}", task=task)
        finally:
            await stop_node(stop, node)

    await t.run(feed)
    return t, hostile, policies[0], written


TOUCHING = [b for b in BEHAVIOURS if b not in ("withhold", *REWORKS)]


@pytest.mark.parametrize("behaviour", TOUCHING)
async def test_every_batch_a_hostile_behaviour_touches_is_refused_and_no_honest_one(tmp_path: Path, behaviour: str) -> None:
    # stale: versions that move (``_Trained``), by 5% per weight per version: v0's weights served as v1
    stale = behaviour == "stale"  # its v0 batch is honest (no older weights yet): one more version
    t, hostile, trained, written = await _run(tmp_path, behaviour, move=0.05 if stale else 0.0, versions=VERSIONS + stale)
    assert hostile.hostile is not None
    stats = hostile.hostile.stats
    refused = t.node.intake.stats.rejected_by_node.get("i1", {})
    assert set(refused) <= set(REPLAY_REASONS), refused
    # Every batch of i1 the trainer decided on was refused, except the ones the behaviour left honest
    # (a stale node's first version: it has no older weights to serve) — those it trained on.
    untouched_trained = {v for n, v in trained.rows if n == "i1"}
    decided = _looked_at(t, "i1")
    assert sum(refused.values()) + len(untouched_trained) == decided, (refused, untouched_trained, decided)
    assert sum(refused.values()) >= 1 + (not stale) and stats.touched >= sum(refused.values())
    if behaviour == "stale":
        assert untouched_trained <= {0}  # only v0's batch, served with v0's own weights
    else:
        assert not untouched_trained and stats.touched == stats.batches
    # The honest node: every batch taken and trained on, none refused.
    assert t.node.intake.stats.rejected_by_node.get("i0", {}) == {}
    honest = [v for n, v in trained.rows if n == "i0"]
    assert set(honest) <= set(written)
    # Every honest batch trained on; but a stale node's untouched v0 batch can take a step first, so
    # the run may reach its last version before i0's last batch is taken (seen under load).
    untaken = len(written) * PROMPTS * G - len(honest)
    assert untaken == 0 or (stale and untaken == PROMPTS * G and t.node.version == VERSIONS + 1), (honest, written)
    assert t.node.state.rejected.get("i1") == refused  # what /status and /metrics show


CHOOSING = {  # issue 38: what each behaviour that picks honest rows is refused for at intake
    "better-half": {"incomplete", "assignment_changed"},  # the latter: the better half was the first
    "aliases": {"group_id"},
    "copies": {"group_id"},
    "cut-groups": {"group_size", "group_size_changed"},  # the latter: every group cut to one length
    "repeat": {"batch_repeated"},
    "reward-one": {REWARD_MISMATCH},  # honest rows, lied rewards: the feed's re-score, before any step
}
"""``prefix-cut`` needs a wrong completion with a prefix that scores, which the untrained tiny
model here hardly samples: ``test_a_prefix_cut_row_and_claimed_rewards_at_the_batch_check``."""


@pytest.mark.parametrize("behaviour", sorted(CHOOSING))
async def test_a_node_that_chooses_honest_rows_gets_none_of_its_choices_trained_on(tmp_path: Path, behaviour: str) -> None:
    """Every batch i1 reworked is refused at intake (before any step), for a reason an honest
    node never gives (a strike); the honest node: 0 refusals. What i1 sent unchanged (a first
    batch ``repeat`` cannot repeat yet; a ``prefix-cut`` batch with no wrong row that a prefix
    mends; a ``cut-groups`` batch whose every group peaks at its last row) is trained on."""
    t, hostile, trained, written = await _run(tmp_path, behaviour, batches_per_version=2)
    assert hostile.hostile is not None and hostile.hostile.stats.touched >= 1
    refused = t.node.intake.stats.rejected_by_node.get("i1", {})
    reasons = set(refused) - {"distrusted"}
    assert reasons and reasons <= CHOOSING[behaviour], refused
    assert reasons <= set(ANSWER_REASONS) | {"batch_repeated", REWARD_MISMATCH}  # before replay, before any step
    if behaviour == "repeat":  # its first answers are honest batches, trained on; every copy refused
        assert refused["batch_repeated"] >= 1
    else:  # every batch it sent was reworked: none trained on
        assert not [v for n, v in trained.rows if n == "i1"]
    assert t.node.intake.stats.rejected_by_node.get("i0", {}) == {}  # 0 false refusals
    assert {v for n, v in trained.rows if n == "i0"} <= set(written)


def test_the_reworks_choose_rows_as_described() -> None:
    from pulsenet.nodes.hostile_rows import alias, rework

    def row(group: str, reward: float, ids: tuple[int, ...] = (49, 10)) -> Rollout:
        return Rollout(
            group=group, prompt_ids=(1,), completion_ids=ids, logprobs=tuple(-0.1 for _ in ids), reward=reward,
            version=0, model_digest="0" * 64, node="i1", seed=0,
        )

    g = [f"i1-v0-b0-p{k}" for k in range(4)]
    rows = [row(g[k], r) for k, rs in enumerate([(0, 0), (1, 1), (1, 0), (0, 1)]) for r in rs]
    score = lambda i, ids: 1.0 if list(ids) == [49] else 0.0  # noqa: E731
    [half] = rework("better-half", rows, score, previous=None, n=2, copies=3)
    assert [r.group for r in half] == [g[1], g[1], g[2], g[2]]
    [al] = rework("aliases", rows, score, previous=None, n=1, copies=3)
    assert [r.group for r in al[8:]] == ["i1-v0-b0-p01"] * 2 + ["i1-v0-b0-p001"] * 2 and alias(g[1], 0) == g[1]
    [cp] = rework("copies", rows, score, previous=None, n=1, copies=3)
    assert [r.group for r in cp] == [g[1], g[1], "i1-v0-b0-p01", "i1-v0-b0-p01", "i1-v0-b0-p001", "i1-v0-b0-p001"]
    [cut] = rework("cut-groups", rows, score, previous=None, n=1, copies=3)
    assert [(r.group, r.reward) for r in cut] == [(g[0], 0), (g[1], 1), (g[2], 1), (g[3], 0), (g[3], 1)]
    [pre] = rework("prefix-cut", rows, score, previous=None, n=1, copies=3)
    assert [r.completion_ids for r in pre] == [(49,), (49,), (49, 10), (49, 10), (49, 10), (49,), (49,), (49, 10)]
    assert rework("repeat", rows, score, previous=rows[:2], n=1, copies=3) == [rows, rows[:2]]
    assert {r.reward for r in rework("reward-one", rows, score, previous=None, n=1, copies=3)[0]} == {1.0}


async def test_withholding_passes_replay_and_leaves_gaps_in_its_batch_numbers(tmp_path: Path) -> None:
    """A node that publishes a batch only when its reward suits it sends honest rows: replay passes
    them (no refusal), and the batches it withheld are the holes in the batch numbers it answered."""
    t, hostile, trained, _ = await _run(tmp_path, "withhold", batches_per_version=4)
    assert hostile.hostile is not None
    assert t.node.intake.stats.rejected_by_node == {}
    stats = hostile.hostile.stats
    assert stats.withheld >= 1 and hostile.writer.stats.batches + stats.withheld == stats.batches
    # What the trainer can see: batch numbers i1 was assigned and made (4 per version) but never
    # answered. A withheld batch before a published one is a hole; after the last, a shortfall.
    answered = [k.removeprefix(ANSWERED + "i1/") for k in t.node.intake.consumed() if k.startswith(ANSWERED + "i1/")]
    made = {v: n for v, n in hostile._batches_at.items()}
    assert answered and all(int(a.split("-b")[1]) < made[int(a[1:].split("-")[0])] for a in answered)
    assert len(answered) < sum(made.values())  # the withheld ones: never answered
    assert any(n == "i1" for n, _ in trained.rows)  # what it did publish was trained on


def test_a_behaviour_is_one_flag() -> None:
    c = HostileConfig.parse("perturbed:layer=model.layers.0.mlp.down_proj.weight,factor=1.1")
    assert (c.behaviour, c.layer, c.factor) == ("perturbed", "model.layers.0.mlp.down_proj.weight", 1.1)
    assert HostileConfig.parse("stale:lag=2").lag == 2 and HostileConfig.parse("best-of-n").n == 4
    for bad in ("nice", "stale:lag=x", "stale:lag", "stale:nope=1", "stale:lag=0"):
        with pytest.raises(ConfigError):
            HostileConfig.parse(bad)


# --- pulsenet chaos --hostile ------------------------------------------------------------------


def test_chaos_takes_one_behaviour_per_node_and_sets_it_on_that_node() -> None:
    from pulsenet.chaos.faults import Chaos, ChaosConfig
    from pulsenet.settings import load_settings, to_toml_table

    c = load_settings(ChaosConfig, table="chaos", argv=["--hostile", "i1=stale:lag=2", "--count", "0"], environ={})
    nodes = [InferenceConfig(id="i0"), InferenceConfig(id="i1")]
    _, written = Chaos(c).adjust([], nodes)
    assert [n.hostile for n in written] == ["", "stale:lag=2"]
    assert [n.hostile for n in nodes] == ["", ""]  # new settings: the planned ones are left as they are
    assert to_toml_table(written[1])["hostile"] == "stale:lag=2"  # what the launcher writes into i1's config
    for bad in (["i7=chosen"], ["i1=nice"], ["i1"], ["i0=chosen", "i1=copy"]):  # the last: no honest node left
        with pytest.raises(ConfigError):
            ChaosConfig(hostile=bad, count=0)


def test_the_chaos_audit_checks_replay_refused_the_hostile_node_and_no_honest_one() -> None:
    from pulsenet.chaos.check import audit
    from pulsenet.nodes.events import VersionEvent

    def run(refusals: dict[str, float]) -> dict[str, Any]:
        events = {
            "t0": [
                VersionEvent(kind="published", node="t0", role="trainer", version=v, digest=f"{v:064x}", totals=dict(refusals))
                for v in range(2)
            ],
        }
        roles = {"t0": "trainer", "i0": "inference", "i1": "inference"}
        settings = {"i0": {"hostile": ""}, "i1": {"hostile": "best-of-n"}}
        return audit(events=events, roles=roles, settings=settings)["checks"]["hostile"]

    assert run({"rejected:i1:replay_token": 2, "rejected:i0:stale": 1})["ok"]
    assert not run({"rejected:i1:reward_range": 2})["ok"]  # refused, but for a limit, not a lie
    assert run({"rejected:i1:problem_repeated": 1})["ok"]  # refused at intake (issue 38)
    assert not run({"rejected:i1:replay_token": 2, "rejected:i0:replay_logprob": 1})["ok"]  # a false refusal
