"""Issue 30, trust at the intake: a node whose batches the replay refuses K times is no longer
read (also after a restart), batch numbers a node withholds are counted without ever blaming an
honest node, and open nodes (no configured key) are pinned, budgeted and dropped on their first
refused batch. Through real SeaweedFS buckets, with each node's own writer and key."""

from __future__ import annotations

import dataclasses
import functools
import logging
import random

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import generate_latest

from pulsenet.nodes.rounds import load_consumed, save_consumed
from pulsenet.nodes.status import NodeState, StatusServer
from pulsenet.rl.answers import answer_id
from pulsenet.rl.tasks import Assignment, group_id
from pulsenet.rollouts import RolloutIntake, RolloutIntakeConfig, RolloutSource
from pulsenet.rollouts.intake import REPLAY_REASONS
from pulsenet.rollouts.layout import RolloutLayout
from pulsenet.rollouts.trust import Gaps, Trust
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import DIGESTS, Site, make_rows, make_sites

pytestmark = pytest.mark.timeout(120)

ANSWER = functools.partial(answer_id, Assignment(batches_per_version=16, prompts_per_batch=4))


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)


def batch(node: str, version: int, b: int, *, digest: str | None = None) -> list:
    """Rows of batch number ``b`` of ``node`` at ``version``, with the group ids a node answers with."""
    rows = make_rows(node, version, groups=2, g=2, seed=b, digest=digest)
    return [dataclasses.replace(r, group=group_id(node, version, b, i // 2)) for i, r in enumerate(rows)]


def intake(sources: list[RolloutSource], **cfg: object) -> RolloutIntake:
    kw = {k: cfg.pop(k) for k in ("trainer_id", "participants") if k in cfg}
    return RolloutIntake(sources, DIGESTS.get, RolloutIntakeConfig(run="test", **cfg), answer_of=ANSWER, **kw)


def open_source(site: Site) -> RolloutSource:
    """``site`` as a source the trainer holds no key for."""
    return RolloutSource(site.node, site.read, {})


def rejected(ti: RolloutIntake, node: str) -> dict[str, int]:
    return ti.stats.rejected_by_node.get(node, {})


# --- the decisions, no store -------------------------------------------------------------------


def test_strikes_distrust_after_k_and_rescore_is_no_strike() -> None:
    t = Trust(3, frozenset(REPLAY_REASONS))
    assert t.refused("n", "rescore", 1) is None and t.refused("n", "signature", 1) is None
    assert t.refused("n", "replay_token", 1) is None and t.refused("n", "replay_logprob", 2) is None
    assert "n" not in t.distrusted
    assert t.refused("n", "replay_params", 3) is not None and t.distrusted == {"n": 3}
    assert t.refused("n", "replay_token", 4) is None  # said once
    never = Trust(0, frozenset(REPLAY_REASONS))
    assert all(never.refused("n", "replay_token", v) is None for v in range(10)) and not never.distrusted
    opened = Trust(3, frozenset(REPLAY_REASONS), open_nodes=frozenset({"o"}))
    assert opened.refused("o", "step_failed", 1) is None and opened.refused("o", "over_budget", 1) is None
    assert opened.refused("o", "unverifiable", 1) is None  # the trainer lacks the weights, not the node's doing
    assert opened.refused("o", "rescore", 1) is not None and "o" in opened.distrusted
    again = Trust(3, frozenset(REPLAY_REASONS))
    again.restore({**t.record(), "inf-a/rollouts/manifests/x.json": 3, "answered:inf-a/v1-b0": 1})
    assert again.distrusted == {"n": 3} and again.strikes == {"n": 3}
    again.forgive(["n"])
    assert not again.distrusted and not again.strikes


def test_gaps_are_a_lower_bound_from_this_processes_listings() -> None:
    g = Gaps()
    g.saw_listing("honest", {1: 3}, 0, 20)
    g.saw_listing("cheat", {1: 2}, 0, 20)  # published b = 0 and 2, withheld b = 1
    for b in range(3):
        g.saw_accepted("honest", 1, b)
    g.saw_accepted("cheat", 1, 2)
    g.saw_accepted("restored", 1, 5)  # no listing of this process holds its version: nothing known
    assert g.settle(1) == {}  # v1 still in the window
    assert g.settle(2) == {"cheat": 1}
    assert g.settle(2) == {} and not g.listed and not g.accepted  # counted once, then forgotten
    g.saw_listing("far", {10**9: 50}, 0, 20)
    assert not g.listed  # a planted far version is not kept


def test_gaps_never_blame_an_honest_node_and_never_exceed_what_was_withheld() -> None:
    """2,000 random runs: a node makes batches 0..n-1 of each version in order and publishes each
    (honest) or all but a random few (cheat); trainers list at random moments between writes and
    accept a random share of what their listings show (the partition, deferrals). Every trainer's
    count is 0 for the honest node and at most what the cheat withheld."""
    rng = random.Random(30)
    caught = 0
    for _ in range(2000):
        withheld: dict[int, set[int]] = {}
        published: dict[int, int] = {}  # version -> names listed so far
        gaps = [Gaps() for _ in range(rng.randint(1, 3))]
        cheat = rng.random() < 0.5
        for v in range(rng.randint(1, 4)):
            n = rng.randint(1, 8)
            withheld[v] = {b for b in range(n) if cheat and rng.random() < 0.3}
            names: list[int] = []
            for b in range(n):
                if b not in withheld[v]:
                    names.append(b)
                    published[v] = len(names)
                for g in gaps:
                    if rng.random() < 0.4:  # this trainer lists now
                        g.saw_listing("x", dict(published), 0, 100)
                        for got in names:
                            if rng.random() < 0.5:
                                g.saw_accepted("x", v, got)
        for g in gaps:
            total = sum(g.settle(100).values())
            assert total == 0 if not cheat else total <= sum(len(w) for w in withheld.values())
            caught += total > 0
    assert caught > 200  # and it is no empty bound


# --- distrust after K replay refusals ---------------------------------------------------------


async def test_a_node_is_distrusted_after_k_replay_refusals_and_stays_so_after_a_restart(
    sites: list[Site], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = sites
    wa, wb = a.writer(), b.writer()
    for b_ in range(5):
        await wa.write(batch(a.node, 1, b_))
    await wb.write(batch(b.node, 1, 0))
    ti = intake([a.source(), b.source()], refusals_to_distrust=3, relist_after_s=0.0)
    assert await ti.poll(1) == 6
    of_a = [x for x in ti.take(1, max_batches=6) if x.node == a.node]
    for x in of_a[:2]:
        ti.refused(x, "replay_token", "row 0 token 3 is not the draw's")
    ti.refused(of_a[2], "rescore", "no row passed re-scoring")  # not a strike
    assert a.node not in ti.trust.distrusted and a.node not in ti.stats.distrusted
    with caplog.at_level(logging.ERROR, logger="pulsenet.rollouts.intake"):
        ti.refused(of_a[3], "replay_logprob", "|dlogprob| 0.7")
    assert a.node in ti.stats.distrusted and "2 batches" not in ti.stats.distrusted[a.node]
    assert [r.message for r in caplog.records if "DISTRUSTED" in r.message] != []
    # its new batches are skipped before any GET (counted); the other node's still flow
    for b_ in range(5, 8):
        await wa.write(batch(a.node, 1, b_))
    await wb.write(batch(b.node, 1, 1))
    before, down = a.read.requests.snapshot(), ti.stats.bytes_downloaded
    assert await ti.poll(1) == 1
    spent = a.read.requests - before
    assert spent.get == 0 and spent.list == 1  # one listing (once per relist_after_s): no head, manifest or payload
    assert (
        rejected(ti, a.node)["distrusted"] == 3
        and ti.stats.bytes_downloaded - down == (await b.read.list("rollouts/batches/", timeout=10))[-1].size
    )
    assert rejected(ti, a.node)["replay_token"] == 2 and rejected(ti, a.node)["rescore"] == 1
    # distrusted nodes get no share of the demand
    assert ti.demand(1, 8).grants == {a.node: 0, b.node: 8}
    # a restart keeps it (the consumed record), and K - 1 strikes of b survive as well
    ti.refused(ti.take(1)[0], "replay_params", "temperature 0.7, the task says 1.0")
    restarted = intake([a.source(), b.source()], refusals_to_distrust=3)
    restarted.skip_consumed(ti.consumed())
    await wa.write(batch(a.node, 1, 8))
    assert await restarted.poll(1) == 0
    assert rejected(restarted, a.node) == {"distrusted": 4}  # b = 5..8
    assert restarted.trust.strikes[b.node] == 1 and b.node not in restarted.trust.distrusted
    # what the trainer's /status and /metrics show (its NodeState holds the intake's live counts)
    state = NodeState(role="trainer", node_id="t0")
    state.rejected = restarted.stats.rejected_by_node
    assert state.to_json()["rejected"][a.node] == {"distrusted": 4}
    metrics = generate_latest(StatusServer(state).registry).decode()
    assert f'pulsenet_rollouts_rejected_total{{node="t0",reason="distrusted",role="trainer",source="{a.node}"}} 4.0' in metrics
    # an operator lifts it
    forgiven = intake([a.source(), b.source()], refusals_to_distrust=3, forgive=[a.node])
    forgiven.skip_consumed(ti.consumed())
    assert await forgiven.poll(1) == 4 and not forgiven.stats.distrusted


async def test_k_zero_never_distrusts(sites: list[Site]) -> None:
    a, _ = sites
    wa = a.writer()
    for b_ in range(4):
        await wa.write(batch(a.node, 1, b_))
    ti = intake([a.source()], refusals_to_distrust=0)
    assert await ti.poll(1) == 4
    for x in ti.take(1):
        ti.refused(x, "replay_token", "bad")
    await wa.write(batch(a.node, 1, 4))
    assert await ti.poll(1) == 1 and not ti.stats.distrusted


# --- gaps ---------------------------------------------------------------------------------------


async def test_withheld_batch_numbers_are_counted_and_honest_nodes_never_blamed(sites: list[Site]) -> None:
    """Node b generates batches 0..3 of v1 and publishes 0, 2 and 3 (it keeps only those it likes);
    node a publishes all. Two trainers share the pool by the partition: each counts what it can
    prove, and neither ever blames a."""
    a, b = sites
    wa, wb = a.writer(), b.writer()
    for b_ in range(4):
        await wa.write(batch(a.node, 1, b_))
        if b_ != 1:
            await wb.write(batch(b.node, 1, b_))
    await wa.write(batch(a.node, 2, 0))
    trainers = [
        intake([a.source(), b.source()], trainer_id=t, participants=("t0", "t1"), max_staleness=2) for t in ("t0", "t1")
    ]
    tops = {}
    for ti in trainers:
        await ti.poll(1)
        tops[ti.trainer_id] = max((int(k.rsplit("-b", 1)[1]) for k in _answers(ti, b.node)), default=-1)
        await ti.poll(3)  # v1 still in the window: nothing judged yet
        assert "withheld" not in rejected(ti, b.node)
        await ti.poll(4)  # v1 left it
        assert "withheld" not in rejected(ti, a.node)
    # b listed 3 names of v1: whoever accepted its batch 3 proves one withheld; a trainer whose
    # highest number of b is 2 or below proves nothing
    counts = [rejected(ti, b.node).get("withheld", 0) for ti in trainers]
    assert counts == [max(0, tops[ti.trainer_id] + 1 - 3) for ti in trainers] and sum(counts) == 1, (counts, tops)
    # a lone trainer sees all of it, once
    alone = intake([a.source(), b.source()], max_staleness=2)
    await alone.poll(1)
    await alone.poll(4)
    await alone.poll(5)
    assert rejected(alone, b.node) == {"withheld": 1} and rejected(alone, a.node) == {}


def _answers(ti: RolloutIntake, node: str) -> list[str]:
    """Batch ids of ``node`` ``ti`` accepted (taken or not: the consumed record holds the taken ones)."""
    return [k.removeprefix(f"{node}/") for k in ti._answered if k.startswith(f"{node}/")]


async def test_a_restarted_trainer_blames_no_one_for_versions_its_node_deleted(sites: list[Site]) -> None:
    a, _ = sites
    wa = a.writer(max_staleness=2)
    for b_ in range(3):
        await wa.write(batch(a.node, 1, b_))
    ti = intake([a.source()], max_staleness=2)
    assert await ti.poll(1) == 3
    ti.take(1)
    await wa.write(batch(a.node, 4, 0))
    await wa.retain(4)  # v1 is gone from the node's store
    again = intake([a.source()], max_staleness=2)
    again.skip_consumed(ti.consumed())
    await again.poll(3)
    await again.poll(4)
    assert rejected(again, a.node) == {}


# --- open inference -----------------------------------------------------------------------------


async def test_an_open_node_is_pinned_budgeted_and_dropped_on_its_first_refusal(sites: list[Site]) -> None:
    a, o = sites
    wa, wo = a.writer(), o.writer()
    await wa.start()
    for b_ in range(3):
        await wo.write(batch(o.node, 1, b_))
    closed = intake([a.source(), open_source(o)])
    assert await closed.poll(1) == 0 and rejected(closed, o.node) == {"signature": 3}  # no key, not open: as before
    ti = intake([a.source(), open_source(o)], open_inference=True, open_budget=2, relist_after_s=0.0)
    before = o.read.requests.snapshot()
    assert await ti.poll(1) == 2
    assert rejected(ti, o.node) == {"over_budget": 1} and ti.trust.pinned[o.node] == wo.key_id
    assert (o.read.requests - before).get == 1 + 1 + 1 + 2 * 2  # key, head to prove it, head, two manifests and payloads
    await wo.write(batch(o.node, 2, 0))  # a new version: a new budget
    assert await ti.poll(2) == 1
    assert await ti.poll(2) == 0  # and the pinned key answers 304: no new read
    # its first refused batch (here: by the replay) drops it; no further batch is fetched
    ti.refused(ti.take(2)[0], "replay_logprob", "|dlogprob| 2.1")
    assert o.node in ti.stats.distrusted and not [x for x in ti.take(2) if x.node == o.node]
    await wo.write(batch(o.node, 2, 1))
    down = ti.stats.bytes_downloaded
    assert await ti.poll(2) == 0 and ti.stats.bytes_downloaded == down
    assert rejected(ti, o.node)["distrusted"] == 1  # the new one (take handed out the rest)
    # a refusal at the intake drops it just the same
    ti2 = intake([a.source(), open_source(o)], open_inference=True, open_budget=8)
    await wo.write(batch(o.node, 2, 2, digest=DIGESTS[9]))
    assert await ti2.poll(2) == 2  # v2 b0, b1 accepted; b2 refused (wrong digest); v1 skipped after it
    assert o.node in ti2.stats.distrusted and ti2.take(2) == []  # what it had queued goes too
    assert rejected(ti2, o.node) == {"wrong_digest": 1, "distrusted": 5}  # v2 b0, b1 queued; v1's three


async def test_an_open_nodes_key_that_changes_is_refused_also_after_a_restart(sites: list[Site], tmp_path) -> None:
    a, o = sites
    wo = o.writer()
    await wo.write(batch(o.node, 1, 0))
    ti = intake([a.source(), open_source(o)], open_inference=True)
    assert await ti.poll(1) == 1
    record = ti.consumed()
    # the node swaps its key (a new identity under the same name): refused, and it is dropped
    other = Ed25519PrivateKey.generate()
    w2 = dataclasses.replace(o, key=other).writer()
    await w2.write(batch(o.node, 1, 1))
    assert await ti.poll(1) == 0
    assert rejected(ti, o.node)["key_changed"] == 1 and o.node in ti.stats.distrusted
    # a restarted trainer remembers the pinned key, not just the distrust (through its file)
    save_consumed(tmp_path / "consumed.json", 7, record)  # from before the swap: pinned, not distrusted
    fresh = intake([a.source(), open_source(o)], open_inference=True)
    fresh.skip_consumed(load_consumed(tmp_path / "consumed.json", 7, "t0"))
    assert await fresh.poll(1) == 0 and rejected(fresh, o.node)["key_changed"] == 1
    # unless the operator forgives it (after the node removed what its old key signed): the new
    # key is pinned and its batch taken
    await o.own.delete([RolloutLayout().manifest(1, o.node, 0)], timeout=10)
    forgiven = intake([a.source(), open_source(o)], open_inference=True, forgive=[o.node])
    forgiven.skip_consumed(fresh.consumed())
    assert await forgiven.poll(1) == 1 and forgiven.trust.pinned[o.node] == w2.key_id
    # an open node that publishes an allowlisted node's key is refused
    raw = a.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    await o.own.put("rollouts/key.pub", raw, timeout=10)
    third = intake([a.source(), open_source(o)], open_inference=True)
    assert await third.poll(1) == 0 and rejected(third, o.node) == {"wrong_node_key": 1}
    # junk is not a key
    await o.own.put("rollouts/key.pub", b"not a key", timeout=10)
    fourth = intake([a.source(), open_source(o)], open_inference=True)
    assert await fourth.poll(1) == 0 and rejected(fourth, o.node) == {"malformed": 1}


async def test_an_open_node_cannot_pin_another_open_nodes_key_as_its_own(sites: list[Site], tmp_path) -> None:
    """Issue 38: o publishes a's public key as its own. A key is pinned only once the node's head,
    signed for its own context, verifies under it: o cannot, so o is refused (and, an open node,
    dropped); a is pinned and its batches taken, in either order of polling, also after a restart."""
    a, o = sites
    raw = a.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    wa, wo = a.writer(), o.writer()
    await wo.write(batch(o.node, 1, 0))
    await o.own.put("rollouts/key.pub", raw, timeout=10)  # after its start wrote its own
    for order in ([open_source(o), open_source(a)], [open_source(a), open_source(o)]):
        ti = intake(order, open_inference=True)
        assert await ti.poll(1) == 0
        assert rejected(ti, o.node) == {"wrong_node_key": 1} and o.node in ti.stats.distrusted
        assert o.node not in ti.trust.pinned
    await wa.write(batch(a.node, 1, 0))
    assert await ti.poll(1) == 1 and ti.trust.pinned[a.node] == wa.key_id and rejected(ti, a.node) == {}
    assert [b.node for b in ti.take(1)] == [a.node]
    save_consumed(tmp_path / "consumed.json", 7, ti.consumed())
    again = intake([open_source(o), open_source(a)], open_inference=True)
    again.skip_consumed(load_consumed(tmp_path / "consumed.json", 7, "t0"))
    await wa.write(batch(a.node, 1, 1))
    assert await again.poll(1) == 1 and rejected(again, a.node) == {} and o.node in again.stats.distrusted


def test_a_trainer_takes_a_source_without_a_key_only_with_open_inference(tmp_path) -> None:
    """``build_trainer``: a node without a trusted key is a config error, unless open inference is
    on, when it is an open source (and the allowlisted one keeps its key)."""
    from pulsenet.errors import ConfigError
    from pulsenet.nodes.config import TrainerConfig
    from pulsenet.nodes.run import build_trainer
    from pulsenet.signing import generate_keypair
    from pulsenet.store import LocalStore

    generate_keypair(tmp_path / "t0.key")
    generate_keypair(tmp_path / "i1.key")

    def config(**intake: object) -> TrainerConfig:
        return TrainerConfig(
            store=f"file://{tmp_path}/t0",
            key=tmp_path / "t0.key",
            inference=[f"i0=file://{tmp_path}/i0", f"i1=file://{tmp_path}/i1"],
            trust_inference=[f"i1={tmp_path}/i1.key.pub"],
            warmup_steps=0,
            state_dir=tmp_path / "state",
            intake=RolloutIntakeConfig(**intake),
        )

    def opened(url: str) -> LocalStore:
        return LocalStore(url.removeprefix("file://"))

    with pytest.raises(ConfigError, match=r"no trusted key for inference node\(s\) \['i0'\]"):
        build_trainer(config(), open_store=opened)
    node = build_trainer(config(open_inference=True), open_store=opened)
    assert node.intake.trust.open_nodes == {"i0"}
    c = config(open_inference=True)
    c.trust_inference = []
    assert build_trainer(c, open_store=opened).intake.trust.open_nodes == {"i0", "i1"}


def test_the_trust_settings_come_from_the_trainers_intake_table(tmp_path) -> None:
    from pulsenet.nodes.config import TrainerConfig
    from pulsenet.settings import load_settings

    (tmp_path / "t.toml").write_text(
        '[trainer.intake]\nrefusals_to_distrust = 5\nforgive = ["i0", "i1"]\nopen_inference = true\nopen_budget = 4\n'
    )
    c = load_settings(TrainerConfig, table="trainer", config=tmp_path / "t.toml", environ={}).intake
    assert (c.refusals_to_distrust, c.forgive, c.open_inference, c.open_budget) == (5, ["i0", "i1"], True, 4)
    d = RolloutIntakeConfig()
    assert (d.refusals_to_distrust, d.forgive, d.open_inference, d.open_budget) == (3, [], False, 2)
    with pytest.raises(ValueError, match="refusals_to_distrust"):
        RolloutIntakeConfig(refusals_to_distrust=-1)
