"""FSDP2 for a rank group's trainer: the model's FP32 master weights, gradients and AdamW state sharded
over the rank group's ranks, with the same bits as one process computing every rank's share.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to every block of the model (the
members of its ``nn.ModuleList``: a transformer's decoder layers) and then to the root, so each
rank keeps dim-0 chunk ``rank`` of every parameter (``torch.chunk`` over the ranks, as FSDP2 cuts
them: ``local_chunk``). A forward all-gathers a block's FP32 weights; a backward reduce-scatters
its gradients, *summed* over the ranks (``set_gradient_divide_factor(1)`` with plain SUM
collectives: every rank's loss is already normalised by the whole batch, and gloo has no
pre-multiplied sum); AdamW then steps each rank's chunk, elementwise, as it would the whole tensor.

The ``bf16-weights`` forward (``rl.local``: the forward sees ``fp32(bf16(θ))``, the gradient goes
straight through to θ) is a forward pre-hook on every sharded module that rounds the freshly
gathered full weights in place. The gathered copy is only the forward's (FSDP2 never writes it
back to the shards), so the masters stay FP32; the gradient with respect to the rounded copy is
what the straight-through estimator hands the master. The gathered weights stay up until the
backward is done (``reshard_after_forward=False``: a backward that gathered them again would see
them unrounded), then FSDP2 frees them; ``reshard`` also frees them after an optimizer step or a
load, so no forward ever sees stale weights. FSDP2's own ``MixedPrecisionPolicy(param_dtype=
bfloat16)`` is a different mode (BF16 matmuls and BF16 gradients: ``autocast-bf16`` is closer).

Exactness, checked by tests/integration/test_distributed.py and tests/integration/test_torchrun_trainer.py: with 2 ranks a
reduce-scatter is one FP32 addition per element, ``g0 + g1``, so the sharded step equals the
single-process reference (``rl.parallel.DataParallel(reference_world=2)``) to the bit, the
clipping norm included (``grad_norm``: both sides take the norm chunk by chunk, the way the shards
hold it). With more ranks the reduction order is the backend's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def shard_model(
    model: torch.nn.Module, device: torch.device, *, round_bf16: bool, group: dist.ProcessGroup | None = None
) -> None:
    """FSDP2 on ``model`` in place (its parameters become DTensor shards): per block, then the root.

    ``round_bf16``: the forward sees every weight rounded to BF16 (the ``bf16-weights`` mode).
    Rebuild any optimizer afterwards: the parameters are new objects.
    """
    mesh = DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device.type)
    blocks = [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
    for module in [*blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=False)
        assert isinstance(module, FSDPModule)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        if round_bf16:
            module.register_forward_pre_hook(_round_gathered_weights)


def _round_gathered_weights(module: torch.nn.Module, args: Any) -> None:
    """Runs after FSDP2's own pre-forward hook gathered ``module``'s weights: round them in place.
    Shards (DTensors: blocks not gathered yet) are the masters and stay as they are; rounding a
    block twice changes nothing."""
    with torch.no_grad():
        for p in module.parameters():
            if not isinstance(p, DTensor):
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered block (after an optimizer step or a load: the next forward gathers anew)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """False: the next backward keeps its gradients on the rank (a micro-batch that is not the last)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync, recurse=True)


def is_shard(t: Any) -> bool:
    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a shard is all-gathered (a collective: every rank must call it alike)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of a shard (a view: writes go to the shard); a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def chunk_of(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Dim-0 chunk ``rank`` of ``world`` as FSDP2 cuts it (``torch.chunk``; empty past the end)."""
    chunks = torch.chunk(t, world, dim=0)
    return chunks[rank] if rank < len(chunks) else t[:0]


def local_chunk(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of ``whole`` where ``like`` is a shard; ``whole`` itself otherwise."""
    if not isinstance(like, DTensor):
        return whole
    mesh = like.device_mesh
    return chunk_of(whole, mesh.get_local_rank(), mesh.size())


def as_shard(whole: torch.Tensor, like: DTensor) -> DTensor:
    """``whole`` cut like ``like`` (this rank's chunk, no communication: every rank holds ``whole``)."""
    part = local_chunk(whole, like).to(like.device).contiguous()
    return DTensor.from_local(part, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def cut_like(value: Any, param: torch.Tensor) -> Any:
    """An optimizer moment of ``param``'s shape, given whole, cut like ``param`` when it is a shard;
    anything else (AdamW's step count) as it is."""
    if isinstance(param, DTensor) and torch.is_tensor(value) and value.shape == param.shape:
        return as_shard(value, param)
    return value


def chunk_norms(grads: Sequence[torch.Tensor | None], world: int, rank: int | None = None) -> torch.Tensor:
    """``[world, len(grads)]`` 2-norms of every rank's chunk of every gradient.

    ``rank`` given: a rank group rank, whose ``grads`` are its shards; the other rows come from the other
    ranks (``all_gather``). ``rank`` None: one process holding the whole gradients (the reference)
    cuts them itself. Either way every rank ends with the same matrix, to the bit."""
    def norm(g: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32) if g is None else torch.linalg.vector_norm(g.float()).cpu()

    if rank is None:
        return torch.stack(
            [torch.stack([norm(None if g is None else chunk_of(g, r, world)) for g in grads]) for r in range(world)]
        )
    mine = torch.stack([norm(None if g is None else local(g)) for g in grads])
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def clip_to_norm(grads: Sequence[torch.Tensor | None], norms: torch.Tensor, max_norm: float) -> float:
    """Scale the gradients so their global 2-norm is at most ``max_norm`` (``clip_grad_norm_``'s
    rule) with the norm taken from ``chunk_norms``; the norm before clipping."""
    total = torch.linalg.vector_norm(torch.linalg.vector_norm(norms, dim=0))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        if g is not None:
            part = local(g)
            part.mul_(coef.to(part.device))
    return float(total)
