"""Supervision of a local network's processes: the decisions, apart from the processes.

``pulsenet up`` (its ``Supervisor`` in nodes/up/supervisor.py) polls its children and asks these pieces what to do; each is
plain logic over plain records, so it is tested without starting anything:

- ``SuperviseConfig``: the restart policy (systemd's ``Restart=on-failure`` with
  ``StartLimitBurst``/``StartLimitIntervalSec``, Kubernetes' crash-loop backoff) and the round
  deadline after which a network that makes no version is reported stuck;
- ``Restarts``: one child's exits and restarts. An unexpected exit is restarted after
  ``store.backoff_delay`` (exponential, full jitter) in the number of restarts within the window;
  the ``max_restarts + 1``-th exit within ``window_s`` is a crash loop, and only that ends a run;
- ``Liveness``: one child's health probes, as a Kubernetes liveness probe counts them: a node that
  does not answer ``liveness_failures`` probes in a row (a timeout is a failure) is restarted,
  whatever the reason it cannot answer (its event loop or GIL blocked in C code, a deadlock); a
  start-up that has not answered yet is given ``liveness_grace_s`` first;
- ``last_error``: the node's last *error* in its log since its current life began (an ERROR or
  CRITICAL record, a ``pulsenet: error`` line, an uncaught exception), never merely its last line;
- ``holdup``: which trainer holds a stuck network up, from what the supervisor sees of each
  (down or restarting, not answering, behind, its ``/healthz`` reasons);
- ``end_of_run``: whether a run is over, and with which exit code and reason, from one poll's
  ``RunView`` (a crash loop, a stop signal, a failed chaos injector, every node at the final
  version, the inference nodes late to serve it, the run's timeout);
- ``Journal``: ``<workdir>/state/supervisor.jsonl``, one JSON line per exit, restart, crash loop,
  stuck/unstuck network, store restart (and, under ``pulsenet chaos``, per fault): the record the
  chaos checker audits next to the nodes' own ``events.jsonl``;
- ``EventTail``: a node's ``events.jsonl`` read incrementally (the supervisor polls it twice a
  second for hours; re-reading whole files would grow with the run).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsenet.errors import ConfigError
from pulsenet.nodes.events import VersionEvent, read_jsonl
from pulsenet.store.base import backoff_delay

JOURNAL_FILE = "supervisor.jsonl"


@dataclass(kw_only=True)
class SuperviseConfig:
    """How ``pulsenet up`` keeps its nodes and its store running (the [up.supervise] table, --supervise.*)."""

    max_restarts: int = 5
    """A child that would need more than this many restarts within window_s is in a crash loop:
    the run ends, naming it, how often it exited and its last error (systemd's StartLimitBurst)."""
    window_s: float = 600.0
    """The crash-loop window (systemd's StartLimitIntervalSec); restarts older than this are forgotten."""
    backoff_s: float = 1.0
    """Restart delay bound after the first exit in the window; doubled per restart within the
    window (full jitter: a uniform draw below the bound), up to backoff_cap_s."""
    backoff_cap_s: float = 30.0
    """Largest restart delay bound."""
    round_deadline_s: float = 0.0
    """A network that makes no new version for this long is reported stuck, with the trainer that
    holds it up (0: twice the trainers' PULSELoCo deadline_s, or 300 s for a lone trainer)."""
    restart_stuck: bool = True
    """Restart a node whose own /healthz says "stuck" (no progress for its stuck_after_s), as a
    Kubernetes liveness probe would; "degraded" (a store down, waiting on a peer) is left alone."""
    liveness_failures: int = 20
    """Restart a node that has answered before and then leaves this many health probes in a row
    unanswered (a probe every ``poll_s``, each timing out after 2 s: 20 probes are 10-50 s), as a
    Kubernetes liveness probe's failureThreshold does: a node frozen in C code (its event loop or
    GIL blocked) cannot say it is stuck. 0: never."""
    liveness_grace_s: float = 300.0
    """A node that has not answered since it (re)started is probed only after this long (Kubernetes'
    startupProbe): loading a model and warming up are not a frozen node."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.backoff_cap_s < self.backoff_s:
            raise ConfigError(
                "supervise: max_restarts >= 0, window_s > 0 and 0 <= backoff_s <= backoff_cap_s, got "
                f"{self.max_restarts}, {self.window_s}, {self.backoff_s}, {self.backoff_cap_s}"
            )
        if self.liveness_failures < 0 or not self.liveness_grace_s >= 0:
            raise ConfigError(
                "supervise: liveness_failures >= 0 and liveness_grace_s >= 0, got "
                f"{self.liveness_failures}, {self.liveness_grace_s}"
            )


@dataclass
class Liveness:
    """One child life's health probes, counted as a Kubernetes liveness probe counts them."""

    started: float
    """Monotonic time this life started."""
    misses: int = 0
    """Probes in a row without an answer (counted once the grace period is over or it has answered)."""
    answered: bool = False
    """This life has answered a probe."""

    def probed(self, answered: bool, now: float, policy: SuperviseConfig) -> str | None:
        """Record one probe (``answered``: the node answered in time); why the node must be
        restarted now, or None. An answer resets the count; before its first answer a node is
        not counted until ``liveness_grace_s`` after its start."""
        if answered:
            self.answered, self.misses = True, 0
            return None
        if policy.liveness_failures == 0 or (not self.answered and now - self.started < policy.liveness_grace_s):
            return None
        self.misses += 1
        if self.misses < policy.liveness_failures:
            return None
        since = "" if self.answered else f" since its start {now - self.started:.0f} s ago"
        return f"no answer to {self.misses} health probes in a row{since}"


@dataclass
class Exit:
    """One unexpected exit of a child."""

    at: float
    """Wall-clock time (Unix seconds)."""
    code: int | None
    """Exit status (negative: the signal that ended it), None for a child stopped as stuck before it exited."""
    why: str
    """``describe_exit``, or why the supervisor stopped it."""
    error: str
    """Its last error (``last_error``), "" if none was logged."""


@dataclass
class Restarts:
    """One child's unexpected exits and restarts: what decides a crash loop and what the table shows."""

    count: int = 0
    """Restarts so far."""
    exits: list[Exit] = field(default_factory=list)
    recent: deque[float] = field(default_factory=deque)
    """Monotonic times of the restarts within the window."""
    due: float | None = None
    """Monotonic time the pending restart is due, None when none is pending."""

    def exited(self, exit: Exit, now: float, policy: SuperviseConfig, rng: random.Random | None = None) -> float | None:
        """Record an unexpected exit; the delay before its restart, or None: a crash loop (the
        child was already restarted ``max_restarts`` times within ``window_s``)."""
        self.exits.append(exit)
        while self.recent and now - self.recent[0] > policy.window_s:
            self.recent.popleft()
        if len(self.recent) >= policy.max_restarts:
            self.due = None
            return None
        delay = backoff_delay(len(self.recent), policy.backoff_s, policy.backoff_cap_s, rng)
        self.due = now + delay
        return delay

    def restarted(self, now: float) -> None:
        self.count += 1
        self.recent.append(now)
        self.due = None

    def crash_loop(self, name: str, policy: SuperviseConfig) -> str:
        """The failure reason of a crash loop: which child, how often, how it exited, its last error."""
        recent = self.exits[-(policy.max_restarts + 1) :]
        how = ", ".join(e.why for e in recent)
        error = next((e.error for e in reversed(recent) if e.error), "")
        return (
            f"{name} is in a crash loop: {len(recent)} exits within {policy.window_s:g} s "
            f"({self.count} restarts in all; {how}); last error: {error or 'none logged'}"
        )


def describe_exit(code: int | None) -> str:
    """``killed by SIGKILL``, ``exit code 2``, ``exit code 0``."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_TEXT_ERROR = re.compile(r"^\S+ \S+ (ERROR|CRITICAL) ")
TAIL_BYTES = 512 * 1024
"""How much of a log's end ``last_error`` reads: an error far older than that is not the last one."""


def last_error(path: Path, since: int = 0) -> str:
    """The last error a node logged after byte ``since`` of its log (where its current life began):
    a ``pulsenet: error`` line (the CLI's typed error), an ERROR/CRITICAL record (JSON or text
    format, with its exception's last line), or the final line of an uncaught traceback. "" if
    there is none: never its last line, which is usually an unrelated INFO record."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(since, size - TAIL_BYTES)
            f.seek(start)
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    lines = text.splitlines()
    if start > since and lines:
        lines = lines[1:]  # the first line is cut
    for k in range(len(lines) - 1, -1, -1):
        line = lines[k].rstrip()
        if line.startswith("pulsenet: error"):
            return line[:500]
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("level") in ("ERROR", "CRITICAL"):
                msg = str(rec.get("msg", ""))
                exc = str(rec.get("exc") or "").strip().splitlines()
                return (f"{msg} ({exc[-1]})" if exc else msg)[:500]
            continue
        if _TEXT_ERROR.match(line):
            return line[:500]
        if line and not line[0].isspace() and _ends_traceback(lines, k):
            return line[:500]  # the exception line of an uncaught traceback
    return ""


def _ends_traceback(lines: list[str], k: int) -> bool:
    """Whether ``lines[k]`` is the exception line under a Python traceback's indented frames."""
    j = k - 1
    while j >= 0 and lines[j][:1].isspace():
        j -= 1
    return j < k - 1 and j >= 0 and lines[j].startswith("Traceback (most recent call last)")


@dataclass(frozen=True, slots=True)
class TrainerView:
    """What the supervisor sees of one trainer at a poll."""

    name: str
    state: str
    """``running``, ``restarting`` (exited, restart pending), ``done`` (exited after its last version)."""
    health: str
    """Its /healthz status (``ok``, ``degraded``, ``stuck``), ``no answer``, ``starting``, or the exit."""
    version: int | None
    """The newest version it published (its events)."""
    round: int | None = None
    """The PULSELoCo round it is in (/status)."""
    reasons: tuple[str, ...] = ()
    """Its /healthz reasons."""
    idle_s: float | None = None
    """Seconds since its loop last made progress (/status)."""
    exit: str = ""
    """How it last exited (restarting)."""


def holdup(trainers: Sequence[TrainerView], store: str = "") -> str:
    """Which trainer holds a stuck network up, and why, in one line; ``store``: why the store is
    out ("" if it serves). The first that applies: the store is down; a trainer is down or
    restarting; a trainer does not answer; a trainer is behind the others; a trainer reports
    degraded or stuck (its reasons); else every trainer waits, with their rounds."""
    if store:
        return f"the store: {store}"
    down = [t for t in trainers if t.state == "restarting"]
    if down:
        return "; ".join(f"{t.name} is down ({t.exit or 'exited'}), restarting" for t in down)
    mute = [t for t in trainers if t.state == "running" and t.health in ("no answer", "starting")]
    if mute:
        return "; ".join(f"{t.name} does not answer /status ({t.health})" for t in mute)
    versions = {t.name: t.version for t in trainers if t.state == "running"}
    known = [v for v in versions.values() if v is not None]
    if known and (None in versions.values() or min(known) < max(known)):
        low = min(known) if None not in versions.values() else None
        behind = [n for n, v in versions.items() if v == low]
        return "; ".join(f"{n} is behind at v{_v(versions[n])} (newest v{max(known)})" for n in behind)
    unwell = [t for t in trainers if t.state == "running" and t.health not in ("ok",)]
    if unwell:
        return "; ".join(f"{t.name} is {t.health}: {', '.join(t.reasons) or 'no reason given'}" for t in unwell)
    waiting = ", ".join(
        f"{t.name} v{_v(t.version)} round {_v(t.round)}" + (f" idle {t.idle_s:.0f} s" if t.idle_s is not None else "")
        for t in trainers
    )
    return f"no trainer reports a fault: {waiting}"


def with_inference(line: str, inference: Sequence[tuple[str, str, Sequence[str]]]) -> str:
    """``holdup``'s ``line``, and when no trainer reports a fault (the trainers wait for rollouts)
    the inference nodes that do: ``(name, health, reasons)`` of each. A node that drops every
    prompt it is asked to generate reports degraded with why; naming it beats "no trainer reports
    a fault" (issue 29)."""
    unwell = [
        f"{name} is {health}: {'; '.join(reasons) or 'no reason given'}"
        for name, health, reasons in inference
        if health != "ok"
    ]
    if not unwell or not line.startswith("no trainer reports a fault"):
        return line
    return "; ".join(unwell) + f" ({line})"


@dataclass(frozen=True, slots=True)
class RunView:
    """What the supervisor sees of a run at one poll: what ``end_of_run`` decides on."""

    failure: str = ""
    """A crash loop (a node's or the store's), "" if none."""
    stopped: bool = False
    """A stop was asked for (SIGINT or SIGTERM)."""
    stop_reason: str = ""
    """Why it was stopped (``stopped by SIGINT``)."""
    injector_error: str = ""
    """``pulsenet chaos``'s injector failed with this ("" if it runs, or there is none)."""
    final: int | None = None
    """The version the trainers finished at; None while any trainer still trains."""
    serving: tuple[tuple[str, int], ...] = ()
    """(name, version its current life serves; -1: none or down) of every inference node."""
    serve_deadline: float | None = None
    """When the inference nodes must serve ``final`` by (monotonic seconds)."""
    serve_timeout_s: float = 0.0
    deadline: float = float("inf")
    """When the whole run gives up (monotonic seconds)."""
    timeout_s: float = 0.0
    holdup: str = ""
    """Which trainer holds a stuck network up ("" when it moves)."""


@dataclass(frozen=True, slots=True)
class End:
    """How a run ended: the exit code (0 done, 1 failed, 130 stopped) and why."""

    code: int
    reason: str


def end_of_run(view: RunView, now: float) -> End | None:
    """The run is over (and how), or None while it goes on. First what fails a run whatever the
    versions say (a crash loop, a stop, the injector), then the versions, then the clock."""
    if view.failure:
        return End(1, view.failure)
    if view.stopped:
        return End(130, view.stop_reason)
    if view.injector_error:
        return End(1, f"chaos failed: {view.injector_error}")
    if view.final is not None:
        behind = [name for name, version in view.serving if version < view.final]
        if not behind:
            return End(0, f"done: every node at v{view.final}")
        if view.serve_deadline is not None and now > view.serve_deadline:
            return End(1, f"{', '.join(behind)} did not serve v{view.final} within {view.serve_timeout_s:g} s")
    if now > view.deadline:
        return End(1, f"timed out after {view.timeout_s:g} s" + (f"; stuck: {view.holdup}" if view.holdup else ""))
    return None


def _v(x: int | None) -> str:
    return "-" if x is None else str(x)


class Journal:
    """``supervisor.jsonl``: one JSON line per supervision event, appended and flushed as it happens."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = {"at": time.time(), "kind": kind, **fields}
        self.records.append(record)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The records of a ``supervisor.jsonl`` (a torn last line is skipped)."""
    return [r for r in read_jsonl(path) if isinstance(r, dict)]


class EventTail:
    """A node's ``events.jsonl``, read from where the last read stopped (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[VersionEvent] = []
        self._offset = 0

    def read(self) -> list[VersionEvent]:
        """The events appended since the last call (also added to ``events``)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next read
        self._offset += end
        new = []
        for line in data[:end].splitlines():
            try:
                new.append(VersionEvent.from_dict(json.loads(line)))
            except (ValueError, TypeError):
                continue  # a line torn by a kill mid-write, then continued by the next life
        self.events += new
        return new

    def last(self, *kinds: str) -> VersionEvent | None:
        return next((e for e in reversed(self.events) if not kinds or e.kind in kinds), None)
