"""How the shares of a data-parallel GRPO or supervised step are computed and summed: one rank's
share on an FSDP2-sharded model, or every share in rank order in the single-process reference
(the rank group itself: ``rl.distributed``; why the two give the same bits: its docstring)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pulsenet.rl import sharding


class DataParallel:
    """Which shares of a batch this process computes, and how the shares' gradients are summed.

    A rank of a group computes its own share (``shares == (rank,)``) on its FSDP2-sharded model
    (``rl.sharding``), whose backward reduce-scatters the sum of the ranks' gradients. The
    single-process reference (``reference_world=W``) computes all W shares in rank order, keeps
    each share's gradients apart (``share_done``) and adds them up left to right
    (``sum_gradients``), which is what a 2-rank reduce-scatter computes. The step calls
    ``before_backward`` before each backward pass, ``share_done`` after each share's, then
    ``sum_gradients`` once, then the optimizer step with ``chunk_norms`` for the clipping norm.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, reference_world: int | None = None) -> None:
        self.group = group
        self.reference = reference_world is not None
        if reference_world is not None:
            self.world, self.shares = reference_world, tuple(range(reference_world))
        else:
            self.world, self.shares = dist.get_world_size(group), (dist.get_rank(group),)
        self._stash: list[list[torch.Tensor | None]] = []

    def before_backward(self, model: torch.nn.Module, *, last: bool) -> None:
        """A rank group's backward reduce-scatters only on this process's last pass of the step: the
        earlier micro-batches accumulate on the rank first, as the reference accumulates a share."""
        if not self.reference:
            sharding.set_gradient_sync(model, last)

    def share_done(self, model: torch.nn.Module) -> None:
        if self.reference:
            params = list(model.parameters())
            self._stash.append([p.grad for p in params])
            for p in params:
                p.grad = None

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """The reference's ``g0 + g1 + ...``; on a rank group the backward's reduce-scatter did it."""
        if not self.reference:
            return
        for i, p in enumerate(model.parameters()):
            total = None
            for grads in self._stash:
                g = grads[i]
                total = g if total is None else (total if g is None else total + g)
            p.grad = total
        self._stash.clear()

    def chunk_norms(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The clipping norm's parts, the same bits on every rank and in the reference (``rl.sharding``)."""
        return sharding.chunk_norms(grads, self.world, None if self.reference else self.shares[0])

    def sum_metrics(self, values: torch.Tensor) -> torch.Tensor:
        """Per-process sums of a step's statistics, summed over the rank group."""
        return values if self.reference else _all_reduce(values, dist.ReduceOp.SUM, self.group)

    def max_metrics(self, values: torch.Tensor) -> torch.Tensor:
        return values if self.reference else _all_reduce(values, dist.ReduceOp.MAX, self.group)


def _all_reduce(values: torch.Tensor, op: Any, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = values.clone()
    dist.all_reduce(out, op=op, group=group)
    return out
