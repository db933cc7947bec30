"""Kernels of the zoned patch coder (numba, nogil: tensors encode in parallel threads).

The change mask is coded per *zone* in the zone's own rank space (codec/mask.py), so every member
of every zone with changes must be counted. What keeps that cheap:

- Zones without changes (at RL learning rates: the large-magnitude bulk of every tensor) are not
  visited at all; when the bulk has changes, its ranks come from the small zones below it
  (rank = position - entries below the bulk before it), never from counting the bulk.
- Membership is tested 32 entries at a time: vector compares into a bit mask (an LLVM intrinsic,
  :func:`_group_members`), whose set bits are listed with tzcnt, four slots written
  unconditionally so that groups of up to four members take no data-dependent branch. Entries
  outside the coded zones cost about 0.1 ns; changed entries are found the same way.
- Chunk by chunk (in L2), members are listed in position order and bucketed by zone; each zone
  is then coded with its rank, list pointer and value count in registers. The decoder copies
  the chunk of the base as it goes, so the random writes that follow hit cache.
- "ones" zones with many members (not the bulk) are only counted, a popcount per group, and
  searched bit by bit only in the rare groups that hold a change.
- Indices numba cannot prove non-negative are cast to uint64 in the per-member loops: numba
  wraps negative indices around, a check and select on every access; in a copy loop that check
  also stops LLVM from vectorising it (:func:`_copy`).

Arithmetic is done on uint64 and masked to the element width ``M``, so one kernel serves every
width. ``S`` is the sign bit of the width. For sign-magnitude floats the codes are differences of
*ordered* bits (see coding.ordered); for integers, plain wrapping differences. Zigzag keeps small
steps in either direction small.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

BITMAP, ONES, ZEROS = 0, 1, 2  # zone modes
BUCKET, COUNT, COMPLEMENT = 0, 1, 2  # how a zone's members are found (encode_zones)
CHUNK = 1 << 13  # entries per chunk: the chunk and its per-zone member lists stay in L2


GROUP = 32  # entries tested at once: one bit each in a uint32 mask
HIST_BLOCK = 1 << 17  # change_histogram's block (entries): both its passes over a block find it in L2


def _vector_load(context, builder, arr_type, arr, i):
    """``GROUP`` consecutive entries of a 1-D array from index ``i``, as one LLVM vector."""
    et = context.get_data_type(arr_type.dtype)
    data = context.make_array(arr_type)(context, builder, arr).data
    ptr = builder.bitcast(builder.gep(data, [i]), ir.VectorType(et, GROUP).as_pointer())
    return builder.load(ptr, align=et.width // 8)


def _check_unsigned(*arrays):
    for t in arrays:
        if not (isinstance(t, types.Array) and t.ndim == 1 and isinstance(t.dtype, types.Integer) and not t.dtype.signed):
            raise TypingError(f"group masks need 1-D unsigned integer arrays, got {t}")


@intrinsic
def _group_members(typingctx, a, i, magmask, lo, span):
    """Bit j set iff ``(a[i + j] & magmask) - lo < span`` in the entries' own width (unsigned):
    magnitude in [lo, lo + span). Vector compares (16 BF16 entries per AVX2 instruction) and a
    movemask: no loop over lanes, no branch."""
    _check_unsigned(a)
    sig = types.uint32(a, i, magmask, lo, span)

    def codegen(context, builder, sig, args):
        v = _vector_load(context, builder, sig.args[0], args[0], args[1])
        vt = v.type

        def splat(k):
            x = context.cast(builder, args[k], sig.args[k], sig.args[0].dtype)
            one = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(
                one, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), GROUP), [0] * GROUP)
            )

        d = builder.sub(builder.and_(v, splat(2)), splat(3))
        return builder.bitcast(builder.icmp_unsigned("<", d, splat(4)), ir.IntType(GROUP))

    return sig, codegen


@intrinsic
def _group_changes(typingctx, a, b, i):
    """Bit j set iff ``a[i + j] != b[i + j]`` (vector compare and movemask, as _group_members)."""
    _check_unsigned(a, b)
    sig = types.uint32(a, b, i)

    def codegen(context, builder, sig, args):
        va = _vector_load(context, builder, sig.args[0], args[0], args[2])
        vb = _vector_load(context, builder, sig.args[1], args[1], args[2])
        return builder.bitcast(builder.icmp_unsigned("!=", va, vb), ir.IntType(GROUP))

    return sig, codegen


@njit(nogil=True, cache=True)
def change_histogram(a, b, aw, bw, magmask, shift, nbins, stride):
    """Per context bin: entries of ``a``, entries whose bits differ in ``b``, and the word stride
    the entries were counted at (``aw``/``bw`` as from packed_words).

    Changes are counted exactly (every one is coded), found ``GROUP`` entries at a time. Entries
    only size the zones, so for 16-bit dtypes they are counted in every ``stride``-th word and
    scaled up (a bin holds at least its changes); :func:`zone_layout` leaves room for the
    estimate's error, and mask.encode_sparse recounts with stride 1 if a zone outgrew it. A
    word's four lanes count into four tables, so consecutive increments never wait on each
    other's store. Other dtypes: exact, stride 1."""
    if a.itemsize != 2:
        n_bin, k_bin = bin_histogram(a, b, magmask, shift, nbins, 1)
        return n_bin, k_bin, 1
    k0, k1 = np.zeros(nbins, dtype=np.int64), np.zeros(nbins, dtype=np.int64)
    k2, k3 = np.zeros(nbins, dtype=np.int64), np.zeros(nbins, dtype=np.int64)
    h0, h1 = np.zeros(nbins, dtype=np.int64), np.zeros(nbins, dtype=np.int64)
    h2, h3 = np.zeros(nbins, dtype=np.int64), np.zeros(nbins, dtype=np.int64)
    one = np.uint32(1)
    g1 = a.size // GROUP * GROUP
    # block by block: its changes, then its sampled words while ``a``'s block is in cache (one
    # block when there is no whole group; the last one samples the words to the end)
    for e0 in range(0, max(g1, 1), HIST_BLOCK):
        for g in range(e0, min(e0 + HIST_BLOCK, g1), GROUP):
            d = _group_changes(a, b, g)
            if d == 0:
                continue
            # A group's first four changes without a branch on how many there are (at RL rates a
            # group holds 0-3 changes, a coin flip the predictor cannot learn): a missing one reads
            # entry g (``tz(0) & 31`` is 0) and adds 0. Four tables, as for the entries below.
            n = _popcount(np.uint64(d))
            i0 = trailing_zeros(d) & 31
            d &= d - one
            i1 = trailing_zeros(d) & 31
            d &= d - one
            i2 = trailing_zeros(d) & 31
            d &= d - one
            i3 = trailing_zeros(d) & 31
            d &= d - one
            k0[(np.uint64(a[g + i0]) & magmask) >> shift] += 1
            k1[(np.uint64(a[g + i1]) & magmask) >> shift] += n > 1
            k2[(np.uint64(a[g + i2]) & magmask) >> shift] += n > 2
            k3[(np.uint64(a[g + i3]) & magmask) >> shift] += n > 3
            while d:
                k0[(np.uint64(a[g + trailing_zeros(d)]) & magmask) >> shift] += 1
                d &= d - one
        w0 = (e0 // 4 + stride - 1) // stride * stride  # the first sampled word of the block
        w1 = aw.size if e0 + HIST_BLOCK >= g1 else (e0 + HIST_BLOCK) // 4  # the last block takes the rest
        for wi in range(w0, w1, stride):
            w = aw[wi]
            h0[(w & magmask) >> shift] += 1
            h1[((w >> np.uint64(16)) & magmask) >> shift] += 1
            h2[((w >> np.uint64(32)) & magmask) >> shift] += 1
            h3[((w >> np.uint64(48)) & magmask) >> shift] += 1
    k_bin = k0 + k1 + k2 + k3
    n_bin = (h0 + h1 + h2 + h3) * stride
    for i in range(aw.size * 4, a.size):  # the tail past the last whole word
        n_bin[(np.uint64(a[i]) & magmask) >> shift] += 1
    for i in range(g1, a.size):  # ... and past the last whole group
        if a[i] != b[i]:
            k_bin[(np.uint64(a[i]) & magmask) >> shift] += 1
    return np.maximum(n_bin, k_bin), k_bin, stride


@njit(nogil=True, cache=True)
def bin_histogram(a, b, magmask, shift, nbins, stride):
    """Per context bin: entries and changed entries (bits differ), counted in every ``stride``-th
    entry and scaled up. The decoder estimates zone sizes from a sample of the base (``b`` = ``a``)
    to choose how to find each zone's members; :func:`change_histogram` serves the encoder."""
    n_bin = np.zeros(nbins, dtype=np.int64)
    k_bin = np.zeros(nbins, dtype=np.int64)
    for i in range(0, a.size, stride):
        x = np.uint64(a[i])
        c = (x & magmask) >> shift
        n_bin[c] += stride
        if x != np.uint64(b[i]):
            k_bin[c] += stride
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


@njit(nogil=True, cache=True)
def zone_plan(n_bin, k_bin, max_zones):
    """Zone boundaries (exclusive upper bins) and modes minimising the estimated mask size.

    Dynamic programming over groups of non-empty bins (:func:`zone_dp`). Each bin from the first
    to the last with changes is its own group; the unchanged runs at either end are one group
    each (splitting them never pays). Empty bins join the zone above them.
    """
    nb = n_bin.size
    bins = np.empty(nb, dtype=np.int64)
    nz = 0
    for c in range(nb):
        if n_bin[c] > 0:
            bins[nz] = c
            nz += 1
    f = last = -1
    for g in range(nz):
        if k_bin[bins[g]] > 0:
            f = g if f < 0 else f
            last = g
    starts = np.empty(nz + 1, dtype=np.int64)
    starts[0], G = 0, 1
    if f >= 0:
        for g in range(max(f, 1), min(last + 2, nz)):
            starts[G] = g
            G += 1
    starts[G] = nz
    N, K = np.zeros(G + 1), np.zeros(G + 1)
    group_last = np.empty(G, dtype=np.int64)
    for gi in range(G):
        n = k = 0.0
        for g in range(starts[gi], starts[gi + 1]):
            n += n_bin[bins[g]]
            k += k_bin[bins[g]]
        N[gi + 1], K[gi + 1] = N[gi] + n, K[gi] + k
        group_last[gi] = bins[starts[gi + 1] - 1]
    backs, finals, mode = zone_dp(N, K, min(max_zones, G))
    z = np.argmin(finals) + 1
    ends = np.empty(z, dtype=np.int64)
    j = G
    for t in range(z - 1, -1, -1):
        ends[t] = j
        j = backs[t, j]
    his = np.empty(z, dtype=np.int64)
    modes = np.empty(z, dtype=np.int8)
    start = 0
    for t in range(z):
        his[t] = group_last[ends[t] - 1] + 1
        modes[t] = mode[start, ends[t]]
        start = ends[t]
    his[z - 1] = nb
    return his, modes


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


def require_little_endian() -> None:
    """Lane j of a packed word must be entry j, and bitmap bytes are read as little-endian words."""
    if sys.byteorder != "little":
        raise NotImplementedError("the zoned patch kernels need a little-endian host")


def packed_words(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, a's leading entries as uint64 words) for the sampled entry counts and the encoder's
    cache warming; ``a`` is copied only if its buffer is not 8-byte aligned (numba needs aligned
    words)."""
    require_little_endian()
    lanes = 8 // a.itemsize
    if a.ctypes.data % 8:
        a = a.copy()
    return a, a[: a.size // lanes * lanes].view(np.uint64)


@intrinsic
def _popcount(typingctx, x):
    """Set bits of a uint64 (one popcnt)."""

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])

    return types.uint64(types.uint64), codegen


@njit(inline="always")
def _copy(src, dst):
    """``dst[:] = src`` as a loop from index 0, which LLVM turns into vector moves: numba's slice
    assignment, or a loop whose index it cannot prove non-negative (negative indices wrap around),
    copies an entry at a time, 5-10x slower."""
    for i in range(src.size):
        dst[i] = src[i]


@njit(inline="always")
def _list_bits(m, p, out, n):
    """Append ``p`` + the index of each set bit of ``m`` (ascending) to ``out[n:]``; returns the
    new length. Four slots are written whatever ``m`` holds (``out`` has that slack), so groups
    with up to four members, nearly all of them, take no data-dependent branch."""
    c = np.int64(_popcount(np.uint64(m)))
    for k in range(4):
        out[n + k] = p + trailing_zeros(m)
        m &= m - np.uint32(1)
    k = n + 4
    while m:
        out[k] = p + trailing_zeros(m)
        m &= m - np.uint32(1)
        k += 1
    return n + c


@njit(inline="always")
def _chunk_buffers(nz):
    """Scratch for :func:`_scan_chunk`: member offsets, per-zone member rows (+ the discard
    row) and their counts, changed offsets of the complement zone."""
    return (
        np.empty(CHUNK + 4, dtype=np.int32), np.empty((nz + 1, CHUNK), dtype=np.int32),
        np.zeros(nz + 1, dtype=np.int64), np.empty(CHUNK + 4, dtype=np.int32),
    )  # fmt: skip


@njit(inline="always")
def _scan_chunk(a, b, c0, c1, magmask, shift, lo, hi, lut, bufs, complement):
    """Find the chunk's entries with magnitude in [lo, hi) and bucket them by zone, in position order.

    ``flat[:nf]``: their offsets from c0; ``lists[z, :cnt[z]]``: zone z's (``lut``: bin -> zone, or
    the last row for bins of zones that are not bucketed). With ``complement`` (encoder only) also
    ``ctop[:nt]``: changed entries *outside* [lo, hi) (the complement zone's changes). Entries are
    tested ``GROUP`` at a time into bit masks, whose set bits are then listed; only members are
    bucketed. Returns (nf, nt).
    """
    flat, lists, cnt, ctop = bufs
    g1 = c0 + (c1 - c0) // GROUP * GROUP
    span = hi - lo
    nf = nt = 0
    for g in range(c0, g1, GROUP):
        m = _group_members(a, g, magmask, lo, span)
        nf = _list_bits(m, g - c0, flat, nf)
        if complement:
            nt = _list_bits(_group_changes(a, b, g) & ~m, g - c0, ctop, nt)
    for i in range(g1, c1):  # the tensor's last entries, past the last whole group
        x = np.uint64(a[i]) & magmask
        if x >= lo and x < hi:
            flat[nf] = i - c0
            nf += 1
        elif complement and a[i] != b[i]:
            ctop[nt] = i - c0
            nt += 1
    cnt[:] = 0
    for f in range(nf):
        j = flat[f]
        z = np.uint64(lut[(np.uint64(a[np.uint64(c0) + np.uint64(j)]) & magmask) >> shift])
        c = cnt[z]
        lists[z, np.uint64(c)] = j
        cnt[z] = c + 1
    return nf, nt


@njit(inline="always")
def _encode_ones(a, b, magmask, lo, hi, e0, e1, r, k, ranks, ro, rc, vals, vo, vc, signmag, M, S, top):
    """Entries [e0, e1) (``e0`` on a group boundary) of a "ones" zone (few changes among many
    members), continuing its count of ``r`` members and ``k`` listed ranks: members are only
    counted, ``GROUP`` at a time with one popcount; groups with a changed member (rare) list its
    rank and code. Returns the new (r, k)."""
    span = hi - lo
    g1 = e0 + (e1 - e0) // GROUP * GROUP
    for g in range(e0, g1, GROUP):
        mem = _group_members(a, g, magmask, lo, span)
        chm = mem & _group_changes(a, b, g)
        while chm:
            j = trailing_zeros(chm)
            below = mem & ((np.uint32(1) << np.uint32(j)) - np.uint32(1))
            ranks[ro + min(k, rc)] = r + np.int64(_popcount(np.uint64(below)))
            vals[vo + min(k, vc)] = _code(np.uint64(a[g + j]), np.uint64(b[g + j]), signmag, M, S, top)
            k += 1
            chm &= chm - np.uint32(1)
        r += np.int64(_popcount(np.uint64(mem)))
    for i in range(g1, e1):  # entries past the last whole group (the tensor's end)
        x, y = np.uint64(a[i]), np.uint64(b[i])
        if (x & magmask) >= lo and (x & magmask) < hi:
            if x != y:
                ranks[ro + min(k, rc)] = r
                vals[vo + min(k, vc)] = _code(x, y, signmag, M, S, top)
                k += 1
            r += 1
    return r, k


@njit(inline="always")
def _decode_ones(a, out, magmask, lo, hi, e0, e1, r, p, ranks, ro, vals, vo, vc, signmag, M, S, top):
    """Inverse of :func:`_encode_ones` over entries [e0, e1), continuing from ``r`` members and
    ``p`` ranks consumed: count members a group at a time; in the group holding the next listed
    rank, find that member's bit. Returns the new (r, p)."""
    span = hi - lo
    g1 = e0 + (e1 - e0) // GROUP * GROUP
    big = np.int64(1) << 62
    nxt = ranks[ro + p]
    nxt = big if nxt < 0 else nxt  # the list's -1 sentinel: nothing more listed
    for g in range(e0, g1, GROUP):
        mem = _group_members(a, g, magmask, lo, span)
        c = np.int64(_popcount(np.uint64(mem)))
        while nxt < r + c:  # (ranks increase: nxt >= r here)
            m = mem
            for _ in range(nxt - r):  # drop the members before it
                m &= m - np.uint32(1)
            i = g + trailing_zeros(m)
            out[i] = _apply(np.uint64(a[i]), np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
            p += 1
            nxt = ranks[ro + p]
            nxt = big if nxt < 0 else nxt
        r += c
    for i in range(g1, e1):  # entries past the last whole group (the tensor's end)
        x = np.uint64(a[i])
        if (x & magmask) >= lo and (x & magmask) < hi:
            if r == nxt:
                out[i] = _apply(x, np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
                p += 1
                nxt = ranks[ro + p]
                nxt = big if nxt < 0 else nxt
            r += 1
    return r, p


@njit(nogil=True, cache=True)
def member_search(los, his, zmode, members, below_top, n, nbins):
    """How :func:`encode_zones` / :func:`decode_zones` find each coded zone's members: a choice
    for speed only, every choice codes the same bytes. ``members``: (estimated) members per zone,
    ``below_top``: entries below the last zone. The top "ones" zone (the bulk of large weights) is
    the complement of what is below it when that is small; other "ones" zones holding more than
    1% of the entries are counted a group at a time (one extra pass, ~0.03 ns per entry) rather
    than listed one by one (~4 ns per member); the rest are bucketed."""
    nz = zmode.size
    how = np.full(nz, BUCKET, dtype=np.int8)
    if his[nz - 1] == nbins and zmode[nz - 1] == ONES and below_top * 4 <= n:
        how[nz - 1] = COMPLEMENT
    else:
        for z in range(nz):
            if zmode[z] == ONES and members[z] * 100 > n:
                how[z] = COUNT
    return how


@njit(inline="always")
def _scan_table(los, his, how, nbins, shift):
    """The magnitude range [lo, hi) the chunk scan lists (the bucketed zones, or all below a
    complement zone) and a bin -> zone table for it (other bins -> the discard row)."""
    nz = how.size
    lut = np.full(nbins, nz, dtype=np.int32)
    lo, hi = nbins, 0
    for z in range(nz):
        if how[z] == BUCKET:
            lut[los[z] : his[z]] = z
            lo, hi = min(lo, los[z]), max(hi, his[z])
    if how[nz - 1] == COMPLEMENT:
        lo, hi = 0, los[nz - 1]
    return np.uint64(min(lo, hi)) << shift, np.uint64(hi) << shift, lut


@njit(nogil=True, cache=True)
def zone_layout(plan_his, plan_mode, n_bin, k_bin, a, stride):
    """Regions for :func:`encode_zones` from per-bin counts (changes exact; entries counted every
    ``stride``-th word, an estimate: each zone gets room for ~8 standard deviations above it).
    Only zones with changes are coded. Returns their plan
    indices, bounds, modes, (estimated) members and changes, and the regions (bitmap words,
    ranks, value codes of ``a``'s dtype), each ending with a slot of slack."""
    lanes = 8 // a.itemsize
    nzp = plan_his.size
    act = np.empty(nzp, dtype=np.int64)
    na, lo_bin = 0, 0
    for z in range(nzp):
        if k_bin[lo_bin : plan_his[z]].sum() > 0:
            act[na] = z
            na += 1
        lo_bin = plan_his[z]
    act = act[:na]
    his, zmode = plan_his[act], plan_mode[act]
    los, n_z, k_z = np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64)
    bm_cap, rk_cap = np.zeros(na, dtype=np.int64), np.zeros(na, dtype=np.int64)
    bm_off, rk_off, val_off = np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64)
    bm_n = rk_n = val_n = 0
    for i in range(na):
        los[i] = 0 if act[i] == 0 else plan_his[act[i] - 1]
        n_z[i], k_z[i] = n_bin[los[i] : his[i]].sum(), k_bin[los[i] : his[i]].sum()
        room = n_z[i]
        if stride > 1:  # the estimate's variance is at most stride * lanes * n
            room = min(a.size, room + np.int64(8.0 * np.sqrt(stride * lanes * room)) + 8 * stride * lanes)
        if zmode[i] == BITMAP:
            bm_cap[i] = (room + 63) // 64
        elif zmode[i] == ONES:
            rk_cap[i] = k_z[i]
        else:
            rk_cap[i] = room - k_z[i]
        bm_off[i], rk_off[i], val_off[i] = bm_n, rk_n, val_n
        bm_n, rk_n, val_n = bm_n + bm_cap[i] + 1, rk_n + rk_cap[i] + 1, val_n + k_z[i] + 1
    bm, ranks = np.zeros(bm_n, dtype=np.uint64), np.full(rk_n, -1, dtype=np.int64)
    vals = np.zeros(val_n, dtype=a.dtype)
    return act, los, his, zmode, n_z, k_z, bm, bm_off, bm_cap, ranks, rk_off, rk_cap, vals, val_off


BAD_PADDING, BAD_GAP, STRAY_VALUES, BAD_SIZE = 1, 2, 3, 4  # decode_layout's complaints


@njit(nogil=True, cache=True)
def decode_layout(table, mask, codes, n):
    """The regions :func:`decode_zones` reads, from a patch's zone table (rows of hi, mode,
    count, width, size, nnz, checked by mask.check_zones), its raw mask section and the value
    codes in zone order. Zones that list nothing in "ones" mode have no changes and are left out.

    Each region ends as the kernel expects: a zero word after a bitmap, a -1 after a rank list,
    a 0 code after a zone's values. Returns (error, zone) for a malformed mask (``BAD_PADDING``:
    bitmap padding bits set, ``BAD_GAP``: a rank gap past the tensor, ``STRAY_VALUES``: a zone
    without changes declaring values, ``BAD_SIZE``: sizes that disagree with the counts or the
    sections; error 0 if none), then the coded zones' plan indices, bounds, modes, bitmap words,
    rank and value counts and the regions.
    """
    nzp = table.shape[0]
    act = np.empty(nzp, dtype=np.int64)
    na, err, bad = 0, 0, -1
    mask_n = val_n = 0
    for z in range(nzp):
        count, width, size = table[z, 2], table[z, 3], table[z, 4]
        want = (count + 7) // 8 if table[z, 1] == BITMAP else count * width
        bad_width = table[z, 1] != BITMAP and width != 1 and width != 2 and width != 4 and width != 8
        if size != want or count < 0 or table[z, 5] < 0 or bad_width:
            err, bad = BAD_SIZE, z
        mask_n, val_n = mask_n + size, val_n + table[z, 5]
    if not err and (mask_n != mask.size or val_n != codes.size):
        err, bad = BAD_SIZE, -1
    for z in range(nzp):
        if table[z, 1] != ONES or table[z, 2] > 0:
            act[na] = z
            na += 1
        elif table[z, 5] > 0 and not err:
            err, bad = STRAY_VALUES, z
    na = 0 if err else na  # nothing to lay out: the caller raises
    act = act[:na]
    los, his, zmode = np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int8)
    bm_words, rk_cnt, val_cnt = np.zeros(na, dtype=np.int64), np.zeros(na, dtype=np.int64), np.empty(na, dtype=np.int64)
    bm_off, rk_off, val_off = np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64), np.empty(na, dtype=np.int64)
    bm_n = rk_n = val_n = 0
    for j in range(na):
        z = act[j]
        los[j] = 0 if z == 0 else table[z - 1, 0]
        his[j], zmode[j], val_cnt[j] = table[z, 0], table[z, 1], table[z, 5]
        if zmode[j] == BITMAP:
            bm_words[j] = (table[z, 2] + 63) // 64
        else:
            rk_cnt[j] = table[z, 2]
        bm_off[j], rk_off[j], val_off[j] = bm_n, rk_n, val_n
        bm_n, rk_n, val_n = bm_n + bm_words[j] + 1, rk_n + rk_cnt[j] + 1, val_n + val_cnt[j] + 1
    bm, ranks = np.zeros(bm_n, dtype=np.uint64), np.full(rk_n, -1, dtype=np.int64)
    vals = np.zeros(val_n, dtype=codes.dtype)
    bm8 = bm.view(np.uint8)
    off = voff = j = 0
    for z in range(nzp if not err else 0):
        count, width, size, nnz = table[z, 2], table[z, 3], table[z, 4], table[z, 5]
        if j < na and act[j] == z:
            if table[z, 1] == BITMAP:
                if count & 7 and mask[off + size - 1] >> (count & 7):
                    err, bad = BAD_PADDING, z
                bm8[8 * bm_off[j] : 8 * bm_off[j] + size] = mask[off : off + size]
            else:
                r = np.int64(-1)
                for t in range(count):  # byte planes of the gaps: plane k holds byte k of each
                    g = np.uint64(0)
                    for k in range(width):
                        g |= np.uint64(mask[off + k * count + t]) << np.uint64(8 * k)
                    if g >= np.uint64(n):
                        err, bad = BAD_GAP, z
                        g = np.uint64(0)
                    r += np.int64(g) + 1
                    ranks[rk_off[j] + t] = r
            vals[val_off[j] : val_off[j] + nnz] = codes[voff : voff + nnz]
            voff += nnz
            j += 1
        off += size
        if err:
            break
    return err, bad, act, los, his, zmode, bm_words, rk_cnt, val_cnt, bm, bm_off, ranks, rk_off, vals, val_off


