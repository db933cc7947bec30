"""The supervisor's records of a run: each ``Node`` (its command and current process) and the
``Outcome``; a node's version read from its own events (``nodes/events.py``)."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsenet.nodes.events import VersionEvent
from pulsenet.nodes.supervisor import EventTail, Liveness, Restarts


@dataclass
class Node:
    """One node of the network: its command (the same for every life) and its current process."""

    name: str
    role: str
    cmd: list[str]
    env: dict[str, str]
    log_path: Path
    events_path: Path
    status_url: str
    proc: subprocess.Popen[bytes] | None = None
    """The current life's process; None between an exit and its restart, and once done."""
    status: dict[str, Any] = field(default_factory=dict)
    """Its last /status answer."""
    health: str = "starting"
    """Its /healthz status (``ok``, ``degraded``, ``stuck``), ``starting``, ``no answer``, ``down: ...``, ``done``."""
    reasons: list[str] = field(default_factory=list)
    """Its /healthz reasons."""
    restarts: Restarts = field(default_factory=Restarts)
    pids: list[int] = field(default_factory=list)
    """The process id of every life."""
    log_offset: int = 0
    """Where the current life's output starts in its log (its last error is looked for after it)."""
    life_from: int = 0
    """Index of the current life's first event in ``tail.events``."""
    answered: bool = False
    """The current life has answered /status."""
    done: bool = False
    """A trainer that exited after its last version."""
    stopping: str = ""
    """Why the supervisor is stopping the current life (stuck, or not answering), "" otherwise."""
    liveness: Liveness = field(default_factory=lambda: Liveness(time.monotonic()))
    """The current life's health probes (``supervisor.Liveness``)."""
    unresponsive: str = ""
    """Why the current life must be restarted for not answering its probes, "" while it answers."""
    tail: EventTail = field(init=False)
    """Its ``events.jsonl``, read as it grows: every version it published or served, in every life."""

    def __post_init__(self) -> None:
        self.tail = EventTail(self.events_path)

    @property
    def pid(self) -> int | None:
        return self.pids[-1] if self.pids else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Outcome:
    """What a run ended with: its exit code, the nodes, and the history read from their events."""

    code: int
    reason: str
    nodes: list[Node]
    events: dict[str, list[VersionEvent]]
    wall_s: float
    store_restarts: int = 0


def node_version(n: Node) -> int:
    """The version a node last published (trainer) or swapped in (inference), from its events; -1: none yet."""
    e = n.tail.last("published") if n.role == "trainer" else n.tail.last("served", "stopped")
    return -1 if e is None else e.version


def serving_version(n: Node) -> int:
    """The version a running node's current life serves (its events since it started); -1: none, or down."""
    if not n.running:
        return -1
    return max((e.version for e in n.tail.events[n.life_from :] if e.kind == "served"), default=-1)

