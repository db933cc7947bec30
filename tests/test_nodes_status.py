"""The node status endpoints over real HTTP, and JSON-lines logging."""

from __future__ import annotations

import json
import logging
import time

import aiohttp

from pulsenet.logs import JsonFormatter
from pulsenet.nodes.status import NodeState, StatusServer


async def test_healthz_status_and_metrics_over_http() -> None:
    state = NodeState(role="inference", node_id="i0", version=7, digest="ab" * 32, staleness=1, reward=0.25)
    state.rollouts["produced"] = 48
    state.bytes["pulsesync"] = 12345
    async with StatusServer(state, stuck_after_s=5.0) as server, aiohttp.ClientSession() as http:
        assert server.port > 0
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200 and (await r.json())["ok"] is True
        async with http.get(f"{server.url}/status") as r:
            body = await r.json()
        assert (body["role"], body["node_id"], body["version"], body["digest"]) == ("inference", "i0", 7, "ab" * 32)
        assert body["rollouts"]["produced"] == 48 and body["bytes"]["pulsesync"] == 12345
        async with http.get(f"{server.url}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        assert 'pulsenet_policy_version{node="i0",role="inference"} 7.0' in text
        assert 'pulsenet_rollouts_total{node="i0",outcome="produced",role="inference"} 48.0' in text
        assert 'pulsenet_store_bytes_total{channel="pulsesync",node="i0",role="inference"} 12345.0' in text
        # The metrics read the live state: no second bookkeeping to drift.
        state.version = 8
        async with http.get(f"{server.url}/metrics") as r:
            assert 'pulsenet_policy_version{node="i0",role="inference"} 8.0' in await r.text()
        # A loop that stopped making progress is reported as stuck.
        state.last_beat = time.monotonic() - 6.0
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 503 and (await r.json())["ok"] is False
        state.beat()
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200


def test_json_log_lines_carry_extra_fields() -> None:
    record = logging.LogRecord("pulsenet.nodes", logging.WARNING, __file__, 1, "round %d late", (3,), None)
    record.node = "t1"
    line = json.loads(JsonFormatter().format(record))
    assert (line["level"], line["logger"], line["msg"], line["node"]) == ("WARNING", "pulsenet.nodes", "round 3 late", "t1")
    assert line["ts"].endswith("Z")


def test_report_writes_summary_and_plots(tmp_path) -> None:
    from pulsenet.nodes.report import write_report

    rounds = [
        {"round": r, "reward": 0.1 * r, "staleness": r % 2, "sparsity": 0.99,
         "bytes": {"pulsesync": 1000, "full_sync": 100000, "pulseloco": 500, "diloco": 9000, "ddp": 70000, "rollouts": 300}}
        for r in (1, 2, 3)
    ]  # fmt: skip
    nodes = {"t0": {"role": "trainer", "version": 3, "digest": "d" * 64}, "i0": {"role": "inference", "version": 3, "digest": "d" * 64}}
    summary = write_report(tmp_path, rounds=rounds, nodes=nodes)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["bytes"] == {"pulsesync": 3000, "full_sync": 300000, "pulseloco": 1500, "diloco": 27000, "ddp": 210000, "rollouts": 900}
    assert on_disk["ratios"]["full_sync_over_pulsesync"] == 100.0 and on_disk["staleness"] == 1
    assert on_disk["nodes"]["i0"]["role"] == "inference" and summary["reward"] == [0.1, 0.2, 0.30000000000000004]
    for name in ("reward.png", "bytes.png", "sparsity.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
