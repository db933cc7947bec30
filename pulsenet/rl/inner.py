"""Inner loops for PULSELoCo (``pulsenet.loco.inner.InnerLoop``): supervised and GRPO.

``SupervisedInner``: a ``LocalTrainer`` stepping on a task's batches (the benchmark and
``pulsenet loco train``); it trains a round itself (``train``). ``GRPOInner``: a ``GRPOTrainer``
stepping on rollout batches its caller hands it one step at a time (the trainer daemon, whose
loop owns the data: ``LocoTrainer.next_round(train)`` with the daemon's inner phase). Both keep
their resume state in the same shape, ``{"optimizer", "rng", "steps"}`` of the underlying
``LocalTrainer``, so resume points and the checkpoints in the store are what they were before the
protocol existed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.rl.grpo import GRPOMetrics, GRPOTrainer
from pulsenet.rl.local import Forward, LocalTrainer
from pulsenet.rl.tasks import ArithmeticTask


@dataclass(kw_only=True)
class SupervisedSettings:
    """The supervised inner loop of a trainer (``pulsenet loco train``, ``pulsenet bench loco``)."""

    model: Literal["tiny", "smollm2"] = "tiny"
    """Model to train: tiny (built from the seed) or smollm2 (SmolLM2-135M)."""
    lr: float | None = None
    """Inner AdamW learning rate (None: 1e-3 tiny, 3e-6 smollm2)."""
    batch: int = 4
    """Rows per inner step."""
    seq: int = 32
    """Tokens per row."""
    forward: Forward = "bf16-weights"
    """Inner forward: bf16-weights (FP32 maths on the BF16-rounded weights, fast on any CPU),
    autocast-bf16 (torch.autocast, for CPUs/GPUs with native BF16), fp32 (sees sub-BF16 updates the
    PULSELoCo gate withholds)."""
    seed: int = 0
    """Run seed: model init (same on every trainer) and data streams."""
    threads: int | None = None
    """Torch threads for this process (None: torch's default)."""


def data_seed(seed: int, trainer_id: str) -> int:
    """Each trainer's own data stream, stable across restarts and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{trainer_id}".encode()).digest()[:4], "little") >> 1


def _checkpoint(local: LocalTrainer) -> dict[str, Any]:
    return {"optimizer": local.optimizer_state(), "rng": local.rng_state(), "steps": local.steps}


def _restore(local: LocalTrainer, state: Mapping[str, Any]) -> None:
    local.load_optimizer_state(state["optimizer"])
    local.load_rng_state(state["rng"])
    local.steps = int(state["steps"])


class LocalInner:
    """What every inner loop over one ``LocalTrainer`` (``self.local``) shares: the weights, the
    live parameters and the resume state; subclasses supply ``train``."""

    local: LocalTrainer

    def state_fp32(self) -> dict[str, torch.Tensor]:
        return self.local.state_fp32()

    def load_state_fp32(self, state: Mapping[str, torch.Tensor]) -> None:
        self.local.load_state_fp32(dict(state))

    def parameters(self) -> Mapping[str, torch.Tensor]:
        if self.local.device.type == "cpu":
            return dict(self.local.model.named_parameters())
        # On an accelerator the round gets a CPU snapshot (it reads numpy views). Taken now, that
        # is what the live view would show: the round calls this only between inner phases, uses
        # the mapping before the next one starts (the encode) or after it finished (the overlap
        # mode's re-base), and never writes it; new weights always go in through load_state_fp32.
        return self.local.state_fp32()

    def checkpoint(self) -> dict[str, Any]:
        return _checkpoint(self.local)

    def restore(self, state: Mapping[str, Any]) -> None:
        _restore(self.local, state)


class SupervisedInner(LocalInner):
    """H ``LocalTrainer.train_step`` on ``task``: batches follow the step counter, so a restored
    trainer resumes its data stream too."""

    def __init__(self, local: LocalTrainer, task: ArithmeticTask) -> None:
        self.local, self.task = local, task

    def train(self, steps: int) -> list[float]:
        losses = [self.local.train_step(self.task) for _ in range(steps)]
        self.local.optimizer.zero_grad(set_to_none=True)  # free the gradients between rounds
        return losses


class GRPOInner(LocalInner):
    """The trainer daemon's handle on its GRPO model: one step at a time, on rows its caller took.

    It does not draw batches: the daemon's loop takes rollouts from its intake and calls ``step``
    for each (in a thread), so a PULSELoCo round's inner phase is the caller's, not a pull through
    a callback. Besides the ``InnerLoop`` surface (weights, resume state) it gives the daemon what
    a version needs: the BF16 weights to publish and a whole-trainer checkpoint (weights too) for
    the lone trainer's resume point. A data-parallel rank group overrides each of these to run on
    every rank (``rl.distributed.GroupGRPOInner``).
    """

    def __init__(self, grpo: GRPOTrainer) -> None:
        self.grpo = grpo
        self.local = grpo.local  # the GRPOTrainer's own, made once with it

    def step(self, batch: Sequence[Rollout]) -> GRPOMetrics:
        """One GRPO step (``GRPOTrainer.step``) on ``batch``."""
        return self.grpo.step(batch)

    def end_phase(self) -> None:
        """Free the gradients: they would otherwise live across a round's exchange."""
        self.grpo.local.optimizer.zero_grad(set_to_none=True)

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The weights the inference nodes serve (what PULSESync publishes)."""
        return self.grpo.bf16_state()

    def full_checkpoint(self) -> dict[str, Any]:
        """``LocalTrainer.checkpoint``: weights, optimizer, RNG and step counter, the live tensors
        (no copy): serialise it before the next step, as ``LocalRounds`` does."""
        return self.grpo.local.checkpoint(snapshot=False)

    def restore_full(self, checkpoint: Mapping[str, Any]) -> None:
        """Put back what ``full_checkpoint`` returned."""
        self.grpo.local.restore(dict(checkpoint))
