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
    assert set(s["bytes_per_worker_round"]) == {"ddp", "diloco", "pulseloco"}
    assert s["digests_equal"] is True
    assert 0 < s["sent_fraction"] <= 1
    assert s["bytes_per_worker_round"]["ddp"] == 2 * 4 * doc["n_params"]
    assert s["ratio_vs_ddp"] > 1
    assert len(doc["rounds"]) == 2 and all(r["pulseloco"]["eval_loss"] is not None for r in doc["rounds"])
    assert list(tmp_path.glob("pulseloco-bench-*")) == []  # the temporary stores are gone
