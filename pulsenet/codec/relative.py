"""Lossless coding of PULSELoCo values relative to the base weights both sides hold.

A sent value is ``s = e + (θ - θ_local)``: sums and differences of FP32 numbers near θ, so ``s`` is
almost always an exact multiple of ``ulp(θ)``, and the gate sent it only because ``θ - s`` leaves
θ's BF16 rounding cell, so ``|s|`` is at least the distance from θ to that cell's edge in the
direction of the update. Per entry, with ``u = ulp(θ) = 2^(max(E, 1) - 150)`` (E: θ's biased
exponent) and ``k = s / u``::

    toward = sign(s) == sign(θ)             # the update θ - s moves θ toward zero
    T      = threshold(θ, toward)           # fewest ulps that leave the cell that way (>= 1)
    near   = threshold(θ, True) <= threshold(θ, False)   # the nearer edge is toward zero
    code   = ((|k| - T) << 1) | (toward != near)

valid when E < 255, k is an integer and T <= |k| < 2^24. The receiver knows θ, so it recomputes
both thresholds, the direction from the low bit and rebuilds ``s = ±(q + T)·u`` exactly. The low
bit says "the update crossed the farther edge", which is rare when one edge is much nearer: cheaper
than the sign itself. Any entry that does not round-trip bit for bit through this (±0,
non-finite, non-multiples, huge, below the threshold) is an *escape* and travels as raw FP32
bits. T need not be tight for correctness, only deterministic: both sides compute it from θ's
bits alone, with integer arithmetic.
"""

from __future__ import annotations

import numpy as np

from pulsenet.codec import relative_kernels as kernels
from pulsenet.errors import PayloadError

N_CONTEXTS = 256 + 17
"""Contexts of the position coding: ``max(E, 1) + bitlen(distance to the cell edge)``, E < 256."""


def context(base_bits: np.ndarray) -> np.ndarray:
    """Per entry, how likely an update is to cross θ's BF16 cell edge, as a small integer (uint16).

    ``max(E, 1) + bitlen(|(a & 0xFFFF) - 0x8000|)``: the binary logarithm, up to a constant, of the
    absolute distance from θ to the nearest edge of its BF16 rounding cell (the low 16 bits of the
    pattern place θ in the cell; 0x8000 is the edge). An update of a given size crosses near edges
    far more often than far ones, so the sent mask coded per context costs about half as much.
    Only needs to be deterministic, not exact (it ignores ties and binade edges).
    """
    return kernels.contexts(np.ascontiguousarray(base_bits, dtype=np.uint32).reshape(-1))


def threshold(a: np.ndarray, toward: np.ndarray) -> np.ndarray:
    """T per entry: a lower bound on ``|k|`` for ``θ - s`` to leave θ's BF16 cell (int64, >= 1).

    ``a``: θ's magnitude bit pattern (int64, sign cleared); ``toward``: whether the update moves θ
    toward zero.
    """
    t_toward, t_away = thresholds(a)
    return np.where(toward, t_toward, t_away)


def thresholds(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(T toward zero, T away from zero)`` per entry, each >= 1 (kernels._thresholds).

    The cell of ``r = bf16(|θ|)`` (round to nearest even) spans the magnitude patterns ``[lo, hi]``
    around ``b = r << 16`` (±0x8000 if r is even, else ±0x7FFF). Within one exponent (or across
    the subnormal/E=1 edge, which share u) patterns are u apart; leaving the binade toward zero
    halves the spacing (exact there), away from zero doubles it (rounded: one less).
    """
    a = np.asarray(a, dtype=np.int64)
    t_toward, t_away = kernels.thresholds(np.ascontiguousarray(a).reshape(-1))
    return t_toward.reshape(a.shape), t_away.reshape(a.shape)


def encode(base_bits: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, escaped)``: uint32 codes of the entries that round-trip exactly, and the escape mask.

    ``base_bits``: θ's FP32 bit patterns at the sent positions (uint32); ``values``: s (float32).
    Every code is checked by decoding it, so the escape mask is right whatever the inputs.
    """
    base = np.ascontiguousarray(base_bits, dtype=np.uint32).reshape(-1)
    return kernels.relative_codes(base, np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32))


def decode(base_bits: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The float32 values ``codes`` stand for against θ's bits; ``PayloadError`` if a code is impossible."""
    out = np.empty(codes.size, dtype=np.uint32)
    base = np.ascontiguousarray(base_bits, dtype=np.uint32).reshape(-1)
    err, i = kernels.relative_values(base, np.ascontiguousarray(codes).reshape(-1), out)
    if err == kernels.NONFINITE_BASE:
        raise PayloadError("a coded value sits on a non-finite base weight")
    if err == kernels.K_TOO_LARGE:
        raise PayloadError(f"a coded value has |k| >= 2^24 (entry {i})")
    return out.view(np.float32)
