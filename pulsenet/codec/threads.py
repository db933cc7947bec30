"""How many threads the codec runs: the caller's share of this node's cores.

Encode, apply and SHA-256 verification are all thread-parallel (numba ``nogil`` kernels, zstd and
hashlib release the GIL), so by default they use every core this process may run on
(``os.sched_getaffinity``: a container's or taskset's cores, not the host's), capped by the
process's thread share where one is set: ``OMP_NUM_THREADS``, which ``pulsenet up`` sets per node
(``--node-threads``), so several nodes on one host do not each take every core.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (``os.cpu_count`` where there is no affinity, e.g. macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def codec_threads(requested: int | None = None) -> int:
    """``requested`` when it is at least 1; otherwise (0 or None) the available cores, capped by
    ``OMP_NUM_THREADS`` when the launcher set one. Read at call time, never at import."""
    if requested is not None and requested >= 1:
        return requested
    cores = available_cores()
    share = os.environ.get("OMP_NUM_THREADS", "").strip()
    if share.isdigit() and int(share) >= 1:
        return min(cores, int(share))
    return cores
