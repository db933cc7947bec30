"""BF16 bit views and the compute-visibility gate.

Everything that decides "did this weight change?" works on raw bit patterns, never on float
comparisons: ``-0.0 == 0.0`` and ``nan != nan`` would lie about what the next forward pass sees.
"""

from __future__ import annotations

import numpy as np
import torch

# Integer views of the same width as each floating dtype, for exact bit arithmetic.
_UINT_OF_WIDTH = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bit patterns as a flat unsigned numpy array (a view, no copy when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    width = t.element_size()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.dtype != torch.uint8:
        t = t.view(_TORCH_INT_OF_WIDTH[width])
    return t.numpy().view(_UINT_OF_WIDTH[width])


def from_bits(u: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`bits`: reinterpret unsigned bit patterns as a tensor of ``dtype``."""
    width = u.dtype.itemsize
    if u.size == 0:
        return torch.empty(shape, dtype=dtype)
    if not u.flags.writeable:  # a tensor over a read-only buffer is undefined behaviour in torch
        u = u.copy()
    t = torch.from_numpy(np.ascontiguousarray(u))
    if dtype == torch.uint8:
        return t.reshape(shape)
    if dtype == torch.bool:
        return t.view(torch.bool).reshape(shape)
    return t.view(_TORCH_INT_OF_WIDTH[width]).view(dtype).reshape(shape)


def visible_change(theta: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Boolean mask of entries where applying ``update`` changes the BF16 value the forward pass sees.

    ``bf16(theta - update) != bf16(theta)``, compared as bit patterns so that a sign flip of zero or
    a NaN payload change counts as a change and nothing else does. Both inputs are FP32.
    """
    before = theta.to(torch.bfloat16).view(torch.int16)
    after = (theta - update).to(torch.bfloat16).view(torch.int16)
    return before != after
