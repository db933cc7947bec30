"""The node status endpoints over real HTTP, their limits, and JSON-lines logging."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from pulsenet.logs import JsonFormatter
from pulsenet.nodes.status import NodeState, StatusLimits, StatusServer

WORKER = Path(__file__).parents[1] / "support" / "status_worker.py"


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
    nodes = {
        "t0": {"role": "trainer", "version": 3, "digest": "d" * 64},
        "i0": {"role": "inference", "version": 3, "digest": "d" * 64},
    }
    summary = write_report(tmp_path, rounds=rounds, nodes=nodes)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["bytes"] == {
        "pulsesync": 3000, "full_sync": 300000, "pulseloco": 1500, "diloco": 27000, "ddp": 210000, "rollouts": 900
    }
    assert on_disk["ratios"]["full_sync_over_pulsesync"] == 100.0 and on_disk["staleness"] == 1
    assert on_disk["nodes"]["i0"]["role"] == "inference" and summary["reward"] == [0.1, 0.2, 0.30000000000000004]
    for name in ("reward.png", "bytes.png", "sparsity.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- limits (issue 21 item 8) ---------------------------------------------------------------------

FLOOD = 1100
"""Unfinished connections held open: past the usual 1024-descriptor limit of a node process."""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False  # still open, nothing sent
    except ConnectionResetError:
        return True


@pytest.mark.timeout(120)
def test_a_flood_of_unfinished_connections_leaves_the_node_its_fds_and_healthz() -> None:
    """1,100 connections that never finish a request (half send a partial head, half nothing) against
    a real status server in its own process (uvloop, 1024 fds): before the limits its fd table
    filled, its own file opens failed and /healthz timed out."""
    worker = subprocess.Popen(
        [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
    )
    held: list[socket.socket] = []
    try:
        assert worker.stdout is not None
        port = json.loads(worker.stdout.readline())["port"]
        base = _fds(worker.pid)
        cap = StatusLimits().max_connections
        for i in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            held.append(s)
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as r:
            assert r.status == 200 and json.loads(r.read())["ok"] is True
        assert time.monotonic() - t0 < 1.0
        # The node's fds stay bounded by the cap, whatever the flood holds on its side.
        assert _fds(worker.pid) <= base + cap + 4, (_fds(worker.pid), base, cap)
        # The oldest idle connections were closed to make room (not left to pile up in the kernel).
        assert sum(_closed_by_peer(s) for s in held) >= FLOOD - cap
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5.0) as r:
            body = json.loads(r.read())
        assert body["errors"] == 0, body["last_error"]  # its own file opens never failed
    finally:
        for s in held:
            s.close()
        worker.communicate(timeout=30)
    assert worker.returncode == 0


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> float:
    """Seconds until the server closes the connection (EOF or reset), failing after ``seconds``."""
    t0 = time.monotonic()
    async with asyncio.timeout(seconds):
        try:
            while await reader.read(1024):
                pass
        except ConnectionResetError:
            pass
    return time.monotonic() - t0


async def test_slow_and_silent_request_heads_are_dropped_after_the_header_timeout() -> None:
    state = NodeState(role="trainer", node_id="t0")
    limits = StatusLimits(header_timeout_s=0.5)
    async with StatusServer(state, limits=limits) as server, aiohttp.ClientSession() as http:
        silent = await asyncio.open_connection("127.0.0.1", server.port)
        slow = await asyncio.open_connection("127.0.0.1", server.port)

        async def trickle() -> None:  # one byte every 50 ms: a head that would take seconds
            for b in b"GET /status HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
                slow[1].write(bytes([b]))
                await asyncio.sleep(0.05)

        sender = asyncio.create_task(trickle())
        try:
            waited = await asyncio.gather(_closed_within(silent[0], 10), _closed_within(slow[0], 10))
        finally:
            sender.cancel()
        assert all(w >= 0.4 for w in waited), waited  # not before the timeout
        assert server.connections.header_timeouts == 2
        async with http.get(f"{server.url}/healthz") as r:  # the server itself is fine
            assert r.status == 200
        for _, w in (silent, slow):
            w.close()


async def test_request_size_limits_methods_and_handler_timeout() -> None:
    class Slow(StatusServer):
        async def _status(self, _: object) -> aiohttp.web.Response:  # type: ignore[override]
            await asyncio.sleep(30)
            raise AssertionError("unreachable")

    state = NodeState(role="trainer", node_id="t0")
    async with Slow(state, limits=StatusLimits(handler_timeout_s=0.3)) as server, aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/healthz", headers={"X-Big": "a" * 5000}) as r:
            assert r.status == 400  # a header line over max_line_size
        async with http.get(f"{server.url}/healthz", headers={f"X-{i}": "1" for i in range(40)}) as r:
            assert r.status == 400  # more than max_headers fields
        async with http.get(f"{server.url}/healthz", data=b"x" * 10) as r:
            assert r.status == 413  # no endpoint takes a body
        async with http.post(f"{server.url}/healthz") as r:
            assert r.status == 405
        async with http.get(f"{server.url}/nope") as r:
            assert r.status == 404
        t0 = time.monotonic()
        async with http.get(f"{server.url}/status") as r:
            assert r.status == 504 and time.monotonic() - t0 < 5
        async with http.head(f"{server.url}/healthz") as r:
            assert r.status == 200
        async with http.get(f"{server.url}/healthz") as r:
            assert r.status == 200


async def test_past_the_cap_idle_connections_make_room_and_busy_ones_are_kept() -> None:
    """At ``max_connections`` a new connection evicts the oldest idle one; a connection whose
    request is inside a handler is never evicted, and when every one is, the new one gets a 503."""
    gate = asyncio.Event()

    class Held(StatusServer):
        async def _status(self, request: object) -> aiohttp.web.Response:  # type: ignore[override]
            await gate.wait()
            return await super()._status(request)  # type: ignore[arg-type]

    state = NodeState(role="trainer", node_id="t0")
    async with (
        Held(state, limits=StatusLimits(max_connections=2)) as server,
        aiohttp.ClientSession() as http,
        aiohttp.ClientSession() as http2,
    ):
        idle = await asyncio.open_connection("127.0.0.1", server.port)
        busy = asyncio.create_task(http.get(f"{server.url}/status"))  # held inside its handler
        while len(server._server.busy) < 1:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        async with http.get(f"{server.url}/healthz") as r:  # evicts ``idle``, not ``busy``
            assert r.status == 200
        await _closed_within(idle[0], 5)
        assert server.connections.evicted >= 1 and not busy.done()
        # Both slots inside a handler: a third connection is refused with a 503, at once.
        second = asyncio.create_task(http2.get(f"{server.url}/status"))
        while len(server._server.busy) < 2:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        r3, w3 = await asyncio.open_connection("127.0.0.1", server.port)
        w3.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r3.read(), 5)).startswith(b"HTTP/1.1 503")
        assert server.connections.refused == 1
        gate.set()
        for task in (busy, second):
            async with await task as r:
                assert r.status == 200
        w3.close()
        idle[1].close()
