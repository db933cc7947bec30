"""The inner loop a PULSELoCo round drives: the handful of methods the round needs, nothing more.

A round (``trainer.py``) asks its inner loop to

- hand over / take the FP32 master weights (``state_fp32`` / ``load_state_fp32``),
- show its live named parameters (``parameters``), which the pseudo-gradient and the overlap
  mode's re-base read in place without a copy (a CPU snapshot when they live on a GPU),
- snapshot and restore what a restart needs to continue bit-identically: optimizer, RNG and
  step counter (``checkpoint`` / ``restore``), stored in the trainer's resume point,

and, when its caller does not drive the inner phase itself (``LocoTrainer.run``), to run H
optimizer steps from the weights it holds (``SelfTraining.train``).

What the steps train on is the inner loop's business, or its caller's: the supervised adapter
draws its batches from a task, the GRPO adapter steps on the rollouts the trainer daemon took
(both in ``pulsenet.rl.inner``). ``loco/`` therefore imports nothing from ``pulsenet.rl``.

Threading: the round calls these from worker threads (``parameters`` from the event loop), one
at a time: never two at once, never anything while an inner phase runs (with ``overlap`` too).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class InnerLoop(Protocol):
    def state_fp32(self) -> dict[str, torch.Tensor]:
        """A copy of the FP32 master weights by parameter name (tied duplicates excluded)."""
        ...

    def load_state_fp32(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state`` into the master weights; optimizer, RNG and step count stay as they are."""
        ...

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """The live FP32 parameters by the same names (read, not copied, by the round), on the CPU.

        Weights on an accelerator or sharded over a site come as a CPU snapshot taken at the call
        (the round calls it in a thread): the round only reads the mapping, and only while no
        inner phase runs, so the snapshot is what it would see."""
        ...

    def checkpoint(self) -> dict[str, Any]:
        """Optimizer, RNG and step state, ``torch.save``-able with ``weights_only=True``: a deep copy
        taken now (later steps mutate the live state)."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Put back what ``checkpoint`` returned; raise (KeyError, TypeError, ValueError, RuntimeError)
        when it does not fit this model."""
        ...


@runtime_checkable
class SelfTraining(InnerLoop, Protocol):
    """An inner loop that trains a round on its own data (``LocoTrainer.run`` needs one)."""

    def train(self, steps: int) -> list[float]:
        """Up to ``steps`` optimizer steps from the current weights; one loss per step taken.

        Fewer (even none) is allowed: the round publishes whatever progress was made. Free the
        gradients before returning (they would otherwise live across the exchange)."""
        ...