PACKED, OUTGREW, DISAGREES = 0, 1, 2  # pack_zones' verdicts


@njit(nogil=True, cache=True)
def pack_zones(plan_his, plan_mode, act, n_z, k_z, stride, members, listed, nval, bm, bm_off, bm_cap, ranks, rk_off,
               rk_cap, vals, val_off):  # fmt: skip
    """The patch sections from :func:`encode_zones`' regions, in one call (no per-zone Python).

    Returns (verdict, table, mask, codes). ``OUTGREW``: a zone held more than its room (the
    estimate fell short: count exactly and code again); ``DISAGREES``: counts that contradict
    the histogram (a bug). Else ``table`` has a row per plan zone (hi, mode, count, width, size,
    nnz; zones without changes are empty "ones" zones), ``mask`` the zones' raw mask bytes in
    order (bitmap bits, or the gaps between listed ranks as byte planes of the narrowest width)
    and ``codes`` the changed entries' codes in zone order.
    """
    nzp, na = plan_his.size, act.size
    table = np.zeros((nzp, 6), dtype=np.int64)
    for z in range(nzp):
        table[z, 0], table[z, 1], table[z, 3] = plan_his[z], ONES, 1
    empty = np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=vals.dtype)
    for i in range(na):
        if plan_mode[act[i]] == BITMAP:
            if members[i] > 64 * bm_cap[i]:
                return OUTGREW, table, *empty
        elif listed[i] > rk_cap[i]:
            return OUTGREW, table, *empty
    for i in range(na):
        m = plan_mode[act[i]]
        if nval[i] != k_z[i] or (m == ONES and listed[i] != k_z[i]):
            return DISAGREES, table, *empty
        if stride == 1 and ((m == BITMAP and members[i] != n_z[i]) or (m == ZEROS and listed[i] != n_z[i] - k_z[i])):
            return DISAGREES, table, *empty
    size = ncodes = 0
    for i in range(na):
        z = act[i]
        table[z, 1], table[z, 5] = plan_mode[z], nval[i]
        if plan_mode[z] == BITMAP:
            table[z, 2], table[z, 3], table[z, 4] = members[i], 0, (members[i] + 7) // 8
        else:
            prev, top = -1, 0
            for t in range(rk_off[i], rk_off[i] + listed[i]):  # ranks -> gaps, in place
                r = ranks[t]
                ranks[t] = r - prev - 1
                top = max(top, ranks[t])
                prev = r
            w = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4 if top < 1 << 32 else 8
            table[z, 2], table[z, 3], table[z, 4] = listed[i], w, listed[i] * w
        size += table[z, 4]
        ncodes += nval[i]
    mask, codes = np.empty(size, dtype=np.uint8), np.empty(ncodes, dtype=vals.dtype)
    off = c = 0
    for i in range(na):
        z = act[i]
        if plan_mode[z] == BITMAP:  # the words' bytes, little-endian
            for j in range(table[z, 4]):
                mask[off + j] = np.uint8((bm[bm_off[i] + (j >> 3)] >> np.uint64(8 * (j & 7))) & np.uint64(0xFF))
        else:  # plane k: byte k of every gap
            cnt, w = table[z, 2], table[z, 3]
            for k in range(w):
                for t in range(cnt):
                    mask[off + k * cnt + t] = np.uint8((ranks[rk_off[i] + t] >> (8 * k)) & 0xFF)
        off += table[z, 4]
        codes[c : c + nval[i]] = vals[val_off[i] : val_off[i] + nval[i]]
        c += nval[i]
    return PACKED, table, mask, codes


