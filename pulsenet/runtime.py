"""Process-level settings for long-running nodes, applied at the edge (CLI, node start-up)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

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
