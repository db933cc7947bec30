"""``pulsenet bench scale``: the request counts it measures on SeaweedFS, and its cost arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pulsenet.bench.scale import MONTH_S, PRICES, ScaleBenchSettings, per_version_node_counts, project, run
from pulsenet.errors import ConfigError

pytestmark = pytest.mark.timeout(300)
ZERO = {"get": 0.0, "get_not_modified": 0.0, "head": 0.0, "list": 0.0, "put": 0.0, "delete": 0.0}


def _measured(per_version_get: float = 3.0) -> dict:
    """What the SeaweedFS run measures: an idle poll is one 304; a version is head GET, LIST,
    manifest GET and the patch streamed in one GET."""
    return {
        "source": "test",
        "idle_poll": ZERO | {"get_not_modified": 1.0},
        "per_version_per_inference_node": ZERO | {"get": per_version_get, "list": 1.0},
        "per_version_per_inference_node_without_ranges": ZERO | {"get": per_version_get - 1, "list": 1.0},
        "per_version_publisher_without_payloads": ZERO | {"put": 2.0, "list": 1.0},
    }


def test_projection_arithmetic_by_hand() -> None:
    args = ScaleBenchSettings()  # 2 s polls, a version a minute, 4 trainers, 108 MB patches, 8 MiB ranges
    row = project(_measured(), args, 1000)
    versions, polls = MONTH_S / 60, MONTH_S / 2  # 43,200 and 1,296,000 a month
    per_version = per_version_node_counts(_measured())
    assert per_version["get"] == 3 and per_version["head"] == 0  # head, manifest, the patch streamed whole
    node = row["per_node_per_month"]["requests"]
    assert node["get_not_modified"] == pytest.approx(polls - versions)
    assert node["get"] == pytest.approx(3 * versions) and node["list"] == pytest.approx(versions)
    # R2 (no egress fee): Class B = 304s + GETs + HEADs, Class A = LISTs, for 1,000 nodes.
    class_b = 1000 * (polls - versions + 3 * versions)
    class_a = 1000 * versions
    assert row["monthly_usd"]["r2"]["pulsesync"] == pytest.approx(class_b * 0.36e-6 + class_a * 4.5e-6)
    # S3: the same requests plus egress in tiers (10 TB at 0.09, 40 TB at 0.085, 100 TB at 0.07, rest 0.05).
    gb = 1000 * versions * 108e6 / 1e9
    egress = 10_240 * 0.09 + 40_960 * 0.085 + 102_400 * 0.07 + (gb - 153_600) * 0.05
    assert row["monthly_usd"]["s3"]["pulsesync"] == pytest.approx(class_b * 0.4e-6 + class_a * 5e-6 + egress)
    # Before conditional polling every idle poll was a head GET and a LIST: Class A x 30 on R2.
    before = row["requests_per_month"]["pulsesync_before_conditional_polling"]
    assert before["list"] == pytest.approx(1000 * polls) and before["get_not_modified"] == 0
    assert row["monthly_usd"]["r2"]["before_conditional_polling"] > 5 * row["monthly_usd"]["r2"]["total"]
    # Rates on one channel's prefix: 250 nodes per channel; a version lands on all within one poll.
    rates = row["per_channel_prefix"]
    assert rates["get_head_per_s_burst"] == pytest.approx(250 * 3 / 2)
    assert rates["list_per_s_before"] == pytest.approx(125) and rates["list_per_s_mean"] == pytest.approx(250 / 60)
    assert row["within_s3_prefix_limits"]
    assert project(_measured(), args, 10_000)["within_s3_prefix_limits"]  # 3,750 GET/s in a burst
    assert not project(_measured(), args, 100_000)["within_s3_prefix_limits"]  # 37,500
    assert {p.name for p in PRICES} == {"s3", "r2"} and all("2026" in p.source for p in PRICES)


def test_rl_json_counts_replace_the_measurement(tmp_path: Path) -> None:
    doc = tmp_path / "rl.json"
    doc.write_text(
        json.dumps(
            {
                "summary": {
                    "requests": {
                        "idle_poll": {"get": 0, "get_not_modified": 1, "list": 0},
                        "per_version_per_inference_node": {"get": 3, "list": 1, "put": 2},
                    }
                }
            }
        )
    )
    result = run(ScaleBenchSettings(rl_json=doc, nodes=(100,)))
    assert result["measured"]["source"] == str(doc)
    assert result["requests"]["per_version_per_inference_node"] == {"get": 3.0, "list": 1.0, "put": 2.0}
    assert [r["inference_nodes"] for r in result["scale"]] == [100]
    doc.write_text(json.dumps({"summary": {}}))
    with pytest.raises(ConfigError, match=r"requests\.idle_poll"):
        run(ScaleBenchSettings(rl_json=doc))


@pytest.mark.integration
def test_bench_scale_measures_on_seaweedfs(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pulsenet", "bench", "scale", "--versions", "2", "--idle-polls", "3",
         "--nodes", "10", "1000", "--workdir", str(tmp_path / "w"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["schema"] == "pulsenet.bench.scale/1"
    m = result["measured"]
    assert m["idle_polls_all_equal"] and m["idle_poll"] == ZERO | {"get_not_modified": 1.0, "bytes_down": 0.0, "bytes_up": 0.0}
    per_version = m["per_version_per_inference_node"]
    assert (per_version["list"], per_version["head"], per_version["put"]) == (1, 0, 0)
    assert per_version["get"] == 3  # the head, the manifest, the patch (one streamed GET)
    assert m["announced_idle"]["get_not_modified"] == 1 and sum(m["announced_idle"].values()) == 1
    assert m["join"]["list"] == 1 and m["per_version_publisher"]["put"] >= 3  # patch, manifest, head
    assert result["requests"]["idle_poll"] == {"get": 0, "get_not_modified": 1, "list": 0}
    rows = {r["inference_nodes"]: r for r in result["scale"]}
    assert set(rows) == {10, 1000} and rows[10]["within_s3_prefix_limits"]
    assert rows[1000]["monthly_usd"]["r2"]["total"] < rows[1000]["monthly_usd"]["r2"]["before_conditional_polling"]
