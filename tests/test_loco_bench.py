"""``pulsenet bench loco`` on the tiny model: the JSON contract and that the figures are sane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pulsenet.cli import main


@pytest.mark.timeout(120)
def test_bench_loco_tiny_json(tmp_path: Path) -> None:
    out = tmp_path / "loco.json"
    argv = [
        "bench",
        "loco",
        "--model",
        "tiny",
        "--workers",
        "2",
        "--rounds",
        "2",
        "--H",
        "2",
        "--threads",
        "1",
    ]
    assert main([*argv, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    b = s["bytes_per_worker_round"]
    assert set(b) == {"ddp", "diloco", "diloco_zstd", "pulseloco"}
    assert s["digests_equal"] is True
    assert 0 < s["sent_fraction"] <= 1
    # DDP and DiLoCo on one basis (raw FP32 as published); diloco_zstd is what the workers put.
    assert b["ddp"] == 2 * 4 * doc["n_params"] and b["diloco"] == 4 * doc["n_params"]
    assert 0 < b["diloco_zstd"] < b["diloco"] + 4096
    for base in ("ddp", "diloco", "diloco_zstd"):
        assert s[f"ratio_vs_{base}"] == b[base] / b["pulseloco"]
    assert s["ratio_vs_ddp"] > 1
    assert doc["config"]["forward"] == "bf16-weights"
    assert [len(v) for v in s["eval_loss"].values()] == [2, 2]
    assert len(doc["rounds"]) == 2 and all(r["pulseloco"]["eval_loss"] is not None for r in doc["rounds"])
    assert list(tmp_path.glob("pulseloco-bench-*")) == []  # the temporary stores are gone


@pytest.mark.timeout(120)
def test_bench_loco_emulated_links_charge_every_transfer(tmp_path: Path) -> None:
    """With ``--link-mbps`` each worker pays its own upload and every peer download on its link."""
    out, workers, rounds, mbps = tmp_path / "loco.json", 3, 2, 2.0
    argv = ["bench", "loco", "--model", "tiny", "--workers", str(workers), "--rounds", str(rounds), "--H", "2",
            "--threads", "1", "--modes", "pulseloco", "--link-mbps", str(mbps)]  # fmt: skip
    assert main([*argv, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["digests_equal"] is True and doc["config"]["link_mbps"] == mbps
    link_s = [r["pulseloco"]["payload_bytes"] * 8 / (mbps * 1e6) for r in doc["rounds"]]
    for r, t in zip(doc["rounds"], link_s, strict=True):
        assert r["pulseloco"]["upload_s"] >= 0.9 * t
    # a round needs a first upload, then each worker's downloads of its peers' payloads one after
    # another on its own link (shared downloads would let the workers split them: ~2 instead of 3)
    assert doc["summary"]["time_s"]["pulseloco"]["wall"] >= 0.9 * workers * sum(link_s)
    assert main([*argv[:-1], "0", "--workdir", str(tmp_path)]) != 0
