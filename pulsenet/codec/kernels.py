"""Fused single-pass kernels for the patch codec (numba, nogil: tensors encode in parallel threads).

Every element is touched a fixed small number of times: a histogram pass and a coding pass to
encode, one pass to decode *and* apply. NumPy would need a pass (and a temporary) per zone.

Arithmetic is done on uint64 and masked to the element width ``M``, so one kernel serves every
width. ``S`` is the sign bit of the width. For sign-magnitude floats the codes are differences of
*ordered* bits (see coding.ordered); for integers, plain wrapping differences. Zigzag keeps small
steps in either direction small.
"""

from __future__ import annotations

import numpy as np
from numba import njit

BITMAP, ONES, ZEROS = 0, 1, 2

# decode_pass error codes (0 = ok)
ERR_BITMAP_SHORT, ERR_VALUES_OVERFLOW, ERR_ZERO_DELTA, ERR_RANKS_LEFT, ERR_VALUES_LEFT, ERR_BITMAP_SIZE = range(1, 7)


@njit(nogil=True, cache=True)
def bin_histogram(a, b, magmask, shift, nbins):
    """Per context bin: number of entries and of changed entries (bits differ)."""
    n_bin = np.zeros(nbins, dtype=np.int64)
    k_bin = np.zeros(nbins, dtype=np.int64)
    for i in range(a.size):
        x = np.uint64(a[i])
        c = (x & magmask) >> shift
        n_bin[c] += 1
        if x != np.uint64(b[i]):
            k_bin[c] += 1
    return n_bin, k_bin


@njit(inline="always")
def _flip(x, M, S, top):
    """XOR mask mapping bits to/from value order: S for non-negative, M (all bits) for negative."""
    neg = np.uint64(0) - ((x >> top) & np.uint64(1))
    return S ^ (neg & (M ^ S))


@njit(inline="always")
def _code(x, y, signmag, M, S, top):
    """zigzag(ordered(y) - ordered(x)), branch-free (signs are coin flips)."""
    if signmag:
        x = x ^ _flip(x, M, S, top)
        y = y ^ _flip(y, M, S, top)
    d = (y - x) & M
    return ((d << np.uint64(1)) ^ (np.uint64(0) - (d >> top))) & M


@njit(inline="always")
def _apply(x, code, signmag, M, S, top):
    """Inverse of _code: the new bits from the old bits and the code (code 0 -> x)."""
    d = ((code >> np.uint64(1)) ^ (np.uint64(0) - (code & np.uint64(1)))) & M
    if signmag:
        o = (x ^ _flip(x, M, S, top)) + d
        o &= M
        # inverse map: the sign bit of the ordered value is set for non-negative values
        return o ^ (S ^ ((np.uint64(0) - (((o >> top) & np.uint64(1)) ^ np.uint64(1))) & (M ^ S)))
    return (x + d) & M


@njit(nogil=True, cache=True)
def encode_pass(a, b, magmask, shift, lut, zmode, bm_off, bm_mask, bm_buf, rk_off, rk_buf, val_off, vals, signmag, M, S, top):
    """Write each zone's bitmap bits or listed ranks, and each changed entry's code grouped by zone.

    Branch-free on the data (change flags are coin flips in the zones that matter): every entry
    writes its bit, rank and code; counters advance only where they should. Non-bitmap zones
    write their bits into a scratch byte (``bm_mask`` = 0); every rank/value region has one slot
    of slack at its end for the write that does not count.
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    listed = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    for i in range(a.size):
        x = np.uint64(a[i])
        y = np.uint64(b[i])
        z = lut[(x & magmask) >> shift]
        r = rank[z]
        rank[z] = r + 1
        ch = np.int64(x != y)
        m = zmode[z]
        bm_buf[bm_off[z] + ((r >> 3) & bm_mask[z])] |= np.uint8(ch << (r & 7))
        if m != BITMAP and ch == np.int64(m == ONES):
            rk_buf[rk_off[z] + listed[z]] = r
            listed[z] += 1
        if ch:
            vals[val_off[z] + nval[z]] = _code(x, y, signmag, M, S, top)
            nval[z] += 1
    return rank, listed, nval


@njit(nogil=True, cache=True)
def decode_pass(
    a, out, magmask, shift, lut, zmode, bm_off, bm_len, bm_mask, bm_buf, rk_off, rk_buf, val_off, val_cnt, vals,
    signmag, M, S, top,
):
    """Rebuild ``out`` from base ``a`` in one branch-free pass; returns per-zone (members, ranks
    consumed, values consumed) for the caller to check against the table.

    Never reads outside its buffers whatever the patch says: bitmap bytes and value slots are
    clamped to their zone (every value region ends with a 0 slot, every rank list with a -1
    sentinel that no rank equals). Any disagreement shows in the returned counts.
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    ptr = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    for i in range(a.size):
        x = np.uint64(a[i])
        z = lut[(x & magmask) >> shift]
        r = rank[z]
        rank[z] = r + 1
        bmz = bm_mask[z]  # -1 for bitmap zones, 0 otherwise
        byte = min((r >> 3) & bmz, bm_len[z])
        bit = np.int64(bm_buf[bm_off[z] + byte] >> (r & 7)) & 1
        hit = np.int64(rk_buf[rk_off[z] + ptr[z]] == r)
        ptr[z] += hit
        listed = hit ^ np.int64(zmode[z] == ZEROS)
        ch = (bit & bmz) | (listed & ~bmz)
        k = min(nval[z], val_cnt[z])
        code = np.uint64(vals[val_off[z] + k]) * np.uint64(ch)
        nval[z] += ch
        out[i] = _apply(x, code, signmag, M, S, top)
    return rank, ptr, nval
