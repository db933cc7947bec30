"""``pulsenet chaos``'s parts without a network: the seeded schedule, the link relay (throttle, cut,
restore) and the checker, which must catch each violation it audits for."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from pulsenet.chaos.check import Limits, audit
from pulsenet.chaos.faults import KINDS, Chaos, ChaosConfig, plan_faults
from pulsenet.chaos.link import LinkProxy
from pulsenet.errors import ConfigError, StoreError
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.nodes.events import VersionEvent
from pulsenet.nodes.up.config import UpConfig
from pulsenet.nodes.up.node import Node
from pulsenet.nodes.up.supervisor import Supervisor
from pulsenet.runtime import spawn_tied
from pulsenet.settings import to_toml_table

ROLES = {"t0": "trainer", "t1": "trainer", "i0": "inference"}
D = {v: f"{v:x}".rjust(64, "d") for v in range(10)}


def test_the_schedule_is_a_function_of_the_seed() -> None:
    c = ChaosConfig(count=12, chaos_seed=5)
    a, b = plan_faults(c, ["t0", "t1"], ["i0", "i1"]), plan_faults(c, ["t0", "t1"], ["i0", "i1"])
    assert a == b and len(a) == 12 and {f.kind for f in a} <= set(KINDS)
    assert plan_faults(ChaosConfig(count=12, chaos_seed=6), ["t0", "t1"], ["i0", "i1"]) != a
    for f in a:
        assert 0 <= f.frac < 1
        if f.kind in ("kill-store", "stall-store"):
            assert f.target == "store"
        elif f.kind == "kill-trainer":
            assert f.target in ("t0", "t1")
        elif f.kind == "kill-inference":
            assert f.target in ("i0", "i1")
    given = plan_faults(ChaosConfig(faults=["cut-link", "kill-store"], link_s=7.0), ["t0"], ["i0"])
    assert [(f.kind, f.duration_s) for f in given] == [("cut-link", 7.0), ("kill-store", 0.0)]
    with pytest.raises(ConfigError, match="unknown fault kinds"):
        ChaosConfig(faults=["kill-everything"])


def test_chaos_adjust_returns_new_settings_and_leaves_the_planned_ones_as_they_are() -> None:
    """Retention and hostile behaviours go into the settings chaos returns; the planned settings
    (shared with the plan) are not mutated (on main before this, ``adjust`` wrote into them)."""
    c = ChaosConfig(count=0, anchor_every=3, retain_rounds=5, hostile=["i1=copy"])
    trainers = [TrainerConfig(id=f"t{k}", store=f"s3://b/t{k}", loco_store="s3://b/loco") for k in range(2)]
    inference = [InferenceConfig(id=f"i{k}", store=f"s3://b/i{k}") for k in range(2)]
    before = [to_toml_table(x) for x in (*trainers, *inference)]
    chaos = Chaos(c)
    t, i = chaos.adjust(trainers, inference)
    assert [(x.publish.anchor_every, x.loco.retain_rounds) for x in t] == [(3, 5), (3, 5)]
    assert [x.hostile for x in i] == ["", "copy"]
    assert [to_toml_table(x) for x in (*trainers, *inference)] == before
    assert chaos.stores == {"t0": "s3://b/t0", "t1": "s3://b/t1", "loco": "s3://b/loco", "i0": "s3://b/i0", "i1": "s3://b/i1"}


def test_the_supervisor_kills_a_node_for_an_injector_and_refuses_what_it_does_not_run(tmp_path: Path) -> None:
    """What chaos does to a run goes through the supervisor's public methods: ``kill`` ends the
    node's current life with SIGKILL; store faults on a run without an embedded store are refused."""
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    node = Node("t0", "trainer", cmd, dict(os.environ), tmp_path / "t0.log", tmp_path / "events.jsonl", "http://127.0.0.1:9")
    sup = Supervisor(UpConfig(model="tiny"), [node], Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="no running node 't0'"):
        sup.kill("t0")
    node.proc = spawn_tied(cmd, "t0")
    try:
        assert sup.kill("t0") == node.proc.pid
        assert node.proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if node.proc.poll() is None:
            node.proc.kill()
    assert sup.store.pid() is None and not sup.store.exited() and sup.store.admin_config() is None
    sup.store.resume()  # a no-op without an embedded store
    with pytest.raises(StoreError):
        sup.store.pause()
    with pytest.raises(StoreError):
        asyncio.run(sup.store.kill())
    # a store that went down on its own between the schedule's wait and the kill: the fault is skipped, the run goes on
    from pulsenet.chaos.faults import Chaos, ChaosConfig, Fault

    record: dict[str, object] = {}
    asyncio.run(Chaos(ChaosConfig(model="tiny", count=0))._inject(sup, Fault("kill-store", "store", 0.5), record))
    assert record["injected"] is False and record["skipped"] == "the store was already down"


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def _roundtrip(port: int, payload: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(payload)
    await w.drain()
    got = await r.readexactly(len(payload))
    w.close()
    return got


@pytest.mark.timeout(60)
async def test_a_delayed_link_costs_each_direction_its_delay_not_throughput() -> None:
    """A site's link in the container network (``delay_s``): a round trip pays the delay twice, and
    1 MB crosses in about that too, since chunks in flight are not held back one by one."""
    server, port = await _echo_server()
    link = LinkProxy(f"http://127.0.0.1:{port}", delay_s=0.2)
    await link.start()
    try:
        t0 = time.monotonic()
        assert await _roundtrip(link.port, b"a" * 10) == b"a" * 10
        small = time.monotonic() - t0
        t0 = time.monotonic()
        assert await _roundtrip(link.port, b"b" * 1_000_000) == b"b" * 1_000_000
        big = time.monotonic() - t0
        assert 0.4 <= small < 2.0 and big < 3.0  # one chunk at a time would take 16 x 0.4 s
    finally:
        await link.close()
        server.close()


@pytest.mark.timeout(60)
async def test_the_link_relays_throttles_cuts_and_restores() -> None:
    server, port = await _echo_server()
    link = LinkProxy(f"http://127.0.0.1:{port}")
    await link.start()
    try:
        assert await _roundtrip(link.port, b"x" * 100_000) == b"x" * 100_000
        assert link.stats.up == link.stats.down == 100_000 and link.state == "open"

        link.throttle(0.8)  # 100 kB/s each way: 50 kB up then 50 kB down take at least ~0.9 s
        t0 = time.monotonic()
        assert await _roundtrip(link.port, b"y" * 50_000) == b"y" * 50_000
        assert time.monotonic() - t0 >= 0.6 and link.state == "0.8 Mbit/s"

        link.cut()
        pending = asyncio.create_task(_roundtrip(link.port, b"z" * 1000))
        done, _ = await asyncio.wait({pending}, timeout=1.0)
        assert not done and link.state == "cut"  # a cut link hangs; it does not refuse
        link.restore()
        assert await asyncio.wait_for(pending, 30) == b"z" * 1000
    finally:
        await link.close()
        server.close()


def _pub(node: str, v: int, digest: str | None = None, at: float = 0.0) -> VersionEvent:
    return VersionEvent(kind="published", node=node, role="trainer", version=v, digest=digest or D[v], at=at)


def _inf(kind: str, v: int, digest: str | None = None, at: float = 0.0, own: str | None = None) -> VersionEvent:
    d = digest or D[v]
    return VersionEvent(
        kind=kind, node="i0", role="inference", version=v, digest=d, at=at,
        weights_digest=own or (d if kind == "stopped" else None),
    )


def _good() -> dict[str, list[VersionEvent]]:
    return {
        "t0": [_pub("t0", v, at=v) for v in range(4)],
        "t1": [_pub("t1", v, at=v) for v in range(4)],
        "i0": [_inf("served", 0, at=0.5), _inf("served", 2, at=2.5), _inf("served", 3, at=3.5), _inf("stopped", 3, at=4)],
    }


def test_a_clean_history_passes() -> None:
    r = audit(
        events=_good(), roles=ROLES, listing={},
        faults=[{"injected": True, "kind": "kill-node", "target": "i0", "recovery_s": 3.0}],
    )
    assert r["verdict"] == "pass", r["checks"]
    assert r["figures"]["max_recovery_s"] == 3.0 and r["figures"]["unverified_served"] == 0


def test_the_checker_catches_each_violation() -> None:
    ev = _good()
    ev["i0"].insert(1, _inf("served", 1, digest="e" * 64, at=1.5))  # a version nobody published with that digest
    r = audit(events=ev, roles=ROLES, listing={})
    assert not r["checks"]["served_verified"]["ok"] and r["figures"]["unverified_served"] == 1

    ev = _good()
    ev["t1"][2] = _pub("t1", 2, digest="f" * 64, at=2)  # t1 disagrees at v2: a fork
    r = audit(events=ev, roles=ROLES, listing={})
    assert not r["checks"]["no_forks"]["ok"] and "2" in r["checks"]["no_forks"]["detail"]["forks"]

    ev = _good()
    ev["i0"].insert(3, _inf("served", 2, at=3.2))  # v3 then v2 within one life
    assert not audit(events=ev, roles=ROLES, listing={})["checks"]["monotonic"]["ok"]
    restart = [{"kind": "restart", "node": "i0", "at": 3.1}]  # ... but a new life may resume an older saved version
    ev["i0"] = [
        _inf("served", 0, at=0.5), _inf("served", 3, at=3.0), _inf("served", 2, at=3.2), _inf("served", 3, at=3.3),
        _inf("stopped", 3, at=4),
    ]
    assert audit(events=ev, roles=ROLES, journal=restart, listing={})["checks"]["monotonic"]["ok"]
    ev = _good()
    ev["t0"].append(_pub("t0", 3, at=5))  # published twice, across a restart
    r = audit(events=ev, roles=ROLES, journal=[{"kind": "restart", "node": "t0", "at": 4.5}], listing={})
    assert not r["checks"]["monotonic"]["ok"]

    ev = _good()
    ev["i0"][-1] = _inf("stopped", 3, at=4, own="0" * 64)  # its own weights do not hash to the digest
    assert not audit(events=ev, roles=ROLES, listing={})["checks"]["converged"]["ok"]
    ev = _good()
    ev["i0"] = [*ev["i0"][:-2], _inf("stopped", 2, at=4)]  # stopped behind
    assert not audit(events=ev, roles=ROLES, listing={})["checks"]["converged"]["ok"]

    faults = [{"injected": True, "kind": "kill-store", "target": "store", "recovery_s": None}]
    assert not audit(events=_good(), roles=ROLES, faults=faults, listing={})["checks"]["recovered"]["ok"]
    assert not audit(events=_good(), roles=ROLES, orphans=["123: weed mini"], listing={})["checks"]["no_orphans"]["ok"]
    assert not audit(events=_good(), roles=ROLES, exit_code=1, reason="crash loop", listing={})["checks"]["run_completed"]["ok"]


def test_store_retention_bounds_are_checked() -> None:
    trainer = {"steps": 100, "consumer_bound": 5, "publish": {"anchor_every": 10, "keep_anchors": 2}}
    inference = {"batches_per_version": 2, "max_staleness": 2}
    stores = {"t0": "s3://b-t0/run", "i0": "s3://b-i0/run"}
    policy = [(f"policy/manifests/v{v:012d}.json", 10) for v in range(75, 100)]
    policy += [(f"policy/payloads/v{v:012d}-patch-{'a' * 16}.pnp", 99) for v in range(75, 101)]  # v100: no manifest
    rollouts = [(f"rollouts/manifests/v{v:012d}-i0-{s:08d}.json", 5) for v in (97, 98, 99) for s in range(2)]
    listing = {stores["t0"]: policy, stores["i0"]: rollouts}
    settings = {"t0": trainer, "i0": inference}
    r = audit(events=_good(), roles=ROLES, listing=listing, stores=stores, settings=settings)
    assert r["checks"]["store_bounded"]["ok"], r["checks"]["store_bounded"]
    kinds = r["store"][stores["t0"]]
    assert kinds["policy versions"] == {"present": 25, "bound": 2 * 10 + 5 + 2}
    assert kinds["policy payloads without a manifest"]["present"] == 1
    listing[stores["t0"]] = [(f"policy/manifests/v{v:012d}.json", 10) for v in range(100)]  # retention never ran
    r = audit(events=_good(), roles=ROLES, listing=listing, stores=stores, settings=settings)
    assert not r["checks"]["store_bounded"]["ok"] and "100 > 27" in r["checks"]["store_bounded"]["detail"][0]


def test_resources_judge_long_lives_by_their_second_half() -> None:
    flat = [
        {"t": t, "node": "i0", "pid": 7, "rss_mb": 500 + (300 if t < 60 else 0.01 * t), "fds": 18}
        for t in range(0, 1200, 10)
    ]
    leak = [{"t": t, "node": "t0", "pid": 8, "rss_mb": 500 + 0.2 * t, "fds": 18 + t // 30} for t in range(0, 1200, 10)]
    short = [{"t": t, "node": "t1", "pid": 9, "rss_mb": 100 + 5 * t, "fds": 3 + t} for t in range(0, 100, 10)]
    r = audit(events=_good(), roles=ROLES, listing={}, samples=flat + leak + short, limits=Limits(4.0, 16, 600))
    res = r["resources"]
    assert res["i0"]["lives"][0]["rss_slope_mb_per_min"] == pytest.approx(0.6, abs=0.01)
    assert res["t0"]["lives"][0]["rss_slope_mb_per_min"] == pytest.approx(12.0, abs=0.01)
    assert "over" not in res["t1"]["lives"][0]  # too short to judge
    detail = r["checks"]["resources"]["detail"]
    assert not r["checks"]["resources"]["ok"] and len(detail) == 2 and all(d.startswith("t0 pid 8") for d in detail)


def test_shared_pulseloco_states_are_held_to_retention_and_records_are_not() -> None:
    stores = {"t0": "s3://b-t0/run", "loco": "s3://b-loco/run"}
    settings = {"t0": {"steps": 100, "loco": {"retain_rounds": 20, "state_every": 10}}}
    states = [(f"state/{r:08d}/manifest", 1) for r in (0, 80, 90, 100)]
    records = [(f"rounds/{r:08d}/record", 1) for r in range(1, 101)]
    r = audit(events=_good(), roles=ROLES, listing={stores["loco"]: states + records}, stores=stores, settings=settings)
    kinds = r["store"][stores["loco"]]
    assert kinds["global states (state/)"] == {"present": 4, "bound": (20 + 10) // 10 + 2}
    assert kinds["round records (rounds/)"]["present"] == 100 and kinds["round records (rounds/)"]["bound"] is None
    assert r["checks"]["store_bounded"]["ok"]
    states = [(f"state/{r:08d}/manifest", 1) for r in range(0, 101, 10)]  # shared retention never ran
    r = audit(events=_good(), roles=ROLES, listing={stores["loco"]: states}, stores=stores, settings=settings)
    assert not r["checks"]["store_bounded"]["ok"] and "11 > 5" in r["checks"]["store_bounded"]["detail"][0]


def test_a_killed_trainer_is_measured_by_what_the_others_published_meanwhile() -> None:
    ev = {  # t1 killed at 2.5 and publishing again at 6; t0 went on with v3 (at 4) and v4 (at 5)
        "t0": [_pub("t0", v, at=t) for v, t in ((0, 0), (1, 1), (2, 2), (3, 4), (4, 5), (5, 6))],
        "t1": [_pub("t1", v, at=t) for v, t in ((0, 0), (1, 1), (2, 2), (5, 6.1))],
        "i0": [_inf("stopped", 5, digest=D[5], at=7)],
    }
    journal = [{"kind": "fault", "fault": "kill-trainer", "target": "t1", "at": 2.5}]
    out = audit(events=ev, roles=ROLES, journal=journal, listing={})["figures"]["trainer_outages"]
    assert out == [{"target": "t1", "down_s": 3.6, "versions_while_down": 3, "max_gap_s": 2.0}]
