"""Benchmark machinery around PULSELoCo trainers sharing one process: cores, timing, decoded payloads.

The round knows nothing of it: it enters ``on_phase(name, round)`` around each phase's work
(``pulsenet.loco.trainer``), and :class:`SharedCores` implements that hook for N in-process
trainers. Compute phases take turns on the cores (one at a time, as N machines would each have
their own), and every phase's time is recorded per (trainer, round, phase) without the turns
waited for, which are recorded apart as ``queued``. The overlapped inner phase is tagged with the
round it trains for, so its time and its queueing land on that round, wherever they ran.

:class:`SharedPayloads` gives the trainers one decoded copy of each payload (a 135M-parameter
dense DiLoCo payload decodes to 540 MB; four trainers each holding four would not fit), and
:func:`ddp_bytes` is the DDP baseline's accounting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator

from pulsenet.codec.payload import Payload
from pulsenet.loco.algorithm import FP32_BYTES
from pulsenet.loco.trainer import PhaseHook
from pulsenet.signed import ObjectRef
from pulsenet.store.base import ObjectStore

COMPUTE = frozenset({"inner", "encode", "apply", "persist", "rebase", "adopt", "replay"})
"""Phases that run CPU work and take turns on the cores; the others (upload, collect, agree) wait on I/O."""


class SharedCores:
    """``on_phase`` hooks for trainers sharing this process's cores: turn-taking and phase clocks."""

    def __init__(self) -> None:
        self.turn = asyncio.Semaphore(1)
        self.seconds: dict[tuple[str, int, str], float] = collections.defaultdict(float)
        """(trainer, round, phase) -> seconds of work (turns waited excluded)."""
        self.queued: dict[tuple[str, int], float] = collections.defaultdict(float)
        """(trainer, round) -> seconds waited for a turn on the cores."""

    def hook(self, trainer: str) -> PhaseHook:
        @contextlib.asynccontextmanager
        async def phase(name: str, r: int) -> AsyncIterator[None]:
            async with contextlib.AsyncExitStack() as stack:
                if name in COMPUTE:
                    t = time.perf_counter()
                    await stack.enter_async_context(self.turn)
                    self.queued[(trainer, r)] += time.perf_counter() - t
                t = time.perf_counter()
                try:
                    yield
                finally:
                    self.seconds[(trainer, r, name)] += time.perf_counter() - t

        return phase

    def phase_s(self, trainer: str, r: int, name: str) -> float:
        return self.seconds.get((trainer, r, name), 0.0)

    def round_s(self, trainer: str, r: int) -> dict[str, float]:
        """The benchmark's per-round phase figures: ``wait`` is collecting less our own upload (it
        runs meanwhile), ``verify`` is agreeing plus persisting."""
        s = lambda name: self.phase_s(trainer, r, name)  # noqa: E731
        return {
            "inner": s("inner"),
            "encode": s("encode"),
            "upload": s("upload"),
            "wait": max(s("collect") - s("upload"), 0.0),
            "apply": s("apply"),
            "verify": s("agree") + s("persist"),
            "queued": self.queued.get((trainer, r), 0.0),
        }


class SharedPayloads:
    """One decoded copy of each payload for all trainers of this process (``loco.collect.DecodedPayloads``).

    ``view(store)`` is what one trainer gets. With ``shares_downloads=False`` (each trainer on its
    own emulated link) a hit still downloads the bytes through that trainer's store, so every link
    carries what it would alone, and only the decoding is shared.
    """

    def __init__(self, *, shares_downloads: bool = True) -> None:
        self.shares_downloads = shares_downloads
        self._items: dict[tuple[str, str], Payload] = {}

    def view(self, store: ObjectStore) -> _View:
        return _View(self, store)


class _View:
    def __init__(self, shared: SharedPayloads, store: ObjectStore) -> None:
        self.shared, self.store = shared, store

    async def get(self, ref: ObjectRef, base_digest: str) -> Payload | None:
        payload = self.shared._items.get((ref.sha256, base_digest))
        if payload is not None and not self.shared.shares_downloads:
            await self.store.get(ref.key, max_bytes=ref.size)  # the bytes still cross this trainer's link
        return payload

    def put(self, ref: ObjectRef, base_digest: str, payload: Payload) -> None:
        self.shared._items[(ref.sha256, base_digest)] = payload

    def evict_before(self, round_: int) -> None:
        items = self.shared._items
        for key in [k for k, p in items.items() if p.round < round_]:
            del items[key]


def ddp_bytes(num_params: int, inner_steps: int) -> int:
    """What DDP would send per worker over the same H steps: one dense FP32 gradient per step."""
    return inner_steps * FP32_BYTES * num_params
