"""One typed record per policy version per node: the source of every view of a run.

A trainer emits a ``published`` event for each version it publishes; an inference node emits a
``served`` event for each verified version it swaps in, and a ``stopped`` event on the way out
(its own weights hashed again). Everything that describes what happened to a version is derived
from these records and nothing else (torchtitan's ``MetricsProcessor``: one record per step,
every sink reads it):

- the node's ``events.jsonl`` (``EventLog``, in its state directory): one JSON object per line,
  appended and flushed as it happens, so it survives the process and holds every version (where
  ``/status`` holds only the latest); ``pulsenet up`` reads these files (``read_events``);
- the node's ``NodeState`` (``/status``, ``/metrics``): ``NodeState.record(event)``;
- one INFO log line per event, for people (``extra=`` carries the record for JSON logs too).

Fields a role does not fill stay at their empty defaults. Byte and phase figures are this
version's; ``totals`` are the node's cumulative counters when the event was emitted, so the last
event of a node carries its run totals.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"
KINDS = ("published", "served", "stopped")


@dataclass(kw_only=True, slots=True)
class VersionEvent:
    """What happened to one policy version on one node."""

    kind: str
    """``published`` (trainer), ``served`` (inference: verified and swapped in), ``stopped`` (inference, last)."""
    node: str
    role: str
    """``trainer`` or ``inference``."""
    version: int
    digest: str
    """The model digest the version was published (or verified) with."""
    at: float = field(default_factory=time.time)
    """Wall-clock time (Unix seconds) of the event: publish returned, weights swapped in, node stopped."""
    round: int | None = None
    """PULSELoCo round that made the version (trainers; a lone trainer's round is its version)."""
    patch: str | None = None
    """``anchor`` or ``patch``: how PULSESync published it (trainers)."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds this version spent in each phase (trainer: ``wait_rollouts``, ``train``,
    ``exchange``, ``publish``; inference: ``apply``)."""
    bytes: dict[str, int] = field(default_factory=dict)
    """This version's bytes by channel. Trainer: ``pulsesync`` (its patch or anchor), ``full``
    (one BF16 checkpoint), ``pulseloco`` (its round payload), ``diloco`` (a dense FP32
    pseudo-gradient), ``ddp`` (a dense gradient per inner step), ``rollouts`` (downloaded since the
    last version). Inference: ``pulsesync`` (downloaded for this version)."""
    reward: float | None = None
    """Mean reward of the rows trained on (trainer) for this version."""
    staleness: list[int] = field(default_factory=list)
    """Trainer: ``version - 1 - rollout version`` of every batch trained on for this version."""
    counts: dict[str, int] = field(default_factory=dict)
    """This version's counts (trainer: ``steps``, ``rows``, ``batches``, ``participants``)."""
    totals: dict[str, float] = field(default_factory=dict)
    """The node's cumulative counters at this event (intake and writer counters, busy seconds, ...)."""
    sparsity: float | None = None
    """Fraction of BF16 weights whose bits this version did not change (trainers)."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """The GRPO metrics of each step that made this version (trainers)."""
    participants: list[str] = field(default_factory=list)
    """The trainers whose payloads the PULSELoCo round averaged."""
    eval: dict[str, Any] | None = None
    """Trainers, every ``eval_every`` versions: ``{version, reward, n}`` of a greedy eval on the
    task's held-out problems."""
    weights_digest: str | None = None
    """``stopped``: the digest of the engine's own weights, hashed again at exit."""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionEvent:
        """The event of a JSON line (unknown keys, from a newer writer, are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class EventLog:
    """A node's events: kept in memory, appended to ``path`` (one JSON line each) and logged.

    Each line is one ``write`` of an ``O_APPEND`` file, flushed at once: a reader sees whole lines
    only, except the last one of a process killed mid-write, which ``read_events`` skips."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.events: list[VersionEvent] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: VersionEvent) -> VersionEvent:
        self.events.append(event)
        record = event.as_dict()
        if self.path is not None:
            line = (json.dumps(record, separators=(",", ":"), default=float) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        log.info(
            "%s: %s v%d (%s…)", event.node, event.kind, event.version, event.digest[:12], extra={"event": record}
        )
        return event

    def last(self, kind: str | None = None) -> VersionEvent | None:
        return next((e for e in reversed(self.events) if kind is None or e.kind == kind), None)


def read_jsonl(path: Path) -> list[Any]:
    """The records of a JSON-lines file, in order (none if it is missing); a torn line (a kill
    mid-write) is skipped."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_events(path: Path) -> list[VersionEvent]:
    """The events in a node's ``events.jsonl``, in order."""
    out: list[VersionEvent] = []
    for data in read_jsonl(path):
        try:
            out.append(VersionEvent.from_dict(data))
        except (ValueError, TypeError):
            continue
    return out
