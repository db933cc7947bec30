"""An asyncio token bucket in Mbit/s, to emulate a commodity link in tests and benchmarks.

Callers charge the bytes they move (before sending, after receiving). A charge larger than the bucket
is allowed: the balance goes negative and the caller sleeps until it is paid back, so the long-run
rate is capped at ``mbps`` whatever the request sizes. Waiters are served in FIFO order (one lock),
as packets on one link would be. Stores keep one bucket per direction (a full-duplex link).
"""

from __future__ import annotations

import asyncio
import time


class RateLimiter:
    """Caps the average throughput of everything charged to it at ``mbps`` megabits per second."""

    def __init__(self, mbps: float, *, burst_s: float = 0.05) -> None:
        if not mbps > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {mbps}")
        self.mbps = mbps
        self.bytes_per_s = mbps * 1e6 / 8
        # A small burst keeps tiny requests (HEAD, manifests) from paying a full sleep each, without
        # letting a large transfer start faster than the link.
        self.capacity = max(self.bytes_per_s * burst_s, 1.0)
        self._tokens = self.capacity
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def acquire(self, nbytes: int) -> None:
        """Charge ``nbytes`` and wait until the link could have carried them."""
        if nbytes <= 0:
            return
        async with self._lock:
            self._refill()
            self._tokens -= nbytes
            if self._tokens >= 0:
                return
            try:
                await asyncio.sleep(-self._tokens / self.bytes_per_s)
            except asyncio.CancelledError:
                # The bytes were never moved: give them back so the link is not under-used afterwards.
                self._refill()
                self._tokens = min(self.capacity, self._tokens + nbytes)
                raise

    def _refill(self) -> None:
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.bytes_per_s)
        self._stamp = now


async def charge(limiter: RateLimiter | None, nbytes: int) -> None:
    """``limiter.acquire`` that is a no-op when no link rate is set."""
    if limiter is not None:
        await limiter.acquire(nbytes)
