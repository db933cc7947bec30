"""Entropy bounds of a change A -> B, to say how close an encoding gets to the limit.

- zeroth order: each tensor's mask as i.i.d. bits at its change rate, plus each changed entry's
  delta code drawn i.i.d. from the tensor's delta histogram;
- conditioned on the base: the same, but rates and delta histograms are taken per context, the
  context being the base value's exponent (its magnitude bits with the mantissa dropped), which
  the receiver knows. This is the bound worth approaching (DESIGN.md, reference numbers).
Both are empirical (plug-in) entropies, in bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pulsenet.codec.bf16 import bits
from pulsenet.codec.coding import ordered, zigzag
from pulsenet.codec.dtypes import SIGN_MAGNITUDE, dtype_name

MANTISSA = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52}


def _h_bits(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1 - p, 1e-300, 1.0)
    return -(p * np.log2(p) + q * np.log2(q))


def _hist_entropy(counts: np.ndarray) -> float:
    """Total bits to code the samples behind a histogram at their empirical distribution."""
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum())


@dataclass(slots=True)
class EntropyBounds:
    zeroth_order_bytes: float
    conditional_bytes: float
    mask_zeroth_bytes: float
    mask_conditional_bytes: float


def entropy_bounds(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> EntropyBounds:
    z_mask = z_val = c_mask = c_val = 0.0
    for name in new:
        if name not in old or old[name].shape != new[name].shape or old[name].dtype != new[name].dtype:
            continue
        a, b = bits(old[name]), bits(new[name])
        changed = np.flatnonzero(a != b)
        n, k = a.size, changed.size
        if k == 0:
            continue
        dt = dtype_name(new[name].dtype)
        delta = zigzag(ordered(b[changed]) - ordered(a[changed])) if dt in SIGN_MAGNITUDE else zigzag(b[changed] - a[changed])
        _, dcounts = np.unique(delta, return_counts=True)
        z_mask += n * float(_h_bits(np.array(k / n)))
        z_val += _hist_entropy(dcounts)
        if dt not in MANTISSA:
            c_mask, c_val = c_mask + n * float(_h_bits(np.array(k / n))), c_val + _hist_entropy(dcounts)
            continue
        mag = a.dtype.type((1 << (8 * a.dtype.itemsize - 1)) - 1)
        ctx_all = ((a & mag) >> MANTISSA[dt]).astype(np.int64)
        n_e = np.bincount(ctx_all)
        ctx = ctx_all[changed]
        k_e = np.bincount(ctx, minlength=n_e.size)
        live = n_e > 0
        c_mask += float((n_e[live] * _h_bits(k_e[live] / n_e[live])).sum())
        # delta entropy per context: histogram of (context, delta) pairs minus the context's own
        pairs = ctx * (1 << 20) + np.minimum(delta.astype(np.int64), (1 << 20) - 1)
        _, pc = np.unique(pairs, return_counts=True)
        c_val += _hist_entropy(pc) - _hist_entropy(k_e)
    return EntropyBounds((z_mask + z_val) / 8, (c_mask + c_val) / 8, z_mask / 8, c_mask / 8)
