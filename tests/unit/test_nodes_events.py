"""One record per version, one config tree, one plan: the node loop's plumbing (issue 20).

- ``EventLog`` writes whole JSON lines that ``read_events`` gives back (a torn last line, from a
  kill mid-write, is skipped); ``NodeState.record`` is what /status shows of versions.
- ``published_event`` / ``inference_event`` build every event the nodes emit: the events.jsonl
  line of each is pinned, byte for byte (fields, order, derived figures).
- ``summarize`` / ``efficiency`` / ``requests`` read nothing but the events.
- ``TrainerConfig`` nests its components' settings; ``run`` is set once and copied, and a nested
  ``run`` is an unknown setting, not a value silently overwritten.
- ``plan_network``: a model's preset under the command's own settings, the same plan for
  ``pulsenet up`` and ``pulsenet bench rl``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pulsenet.errors import ConfigError
from pulsenet.nodes.events import EventLog, VersionEvent, inference_event, published_event, read_events
from pulsenet.nodes.status import NodeState
from pulsenet.nodes.summary import efficiency, requests, run_totals, summarize


def _published(node: str, v: int, at: float, **kw: object) -> VersionEvent:
    return VersionEvent(kind="published", node=node, role="trainer", version=v, digest=f"d{v}", at=at, round=v, **kw)  # type: ignore[arg-type]


def test_events_round_trip_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "n" / "events.jsonl")
    e0 = log.emit(_published("t0", 0, 1.0, bytes={"pulsesync": 10, "full": 100}))
    e1 = log.emit(_published("t0", 1, 2.0, staleness=[0, 1], reward=0.5, counts={"rows": 8}))
    with open(tmp_path / "n" / "events.jsonl", "a") as f:
        f.write('{"kind": "published", "node": "t0", "rol')  # a kill mid-write
    assert read_events(tmp_path / "n" / "events.jsonl") == [e0, e1]
    assert read_events(tmp_path / "missing.jsonl") == []
    # a newer writer's extra field is ignored, not fatal
    line = json.dumps(e1.as_dict() | {"from_the_future": 1})
    (tmp_path / "f.jsonl").write_text(line + "\n")
    assert read_events(tmp_path / "f.jsonl") == [e1]


# The lines the nodes wrote before the builders existed; issue 30 added the "replay" phase (rl/replay.py).
PUBLISHED_LINE = (
    '{"kind":"published","node":"t0","role":"trainer","version":3,"digest":"' + "ab" * 32 + '","at":1700000000.0,'
    '"round":3,"patch":"patch","phases":{"wait_rollouts":1.0,"train":2.0,"exchange":0.5,"replay":0.0,"publish":0.25,"eval":0.125},'
    '"bytes":{"pulsesync":100,"full":1000,"pulseloco":50,"diloco":1000,"ddp":2000,"rollouts":77},"reward":0.5,'
    '"staleness":[0,1],"counts":{"steps":2,"rows":16,"batches":2},"totals":{"rows_accepted":16},"sparsity":0.99,'
    '"steps":[{"loss":0.5,"reward_mean":0.25,"completions":8},{"loss":0.4,"reward_mean":0.75,"completions":8}],'
    '"participants":["t0","t1"],"eval":{"version":3,"reward":0.5,"n":4},"weights_digest":null}\n'
)
"""What a trainer's events.jsonl held for such a version before ``published_event`` (7876ec8's inline event)."""
STOPPED_LINE = (
    '{"kind":"stopped","node":"i0","role":"inference","version":2,"digest":"' + "cd" * 32 + '","at":1700000001.0,'
    '"round":null,"patch":null,"phases":{},"bytes":{"pulsesync":0},"reward":null,"staleness":[],'
    '"counts":{"idle_poll:get":1},"totals":{"rows_produced":4},"sparsity":null,"steps":[],"participants":[],'
    '"eval":null,"weights_digest":"' + "cd" * 32 + '"}\n'
)


def test_the_event_builders_write_the_lines_the_nodes_always_wrote(tmp_path: Path) -> None:
    steps = [{"loss": 0.5, "reward_mean": 0.25, "completions": 8}, {"loss": 0.4, "reward_mean": 0.75, "completions": 8}]
    published = published_event(
        node="t0", version=3, digest="ab" * 32, round=3, patch="patch", wait_s=1.0, train_s=2.0, exchange_s=0.5,
        publish_s=0.25, pulsesync_bytes=100, full_bytes=1000, pulseloco_bytes=50, model_numel=250, rollout_bytes=77,
        steps=steps, staleness=[0, 1], batches=2, totals={"rows_accepted": 16}, sparsity=0.99, participants=["t0", "t1"],
        at=1700000000.0, eval={"version": 3, "reward": 0.5, "n": 4}, eval_s=0.125,
    )  # fmt: skip
    stopped = inference_event(
        "stopped", node="i0", version=2, digest="cd" * 32, pulsesync_bytes=0, totals={"rows_produced": 4},
        counts={"idle_poll:get": 1}, weights_digest="cd" * 32,
    )  # fmt: skip
    stopped.at = 1700000001.0
    served = inference_event("served", node="i0", version=2, digest="cd" * 32, pulsesync_bytes=10, totals={}, apply_s=0.5)
    assert served.phases == {"apply": 0.5} and served.bytes == {"pulsesync": 10} and served.counts == {}
    log = EventLog(tmp_path / "events.jsonl")
    log.emit(published)
    log.emit(stopped)
    assert (tmp_path / "events.jsonl").read_text() == PUBLISHED_LINE + STOPPED_LINE


def test_node_state_shows_what_the_events_say() -> None:
    s = NodeState(role="trainer", node_id="t0")
    s.record(_published("t0", 1, 1.0, staleness=[2, 0], reward=0.25, bytes={"pulsesync": 5, "full": 99, "rollouts": 7}))
    s.record(_published("t0", 2, 2.0, staleness=[1], bytes={"pulsesync": 3, "rollouts": 1}, totals={"stale_queued": 4}))
    assert (s.version, s.digest, s.round, s.reward, s.staleness) == (2, "d2", 2, 0.25, 1)
    assert s.bytes == {"pulsesync": 8, "pulseloco": 0, "rollouts": 8}  # full is a comparison, not moved
    assert s.rollouts["dropped_queued"] == 4 and s.last_event is not None and s.last_event["version"] == 2


def test_summary_and_efficiency_come_from_the_events_alone() -> None:
    roles = {"t0": "trainer", "t1": "trainer", "i0": "inference"}
    ev = {
        "t0": [
            _published("t0", 0, 10.0),
            _published("t0", 1, 20.0, staleness=[0, 1], reward=0.5, counts={"rows": 10, "batches": 2},
                       bytes={"pulsesync": 4, "full": 40, "pulseloco": 3, "diloco": 30, "ddp": 60, "rollouts": 5},
                       phases={"wait_rollouts": 1.0, "train": 3.0, "exchange": 1.0, "replay": 0.5}),
            _published("t0", 2, 30.0, staleness=[1], reward=1.0, counts={"rows": 10, "batches": 1},
                       phases={"wait_rollouts": 2.0, "train": 2.0}, totals={"stale_queued": 1}),
        ],
        "t1": [
            _published("t1", 0, 10.5),
            _published("t1", 1, 20.5, staleness=[2], reward=0.0, counts={"rows": 30, "batches": 1}),
            _published("t1", 2, 30.5, counts={"rows": 0}),
        ],
        "i0": [
            VersionEvent(kind="served", node="i0", role="inference", version=0, digest="d0", at=11.0),
            VersionEvent(kind="served", node="i0", role="inference", version=1, digest="d1", at=21.0),
            VersionEvent(kind="served", node="i0", role="inference", version=2, digest="d2", at=33.0),
            VersionEvent(kind="stopped", node="i0", role="inference", version=2, digest="d2", at=40.0,
                         weights_digest="d2", counts={"idle_poll:get_not_modified": 1, "idle_poll:list": 0},
                         totals={"rows_produced": 80, "batches_produced": 8, "generating_s": 9.0,
                                 "waiting_version_s": 1.0, "waiting_first_s": 50.0, "requests:get": 30}),
        ],
    }  # fmt: skip
    s = summarize(ev, roles, max_staleness=2)
    assert [r["round"] for r in s["rounds"]] == [1, 2]
    r1 = s["rounds"][0]
    assert r1["reward"] == pytest.approx((0.5 * 10 + 0.0 * 30) / 40) and r1["staleness"] == 2
    assert r1["bytes"] == {"pulsesync": 4, "full_sync": 40, "pulseloco": 3, "diloco": 30, "ddp": 60, "rollouts": 5}
    assert all(s["checks"].values()), s["checks"]
    e = efficiency(ev, roles)
    assert e["trained_fraction"] == pytest.approx(50 / 80) and e["dropped_fraction"] == pytest.approx(1 / 8)
    assert e["staleness_mean"] == pytest.approx(4 / 4) and e["staleness"] == {"0": 1, "1": 2, "2": 1}
    assert e["engine_busy"] == pytest.approx(0.9)  # the wait for the first version does not count
    assert e["trainer_busy"] == pytest.approx(5.0 / 9.5, abs=1e-4)  # rounded to 4 places
    assert e["replay_cost"] == {"of_train": pytest.approx(0.1), "of_rounds": pytest.approx(0.5 / 9.5, abs=1e-4)}
    assert e["round_s"] == pytest.approx(10.0) and e["update_latency_s"]["max"] == pytest.approx(3.0)
    assert e["update_latency_fraction"]["max"] == pytest.approx(0.3)
    rq = requests(ev, roles)
    assert rq["idle_poll"] == {"get_not_modified": 1, "list": 0}
    assert rq["per_version_per_inference_node"] == {"get": 10.0}
    # a node whose digest differs, or that served an unpublished version, fails the checks
    ev["i0"][2] = VersionEvent(kind="served", node="i0", role="inference", version=2, digest="forged", at=33.0)
    assert not summarize(ev, roles, max_staleness=2)["checks"]["served_verified"]


def test_a_restarted_node_counts_from_zero_and_its_lives_add_up() -> None:
    """A killed and restarted node's counters start again from zero: the run's totals are the sum
    of each life's last totals (not just the last life's: that made a run with a killed inference
    node report 106% of its generated rollouts trained on)."""

    def served(v: int, rows: int, s: float) -> VersionEvent:
        return VersionEvent(kind="served", node="i1", role="inference", version=v, digest=f"d{v}",
                            totals={"rows_produced": rows, "generating_s": s})  # fmt: skip

    life = [served(0, 0, 0.0), served(1, 64, 1.0), served(2, 128, 2.5)]
    again = [served(2, 0, 0.0), served(3, 32, 0.5), served(4, 96, 1.0)]
    assert run_totals(life + again) == {"rows_produced": 224, "generating_s": 3.5}
    assert run_totals(life) == {"rows_produced": 128, "generating_s": 2.5} and run_totals([]) == {}
    trainer = [_published("t0", 0, 1.0), _published("t0", 1, 2.0, counts={"rows": 200, "batches": 2})]
    e = efficiency({"t0": trainer, "i1": life + again}, {"t0": "trainer", "i1": "inference"})
    assert e["trained_fraction"] == pytest.approx(200 / 224, abs=1e-4)  # rounded to 4 places


def test_the_config_tree_sets_run_once(tmp_path: Path) -> None:
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
    from pulsenet.settings import load_settings, to_toml_table

    cfg = tmp_path / "t.toml"
    cfg.write_text('[trainer]\nrun = "r9"\n[trainer.loco]\ninner-steps = 3\n[trainer.intake]\nmax-staleness = 5\n')
    c = load_settings(TrainerConfig, table="trainer", config=cfg, environ={"PULSENET_PUBLISH__ANCHOR_EVERY": "7"})
    assert (c.loco.inner_steps, c.intake.max_staleness, c.publish.anchor_every) == (3, 5, 7)
    assert c.loco.run == c.intake.run == c.publish.run == "r9"
    c = load_settings(TrainerConfig, table="trainer", config=cfg, environ={"PULSENET_RUN": "r10"})
    assert c.loco.run == c.publish.run == "r10"  # the later source wins everywhere
    cfg.write_text('[trainer.loco]\nrun = "other"\n')
    with pytest.raises(ConfigError, match=r"no setting 'loco\.run'"):
        load_settings(TrainerConfig, table="trainer", config=cfg, environ={})
    # what pulsenet up writes reads back as the same settings
    i = InferenceConfig(run="x", policy=["t0=s3://b/t0"])
    table = to_toml_table(i)
    assert "run" not in table["subscribe"] and "state_dir" not in table["subscribe"]


def test_plan_takes_the_preset_under_the_commands_settings(tmp_path: Path) -> None:
    from pulsenet.nodes.config import NetworkSettings
    from pulsenet.nodes.plan import Site, plan_network

    def plan(**kw: object):
        n = NetworkSettings(**kw)  # type: ignore[arg-type]
        ids = [f"t{k}" for k in range(n.trainers)] + [f"i{k}" for k in range(n.inference)]
        sites = {s: Site(f"s3://b-{s}", tmp_path / f"{s}.key", tmp_path / s) for s in ids}
        return plan_network(n, run="r", sites=sites, public_keys=tmp_path, loco_store="s3://loco")

    t, i = plan()  # tiny, two trainers: a round costs about one lone step of the preset's 512 rows
    assert [c.rows_per_step for c in t] == [64, 64] and t[0].grpo.lr == 5e-4 and t[0].loco.min_quorum == 1
    assert (i[0].prompts, i[0].group_size, i[0].task.max_new_tokens, i[0].task.task) == (8, 8, 5, "arith")
    assert i[0].policy == ["t0=s3://b-t0", "t1=s3://b-t1"] and i[0].batches_per_version == 16
    assert t[0].task == i[0].task and t[0].task is not i[0].task  # one task for every node, each its own copy
    t, i = plan(trainers=1, lr=1e-2, prompts=4)  # given values win over the preset
    assert t[0].rows_per_step == 512 and t[0].grpo.lr == 1e-2 and i[0].prompts == 4 and not t[0].loco_store
    t, i = plan(model="smollm2", trainers=1)
    assert t[0].grpo.lr == 3e-6 and (i[0].task.task, i[0].task.max_new_tokens) == ("arith-shots", 16)
    from pulsenet.nodes.config import TaskOptions

    # a user's dataset: none of the preset's task settings, the columns and rewards given
    t, i = plan(model="smollm2", trainers=1, task="my.jsonl", reward=["math"], max_new_tokens=32,
                task_options=TaskOptions(prompt_column="q", eval_fraction=0.1))  # fmt: skip
    task = i[0].task
    assert (task.task, task.reward, task.max_new_tokens, task.prompt_column, task.eval_fraction, task.stop) == (
        "my.jsonl", ["math"], 32, "q", 0.1, None
    )
    assert t[0].task == task


def test_plan_reads_its_preset_once_and_writes_no_settings_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The preset is read once (7876ec8 parsed it three times, one per table); every node's config
    is a new object with nested settings of its own, the run copied in by its own ``__post_init__``
    (not called by hand); a derived setting (the GRPO step's ``pad_id``) goes into a new config."""
    import pulsenet.nodes.plan as plan_mod
    import pulsenet.settings as settings_mod
    from pulsenet.nodes.config import NetworkSettings, TrainerConfig
    from pulsenet.nodes.plan import Site, plan_network

    reads: list[str] = []
    real = settings_mod.load_toml

    def counted(path: object) -> dict:
        reads.append(str(path))
        return real(path)  # type: ignore[arg-type]

    monkeypatch.setattr(settings_mod, "load_toml", counted)
    monkeypatch.setattr(plan_mod, "load_toml", counted, raising=False)
    n = NetworkSettings(trainers=3, inference=2, max_staleness=4)
    sites = {s: Site(f"s3://b-{s}", tmp_path / f"{s}.key", tmp_path / s) for s in ("t0", "t1", "t2", "i0", "i1")}
    t, i = plan_network(n, run="r", sites=sites, public_keys=tmp_path, loco_store="s3://loco")
    assert len(reads) == 1 and reads[0].endswith("tiny.toml"), reads
    for a, b in ((t[0], t[1]), (t[1], t[2])):
        assert a.loco is not b.loco and a.intake is not b.intake and a.publish is not b.publish and a.grpo is not b.grpo
    assert all(c.loco.run == c.intake.run == c.publish.run == "r" and c.intake.max_staleness == 4 for c in t)
    assert all(c.subscribe.run == "r" and c.subscribe is not i[0].subscribe for c in i[1:])
    assert plan_network(n, run="r", sites=sites, public_keys=tmp_path, loco_store="s3://loco") == (t, i)
    c = TrainerConfig(device="cpu")
    g = c.grpo_config(pad_id=7)
    assert (g.pad_id, c.grpo.pad_id, c.grpo_config().pad_id) == (7, 0, 0)


