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

``published_event`` and ``inference_event`` build them from plain values: the shape of an event
lives here. Fields a role does not fill stay at their empty defaults. Byte and phase figures are this
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
    ``exchange``, ``replay``, ``publish``, ``eval``, each second in one; inference: ``apply``)."""
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


def published_event(
    *,
    node: str,
    version: int,
    digest: str,
    round: int,
    patch: str,
    wait_s: float,
    train_s: float,
    exchange_s: float,
    publish_s: float,
    replay_s: float = 0.0,
    pulsesync_bytes: int,
    full_bytes: int,
    pulseloco_bytes: int,
    model_numel: int,
    rollout_bytes: int,
    steps: list[dict[str, Any]],
    staleness: list[int],
    batches: int,
    totals: dict[str, float],
    sparsity: float | None,
    participants: list[str],
    at: float,
    eval: dict[str, Any] | None = None,
    eval_s: float | None = None,
) -> VersionEvent:
    """A trainer's ``published`` event, from plain values: the round's phases (``wait_rollouts``,
    ``train``, ``exchange``, ``replay`` (rl/replay.py), ``publish``, and ``eval`` when it ran: each
    second in one of them), its bytes by channel and what a
    dense exchange would have cost for comparison (``model_numel`` FP32 values: one DiLoCo
    pseudo-gradient a round, one DDP gradient a step), and the mean reward of the rows its GRPO
    ``steps`` (``GRPOMetrics.as_dict()``) trained on."""
    rows = sum(m["completions"] for m in steps)
    dense = 4 * model_numel  # one FP32 pseudo-gradient: what a DiLoCo worker sends per round
    phases = {"wait_rollouts": wait_s, "train": train_s, "exchange": exchange_s, "replay": replay_s, "publish": publish_s}
    if eval_s is not None:
        phases["eval"] = eval_s
    return VersionEvent(
        kind="published",
        node=node,
        role="trainer",
        version=version,
        digest=digest,
        round=round,
        patch=patch,
        phases=phases,
        bytes={
            "pulsesync": pulsesync_bytes,
            "full": full_bytes,
            "pulseloco": pulseloco_bytes,
            "diloco": dense,
            "ddp": dense * len(steps),  # a dense gradient every inner step
            "rollouts": rollout_bytes,
        },
        reward=sum(m["reward_mean"] * m["completions"] for m in steps) / rows if rows else None,
        staleness=staleness,
        counts={"steps": len(steps), "rows": rows, "batches": batches},
        totals=totals,
        sparsity=sparsity,
        steps=steps,
        participants=participants,
        at=at,
        eval=eval,
    )


def inference_event(
    kind: str,
    *,
    node: str,
    version: int,
    digest: str,
    pulsesync_bytes: int,
    totals: dict[str, float],
    apply_s: float | None = None,
    counts: dict[str, int] | None = None,
    weights_digest: str | None = None,
) -> VersionEvent:
    """An inference node's ``served`` event (``apply_s``: swapping the verified weights in) or its
    ``stopped`` event (``weights_digest``: its weights hashed again; ``counts``: one idle poll's
    requests), from plain values."""
    return VersionEvent(
        kind=kind,
        node=node,
        role="inference",
        version=version,
        digest=digest,
        bytes={"pulsesync": pulsesync_bytes},
        totals=totals,
        phases={} if apply_s is None else {"apply": apply_s},
        counts=counts or {},
        weights_digest=weights_digest,
    )


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
