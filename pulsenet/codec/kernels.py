"""Kernels of the zoned patch coder (numba, nogil: tensors encode in parallel threads).

The change mask is coded per *zone* in the zone's own rank space (codec/mask.py), so every member
of every zone with changes must be counted. What keeps that cheap:

- Zones without changes (at RL learning rates: the large-magnitude bulk of every tensor) are not
  visited at all.
- Membership is tested a 64-bit word at a time (SWAR: four BF16 entries, one add per bound sets
  each lane's top bit), so entries outside the coded zones cost a fraction of a nanosecond.
- "ones" zones (a few changes among many members) are counted with one popcount per word.
- Bitmap and "zeros" zones (most members matter) are handled chunk by chunk: the chunk's members
  are bucketed by zone without data-dependent branches, then each zone is coded with its rank,
  list pointer and value count in registers instead of per-zone counter arrays.

Arithmetic is done on uint64 and masked to the element width ``M``, so one kernel serves every
width. ``S`` is the sign bit of the width. For sign-magnitude floats the codes are differences of
*ordered* bits (see coding.ordered); for integers, plain wrapping differences. Zigzag keeps small
steps in either direction small.
"""

from __future__ import annotations

import sys

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

BITMAP, ONES, ZEROS = 0, 1, 2
CHUNK = 1 << 13  # entries per chunk: the chunk and its per-zone member lists stay in L2


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


ZONE_OVERHEAD_BITS = 96.0  # a zone's entry in the table, compressed


@njit(inline="always")
def _gap_bits(n, k):
    return k * (np.log2(n / max(k, 1.0) + 1.0) + 1.6) + 8.0 if k > 0 else 0.0


@njit(nogil=True, cache=True)
def zone_cost(n, k):
    """Estimated bits of a zone with n members, k of them changed, and its cheapest mode."""
    p = min(max(k / max(n, 1.0), 1e-12), 1 - 1e-12)
    h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    bitmap, ones, zeros = n * max(h, 0.03) * 1.03 + 8.0, _gap_bits(n, k), _gap_bits(n, n - k)
    best, mode = bitmap, BITMAP
    if ones < best:
        best, mode = ones, ONES
    if zeros < best:
        best, mode = zeros, ZEROS
    return best + ZONE_OVERHEAD_BITS, mode


@njit(nogil=True, cache=True)
def zone_dp(N, K, max_zones):
    """Cheapest split of bins into at most ``max_zones`` zones of consecutive bins.

    ``N``/``K``: cumulative members and changes over the bins (leading 0). best[z][j] = cheapest
    cover of the first j bins by z zones. Returns each z's argmin back-pointers, best[z][all bins]
    and the mode of every candidate zone (bins i..j-1 -> mode[i, j]).
    """
    B = N.size - 1
    cost = np.full((B + 1, B + 1), np.inf)
    mode = np.zeros((B + 1, B + 1), dtype=np.int64)
    for j in range(1, B + 1):
        for i in range(j):
            cost[i, j], mode[i, j] = zone_cost(N[j] - N[i], K[j] - K[i])
    best = np.full(B + 1, np.inf)
    best[0] = 0.0
    backs = np.zeros((max_zones, B + 1), dtype=np.int64)
    finals = np.empty(max_zones)
    for z in range(max_zones):
        nxt = np.full(B + 1, np.inf)
        for j in range(B + 1):
            for i in range(j):
                c = best[i] + cost[i, j]
                if c < nxt[j]:
                    nxt[j] = c
                    backs[z, j] = i
        best = nxt
        finals[z] = best[B]
    return backs, finals, mode


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


