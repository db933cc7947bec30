"""Kernels of the PULSELoCo payload's relative coding (numba, nogil): positions, one pass over a
tensor each, and values, one entry at a time.

A relative sparse section codes each sent entry's position as its *ordinal* among the tensor's
entries of the same context (relative.context, from the base weights θ), grouped by context. Both
directions walk the tensor once in position order keeping one counter per context, instead of
sorting 134M entries by context as a numpy formulation must: the encoder reads each sent entry's
ordinal off its context's counter; the decoder emits an entry when its context's counter reaches
that context's next listed ordinal, so positions come out already sorted.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

MALFORMED, OUT_OF_RANGE = 1, 2  # positions_from_ordinals' complaints


@njit(inline="always")
def _context(x):
    """relative.context of one FP32 bit pattern (uint32 as int64); bit length by lzcnt, not a table."""
    return max((x >> 23) & 0xFF, 1) + 64 - leading_zeros(abs((x & 0xFFFF) - 0x8000))


@njit(nogil=True, cache=True)
def contexts(base_bits):
    """relative.context of every entry (uint16)."""
    out = np.empty(base_bits.size, dtype=np.uint16)
    for i in range(base_bits.size):
        out[i] = _context(np.int64(base_bits[i]))
    return out


@njit(nogil=True, cache=True)
def context_ordinals(base_bits, indices, n_contexts):
    """Per sent entry (``indices``, strictly increasing): its context and its ordinal among the
    tensor's entries of that context."""
    m = indices.size
    seen = np.zeros(n_contexts, dtype=np.int64)
    ctx, ords = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64)
    j = 0
    nxt = indices[0] if m else -1
    for i in range(base_bits.size):
        c = _context(np.int64(base_bits[i]))
        if i == nxt:
            ctx[j], ords[j] = c, seen[c]
            j += 1
            nxt = indices[j] if j < m else -1
        seen[c] += 1
    return ctx, ords


@njit(nogil=True, cache=True)
def grouped_gap_planes(ctx, ords, n_contexts):
    """The sent entries' ordinals grouped by context (ascending; position order within), each group
    as gaps (``ordinal - previous - 1``) at the narrowest of 1, 2, 4, 8 bytes, in byte planes.
    Returns (contexts, counts, widths) of the groups and their planes, concatenated."""
    m = ctx.size
    count = np.zeros(n_contexts, dtype=np.int64)
    for j in range(m):
        count[ctx[j]] += 1
    start = np.zeros(n_contexts + 1, dtype=np.int64)
    for c in range(n_contexts):
        start[c + 1] = start[c] + count[c]
    fill, gaps = start[:-1].copy(), np.empty(m, dtype=np.int64)
    for j in range(m):
        gaps[fill[ctx[j]]] = ords[j]
        fill[ctx[j]] += 1
    groups = np.flatnonzero(count)
    widths = np.empty(groups.size, dtype=np.int64)
    total = 0
    for g in range(groups.size):
        c = groups[g]
        prev, top = -1, 0
        for t in range(start[c], start[c + 1]):
            o = gaps[t]
            gaps[t] = o - prev - 1
            top = max(top, gaps[t])
            prev = o
        widths[g] = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
        total += widths[g] * count[c]
    planes = np.empty(total, dtype=np.uint8)
    off = 0
    for g in range(groups.size):
        c, w = groups[g], widths[g]
        k = count[c]
        for p in range(w):
            for t in range(k):
                planes[off + p * k + t] = (gaps[start[c] + t] >> (8 * p)) & 0xFF
        off += w * k
    return groups, count[groups], widths, planes


@njit(nogil=True, cache=True)
def positions_from_ordinals(base_bits, n_contexts, contexts, counts, widths, planes):
    """Inverse of :func:`context_ordinals` + :func:`grouped_gap_planes`: the sent positions, sorted.

    ``contexts`` (strictly ascending, < n_contexts), ``counts`` and ``widths`` describe the groups
    and ``planes`` holds exactly their bytes (checked by the caller). Returns (positions, error,
    context): ``MALFORMED`` for a gap past the tensor, ``OUT_OF_RANGE`` for an ordinal at or past
    its context's number of entries; error 0 if none.
    """
    n, m = base_bits.size, counts.sum()
    ords = np.empty(m, dtype=np.int64)
    ptr, end = np.zeros(n_contexts, dtype=np.int64), np.zeros(n_contexts, dtype=np.int64)
    off = t = 0
    for g in range(contexts.size):
        c, k, w = contexts[g], counts[g], widths[g]
        ptr[c], end[c] = t, t + k
        prev = -1
        for q in range(k):
            gap = np.uint64(0)
            for p in range(w):
                gap |= np.uint64(planes[off + p * k + q]) << np.uint64(8 * p)
            if gap >= np.uint64(n):
                return np.empty(0, dtype=np.int64), MALFORMED, c
            prev += np.int64(gap) + 1
            if prev >= n:
                return np.empty(0, dtype=np.int64), MALFORMED, c
            ords[t] = prev
            t += 1
        off += w * k
    want = np.full(n_contexts, -1, dtype=np.int64)  # each context's next listed ordinal
    for c in range(n_contexts):
        if ptr[c] < end[c]:
            want[c] = ords[ptr[c]]
    seen = np.zeros(n_contexts, dtype=np.int64)
    out = np.empty(m, dtype=np.int64)
    j = 0
    for i in range(n):
        c = _context(np.int64(base_bits[i]))
        if seen[c] == want[c]:
            out[j] = i
            j += 1
            ptr[c] += 1
            want[c] = ords[ptr[c]] if ptr[c] < end[c] else -1
        seen[c] += 1
    for c in range(n_contexts):
        if ptr[c] < end[c]:
            return out[:j], OUT_OF_RANGE, c
    return out, 0, -1


