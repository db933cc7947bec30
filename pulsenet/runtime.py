"""Process-level settings for long-running nodes, applied at the edge (CLI, node start-up); and the
one way a daemon loop waits.

Waiting (torchft's ``futures.py``: one helper owns the timeout and failure policy):
:func:`wait` sleeps until a stop event is set or a timeout passes and says which; :func:`every` is
the poll loop every daemon runs (a step, then a jittered wait), with the failure policy in one
place: a step's exception goes to the caller's ``on_error`` (log and count; re-raise to end the
loop), ``CancelledError`` is never caught; :func:`unless_stopped` abandons one piece of work at a stop.
:func:`all_of` awaits several things at once and raises the first failure as itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import logging
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_M_MMAP_THRESHOLD = -3


def return_large_buffers_to_os(threshold: int = 1 << 20) -> None:
    """Serve allocations above ``threshold`` with mmap, so freed tensor buffers go back to the OS.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
    which tensor-sized buffers come from per-thread heaps that never shrink: a node that streams
    a checkpoint tensor by tensor in worker threads would creep towards the whole model's size in
    RSS. Fixing the threshold turns that dynamic behaviour off. No-op off glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when its parent thread dies (Linux only).

    SIGKILL rather than SIGTERM: with the parent gone nobody is left to fall back to SIGKILL if the
    child hangs in shutdown. What the children of pulsenet write becomes visible only through a
    final atomic put (a manifest, a rename), so a kill loses work in progress, never exposes half of it.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def spawn_tied(args: Sequence[str], name: str, **popen: Any) -> subprocess.Popen[bytes]:
    """``Popen(args, **popen)`` from a thread that lives exactly as long as the child, which gets
    SIGKILL if this process dies (even by SIGKILL) on Linux.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: forked
    from the caller's thread, the child would die when, say, the executor thread that started it
    retires. The keeper thread waits for the child, so it outlives it. ``start_new_session`` is on:
    a terminal's Ctrl-C reaches only this process, which stops its children in order.
    """
    spawned: list[subprocess.Popen[bytes] | BaseException] = []
    ready = threading.Event()

    def keep() -> None:
        try:
            proc = subprocess.Popen(list(args), start_new_session=True, preexec_fn=die_with_parent(), **popen)
        except BaseException as e:  # handed to the caller's thread below
            spawned.append(e)
            ready.set()
            return
        spawned.append(proc)
        ready.set()
        proc.wait()

    threading.Thread(target=keep, name=f"{name}-keeper", daemon=True).start()
    ready.wait()
    if isinstance(spawned[0], BaseException):
        raise spawned[0]
    return spawned[0]


def signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the process group ``spawn_tied`` made for ``proc`` (only what we started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# --- waiting ------------------------------------------------------------------------------------


async def wait(stop: asyncio.Event, timeout: float, *, wake: asyncio.Event | None = None) -> bool:
    """Wait until ``stop`` is set or ``timeout`` seconds pass (or ``wake`` is set, if given); True
    if ``stop`` is set. A timeout at or below zero only looks."""
    events = [stop] if wake is None else [stop, wake]
    if timeout <= 0:
        await asyncio.sleep(0)  # still a turn of the loop: a poll loop at interval 0 must not spin
    elif not any(e.is_set() for e in events):
        waiters = [asyncio.ensure_future(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
    return stop.is_set()


def jittered(interval: float, jitter: float, rng: random.Random | None = None) -> float:
    """``interval`` scaled by a uniform factor in ``[1 - jitter, 1 + jitter]``, never below zero:
    nodes that start together do not poll the store in lockstep."""
    if not jitter:
        return interval
    return max(interval * (1 + jitter * (2 * (rng or random).random() - 1)), 0.0)


async def every(
    interval: float,
    stop: asyncio.Event,
    step: Callable[[], Awaitable[object]],
    *,
    jitter: float = 0.0,
    timeout: float | None = None,
    on_error: Callable[[Exception], None] | None = None,
    rng: random.Random | None = None,
) -> None:
    """Run ``step()`` now and then every ``interval`` seconds (:func:`jittered` by ``jitter``) until
    ``stop`` is set; each step under ``timeout`` when given (its expiry is a ``TimeoutError``).

    The failure policy of every daemon loop: a step that raises an ``Exception`` is handed to
    ``on_error``, which logs and counts it, and the loop goes on; ``on_error`` re-raises what must
    end the loop. Without ``on_error`` a failure ends it (the step handles its own). Cancellation
    (``CancelledError``, a ``BaseException``) is never caught: a stopping node is never retried.
    """
    while not stop.is_set():
        try:
            if timeout is None:
                await step()
            else:
                async with asyncio.timeout(timeout):
                    await step()
        except Exception as e:  # a daemon task's top level: the one place a step's failure is handled
            if on_error is None:
                raise
            on_error(e)
        if await wait(stop, jittered(interval, jitter, rng)):
            return


async def unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``await work``, or cancel it and return None once ``stop`` is set."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its end, without its CancelledError (ours still reaches us)
    return task.result() if not task.cancelled() else None


async def all_of(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all, in a TaskGroup: the first failure cancels the rest and is raised as itself (not
    an ExceptionGroup), so callers keep catching typed errors and nothing is left running."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_awaited(a)) for a in aws]
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None
    return [t.result() for t in tasks]


async def _awaited(a: Awaitable[T]) -> T:
    return await a


def first_error(eg: BaseExceptionGroup) -> BaseException:
    """What the caller of a TaskGroup should see: the first error in the (nested) group that is not
    a cancellation (the others are logged at debug level); a cancellation when there is no other."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for sub in e.exceptions:
                walk(sub)
        elif not isinstance(e, asyncio.CancelledError):
            leaves.append(e)

    walk(eg)
    for extra in leaves[1:]:
        log.debug("also failed: %s: %s", type(extra).__name__, extra)
    return leaves[0] if leaves else asyncio.CancelledError()


def settled(future: concurrent.futures.Future, timeout: float) -> bool:
    """Wait up to ``timeout`` s for a thread-safe ``future`` (its error raised); False if it is still
    running. A thread waiting on the event loop waits in such slices, so it can notice that its
    caller gave up (the loop may never run the future if it is closing)."""
    try:
        future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        return False
    return True
