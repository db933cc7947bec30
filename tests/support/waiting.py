"""Waiting in tests: one way to wait for what a test asserts, never for a fixed time.

``wait_until`` (async: nodes, stores, subscribers in the test's own loop) and ``wait_for_process``
(sync: a ``pulsenet`` command in a child process) share one rule: wait for the condition the test
then asserts, fail with what was awaited once ``timeout`` s pass without it, and fail at once when
the thing doing the work (a task, a process) ends first. With ``progress`` (what the awaited work
has done so far: a version, a count of events, the size of the logs) the ``timeout`` s count from
its last change: on a loaded machine work that keeps moving is waited for, and work that stalls
fails as fast as on a quiet one (the test's own timeout bounds the whole).

The nodes expose what they did as counters and records, not as events a test could await, so the
condition is polled (every ``poll`` s, 50 ms by default): cheap next to the work it waits for.
"""

from __future__ import annotations

import asyncio
import shlex
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest


class _Deadline:
    """``timeout`` s from now, or from ``progress``'s last change."""

    def __init__(self, timeout: float, progress: Callable[[], object] | None) -> None:
        self.timeout, self.progress = timeout, progress
        self.at = time.monotonic() + timeout
        self.seen = progress() if progress is not None else None

    def passed(self) -> bool:
        if self.progress is not None and (now := self.progress()) != self.seen:
            self.seen, self.at = now, time.monotonic() + self.timeout
        return time.monotonic() > self.at

    def why(self, what: str) -> str:
        moved = "" if self.progress is None else f" (no progress since {self.seen!r})"
        return f"timed out after {self.timeout:g} s waiting for {what}{moved}"


async def wait_until(
    cond: Callable[[], object],
    timeout: float,
    what: str,
    *,
    poll: float = 0.05,
    progress: Callable[[], object] | None = None,
    task: asyncio.Task[Any] | None = None,
) -> None:
    """Until ``cond()`` is true; AssertionError naming ``what`` after ``timeout`` s without it, or as
    soon as ``task`` (the node or download doing the work) ends without it (with what it raised)."""
    deadline = _Deadline(timeout, progress)
    while not cond():
        if task is not None and task.done():
            if cond():  # its last act made it true
                return
            ended = "cancelled" if task.cancelled() else repr(task.exception()) if task.exception() else "returned"
            raise AssertionError(f"the task ended ({ended}) before {what}")
        if deadline.passed():
            raise AssertionError(deadline.why(what))
        await asyncio.sleep(poll)


def wait_for_process(
    cond: Callable[[], object],
    timeout: float,
    what: str,
    proc: subprocess.Popen[str],
    *,
    poll: float = 0.2,
    progress: Callable[[], object] | None = None,
) -> None:
    """``wait_until`` for a child process (blocking): fails with the end of its output when ``proc``
    exits first, or kills it and fails after ``timeout`` s without ``cond()``."""
    deadline = _Deadline(timeout, progress)
    while not cond():
        if proc.poll() is not None:
            if cond():  # its last act made it true
                return
            tail = proc.stdout.read()[-3000:] if proc.stdout is not None else ""
            cmd = shlex.join(map(str, proc.args)) if isinstance(proc.args, list) else str(proc.args)
            pytest.fail(f"`{cmd[:200]}` exited ({proc.returncode}) before {what}:\n{tail}")
        if deadline.passed():
            proc.kill()
            pytest.fail(deadline.why(what))
        time.sleep(poll)
