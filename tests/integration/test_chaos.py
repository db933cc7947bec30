"""``pulsenet chaos`` end to end: the local network (real SeaweedFS, two trainers running PULSELoCo,
two inference nodes, each its own process) under a fixed schedule of one fault of each kind, then
the checker's verdict. Nothing is faked: the faults are real signals and a real cut link.

The bounded run is part of the suite; the 30-minute soak behind ``PULSENET_SLOW=1`` is the one
docs/reliability.md reports. Both wait on the network's progress, never on a fixed wall-clock
budget, so they pass on a loaded machine, only slower.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pulsenet.nodes.up.workdir import MARKER

pytestmark = pytest.mark.integration
SMALL = ["--prompts", "8", "--group-size", "4", "--rows-per-step", "32", "--inner-steps", "2"]
ALL_KINDS = ["kill-inference", "kill-trainer", "kill-store", "stall-store", "cut-link"]


@pytest.fixture
def workdir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    cached = getattr(request.config, "cache", None)  # the tiny warm-up, shared with tests/integration/test_up.py
    cache = cached.mkdir("pulsenet-up-cache") if cached is not None else tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    work = tmp_path / "chaos"
    work.mkdir()
    (work / MARKER).write_text("")
    (work / "cache").symlink_to(cache, target_is_directory=True)
    return work


def _chaos(workdir: Path, out: Path, *args: str, stall_s: float = 900.0) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))}
    cmd = [sys.executable, "-m", "pulsenet", "chaos", "--workdir", str(workdir), "--no-live", "--out", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        out_text, _ = proc.communicate()  # bounded by the run's own --timeout-s and the test's timeout
    finally:
        proc.kill()
    return proc.returncode, out_text


@pytest.mark.timeout(2400)
def test_bounded_chaos_run_recovers_from_every_fault_and_passes_the_audit(workdir: Path, tmp_path: Path) -> None:
    """One fault of each kind (SIGKILL of an inference node and of a trainer, SIGKILL of the store,
    the store stopped for 8 s, a trainer's link cut for 12 s), seed 3, 60 rounds of the small tiny
    network: every fault recovered, nothing unverified served, no fork, every node on the last
    version with one digest, no process left, the store within retention."""
    out = tmp_path / "chaos.json"
    args = ["--rounds", "60", *SMALL, "--faults", *ALL_KINDS, "--chaos-seed", "3", "--stall-s", "8", "--link-s", "12"]
    args += ["--timeout-s", "1800", "--sample-s", "2"]
    code, text = _chaos(workdir, out, *args)
    result = json.loads(out.read_text())
    assert code == 0 and result["verdict"] == "pass", text[-5000:]
    assert all(c["ok"] for c in result["checks"].values())

    faults = result["faults"]
    assert [f["kind"] for f in faults] == ALL_KINDS and all(f["injected"] for f in faults), faults
    assert all(f["recovery_s"] is not None and f["recovery_s"] >= 0 for f in faults)
    fig = result["figures"]
    assert fig["faults_injected"] == 5 and fig["recovered"] == 5
    assert fig["unverified_served"] == 0 and fig["forks"] == 0 and fig["served"] > 0 and fig["versions"] == 60
    killed = {f["target"] for f in faults if f["kind"] in ("kill-inference", "kill-trainer")}
    assert all(fig["restarts"].get(n, 0) >= 1 for n in killed) and fig["restarts"].get("store", 0) >= 1, fig

    # The audit read the run's own records: the supervisor's journal has each fault and restart.
    from pulsenet.nodes.supervisor import read_journal

    journal = read_journal(workdir / "state" / "supervisor.jsonl")
    assert [r["fault"] for r in journal if r["kind"] == "fault"] == ALL_KINDS
    assert any(r["kind"] == "store_restart" for r in journal)
    # A kill is recovered from only once its target lives again (a restart between the two records).
    for fault in (r for r in journal if r["kind"] == "fault" and r["fault"].startswith("kill-")):
        back = next(r for r in journal if r["kind"] == "recovered" and r["index"] == fault["index"])
        restart = "store_restart" if fault["target"] == "store" else "restart"
        assert any(
            r["kind"] == restart and r.get("node", "store") == fault["target"] and fault["at"] < r["at"] < back["at"]
            for r in journal
        ), (fault, back)
    cut = next(f for f in faults if f["kind"] == "cut-link")
    assert result["config"]["links"][cut["target"]]["up"] > 0  # its traffic went through the relay
    stores = result["store"]
    assert any(
        k == "policy versions" and v["present"] <= v["bound"]
        for s in stores.values()
        for k, v in s.items()
        if v.get("bound")
    )
    nodes = {"t0", "t1", "i0", "i1"}
    assert nodes <= set(result["resources"]) and all(result["resources"][n]["lives"] for n in nodes)


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)
def test_soak_thirty_minutes_of_seeded_faults(workdir: Path, tmp_path: Path) -> None:
    """The soak docs/reliability.md reports (PULSENET_SLOW=1): 800 rounds of the small tiny network,
    about 30 minutes here, with 16 faults drawn from every kind (seed 7), one every 40 versions or so."""
    out = Path(os.environ.get("PULSENET_SOAK_OUT", tmp_path / "soak.json"))
    args = ["--rounds", "800", *SMALL, "--count", "16", "--chaos-seed", "7", "--settle-versions", "40"]
    args += ["--stall-s", "30", "--link-s", "45", "--timeout-s", "7200", "--sample-s", "5"]
    code, text = _chaos(workdir, out, *args)
    result = json.loads(out.read_text())
    assert code == 0 and result["verdict"] == "pass", text[-8000:]
    assert result["figures"]["unverified_served"] == 0 and result["figures"]["forks"] == 0