async def test_a_lone_trainers_non_finite_round_rolls_back_to_its_start(tmp_path: Path) -> None:
    """Without a gradient-norm guard a step can leave NaN weights; the lone trainer's round checks
    before writing its resume point and rolls back to the one written at start, even in round 1."""
    import torch

    from pulsenet.nodes.rounds import LocalRounds, finite
    from pulsenet.rl import build_tiny_model
    from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
    from pulsenet.rl.inner import GRPOInner
    from pulsenet.rollouts import RolloutIntake, RolloutSource
    from pulsenet.store import LocalStore

    policy = GRPOInner(GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, grad_clip=None)))
    intake = RolloutIntake([RolloutSource("i0", LocalStore(tmp_path / "i0"), {})], lambda v: None)
    rounds = LocalRounds("t0", policy, intake, tmp_path / "state")
    assert await rounds.start(None) == 0 and (tmp_path / "state" / "trainer.pt").is_file()
    before = {n: t.clone() for n, t in policy.state_fp32().items()}

    async def poisoned(r: int) -> list[float]:
        with torch.no_grad():
            next(policy.local.model.parameters()).fill_(float("nan"))
        return [0.0]

    assert await rounds.next_round(poisoned) is None and rounds.round == 0
    after = policy.state_fp32()
    assert finite(after) and all(torch.equal(after[n], before[n]) for n in before)
