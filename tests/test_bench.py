"""``pulsenet bench sync`` and ``bench e2e`` end to end on the tiny model (the demo's code path)."""

from __future__ import annotations

import json
import subprocess
import sys


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pulsenet", "bench", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=240,  # inside pytest's 300 s, so a hang reports its stderr
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_sync_tiny(tmp_path):
    result = run_bench(tmp_path, "sync", "--model", "tiny", "--steps", "2", "--workdir", str(tmp_path / "w"))
    assert result["schema"] == "pulsenet.bench.sync/1"
    assert [r["pair"] for r in result["pairs"]] == ["step0->step1", "step1->step2", "step0->step2"]
    assert result["summary"]["bit_exact"] is True
    for row in result["pairs"]:
        assert 0 < row["changed_fraction"] < 1
        assert row["bytes"]["pulsenet_v1"] < row["bytes"]["full_bf16"]
        assert row["pulsenet_v1"]["encode_MBps"] > 0 and row["pulsenet_v1"]["decode_apply_verify_MBps"] > 0
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [f"step{k}.safetensors" for k in range(3)]


def test_bench_e2e_tiny(tmp_path):
    result = run_bench(tmp_path, "e2e", "--model", "tiny", "--versions", "2", "--subscribers", "1")
    summary = result["summary"]
    assert summary["all_digests_match"] is True
    assert summary["patch_bytes_mean"] < summary["full_checkpoint_bytes"]


def test_bench_rl_tiny(tmp_path):
    """Asynchronous GRPO through the real embedded S3 server: every engine served only verified
    weights (digests equal the published ones), staleness stays within its bound, real numbers."""
    result = run_bench(
        tmp_path, "rl", "--model", "tiny", "--steps", "4", "--inference", "2", "--max-staleness", "1",
        "--rows-per-step", "64", "--prompts", "4", "--group-size", "8", "--workdir", str(tmp_path / "w"),
    )  # fmt: skip
    assert result["schema"] == "pulsenet.bench.rl/1"
    s = result["summary"]
    assert s["digests_equal"] is True and s["final_version"] == 4
    assert len(s["reward"]) == 4 and all(0.0 <= r <= 1.0 for r in s["reward"])
    assert all(int(lag) <= 1 for lag in s["staleness"]) and sum(s["staleness"].values()) >= 4
    assert all(kl >= -1e-6 for kl in s["mismatch_kl"])
    b = s["bytes"]
    assert b["rollouts"] > 0 and 0 < b["pulsesync"] < b["full_sync"]
    assert s["update_apply_s"] and all(t > 0 for t in s["update_apply_s"])
    for node, versions in s["versions_served"].items():
        assert versions[0] == 0 and versions == sorted(versions), node


def test_bench_rl_two_trainers_pulseloco(tmp_path):
    """GRPO with PULSELoCo among two trainers: every trainer publishes every version with the same
    digest, engines follow one channel (each patch downloaded once), payloads were exchanged."""
    result = run_bench(
        tmp_path, "rl", "--model", "tiny", "--trainers", "2", "--inner-steps", "2", "--steps", "2",
        "--inference", "2", "--rows-per-step", "32", "--prompts", "4", "--group-size", "8",
        "--workdir", str(tmp_path / "w"),
    )  # fmt: skip
    s = result["summary"]
    assert s["digests_equal"] is True and s["final_version"] == 2
    assert s["pulseloco_bytes"] > 0 and len(s["reward"]) == 2
    b = s["bytes"]
    # One channel followed per engine: at most one download of each published patch per engine.
    assert 0 < b["pulsesync"] <= 2 * b["pulsesync_published"]  # 2 engines x each version once