@njit(nogil=True, cache=True)
def encode_zones(
    a, b, aw, bw, magmask, shift, nbins, los, his, zmode, how, bm, bm_off, bm_cap, ranks, rk_off, rk_cap,
    vals, val_off, val_cap, signmag, M, S, top,
):
    """Code the given zones (those with changes) of the change a -> b, each into its own region:
    bitmap bits into ``bm`` (uint64 words), listed ranks into ``ranks``, changed entries' codes
    into ``vals``. ``aw``/``bw``: leading entries as uint64 words (:func:`packed_words`).

    ``how`` says how each zone's members are found (mask.py chooses, for speed only):

    - ``COUNT``: a "ones" zone with many members, counted word by word (:func:`_encode_ones`);
    - ``BUCKET``: chunk by chunk, members of the bucketed zones, which span magnitudes [lo, hi),
      are listed by zone (``lut``; :func:`_scan_chunk`) and coded with the zone's state in
      registers. Ranks and codes are stored unconditionally and their counters advance only when
      they count: no branch on change flags (coin flips in bitmap zones). Each rank and value
      region has one slot of slack;
    - ``COMPLEMENT``: the top "ones" zone (the unchanging bulk of large magnitudes, then [lo, hi)
      starts at 0): its members are everything else, so a change's rank is its position minus
      the entries below the zone before it, which the scan lists anyway.

    Writes are clamped to each region's slack slot (``*_cap``: its index), so counts that
    disagree with the layout (a bug) show in the returned (members, listed, changed) per zone,
    which the caller checks, and never as a write outside the buffers.
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    listed = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    acc = np.zeros(nz, dtype=np.uint64)
    cz, scan, counted = -1, False, False
    for z in range(nz):
        if how[z] == COUNT:
            counted = True
        else:
            scan = True
            if how[z] == COMPLEMENT:
                cz = z
    lo, hi, lut = _scan_table(los, his, how, nbins, shift)
    n, lanes = a.size, 8 // a.itemsize
    bufs = _chunk_buffers(nz)
    flat, lists, cnt, ctop = bufs
    below = 0  # entries in [lo, hi) before the chunk
    touch = np.uint64(0)
    for c0 in range(0, n, CHUNK):
        for z in range(nz):  # counted zones first: they read the chunk in order, into cache
            if how[z] == COUNT:
                rank[z], listed[z] = _encode_ones(
                    a, b, magmask, np.uint64(los[z]) << shift, np.uint64(his[z]) << shift, c0, min(c0 + CHUNK, n),
                    rank[z], listed[z], ranks, rk_off[z], rk_cap[z], vals, val_off[z], val_cap[z], signmag, M, S, top,
                )  # fmt: skip
                nval[z] = listed[z]
        if not scan:
            continue
        if cz < 0 and not counted:  # pull b's chunk into cache in order (else the scan reads it): members read it at random
            for wi in range(c0 // lanes, min((c0 + CHUNK) // lanes, bw.size), 8):
                touch ^= bw[wi]
        nf, nt = _scan_chunk(a, b, c0, min(c0 + CHUNK, n), magmask, shift, lo, hi, lut, bufs, cz >= 0)
        for z in range(nz):
            if how[z] != BUCKET:
                continue
            m, r, k, nv, word = zmode[z], rank[z], listed[z], nval[z], acc[z]
            bo, ro, vo, bc, rc, vc = bm_off[z], rk_off[z], val_off[z], bm_cap[z], rk_cap[z], val_cap[z]
            for t in range(cnt[z]):
                i = np.uint64(c0) + np.uint64(lists[z, t])
                x, y = np.uint64(a[i]), np.uint64(b[i])
                ch = np.int64(x != y)
                if m == BITMAP:  # bits gather in a register, one store per 64 members
                    word |= np.uint64(ch) << np.uint64(r & 63)
                    if r & 63 == 63:
                        bm[np.uint64(bo + min(r >> 6, bc))] = word
                        word = np.uint64(0)
                elif m == ZEROS:  # list the unchanged
                    ranks[np.uint64(ro + min(k, rc))] = r
                    k += 1 - ch
                else:  # ONES: list the changed
                    ranks[np.uint64(ro + min(k, rc))] = r
                    k += ch
                vals[np.uint64(vo + min(nv, vc))] = _code(x, y, signmag, M, S, top)
                nv += ch
                r += 1
            rank[z], listed[z], nval[z], acc[z] = r, k, nv, word
        if cz >= 0:
            k, f = listed[cz], 0
            for t in range(nt):
                p = ctop[t]
                while f < nf and flat[f] < p:
                    f += 1
                i = c0 + p
                ranks[rk_off[cz] + min(k, rk_cap[cz])] = i - below - f
                vals[val_off[cz] + min(k, val_cap[cz])] = _code(np.uint64(a[i]), np.uint64(b[i]), signmag, M, S, top)
                k += 1
            listed[cz], nval[cz] = k, k
        below += nf
    if cz >= 0:
        rank[cz] = n - below
    ctop[CHUNK] = np.int32(touch & np.uint64(1))  # keeps the touching loads (a slack slot LLVM cannot prove dead)
    for z in range(nz):
        if how[z] == BUCKET and zmode[z] == BITMAP and rank[z] & 63:
            bm[bm_off[z] + min(rank[z] >> 6, bm_cap[z])] = acc[z]
    return rank, listed, nval


@njit(nogil=True, cache=True)
def decode_zones(
    a, out, magmask, shift, nbins, los, his, zmode, how, bm, bm_off, bm_words, ranks, rk_off, vals,
    val_off, val_cnt, signmag, M, S, top,
):
    """Copy ``a`` into ``out`` and write the new bits of the given zones' members there (chunk by
    chunk, while the chunk is in cache), organised as :func:`encode_zones`; returns per zone
    (members, ranks consumed, values consumed) for the caller to check.

    Never reads outside its buffers whatever the patch says: bitmap words and value slots are
    clamped to their zone (each bitmap region ends with a zero word, each value region with a 0
    code, each rank list with a -1 sentinel). Any disagreement shows in the returned counts.
    """
    nz = zmode.size
    rank = np.zeros(nz, dtype=np.int64)
    ptr = np.zeros(nz, dtype=np.int64)
    nval = np.zeros(nz, dtype=np.int64)
    acc = np.zeros(nz, dtype=np.uint64)
    cz = -1
    for z in range(nz):
        if how[z] == COMPLEMENT:
            cz = z
    lo, hi, lut = _scan_table(los, his, how, nbins, shift)
    _decode_chunks(a, out, magmask, shift, los, his, zmode, how, lo, hi, lut, bm, bm_off, bm_words, ranks, rk_off,
                   vals, val_off, val_cnt, signmag, M, S, top, rank, ptr, nval, acc, cz)  # fmt: skip
    return rank, ptr, nval


@njit(inline="always")
def _decode_chunks(
    a, out, magmask, shift, los, his, zmode, how, lo, hi, lut, bm, bm_off, bm_words, ranks, rk_off, vals, val_off,
    val_cnt, signmag, M, S, top, rank, ptr, nval, acc, cz,
):
    """The chunk loop of :func:`decode_zones`: the chunk's copy, then its counted, bucketed and
    complement zones' changes while it is in cache."""
    nz = zmode.size
    big = np.int64(1) << 62
    n = a.size
    scan = False
    for z in range(nz):
        scan |= how[z] != COUNT
    bufs = _chunk_buffers(nz)
    flat, lists, cnt = bufs[0], bufs[1], bufs[2]
    below = 0
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)
        _copy(a[c0:c1], out[c0:c1])
        for z in range(nz):
            if how[z] == COUNT:
                rank[z], ptr[z] = _decode_ones(
                    a, out, magmask, np.uint64(los[z]) << shift, np.uint64(his[z]) << shift, c0, c1, rank[z], ptr[z],
                    ranks, rk_off[z], vals, val_off[z], val_cnt[z], signmag, M, S, top,
                )  # fmt: skip
                nval[z] = ptr[z]
        if not scan:
            continue
        nf, _ = _scan_chunk(a, a, c0, c1, magmask, shift, lo, hi, lut, bufs, False)
        for z in range(nz):
            if how[z] != BUCKET:
                continue
            m, r, p, nv, word = zmode[z], rank[z], ptr[z], nval[z], acc[z]
            bo, bw, ro, vo, vc = bm_off[z], bm_words[z], rk_off[z], val_off[z], val_cnt[z]
            idx = lists[z]
            if m == BITMAP:  # flags are coin flips: branch-free, a zero code keeps the entry
                for t in range(cnt[z]):
                    if r & 63 == 0:
                        word = np.uint64(bm[np.uint64(bo + min(r >> 6, bw))])  # past the end: the zero slack word
                    ch = np.int64((word >> np.uint64(r & 63)) & np.uint64(1))
                    i = np.uint64(c0) + np.uint64(idx[t])
                    code = np.uint64(vals[np.uint64(vo + min(nv, vc))]) * np.uint64(ch)
                    out[i] = _apply(np.uint64(a[i]), code, signmag, M, S, top)
                    nv += ch
                    r += 1
            elif m == ZEROS:  # members at listed ranks kept, all others changed
                nxt = ranks[ro + p]
                for t in range(cnt[z]):
                    keep = np.int64(r == nxt)
                    p += keep
                    nxt = ranks[np.uint64(ro + p)]
                    i = np.uint64(c0) + np.uint64(idx[t])
                    code = np.uint64(vals[np.uint64(vo + min(nv, vc))]) * np.uint64(1 - keep)
                    out[i] = _apply(np.uint64(a[i]), code, signmag, M, S, top)
                    nv += 1 - keep
                    r += 1
            else:  # ONES: members at listed ranks changed (rarely: a branch)
                nxt = ranks[ro + p]
                nxt = big if nxt < 0 else nxt
                for t in range(cnt[z]):
                    if r == nxt:
                        i = np.uint64(c0) + np.uint64(idx[t])
                        out[i] = _apply(np.uint64(a[i]), np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
                        p += 1
                        nxt = ranks[ro + p]
                        nxt = big if nxt < 0 else nxt
                    r += 1
                nv = p
            rank[z], ptr[z], nval[z], acc[z] = r, p, nv, word
        if cz >= 0:  # the complement zone's listed ranks -> the positions outside [lo, hi)
            ro, vo, vc = rk_off[cz], val_off[cz], val_cnt[cz]
            p, f = ptr[cz], 0
            before = c0 - below  # complement members before the chunk
            end = before + (c1 - c0) - nf
            nxt = ranks[ro + p]
            nxt = big if nxt < 0 else nxt
            while nxt < end:
                loc = nxt - before
                while f < nf and flat[f] <= loc + f:
                    f += 1
                i = c0 + loc + f
                out[i] = _apply(np.uint64(a[i]), np.uint64(vals[vo + min(p, vc)]), signmag, M, S, top)
                p += 1
                nxt = ranks[ro + p]
                nxt = big if nxt < 0 else nxt
            ptr[cz], nval[cz] = p, p
        below += nf
    if cz >= 0:
        rank[cz] = n - below