def packed_words(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, a's leading entries as uint64 words) for the SWAR membership test; ``a`` is copied
    only if its buffer is not 8-byte aligned (numba needs aligned words)."""
    if sys.byteorder != "little":  # lane j of a word must be entry j
        raise NotImplementedError("the zoned patch kernels need a little-endian host")
    lanes = 8 // a.itemsize
    if a.ctypes.data % 8:
        a = a.copy()
    return a, a[: a.size // lanes * lanes].view(np.uint64)


@njit(inline="always")
def _members(word, mags, add_lo, add_hi, signs):
    """Lanes of a packed word whose magnitude is in [lo, hi): their top bit set, others 0.

    Per lane, ``add_lo`` holds ``S - lo``: adding it to a magnitude (< S) sets the lane's top bit
    exactly when magnitude >= lo, and never carries into the next lane. See :func:`_bounds`.
    """
    m = word & mags
    return ((m + add_lo) & ~(m + add_hi)) & signs


@njit(inline="always")
def _bounds(lanes, magmask, lo, hi, S):
    """The per-lane constants of :func:`_members` for zone [lo, hi)."""
    rep = np.uint64(0)
    for j in range(lanes):
        rep |= np.uint64(1) << np.uint64(j * (64 // lanes))
    return magmask * rep, (S - lo) * rep, (S - hi) * rep, S * rep


@intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (one popcnt)."""

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@njit(inline="always")
def _changed_lanes(d, lows, signs):
    """Top bit of every lane of ``d`` that is not zero."""
    return (((d & lows) + lows) | d) & signs


@njit(inline="always")
def _member_buffers(nz):
    """Scratch for :func:`_sort_members`: member words, per-zone member rows (+ the discard row)."""
    return np.empty(CHUNK, dtype=np.int64), np.empty((nz + 1, CHUNK), dtype=np.int32), np.zeros(nz + 1, dtype=np.int64)


@njit(inline="always")
def _sort_members(a, aw, c0, c1, lanes, magmask, shift, lo, hi, S, lut, words, lists, cnt):
    """Bucket the chunk's entries with magnitude in [lo, hi) by zone, in position order.

    ``lists[z, :cnt[z]]`` get the offsets (from c0) of zone z's members; ``lut`` maps a context
    bin to its zone, or to the last row (bins of zones that are not coded: discarded). Members
    are scattered at random, so nothing here branches on the data: first the words holding a
    member are listed, then every entry of those words is dropped into its zone's row.
    """
    mags, add_lo, add_hi, signs = _bounds(lanes, magmask, lo, hi, S)
    w0, w1 = c0 // lanes, min(c1 // lanes, aw.size)
    nw = 0
    for wi in range(w0, w1):
        words[nw] = wi
        nw += _members(aw[wi], mags, add_lo, add_hi, signs) != 0
    cnt[:] = 0
    for t in range(nw):
        for i in range(words[t] * lanes, words[t] * lanes + lanes):
            z = lut[(np.uint64(a[i]) & magmask) >> shift]
            lists[z, cnt[z]] = i - c0
            cnt[z] += 1
    for i in range(max(w1 * lanes, c0), c1):  # entries past the last whole word
        z = lut[(np.uint64(a[i]) & magmask) >> shift]
        lists[z, cnt[z]] = i - c0
        cnt[z] += 1


@njit(inline="always")
def _encode_ones(a, b, aw, bw, magmask, lo, hi, S, ranks, ro, vals, vo, signmag, M, top):
    """A "ones" zone (few changes among many members): members are only counted, four to a
    word with one popcount; words with a changed member (rare) list its rank and code.
    Returns (members, listed ranks, changed entries)."""
    lanes = 8 // a.itemsize
    bits = 64 // lanes
    mags, add_lo, add_hi, signs = _bounds(lanes, magmask, lo, hi, S)
    lows = signs - (signs >> np.uint64(bits - 1))  # every bit below each lane's top
    r = k = 0
    for wi in range(aw.size):
        mem = _members(aw[wi], mags, add_lo, add_hi, signs)
        chm = mem & _changed_lanes(aw[wi] ^ bw[wi], lows, signs)
        if chm:
            rr = r
            for j in range(lanes):
                top_j = np.uint64(j * bits + bits - 1)
                if (mem >> top_j) & np.uint64(1):
                    if (chm >> top_j) & np.uint64(1):
                        i = wi * lanes + j
                        ranks[ro + k] = rr
                        vals[vo + k] = _code(np.uint64(a[i]), np.uint64(b[i]), signmag, M, S, top)
                        k += 1
                    rr += 1
        r += np.int64(_popcount(mem))
    for i in range(aw.size * lanes, a.size):  # entries past the last whole word
        x, y = np.uint64(a[i]), np.uint64(b[i])
        if (x & magmask) >= lo and (x & magmask) < hi:
            if x != y:
                ranks[ro + k] = r
                vals[vo + k] = _code(x, y, signmag, M, S, top)
                k += 1
            r += 1
    return r, k, k


@njit(inline="always")
def _decode_ones(a, aw, out, magmask, lo, hi, S, ranks, ro, vals, vo, vc, signmag, M, top):
    """Inverse of :func:`_encode_ones`: count members a word at a time until the word holding
    the next listed rank. Returns (members, ranks consumed, changes applied)."""
    lanes = 8 // a.itemsize
    bits = 64 // lanes
    mags, add_lo, add_hi, signs = _bounds(lanes, magmask, lo, hi, S)
    big = np.int64(1) << 62
    r = p = 0
    nxt = ranks[ro]
    nxt = big if nxt < 0 else nxt  # the list's -1 sentinel: nothing more listed
    for wi in range(aw.size):
        mem = _members(aw[wi], mags, add_lo, add_hi, signs)
        c = np.int64(_popcount(mem))
        if r + c > nxt:
            rr = r
            for j in range(lanes):
                if (mem >> np.uint64(j * bits + bits - 1)) & np.uint64(1):
                    if rr == nxt:
                        i = wi * lanes + j
                        out[i] = _apply(np.uint64(a[i]), np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
                        p += 1
                        nxt = ranks[ro + p]
                        nxt = big if nxt < 0 else nxt
                    rr += 1
        r += c
    for i in range(aw.size * lanes, a.size):
        x = np.uint64(a[i])
        if (x & magmask) >= lo and (x & magmask) < hi:
            if r == nxt:
                out[i] = _apply(x, np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
                p += 1
                nxt = ranks[ro + p]
                nxt = big if nxt < 0 else nxt
            r += 1
    return r, p, p


@njit(nogil=True, cache=True)
def encode_zones(
    a, b, aw, bw, magmask, shift, los, his, zmode, lo, hi, lut, bm, bm_off, ranks, rk_off, vals, val_off,
    signmag, M, S, top,
):
    """Code the given zones (those with changes) of the change a -> b, each into its own region:
    bitmap bits into ``bm`` (uint64 words), listed ranks into ``ranks``, changed entries' codes
    into ``vals``. ``aw``/``bw``: leading entries as uint64 words (:func:`packed_words`).

    "ones" zones are counted word by word (:func:`_encode_ones`). Bitmap and "zeros" zones (whose
    members mostly matter) span magnitudes [lo, hi); chunk by chunk their members are bucketed
    (``lut``: bin -> zone, other bins -> the discard row) and coded zone by zone with the zone's
    state in registers. Ranks and codes are stored unconditionally and their counters advance
    only when they count: no branch on change flags, which are coin flips in bitmap zones. Each
    rank and value region has one slot of slack. Returns per zone (members, listed, changed).
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    listed = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    acc = np.zeros(nz, dtype=np.uint64)
    dense = 0
    for z in range(nz):
        if zmode[z] == ONES:
            rank[z], listed[z], nval[z] = _encode_ones(
                a, b, aw, bw, magmask, np.uint64(los[z]) << shift, np.uint64(his[z]) << shift, S,
                ranks, rk_off[z], vals, val_off[z], signmag, M, top,
            )
        else:
            dense += 1
    if dense == 0:
        return rank, listed, nval
    words, lists, cnt = _member_buffers(nz)
    n, lanes = a.size, 8 // a.itemsize
    for c0 in range(0, n, CHUNK):
        _sort_members(a, aw, c0, min(c0 + CHUNK, n), lanes, magmask, shift, lo, hi, S, lut, words, lists, cnt)
        for z in range(nz):
            m, r, k, nv, word = zmode[z], rank[z], listed[z], nval[z], acc[z]
            if m == ONES:
                continue
            bo, ro, vo = bm_off[z], rk_off[z], val_off[z]
            for t in range(cnt[z]):
                i = c0 + lists[z, t]
                x, y = np.uint64(a[i]), np.uint64(b[i])
                ch = np.int64(x != y)
                if m == BITMAP:  # bits gather in a register, one store per 64 members
                    word |= np.uint64(ch) << np.uint64(r & 63)
                    if r & 63 == 63:
                        bm[bo + (r >> 6)] = word
                        word = np.uint64(0)
                else:  # ZEROS: list the unchanged
                    ranks[ro + k] = r
                    k += 1 - ch
                vals[vo + nv] = _code(x, y, signmag, M, S, top)
                nv += ch
                r += 1
            rank[z], listed[z], nval[z], acc[z] = r, k, nv, word
    for z in range(nz):
        if zmode[z] == BITMAP and rank[z] & 63:
            bm[bm_off[z] + (rank[z] >> 6)] = acc[z]
    return rank, listed, nval


@njit(nogil=True, cache=True)
def decode_zones(
    a, aw, out, magmask, shift, los, his, zmode, lo, hi, lut, bm, bm_off, bm_words, ranks, rk_off, vals, val_off,
    val_cnt, signmag, M, S, top,
):
    """Write the new bits of the given zones' members into ``out`` (which holds a copy of ``a``),
    organised as :func:`encode_zones`; returns per zone (members, ranks consumed, values
    consumed) for the caller to check.

    Never reads outside its buffers whatever the patch says: bitmap words and value slots are
    clamped to their zone (each bitmap region ends with a zero word, each value region with a 0
    code, each rank list with a -1 sentinel). Any disagreement shows in the returned counts.
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    ptr = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    acc = np.zeros(nz, dtype=np.uint64)
    dense = 0
    for z in range(nz):
        if zmode[z] == ONES:
            rank[z], ptr[z], nval[z] = _decode_ones(
                a, aw, out, magmask, np.uint64(los[z]) << shift, np.uint64(his[z]) << shift, S,
                ranks, rk_off[z], vals, val_off[z], val_cnt[z], signmag, M, top,
            )
        else:
            dense += 1
    if dense == 0:
        return rank, ptr, nval
    words, lists, cnt = _member_buffers(nz)
    n, lanes = a.size, 8 // a.itemsize
    for c0 in range(0, n, CHUNK):
        _sort_members(a, aw, c0, min(c0 + CHUNK, n), lanes, magmask, shift, lo, hi, S, lut, words, lists, cnt)
        for z in range(nz):
            m, r, p, nv, word = zmode[z], rank[z], ptr[z], nval[z], acc[z]
            if m == ONES:
                continue
            bo, bw, ro, vo, vc = bm_off[z], bm_words[z], rk_off[z], val_off[z], val_cnt[z]
            idx = lists[z]
            if m == BITMAP:  # flags are coin flips: branch-free, a zero code keeps the entry
                for t in range(cnt[z]):
                    if r & 63 == 0:
                        word = np.uint64(bm[bo + min(r >> 6, bw)])  # past the end: the zero slack word
                    ch = np.int64((word >> np.uint64(r & 63)) & np.uint64(1))
                    i = c0 + idx[t]
                    code = np.uint64(vals[vo + min(nv, vc)]) * np.uint64(ch)
                    out[i] = _apply(np.uint64(a[i]), code, signmag, M, S, top)
                    nv += ch
                    r += 1
            else:  # ZEROS: members at listed ranks kept, all others changed
                nxt = ranks[ro + p]
                for t in range(cnt[z]):
                    keep = np.int64(r == nxt)
                    p += keep
                    nxt = ranks[ro + p]
                    i = c0 + idx[t]
                    code = np.uint64(vals[vo + min(nv, vc)]) * np.uint64(1 - keep)
                    out[i] = _apply(np.uint64(a[i]), code, signmag, M, S, top)
                    nv += 1 - keep
                    r += 1
            rank[z], ptr[z], nval[z], acc[z] = r, p, nv, word
    return rank, ptr, nval
