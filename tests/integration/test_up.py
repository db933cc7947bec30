"""``pulsenet up`` end to end: a real embedded SeaweedFS, two trainers (PULSELoCo rounds, the
default) and two inference nodes as separate processes, the tiny model, then the report, the
nodes' own logs and the process table are checked. Nothing is faked.

The tiny warm-up is cached in pytest's cache directory (``.pytest_cache``), shared by every run's
work directory, so only the first run on a machine pays for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import boto3
import pytest

from pulsenet.nodes.events import read_events
from pulsenet.nodes.up.workdir import MARKER
from tests.support.waiting import wait_for_process

pytestmark = pytest.mark.integration
PNG = b"\x89PNG\r\n\x1a\n"
MAX_STALENESS = 2
TRAINERS = 2  # PULSELoCo rounds between them, as issue 15's proof asks


@pytest.fixture
def workdir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    cached = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    cache = cached.mkdir("pulsenet-up-cache") if cached is not None else tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    work = tmp_path / "up"
    work.mkdir()
    (work / MARKER).write_text("")  # ours: pulsenet up may wipe run directories here
    (work / "cache").symlink_to(cache, target_is_directory=True)
    yield work
    for line in _ours(work):  # a failed test leaves no process behind either
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split(":")[0]), signal.SIGKILL)


def _env(**extra: str) -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))} | extra


def _up(workdir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "pulsenet", "up", "--workdir", str(workdir), "--no-live", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env())


def _ours(workdir: Path) -> list[str]:
    """Live processes started for this work directory (nodes name their config in it, weed its data)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # exited while we looked
            continue
        if str(workdir) in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def _pid(workdir: Path, needle: str) -> int:
    """The live process of this run whose command line holds ``needle`` (a node's config, the store's dir)."""
    found = [int(line.split(":")[0]) for line in _ours(workdir) if needle in line]
    assert len(found) == 1, (needle, _ours(workdir))
    return found[0]


def _journal(workdir: Path) -> list[dict]:
    from pulsenet.nodes.supervisor import read_journal

    return read_journal(workdir / "state" / "supervisor.jsonl")


def _after(workdir: Path, kind: str, since: float) -> list[dict]:
    """The supervisor's ``kind`` records written after ``since`` (Unix time)."""
    return [r for r in _journal(workdir) if r["kind"] == kind and r["at"] >= since]


