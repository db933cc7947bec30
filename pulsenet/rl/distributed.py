"""Scale inside a site: data-parallel inner steps over ``torch.distributed``, one rank speaking for the site.

A trainer site with N GPUs is launched with ``torchrun --nproc-per-node N``. Every rank holds the
whole model (FP32 master weights, AdamW state) and steps on its share of each batch; the
gradients are summed across the ranks before every optimizer step, so all ranks take the same
step and hold the same weights without ever comparing them. Rank 0 is the site's voice: it wraps
the ranks in a :class:`SiteInner` (an ``InnerLoop``) and runs the PULSELoCo round
(``LocoTrainer``) and PULSESync publishing exactly as a single-process trainer would; ranks > 0
run :func:`serve_rank` and only do what rank 0 tells them over the process group::

    ("train", H)      H data-parallel steps (rank 0 takes them too, in SiteInner.train)
    ("load",)         the new global FP32 weights follow, one broadcast per tensor in name order
    ("restore", s)    optimizer / RNG / step state s (a resume point), so every rank continues alike
    ("stop",)         leave serve_rank

Commands go out with ``broadcast_object_list`` (small pickles from rank 0, which the other ranks
trust: they are one job); weights with ``broadcast`` of the tensors themselves.

The step (:func:`data_parallel_step`). The batch of a step is a function of the step counter
(``batch_of(step)``), so every rank builds the same whole batch and keeps rows ``rank::world``.
Each rank's loss is the *sum* of its rows' token losses divided by the valid-token count of the
whole batch, so the sum of the ranks' gradients is the gradient of the whole batch's mean loss
(a plain per-rank mean followed by an average would weight tokens unevenly when the ranks' rows
hold different numbers of answer tokens). Gradients are summed with one ``all_reduce(SUM)`` per
parameter, in parameter order.

Bit-exactness. FP32 addition is not associative, so the distributed step cannot equal a plain
``LocalTrainer.step`` on the whole batch to the bit. It equals, to the bit, the single-process
*reference* that computes the same per-rank losses in rank order and lets autograd accumulate
their gradients (``SiteInner(..., reference_world=2)``, :func:`reference_step`): with 2 ranks the
all-reduce is a single FP32 addition ``g0 + g1``, which is commutative, so every rank gets exactly
the accumulated ``g0 + g1`` of the reference. With more than 2 ranks the ranks still agree with
each other (an all-reduce hands every rank the same bits), but the backend's reduction order
(gloo's ring, NCCL's trees) need not be the reference's left-to-right one.

Why not FSDP2 (``torch.distributed.fsdp.fully_shard``). It is in this torch build and runs on CPU
with gloo (probed: a 2-rank ``fully_shard`` of the tiny Qwen2 per decoder layer and root, forward,
backward and AdamW step all work), but it does not fit the site's contract:

1. ``InnerLoop.parameters()`` hands the round the live full FP32 parameters to read in place, from
   the event loop, and ``state_fp32`` / ``load_state_fp32`` move the whole state every round.
   Under FSDP2 the parameters are DTensor shards: each of those calls becomes an all-gather or a
   scatter that every rank must join, i.e. more commands, on the event loop's thread too.
2. The ``bf16-weights`` forward runs the model through ``functional_call`` with BF16-rounded copies
   of the master parameters, which bypasses the unshard hooks FSDP2 puts on the modules; FSDP2's
   own ``MixedPrecisionPolicy(param_dtype=bfloat16)`` is the ``autocast-bf16`` mode, not this one.
3. Its reduce-scatter divides by the world size, and clipping sums shard norms, in orders of its
   own: the replicated step here can be checked against a single process to the bit.

For models whose weights, gradients and AdamW state fit on one GPU (16 bytes a parameter: a 1.5B
model on an 80 GB card) replication is the simpler exact choice; sharding with FSDP2 is the next
step for larger ones (gather the full state on rank 0 once per round for the exchange). The
collectives here are the ones DDP runs (DDP adds gradient bucketing and overlaps the all-reduce
with the backward: worth adding on GPUs, unneeded for the tiny model).

Backends: ``nccl`` on GPUs (tensors on the rank's device), ``gloo`` on CPU (what the tests run).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pulsenet.rl.inner import LocalInner, _restore
from pulsenet.rl.local import LocalTrainer
from pulsenet.rl.tasks import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]
BatchOf = Callable[[int], Batch]
"""``batch_of(step) -> (input_ids, labels)``: the whole batch of a step, the same on every rank."""


def task_batches(task: Any, batch_size: int, seq_len: int) -> BatchOf:
    """The supervised data stream of ``SupervisedInner``: ``task.batch`` at the step counter."""
    return lambda step: task.batch(batch_size, seq_len, step=step)


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens the causal LM loss counts in a batch (the shifted labels that are not ignored)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def shard_loss(local: LocalTrainer, batch: Batch, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the whole batch's mean loss: its rows' token-loss sum / the batch's count."""
    input_ids, labels = batch
    count = max(valid_tokens(labels), 1)
    ids, lab = input_ids[rank::world], labels[rank::world]
    logits = local.logits(ids)[:, :-1, :].float()
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        lab[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / count


def data_parallel_step(local: LocalTrainer, batch: Batch, group: dist.ProcessGroup | None = None) -> float:
    """One optimizer step on this rank's rows of ``batch``, gradients summed over ``group``; the
    whole batch's loss (the same float on every rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local.model.train()
    local.optimizer.zero_grad(set_to_none=True)
    loss = shard_loss(local, batch, rank, world)
    loss.backward()
    for p in local.model.parameters():  # the same order on every rank: the calls pair up
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    local.apply_gradients()
    return float(total)


def reference_step(local: LocalTrainer, batch: Batch, world: int) -> float:
    """The single-process step a ``world``-rank :func:`data_parallel_step` equals (to the bit with 2
    ranks): every rank's loss in rank order, gradients accumulated by autograd."""
    local.model.train()
    local.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for rank in range(world):
        loss = shard_loss(local, batch, rank, world)
        loss.backward()
        total = total + loss.detach()
    local.apply_gradients()
    return float(total)


class SiteInner(LocalInner):
    """The site's ``InnerLoop`` on rank 0: every call that changes the model runs on all ranks.

    On construction rank 0's weights go to every rank, so the site starts from one θ whatever the
    other ranks loaded. ``reference_world=W`` makes the single-process reference instead: the same
    steps as a W-rank site (:func:`reference_step`), no process group. Call :meth:`stop` when done,
    so that the other ranks leave :func:`serve_rank`.
    """

    def __init__(
        self,
        local: LocalTrainer,
        batch_of: BatchOf,
        *,
        group: dist.ProcessGroup | None = None,
        reference_world: int | None = None,
    ) -> None:
        self.local, self.batch_of, self.group = local, batch_of, group
        self.reference_world = reference_world
        if reference_world is None:
            if dist.get_rank(group) != 0:
                raise ValueError("SiteInner runs on rank 0; the other ranks run serve_rank")
            self._command("load")
            _broadcast_weights(local, group)

    def _command(self, *cmd: Any) -> None:
        if self.reference_world is None:
            dist.broadcast_object_list([cmd], src=0, group=self.group)

    def train(self, steps: int) -> list[float]:
        self._command("train", steps)
        return _train(self.local, self.batch_of, steps, self.group, self.reference_world)

    def load_state_fp32(self, state: Mapping[str, torch.Tensor]) -> None:
        super().load_state_fp32(state)
        if self.reference_world is None:
            self._command("load")
            _broadcast_weights(self.local, self.group)

    def restore(self, state: Mapping[str, Any]) -> None:
        super().restore(state)
        self._command("restore", dict(state))

    def stop(self) -> None:
        self._command("stop")


def serve_rank(local: LocalTrainer, batch_of: BatchOf, group: dist.ProcessGroup | None = None) -> None:
    """Ranks > 0: do what rank 0's :class:`SiteInner` says until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        cmd = box[0]
        if cmd[0] == "train":
            _train(local, batch_of, int(cmd[1]), group, None)
        elif cmd[0] == "load":
            _broadcast_weights(local, group)
        elif cmd[0] == "restore":
            _restore(local, cmd[1])
        elif cmd[0] == "stop":
            return
        else:
            raise ValueError(f"unknown site command {cmd[0]!r}")


def _train(
    local: LocalTrainer,
    batch_of: BatchOf,
    steps: int,
    group: dist.ProcessGroup | None,
    reference_world: int | None,
) -> list[float]:
    losses = []
    for _ in range(steps):
        batch = batch_of(local.steps)
        if reference_world is None:
            losses.append(data_parallel_step(local, batch, group))
        else:
            losses.append(reference_step(local, batch, reference_world))
    local.optimizer.zero_grad(set_to_none=True)  # free the gradients between rounds
    return losses


def _broadcast_weights(local: LocalTrainer, group: dist.ProcessGroup | None) -> None:
    """Rank 0's FP32 master weights to every rank, one tensor at a time in name order."""
    with torch.no_grad():
        for _, p in sorted(local.model.named_parameters()):
            dist.broadcast(p.data, src=0, group=group)