# --------------------------------------------------------------------------- relative value codes
# relative.py documents the code; these are its per-entry kernels, in exact integer arithmetic.

NONFINITE_BASE, K_TOO_LARGE = 1, 2  # relative_values' complaints
_MANT, _K_LIMIT = 0x7FFFFF, 1 << 24


@njit(inline="always")
def _thresholds(a):
    """(T toward zero, T away from zero) for θ's magnitude pattern ``a`` (relative.thresholds)."""
    e = a >> 23
    r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    half = 0x7FFF if r & 1 else 0x8000
    mant = a & _MANT
    down, up = (r << 16) - half - 1, (r << 16) + half + 1  # nearest magnitude patterns outside the cell
    if down < 0:
        t_down = 1
    elif (down >> 23 == e) or (e <= 1 and down >> 23 <= 1):
        t_down = a - down
    else:
        t_down = mant + ((e << 23) - down + 1) // 2
    if (up >> 23 == e) or (e <= 1 and up >> 23 <= 1):
        t_up = up - a
    else:
        t_up = (0x800000 - mant) + 2 * (up - ((e + 1) << 23)) - 1
    return max(t_down, 1), max(t_up, 1)


@njit(inline="always")
def _k_sign(a, sign_t, code):
    """(|k|, sign of s) that ``code`` stands for against θ (magnitude ``a``, sign ``sign_t``)."""
    t_toward, t_away = _thresholds(a)
    toward = (code & 1) != (t_toward <= t_away)
    return (code >> 1) + (t_toward if toward else t_away), sign_t if toward else 1 - sign_t


@njit(inline="always")
def _value_bits(a, k, sign):
    """FP32 bits of sign·k·ulp(θ), exact for 1 <= k < 2^24 and a finite θ (magnitude ``a``):
    k·ulp(θ) then fits FP32's 24-bit significand and its range."""
    q = max(a >> 23, 1) - 150  # ulp(θ) = 2^q
    b = 64 - leading_zeros(np.int64(k))  # bit length of k
    biased = q + b - 1 + 127
    if biased >= 1:
        mag = (biased << 23) | ((k << (24 - b)) & _MANT)
    else:  # subnormal: k·2^q counted in 2^-149
        mag = k << (q + 149)
    return mag | (sign << 31)


@njit(nogil=True, cache=True)
def relative_codes(base_bits, value_bits):
    """relative.encode on bit patterns: (codes of the entries that round-trip, escaped mask)."""
    m = base_bits.size
    codes, escaped = np.empty(m, dtype=np.uint32), np.ones(m, dtype=np.bool_)
    nc = 0
    for i in range(m):
        tb, sb = np.int64(base_bits[i]), np.int64(value_bits[i])
        a, sign_t = tb & 0x7FFFFFFF, tb >> 31
        e, es, ms = a >> 23, (sb >> 23) & 0xFF, sb & _MANT
        if e == 255 or es == 255:
            continue
        sig = ms if es == 0 else ms | 0x800000  # |s| = sig * 2^(max(es, 1) - 150)
        shift = max(es, 1) - max(e, 1)  # k = |s| / ulp(θ) = sig * 2^shift
        if shift >= 0:
            if shift >= 24 or sig >= 1 << (24 - shift):
                continue
            k = sig << shift
        else:
            if -shift > 24 or sig & ((1 << -shift) - 1):
                continue  # not a whole number of ulps
            k = sig >> -shift
        t_toward, t_away = _thresholds(a)
        toward = (sb >> 31) == sign_t
        t = t_toward if toward else t_away
        if k < t:
            continue
        code = ((k - t) << 1) | np.int64(toward != (t_toward <= t_away))
        k_back, sign = _k_sign(a, sign_t, code)
        if _value_bits(a, k_back, sign) != sb:  # never expected: every code is checked anyway
            continue
        codes[nc] = code
        nc += 1
        escaped[i] = False
    return codes[:nc], escaped


@njit(nogil=True, cache=True)
def relative_values(base_bits, codes, out_bits):
    """relative.decode on bit patterns, into ``out_bits``; returns (error, entry): ``NONFINITE_BASE``
    for a code on a non-finite θ, ``K_TOO_LARGE`` for |k| >= 2^24; error 0 if none."""
    for i in range(codes.size):
        tb = np.int64(base_bits[i])
        a = tb & 0x7FFFFFFF
        if a >> 23 == 255:
            return NONFINITE_BASE, i
        k, sign = _k_sign(a, tb >> 31, np.int64(codes[i]))
        if k >= _K_LIMIT:
            return K_TOO_LARGE, i
        out_bits[i] = _value_bits(a, k, sign)
    return 0, -1


@njit(nogil=True, cache=True)
def thresholds(a):
    """:func:`_thresholds` of every magnitude pattern in ``a`` (int64): (toward zero, away)."""
    t_toward, t_away = np.empty(a.size, dtype=np.int64), np.empty(a.size, dtype=np.int64)
    for i in range(a.size):
        t_toward[i], t_away[i] = _thresholds(a[i])
    return t_toward, t_away
