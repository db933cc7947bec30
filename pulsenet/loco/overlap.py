"""The one-round-delayed outer step (``overlap``): round r+1's inner phase runs while round r is
collected and applied, then its progress is re-based onto θ_r.

The inner phase of r+1 starts from the local weights θ_local of round r (not from θ_r, which is
not known yet); once θ_r is, the progress it made is moved onto it: ``θ_r + (θ_local' - θ_local)``
(``algorithm.rebase``), and round r+1 publishes that without training again. Nothing is carried
over after a failure or a repair (a repair adopted another θ): round r+1 then trains afresh from θ.

What may run beside the inner thread: collect and apply touch neither the local model nor the
inner optimizer; agree (a repair loads θ into the model) and persist (the resume point reads the
inner optimizer and RNG) wait until the inner phase has landed. docs/loco.md §1 and §10, "Overlap".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager

import torch

from pulsenet.errors import PulsenetError
from pulsenet.loco import algorithm as alg
from pulsenet.loco.inner import InnerLoop

log = logging.getLogger(__name__)

Phase = Callable[[str, int], AbstractAsyncContextManager[object]]
"""``phase(name, round)``: the trainer's phase hook (``LocoTrainer._phase``)."""


class Ahead:
    """Round r+1's inner phase, trained while round r is exchanged (:meth:`start` it)."""

    def __init__(
        self, who: str, r: int, inner: InnerLoop, base: alg.StateDict, task: asyncio.Task[list[float]], phase: Phase
    ) -> None:
        self.who, self.round, self.inner, self.phase = who, r + 1, inner, phase
        self.base = base
        """The local weights round r+1 started from: its progress is measured from them."""
        self.task = task
        self.losses: list[float] | None = None
        """Round r+1's losses once it has :meth:`landed` (None: not yet, or it failed)."""

    @classmethod
    async def start(
        cls, who: str, r: int, inner: InnerLoop, train: Callable[[int], Awaitable[list[float]]], phase: Phase
    ) -> Ahead:
        """Start ``train(r + 1)`` from the local weights now."""
        async with phase("rebase", r + 1):
            base = await asyncio.to_thread(inner.state_fp32)
        return cls(who, r, inner, base, asyncio.create_task(train(r + 1)), phase)

    async def landed(self) -> None:
        """Wait for the inner phase (a failure is logged; :meth:`rebase` then starts afresh)."""
        try:
            self.losses = await self.task
        except (PulsenetError, RuntimeError) as e:
            log.error("%s: round %d's overlapped inner phase failed: %s", self.who, self.round, e)

    async def rebase(self, theta: Mapping[str, torch.Tensor], *, repaired: bool) -> list[float] | None:
        """Move the progress trained ahead onto ``theta`` (θ_r); its losses, carried to round r+1, or
        None when it failed or ``repaired`` (a repair adopted another θ): the local model then starts
        round r+1 afresh from θ."""
        if self.losses is None or repaired:
            async with self.phase("adopt", self.round):
                await asyncio.to_thread(self.inner.load_state_fp32, theta)
            return None
        local = await asyncio.to_thread(self.inner.parameters)
        async with self.phase("rebase", self.round):
            await asyncio.to_thread(lambda: self.inner.load_state_fp32(alg.rebase(local, self.base, theta)))
        return self.losses