def _gone(workdir: Path, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _ours(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _finish(proc: subprocess.Popen[str], stall_s: float = 180.0) -> str:
    """``pulsenet up``'s output once it exits; fails (killing it) only after ``stall_s`` s in which no
    node wrote anything: how long a run may take depends on the machine's load, a stall does not."""
    workdir = Path(proc.args[proc.args.index("--workdir") + 1])
    seen, since = _activity(workdir), time.monotonic()
    while True:
        try:
            return proc.communicate(timeout=2.0)[0]
        except subprocess.TimeoutExpired:
            pass
        if (now := _activity(workdir)) != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            proc.kill()
            pytest.fail(f"pulsenet up made no progress for {stall_s:g} s:\n{proc.communicate()[0][-3000:]}")


def _activity(workdir: Path) -> int:
    """Bytes every node has written to its log and events so far."""
    files = [*(workdir / "logs").glob("*.log"), *(workdir / "state").glob("*/events.jsonl")]
    return sum(f.stat().st_size for f in files if f.exists())


def _moving(workdir: Path) -> Callable[[], int]:
    """``_activity`` as ``wait_for_process``'s progress: a wait fails only once no node moves."""
    return lambda: _activity(workdir)


@pytest.mark.timeout(1200)  # the waits fail on a stall; this bounds a slow (loaded) machine
def test_up_trains_serves_verified_versions_and_reports(workdir: Path, tmp_path: Path) -> None:
    report = tmp_path / "report"
    loco = ["--trainers", str(TRAINERS), "--inner-steps", "2"]
    small = ["--prompts", "8", "--group-size", "4", "--rows-per-step", "32"]  # fast, not learning
    proc = _up(workdir, "--rounds", "3", "--inference", "2", "--report", str(report), *small, *loco)
    try:
        out = _finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    trainers = [f"t{k}" for k in range(TRAINERS)]

    # The report: real numbers and the fields the issue asks for.
    summary = json.loads((report / "summary.json").read_text())
    nodes = summary["nodes"]
    assert {n: d["role"] for n, d in nodes.items()} == {t: "trainer" for t in trainers} | {
        "i0": "inference",
        "i1": "inference",
    }
    assert all(d["version"] == 3 for d in nodes.values()), nodes
    digests = {d["digest"] for d in nodes.values()}
    assert len(digests) == 1 and len(digests.pop()) == 64  # final digests equal across all nodes
    assert len(summary["reward"]) == 3 and all(0.0 <= r <= 1.0 for r in summary["reward"])
    assert 0 <= summary["staleness"] <= MAX_STALENESS
    b = summary["bytes"]
    assert set(b) >= {"pulsesync", "full_sync", "pulseloco", "diloco", "ddp", "rollouts"}
    assert 0 < b["pulsesync"] < b["full_sync"] and b["rollouts"] > 0
    assert 0 < b["pulseloco"] < b["diloco"] < b["ddp"]  # sparse payloads; DiLoCo dense; DDP every step
    assert all(0.0 <= s <= 1.0 for s in summary["sparsity"])
    assert all(summary["checks"].values()), summary["checks"]
    for name in ("reward.png", "bytes.png", "sparsity.png"):
        assert (report / name).read_bytes()[:8] == PNG

    # Every trainer runs the same PULSELoCo round: plain averaging as the outer step (docs/rl.md).
    tables = [tomllib.loads((workdir / "config" / f"{t}.toml").read_text())["trainer"] for t in trainers]
    same = {(t["loco_store"], t["loco"]["inner_steps"], t["loco"]["outer_lr"], t["loco"]["outer_momentum"]) for t in tables}
    assert same == {(tables[0]["loco_store"], 2, 1.0, 0.0)}, same

    # Independently of the summary, from the nodes' own version events: every trainer published the
    # same versions; every version an inference node swapped in has the digest the trainers
    # published for it, and its weights rehash to it at exit; rollouts were trained on within the bound.
    published = {e.version: e.digest for e in _events(workdir, "t0") if e.kind == "published"}
    assert sorted(published) == [0, 1, 2, 3]
    for t in trainers:
        events = [e for e in _events(workdir, t) if e.kind == "published"]
        assert {e.version: e.digest for e in events} == published
        assert all(0 <= s <= MAX_STALENESS for e in events for s in e.staleness)
        assert [e.round for e in events] == [0, 1, 2, 3]  # one PULSELoCo round per version
        assert all(e.bytes["pulseloco"] > 0 for e in events[1:])
    for node in ("i0", "i1"):
        events = _events(workdir, node)
        served = [(e.version, e.digest) for e in events if e.kind == "served"]
        assert served and served[-1][0] == 3
        assert all(published[v] == d for v, d in served), served
        stopped = [e for e in events if e.kind == "stopped"]
        assert len(stopped) == 1 and stopped[0].weights_digest == published[3]

    # No orphans: every node process (and the store) is gone once the launcher has returned.
    pids = [d["pid"] for d in summary["nodes_detail"].values()]
    assert len(pids) == TRAINERS + 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _gone(workdir, timeout=2.0) == []


@pytest.mark.timeout(900)
def test_ctrl_c_stops_every_node_cleanly_and_leaves_only_whole_objects(workdir: Path, seaweed) -> None:
    """On an external endpoint (``--s3-endpoint``, the session's SeaweedFS), so the store outlives
    the run: after Ctrl-C every visible version rebuilds and verifies, every visible batch is whole."""
    admin = seaweed.config("admin")
    env = _env(
        AWS_ACCESS_KEY_ID=admin.access_key_id, AWS_SECRET_ACCESS_KEY=admin.secret_access_key, AWS_REGION=admin.region
    )
    prefix = f"up-{os.getpid()}-{time.monotonic_ns() % 10**6}-"
    args = ["--rounds", "1000", "--rows-per-step", "32", "--prompts", "8", "--group-size", "4"]
    args += ["--s3-endpoint", seaweed.endpoint_url, "--bucket-prefix", prefix]
    proc = _up(workdir, *args, env=env)
    logs = workdir / "logs"
    try:
        wait_for_process(
            lambda: any(e.kind == "published" and e.version >= 2 for e in _events(workdir, "t0")),
            180,
            "v2 trained",
            proc,
            progress=_moving(workdir),
        )
        proc.send_signal(signal.SIGINT)
        out = _finish(proc, stall_s=90)
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert "stopped by SIGINT" in out
    assert _gone(workdir, timeout=5.0) == []
    # Each node stopped on its own SIGTERM (no SIGKILL fallback): the inference nodes rehashed
    # their weights on the way out and the trainer closed without an error.
    for node in ("i0", "i1"):
        stopped = [e for e in _events(workdir, node) if e.kind == "stopped"]
        assert len(stopped) == 1 and stopped[0].weights_digest == stopped[0].digest
    assert "Traceback" not in (logs / "t0.log").read_text()

    # The policy channel: the newest visible version rebuilds, verified, to what the trainer logged.
    trainer = tomllib.loads((workdir / "config" / "t0.toml").read_text())["trainer"]
    published = {e.version: e.digest for e in _events(workdir, "t0") if e.kind == "published"}
    pulled = subprocess.run(
        [sys.executable, "-m", "pulsenet", "pull", "--store", trainer["store"], "--run", trainer["run"],
         "--trust", str(workdir / "keys" / "t0.key.pub"), "--out", str(workdir / "pulled")],
        env=env | {"AWS_ENDPOINT_URL": seaweed.endpoint_url}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    version, digest = pulled.stdout.split()[-2:]
    assert published[int(version[1:])] == digest and int(version[1:]) == max(published)
    # The rollout channels: every visible manifest names a batch that is there in full.
    client = boto3.client(
        "s3", endpoint_url=seaweed.endpoint_url, aws_access_key_id=admin.access_key_id,
        aws_secret_access_key=admin.secret_access_key, region_name=admin.region,
    )  # fmt: skip
    for node in ("i0", "i1"):
        cfg = tomllib.loads((workdir / "config" / f"{node}.toml").read_text())["inference"]
        bucket, _, run_prefix = cfg["store"].removeprefix("s3://").partition("/")
        listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{run_prefix}/rollouts/")
        keys = {o["Key"]: o["Size"] for o in listing.get("Contents", [])}
        manifests = [k for k in keys if "/manifests/" in k]
        assert manifests, keys
        for m in manifests:
            refs = dict(_refs(json.loads(client.get_object(Bucket=bucket, Key=m)["Body"].read())))
            stem = m.rsplit("/", 1)[1].removesuffix(".json")
            batch = [k for k in keys if f"/batches/{stem}-" in k]
            assert len(batch) == 1, (m, sorted(keys))
            named = batch[0].split(f"{run_prefix}/", 1)[1]
            assert refs.get(named) == keys[batch[0]], (m, refs)  # there, at the size its manifest signed


def _events(workdir: Path, node: str) -> list:
    """A node's version events (``state/<node>/events.jsonl``)."""
    return read_events(workdir / "state" / node / "events.jsonl")


def _refs(doc: object) -> Iterator[tuple[str, int]]:
    """Every ``{"key": ..., "size": ...}`` reference inside a (signed) JSON document."""
    if isinstance(doc, dict):
        if isinstance(doc.get("key"), str) and isinstance(doc.get("size"), int):
            yield doc["key"], doc["size"]
        for v in doc.values():
            yield from _refs(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _refs(v)


@pytest.mark.timeout(600)
def test_nodes_die_with_a_killed_launcher(workdir: Path) -> None:
    proc = _up(workdir, "--rounds", "1000", "--rows-per-step", "32", "--prompts", "8", "--group-size", "4")
    try:
        wait_for_process(  # launcher, weed, 4 nodes
            lambda: len(_ours(workdir)) >= 6, 120, "nodes and store running", proc, progress=_moving(workdir)
        )
        time.sleep(1.0)
        proc.kill()  # SIGKILL: no handler runs, only PR_SET_PDEATHSIG can take the children down
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert _gone(workdir, timeout=15.0) == []


@pytest.mark.timeout(1500)
def test_up_reports_a_stuck_network_and_restarts_killed_nodes_and_store(workdir: Path, tmp_path: Path) -> None:
    """The issue's table, by hand as an operator would: a trainer frozen (SIGSTOP) makes the network
    STUCK, with that trainer named, until it is continued; then an inference node and the store are
    SIGKILLed and come back (same command, same data directory, ports and keys). The run completes,
    every node on the last version, and the report counts the restarts."""
    report = tmp_path / "report"
    small = ["--prompts", "8", "--group-size", "4", "--rows-per-step", "32", "--inner-steps", "2"]
    # liveness off: t1 is frozen on purpose until the STUCK report, which a loaded machine may take
    # longer to make than liveness takes to restart it (tests/integration/test_supervisor_liveness.py covers that)
    supervise = ["--supervise.round-deadline-s", "8", "--supervise.backoff-s", "0.5", "--supervise.liveness-failures", "0"]
    proc = _up(workdir, "--rounds", "12", "--report", str(report), *small, *supervise)
    try:
        wait_for_process(
            lambda: any(e.version >= 2 for e in _events(workdir, "t0") if e.kind == "published"), 300, "v2", proc,
            progress=_moving(workdir),
        )
        t1 = _pid(workdir, "config/t1.toml")
        frozen = time.time()
        os.kill(t1, signal.SIGSTOP)
        wait_for_process(lambda: _after(workdir, "stuck", frozen), 120, "a stuck report", proc, progress=_moving(workdir))
        os.kill(t1, signal.SIGCONT)
        wait_for_process(
            lambda: _after(workdir, "unstuck", frozen), 180, "the network moving again", proc, progress=_moving(workdir)
        )
        v = max(e.version for e in _events(workdir, "t0") if e.kind == "published")
        os.kill(_pid(workdir, "config/i1.toml"), signal.SIGKILL)
        os.kill(_pid(workdir, str(workdir / "s3")), signal.SIGKILL)
        wait_for_process(
            lambda: any(r["kind"] == "store_restart" for r in _journal(workdir)), 120, "the store back", proc,
            progress=_moving(workdir),
        )
        wait_for_process(
            lambda: any(e.version > v for e in _events(workdir, "t0") if e.kind == "published"), 300, "a version after", proc,
            progress=_moving(workdir),
        )
        out = _finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    journal = _journal(workdir)
    stuck = _after(workdir, "stuck", frozen)[0]
    assert "t1" in stuck["holdup"] and "t0" not in stuck["holdup"], stuck  # the frozen trainer, by name
    assert "STUCK" in out and "t1 does not answer" in out
    exit_i1 = next(r for r in journal if r["kind"] == "exit" and r["node"] == "i1")
    assert exit_i1["why"] == "killed by SIGKILL" and exit_i1["error"] == ""  # no unrelated line as its "error"
    assert any(r["kind"] == "restart" and r["node"] == "i1" for r in journal)
    summary = json.loads((report / "summary.json").read_text())
    assert summary["restarts"]["i1"] >= 1 and summary["restarts"]["store"] == 1, summary["restarts"]
    assert summary["nodes_detail"]["i1"]["restarts"] == summary["restarts"]["i1"]
    assert all(d["version"] == 12 for d in summary["nodes"].values()), summary["nodes"]
    assert len({d["digest"] for d in summary["nodes"].values()}) == 1
    assert all(summary["checks"].values()), summary["checks"]
    assert _gone(workdir, timeout=5.0) == []


@pytest.mark.timeout(900)
def test_a_crash_loop_ends_the_run_naming_the_node_its_exits_and_its_last_error(workdir: Path) -> None:
    """A node that cannot start again (its config broken while it ran) is restarted with backoff
    until the crash-loop limit, then the run fails saying which node, how often and why."""
    small = ["--prompts", "8", "--group-size", "4", "--rows-per-step", "32", "--inner-steps", "2"]
    supervise = ["--supervise.max-restarts", "2", "--supervise.backoff-s", "0.2", "--supervise.backoff-cap-s", "0.5"]
    proc = _up(workdir, "--rounds", "1000", *small, *supervise)
    try:
        wait_for_process(
            lambda: any(e.kind == "served" for e in _events(workdir, "i1")), 300, "i1 serving", proc, progress=_moving(workdir)
        )
        (workdir / "config" / "i1.toml").write_text("[inference]\nno_such_setting = 1\n")
        os.kill(_pid(workdir, "config/i1.toml"), signal.SIGKILL)
        out = _finish(proc)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-3000:]
    loop = next(r for r in _journal(workdir) if r["kind"] == "crash_loop")
    assert loop["node"] == "i1"
    assert (
        "i1 is in a crash loop: 3 exits within 600 s (2 restarts in all; killed by SIGKILL, exit code 2, exit code 2)"
        in loop["reason"]
    )
    assert "no_such_setting" in loop["reason"]  # its last error: what the node said when it failed to start
    assert "i1 is in a crash loop" in out
    assert _gone(workdir, timeout=10.0) == []


def test_up_refuses_to_wipe_a_directory_it_did_not_make(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.txt").write_text("keep me")
    proc = _up(tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "was not made by pulsenet up" in out, out
    assert (tmp_path / "logs" / "mine.txt").read_text() == "keep me"


def test_sparsity_counts_unchanged_bf16_bits() -> None:
    import torch

    from pulsenet.nodes.trainer import unchanged_fraction

    old = {"w": torch.zeros(4, 5, dtype=torch.bfloat16), "b": torch.ones(5, dtype=torch.bfloat16)}
    new = {k: v.clone() for k, v in old.items()}
    assert unchanged_fraction(old, new) == 1.0
    new["w"][0, :3] = 0.5
    new["b"][0] = 1.0078125  # the next BF16 value above 1.0
    assert unchanged_fraction(old, new) == 21 / 25
    new["w"][1, 0] = -0.0  # same value, other bits: a change the patch must carry
    assert unchanged_fraction(old, new) == 20 / 25


def test_the_planned_round_deadline_is_the_trainers_as_planned_not_read_back_from_a_file(tmp_path: Path) -> None:
    """Twice the trainers' PULSELoCo ``deadline_s`` as planned (after an injector's adjustments),
    300 s for a lone trainer, ``--supervise.round-deadline-s`` when given; on 7876ec8 the launcher
    read config/t0.toml back for it."""
    from pulsenet.nodes.supervisor import SuperviseConfig
    from pulsenet.nodes.up import UpConfig
    from pulsenet.nodes.up.sites import Creds, plan_nodes

    class Adjust:
        def adjust(self, trainers: list, inference: list) -> tuple[list, list]:
            return [replace(t, loco=replace(t.loco, deadline_s=45.0)) for t in trainers], inference

        def endpoint(self, node: str, url: str) -> str:
            return url

        async def start(self, sup: object) -> None: ...

        async def run(self, sup: object) -> None: ...

        async def after(self, sup: object) -> None: ...

    sites = ["t0", "t1", "i0", "i1"]
    creds = Creds(env={s: {} for s in sites}, buckets={s: f"b-{s}" for s in [*sites, "loco"]})
    (tmp_path / "config").mkdir()
    plan = plan_nodes(UpConfig(model="tiny"), tmp_path, "run", creds, Adjust())
    assert plan.round_deadline_s == 90.0
    assert tomllib.loads((tmp_path / "config" / "t1.toml").read_text())["trainer"]["loco"]["deadline_s"] == 45.0
    assert plan_nodes(UpConfig(model="tiny", trainers=1), tmp_path, "run", creds).round_deadline_s == 300.0
    given = UpConfig(model="tiny", supervise=SuperviseConfig(round_deadline_s=7.0))
    assert plan_nodes(given, tmp_path, "run", creds).round_deadline_s == 7.0


def test_each_node_gets_its_share_of_the_cores_as_torch_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every node on every core makes torch's threads spin-wait on one another: a node gets
    ``--node-threads``, else OMP_NUM_THREADS as set, else the cores shared among the nodes."""
    from pulsenet.errors import ConfigError
    from pulsenet.nodes.up import UpConfig, run_network
    from pulsenet.nodes.up.sites import Creds, plan_nodes

    sites = ["t0", "t1", "i0", "i1"]
    creds = Creds(env={s: {} for s in sites}, buckets={s: f"b-{s}" for s in [*sites, "loco"]})
    (tmp_path / "config").mkdir()

    def threads(**kw: object) -> set[str]:
        return {n.env["OMP_NUM_THREADS"] for n in plan_nodes(UpConfig(model="tiny", **kw), tmp_path, "run", creds).nodes}  # type: ignore[arg-type]

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(10)))
    assert threads() == {"2"}  # 10 cores, 4 nodes
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert threads() == {"1"}  # never 0
    assert threads(node_threads=3) == {"3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads() == {"4"} and threads(node_threads=1) == {"1"}
    with pytest.raises(ConfigError, match="node-threads"):
        run_network(UpConfig(model="tiny", node_threads=-1, workdir=tmp_path / "w"))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_each_model_gets_a_task_it_can_be_rewarded_on(model: str, tmp_path: Path) -> None:
    """tiny answers its warm-up task; a pretrained model gets solved examples first and its
    completion ends at the newline after its answer (a bare ``3+4=`` gives it no reward signal)."""
    from pulsenet.nodes.up import UpConfig
    from pulsenet.nodes.up.sites import Creds, plan_nodes
    from pulsenet.rl.tasks import SHOTS, TaskConfig, build_task

    sites = ["t0", "t1", "i0", "i1"]
    creds = Creds(env={s: {} for s in sites}, buckets={s: f"b-{s}" for s in [*sites, "loco"]})
    (tmp_path / "config").mkdir()
    nodes = plan_nodes(UpConfig(model=model), tmp_path, "run", creds).nodes
    tables = [tomllib.loads((tmp_path / "config" / f"{n.name}.toml").read_text()) for n in nodes]
    inference = [t["inference"] for t in tables if "inference" in t]
    assert len(inference) == 2
    want = ("arith", []) if model == "tiny" else ("arith-shots", ["\n"])
    for t in inference:
        config = TaskConfig(**{k.replace("-", "_"): v for k, v in t["task"].items()})
        assert (config.task, list(config.prompt_config().stop)) == want, t["task"]

    task = build_task("arith-shots", seed=0)
    problem = task.draw(__import__("random").Random(1))
    lines = problem.prompt.split("\n")
    assert len(lines) == SHOTS + 1 and all("=" in line for line in lines)
    assert all(eval(line.split("=")[0]) == int(line.split("=")[1]) for line in lines[:-1])  # solved shots
    assert task.score(f"{problem.answer}\n", problem) == 1.0
    assert task.score(f"{int(problem.answer) + 1}\n", problem) == 0.0
