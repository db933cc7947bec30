"""Process-level settings for long-running nodes, applied at the edge (CLI, node start-up)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

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
