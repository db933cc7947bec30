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
