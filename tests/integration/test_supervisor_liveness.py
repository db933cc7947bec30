"""Liveness as Kubernetes means it (issue 29, item 10): a node that leaves its health probes
unanswered is restarted, whatever keeps it from answering; the decision (``supervisor.Liveness``)
without processes, then a node frozen in C code under ``pulsenet up``'s supervisor."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import sys
from pathlib import Path

import pytest

from pulsenet.errors import ConfigError
from pulsenet.nodes.supervisor import Liveness, SuperviseConfig

WORKER = Path(__file__).parents[1] / "support" / "frozen_worker.py"
REPO = Path(__file__).resolve().parents[2]


def test_a_node_that_stops_answering_is_restarted_after_n_probes_in_a_row() -> None:
    policy = SuperviseConfig(liveness_failures=3, liveness_grace_s=60.0)
    life = Liveness(started=0.0)
    assert life.probed(True, 1.0, policy) is None
    assert life.probed(False, 2.0, policy) is None
    assert life.probed(False, 3.0, policy) is None
    assert life.probed(True, 4.0, policy) is None  # an answer resets the count
    assert [life.probed(False, 5.0 + i, policy) for i in range(3)][:2] == [None, None]
    assert life.misses == 3
    why = life.probed(False, 9.0, policy)
    assert why is not None and "4 health probes in a row" in why


def test_a_starting_node_gets_its_grace_period_then_counts_like_any_other() -> None:
    policy = SuperviseConfig(liveness_failures=2, liveness_grace_s=60.0)
    life = Liveness(started=100.0)
    assert all(life.probed(False, 100.0 + t, policy) is None for t in range(0, 60, 5))  # loading a model
    assert life.misses == 0
    assert life.probed(False, 161.0, policy) is None
    why = life.probed(False, 162.0, policy)
    assert why is not None and "since its start 62 s ago" in why


def test_liveness_can_be_turned_off_and_is_checked() -> None:
    off = SuperviseConfig(liveness_failures=0)
    life = Liveness(started=0.0, answered=True)
    assert all(life.probed(False, float(t), off) is None for t in range(100))
    with pytest.raises(ConfigError):
        SuperviseConfig(liveness_failures=-1)
    with pytest.raises(ConfigError):
        SuperviseConfig(liveness_grace_s=-1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(120)
async def test_a_node_frozen_in_c_code_is_killed_and_restarted(tmp_path: Path) -> None:
    """The worker answers /status, then holds the GIL inside ``re``'s C matcher: no answer, no
    signal handler, SIGTERM ignored. On 7876ec8 the supervisor showed "no answer" and left it
    frozen; now, after 3 probes in a row, it is stopped (SIGKILL after the grace) and restarted,
    and the new life answers."""
    from rich.console import Console

    from pulsenet.nodes.supervisor import Journal
    from pulsenet.nodes.up import UpConfig
    from pulsenet.nodes.up.node import Node
    from pulsenet.nodes.up.supervisor import Supervisor

    port = _free_port()
    marker = tmp_path / "froze"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    node = Node(
        name="t0", role="trainer", cmd=[sys.executable, str(WORKER), str(port), str(marker)], env=env,
        log_path=tmp_path / "t0.log", events_path=tmp_path / "t0.events.jsonl",
        status_url=f"http://127.0.0.1:{port}",
    )  # fmt: skip
    policy = SuperviseConfig(liveness_failures=3, liveness_grace_s=30.0, backoff_s=0.1, backoff_cap_s=0.2)
    c = UpConfig(workdir=tmp_path, live=False, poll_s=0.2, stop_grace_s=2.0, timeout_s=100.0, supervise=policy)
    journal = Journal(tmp_path / "supervisor.jsonl")
    sup = Supervisor(c, [node], Console(file=io.StringIO()), journal=journal, round_deadline_s=1e9)
    run = asyncio.create_task(sup.run())
    try:
        async with asyncio.timeout(90):
            while not (len(node.pids) >= 2 and node.health == "ok"):
                assert not run.done(), run.result()
                await sup.ticked(10)
    finally:
        sup.stop.set()
        await run
    assert marker.exists()
    kinds = [r["kind"] for r in journal.records]
    assert "unresponsive_node" in kinds and "restart" in kinds, kinds
    first = node.restarts.exits[0]
    assert first.why.startswith("stopped as unresponsive (no answer to 3 health probes in a row")
    assert first.code == -9  # SIGTERM could not reach a frozen interpreter: SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(node.pids[0], 0)
