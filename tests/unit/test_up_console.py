"""``pulsenet up``'s tables fit the console they are given (nodes/up/console.py): in 80 columns no
header is cut to ``hea…`` and no byte count or digest is cut mid-number (on 7876ec8 both tables
were, as the demo showed on a fresh clone)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from pulsenet.nodes.up import UpConfig
from pulsenet.nodes.up.console import print_summary, status_table
from pulsenet.nodes.up.node import Node, Outcome

BIG = 1_234_567_890_123
"""A byte count of a long run (1.2 TB): the widest number a cell holds."""


def _nodes(tmp_path: Path) -> list[Node]:
    nodes = []
    for name, role in (("t0", "trainer"), ("t1", "trainer"), ("i0", "inference"), ("i1", "inference")):
        n = Node(name, role, [], {}, tmp_path / f"{name}.log", tmp_path / f"{name}.jsonl", "http://127.0.0.1:1")
        n.health = "degraded" if name == "t1" else "ok"
        n.status = {
            "reward": 0.8125,
            "staleness": 2,
            "errors": 12345,
            "rollouts": {"consumed": 123456, "produced": 123456},
            "bytes": {"pulsesync": BIG, "pulseloco": BIG, "rollouts": BIG},
        }
        nodes.append(n)
    return nodes


def _summary(nodes: list[Node]) -> dict[str, Any]:
    bytes_ = {"pulsesync": BIG, "full_sync": 10 * BIG, "pulseloco": BIG, "diloco": 8 * BIG, "ddp": 16 * BIG, "rollouts": BIG}
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    detail = {
        "version": 12345, "digest": digest, "restarts": 123, "served": True, "served_verified": True, "weights_digest": digest
    }
    return {
        "rounds": [{"reward": 0.5, "sparsity": 0.97, "bytes": bytes_}] * 3,
        "eval": [],
        "efficiency": {
            "trained_fraction": 0.9, "dropped_fraction": 0.1, "staleness_mean": 1.2, "engine_busy": 0.8,
            "trainer_busy": 0.7, "update_latency_s": {"p95": 1.5}, "round_s": 12.0,
        },
        "nodes": {n.name: detail | {"role": n.role} for n in nodes},
        "checks": {"versions_verified": True},
    }


def _render(width: int, draw: Callable[[Console], None]) -> str:
    out = Console(width=width, record=True, file=io.StringIO())
    draw(out)
    return out.export_text()


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_live_table_fits_the_width_it_is_given(tmp_path: Path, width: int) -> None:
    nodes = _nodes(tmp_path)
    text = _render(width, lambda out: out.print(status_table(nodes, "network at v12345, last version 3 s ago", out.width)))
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width, text
    for word in ("node", "health", "reward", "degraded", "0.812", "123456", "12345"):
        assert word in text, (word, text)
    if width >= 160:  # room for every byte count in full
        assert "1,234,567,890,123" in text, text
    else:
        assert "1235G" in text, text  # whole, in its unit


@pytest.mark.parametrize("width", [80, 160])
def test_the_final_summary_fits_the_width_it_is_given(tmp_path: Path, width: int) -> None:
    nodes = _nodes(tmp_path)
    outcome = Outcome(0, "done: every node at v12345", nodes, {}, 61.0)
    config = UpConfig(trainers=2, inference=2)
    text = _render(width, lambda out: print_summary(out, config, outcome, _summary(nodes)))
    assert max(len(line) for line in text.splitlines()) <= width, text
    table = text[text.index("verified versions and digests") :]
    assert "9f86d081884c" in table and "12345" in table and "own weights" in table, table
    if width < 100:
        assert "…" not in text, text
