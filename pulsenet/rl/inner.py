"""Inner loops for PULSELoCo (``pulsenet.loco.inner.InnerLoop``): supervised and GRPO.

``SupervisedInner``: a ``LocalTrainer`` stepping on a task's batches (the benchmark and
``pulsenet loco train``). ``GRPOInner``: a ``GRPOTrainer`` stepping on rollout batches that its
caller supplies (the trainer node). Both keep their resume state in the same shape,
``{"optimizer", "rng", "steps"}`` of the underlying ``LocalTrainer``, so resume points and the
checkpoints in the store are what they were before the protocol existed.

Feeding a ``GRPOInner``::

    batches: queue.Queue[Sequence[Rollout] | None] = queue.Queue()
    inner = GRPOInner(GRPOTrainer(model, cfg), next_batch=batches.get)
    trainer = LocoTrainer(tid, store, key, keys, inner, loco_config)
    ...  # the intake task: batches.put(verified_rollouts); batches.put(None) to end the round early

``next_batch`` is called in the round's worker thread, once per inner step, and may block there
until a batch is ready (a ``queue.Queue.get`` does). Returning ``None`` ends the inner phase: the
round publishes the progress of the steps already taken (none is fine: an empty update).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.rl.grpo import GRPOMetrics, GRPOTrainer
from pulsenet.rl.local import LocalTrainer
from pulsenet.rl.tasks import ArithmeticTask


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
    """H GRPO steps (``GRPOTrainer.step``, one rollout batch each) on batches from ``next_batch``.

    ``next_batch() -> Sequence[Rollout] | None`` runs in the round's worker thread and may block;
    ``None`` ends the inner phase early (see the module docstring). ``metrics`` holds the last
    inner phase's per-step ``GRPOMetrics`` (reward, KL, clipping) for the caller's status.
    Each step's "loss" reported to the round is ``GRPOMetrics.loss``.
    """

    def __init__(self, grpo: GRPOTrainer, next_batch: Callable[[], Sequence[Rollout] | None]) -> None:
        self.grpo, self.next_batch = grpo, next_batch
        self.metrics: list[GRPOMetrics] = []

    @property
    def local(self) -> LocalTrainer:  # type: ignore[override]
        return self.grpo.local

    def train(self, steps: int) -> list[float]:
        metrics: list[GRPOMetrics] = []
        for _ in range(steps):
            batch = self.next_batch()
            if batch is None:
                break
            metrics.append(self._step(batch))
        self.grpo.local.optimizer.zero_grad(set_to_none=True)
        self.metrics = metrics
        return [m.loss for m in metrics]

    def _step(self, batch: Sequence[Rollout]) -> GRPOMetrics:
        """One GRPO step (a data-parallel site sends it to every rank: ``rl.distributed``)."""
        return self.grpo.step(batch)
