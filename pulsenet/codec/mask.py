"""Sparse tensor change coding conditioned on the base: *which* entries changed, and *by how much*.

At RL learning rates a BF16 weight changes only when its update crosses the weight's rounding
cell, whose width is set by the weight's exponent: small weights change almost always, large ones
rarely. The receiver holds the base, so both sides split entries into *contexts* by the base
value's magnitude bits, ``bin = (bits & ~sign) >> (mantissa_bits - 1)`` (two bins per binade;
integer dtypes have a single bin). The encoder groups adjacent bins into at most ``MAX_ZONES``
*zones* and codes each zone's change flags in the zone's own rank space (its members in position
order), as

- ``bitmap``: one bit per member (change rates near 1/2),
- ``ones``:   gaps between the ranks of changed members (rare changes),
- ``zeros``:  gaps between the ranks of unchanged members (zones that nearly all change),

choosing boundaries and modes by dynamic programming on per-bin counts (changes exact; entries,
which only size the zones, from a sample). Each changed entry's value is
``zigzag(ordered(new) - ordered(old))`` (kernels._code), grouped by zone so entries with similar
statistics sit together for zstd. Everything here is pure: arrays in, bytes out.
"""

from __future__ import annotations

import functools
import itertools
import reprlib
from dataclasses import dataclass

import numpy as np

from pulsenet.codec import kernels
from pulsenet.codec.coding import (
    UINT,
    from_planes,
    narrowest_width,
    ordered,
    to_planes,
    unordered,
    unzigzag,
    zigzag,
)
from pulsenet.errors import PatchCorruptError

MODES = ("bitmap", "ones", "zeros")
MAX_ZONES = 12
SAMPLE_STRIDE = 17  # zones are sized from every 17th word: co-prime with power-of-two row lengths
MANTISSA_BITS = {"BF16": 7, "F16": 10, "F32": 23, "F64": 52, "F8_E4M3": 3, "F8_E5M2": 2}


@dataclass(slots=True)
class Zone:
    """``hi``: exclusive upper context bin. ``count``: listed ranks (ones/zeros) or members (bitmap).
    ``width``: gap width for ones/zeros, 0 for bitmap. ``size``: bytes in the mask section.
    ``nnz``: changed entries in the zone (its share of the values section)."""

    hi: int
    mode: str
    count: int
    width: int
    size: int
    nnz: int

    def to_json(self) -> list:
        return [self.hi, self.mode, self.count, self.width, self.size, self.nnz]

    @classmethod
    def from_json(cls, v: object) -> Zone:
        if not (isinstance(v, list) and len(v) == 6 and v[1] in MODES):
            raise PatchCorruptError(f"zone entry must be [hi, mode, count, width, size, nnz], got {reprlib.repr(v)}")
        hi, mode, count, width, size, nnz = v
        ints = hi, count, width, size, nnz
        if set(map(type, ints)) != {int} or min(ints) < 0 or max(ints) >= 1 << 62:  # (bool is not int here)
            raise PatchCorruptError(f"invalid zone entry {reprlib.repr(v)}")
        if mode != "bitmap" and width not in (1, 2, 4, 8):
            raise PatchCorruptError(f"zone gap width {width} is not 1, 2, 4 or 8")
        return cls(hi, mode, count, width, size, nnz)


@dataclass(frozen=True, slots=True)
class Context:
    """How a dtype's base bits map to context bins."""

    magmask: int
    shift: int
    nbins: int
    signmag: bool
    width: int

    @classmethod
    @functools.cache  # frozen: one per (dtype, width), asked for several times per tensor
    def of(cls, dtype: str, width: int) -> Context:
        mant = MANTISSA_BITS.get(dtype)
        if mant is None:  # integers and bool: one context
            return cls(0, 0, 1, False, width)
        mag = (1 << (8 * width - 1)) - 1
        shift = max(mant - 1, 0)
        return cls(mag, shift, (mag >> shift) + 1, True, width)

    @property
    def M(self) -> np.uint64:
        return np.uint64((1 << (8 * self.width)) - 1)

    @property
    def top(self) -> np.uint64:
        return np.uint64(8 * self.width - 1)

    @property
    def S(self) -> np.uint64:
        return np.uint64(1 << (8 * self.width - 1))


def encode_sparse(
    a: np.ndarray, b: np.ndarray, dtype: str, max_zones: int = MAX_ZONES
) -> tuple[list[Zone], bytes, np.ndarray] | None:
    """Code the change a -> b (same dtype and size); None if nothing changed.

    ``max_zones=1`` skips the context model (no histogram pass, no per-element kernel): faster,
    larger where the base predicts the change well.

    Returns (zones, raw mask section, value codes in zone order as unsigned ints of the width);
    the number of changed entries is ``codes.size``.
    """
    ctx = Context.of(dtype, a.dtype.itemsize)
    if max_zones == 1 or ctx.nbins == 1:
        ne = a != b
        k = np.count_nonzero(ne)
        if k == 0:
            return None
        _, mode = kernels.zone_cost(float(a.size), float(k))
        return _encode_one_zone(a, b, dtype, MODES[mode], ne)
    (a, aw), (b, bw) = kernels.packed_words(a), kernels.packed_words(b)
    counts = a, b, aw, bw, np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins
    n_bin, k_bin, stride = kernels.change_histogram(*counts, SAMPLE_STRIDE)
    if not k_bin.any():
        return None
    while True:
        plan_his, plan_mode = kernels.zone_plan(n_bin, k_bin, max_zones)
        if plan_his.size == 1:
            return _encode_one_zone(a, b, dtype, MODES[plan_mode[0]], a != b)
        act, los, his, zmode, n_z, k_z, bm, bm_off, bm_cap, ranks, rk_off, rk_cap, vals, val_off = kernels.zone_layout(
            plan_his, plan_mode, n_bin, k_bin, a, stride
        )
        how = kernels.member_search(los, his, zmode, n_z, n_bin[: los[-1]].sum(), a.size, ctx.nbins)
        members, listed, nval = kernels.encode_zones(
            a, b, aw, bw, np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins, los, his, zmode, how,
            bm, bm_off, bm_cap, ranks, rk_off, rk_cap, vals, val_off, k_z, ctx.signmag, ctx.M, ctx.S, ctx.top,
        )  # fmt: skip
        verdict, table, raw, codes = kernels.pack_zones(
            plan_his, plan_mode, act, n_z, k_z, stride, members, listed, nval, bm, bm_off, bm_cap, ranks, rk_off,
            rk_cap, vals, val_off,
        )  # fmt: skip
        if verdict != kernels.OUTGREW or stride == 1:
            break
        n_bin, k_bin, stride = kernels.change_histogram(*counts, 1)  # a zone outgrew its estimate: count exactly
    assert verdict == kernels.PACKED, "the zone kernel disagrees with the histogram"
    zones = [Zone(hi, MODES[m], count, width, size, nnz) for hi, m, count, width, size, nnz in table.tolist()]
    return zones, raw.tobytes(), codes


def _codes(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in MANTISSA_BITS:
        return zigzag(ordered(b) - ordered(a))
    return zigzag(b - a)


def _encode_one_zone(
    a: np.ndarray, b: np.ndarray, dtype: str, mode: str, ne: np.ndarray
) -> tuple[list[Zone], bytes, np.ndarray]:
    """Vectorised path for a single zone (no context gain to take): no per-element kernel."""
    pos = np.flatnonzero(ne)
    nbins = Context.of(dtype, a.dtype.itemsize).nbins
    if mode == "bitmap":
        raw = np.packbits(ne, bitorder="little").tobytes()
        zone = Zone(nbins, mode, int(a.size), 0, len(raw), int(pos.size))
    else:
        ranks = pos if mode == "ones" else np.flatnonzero(~ne)
        gaps = np.diff(ranks, prepend=-1) - 1
        width = narrowest_width(int(gaps.max())) if gaps.size else 1
        raw = to_planes(gaps.astype(UINT[width]))
        zone = Zone(nbins, mode, int(ranks.size), width, len(raw), int(pos.size))
    return [zone], raw, _codes(a[pos], b[pos], dtype)


def _decode_one_zone(a: np.ndarray, dtype: str, z: Zone, mask: bytes, codes: np.ndarray, out: np.ndarray) -> np.ndarray:
    if z.mode == "bitmap":
        if z.count != a.size:
            raise PatchCorruptError(f"bitmap covers {z.count} entries, the base has {a.size}")
        flags = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
        if flags[a.size :].any():
            raise PatchCorruptError("bitmap padding bits are not zero")
        pos = np.flatnonzero(flags[: a.size])
    else:
        gaps = from_planes(mask, z.width, z.count)
        # check the unsigned gaps before the cast: a width-8 gap >= 2^63 turns negative in int64
        # (and a negative rank indexes from the end); a float sum under a.size rules out int64 overflow.
        if gaps.size and (int(gaps.max()) >= a.size or gaps.sum(dtype=np.float64) >= a.size):
            raise PatchCorruptError(f"rank gap {int(gaps.max())} out of range for a tensor of {a.size} entries")
        ranks = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if ranks.size and int(ranks[-1]) >= a.size:
            raise PatchCorruptError(f"rank {int(ranks[-1])} out of range for a tensor of {a.size} entries")
        if z.mode == "ones":
            pos = ranks
        else:
            keep = np.ones(a.size, dtype=bool)
            keep[ranks] = False
            pos = np.flatnonzero(keep)
    if pos.size != codes.size:
        raise PatchCorruptError(f"mask decodes to {pos.size} changes, table says {codes.size}")
    old = a[pos]
    if dtype in MANTISSA_BITS:
        new = unordered(ordered(old) + unzigzag(codes))
    else:
        new = old + unzigzag(codes)
    out[:] = a
    out[pos] = new
    return out


def check_zones(zones: list[Zone], dtype: str, width: int, numel: int, nnz: int, mask_size: int) -> None:
    """Table-level checks, before any decoding."""
    ctx = Context.of(dtype, width)
    if not 1 <= len(zones) <= MAX_ZONES:
        raise PatchCorruptError(f"{len(zones)} zones, expected 1..{MAX_ZONES}")
    his = [z.hi for z in zones]
    if any(b <= a for a, b in itertools.pairwise(his)) or his[0] <= 0 or his[-1] != ctx.nbins:
        raise PatchCorruptError(f"zone bounds {his} must increase and end at {ctx.nbins}")
    if sum(z.nnz for z in zones) != nnz:
        raise PatchCorruptError(f"zones hold {sum(z.nnz for z in zones)} changes, table says {nnz}")
    if sum(z.size for z in zones) != mask_size:
        raise PatchCorruptError(f"zones declare {sum(z.size for z in zones)} mask bytes, section has {mask_size}")
    for z in zones:
        if z.count > numel or z.nnz > numel:
            raise PatchCorruptError(f"zone counts {z.count}/{z.nnz} exceed the tensor's {numel} entries")
        want = (z.count + 7) // 8 if z.mode == "bitmap" else z.count * z.width
        if z.size != want:
            raise PatchCorruptError(f"{z.mode} zone of {z.count} declares {z.size} bytes, expected {want}")


def decode_sparse(
    a: np.ndarray, dtype: str, zones: list[Zone], mask: bytes, codes: np.ndarray, out: np.ndarray | None = None
) -> np.ndarray:
    """Rebuild the new bits from base ``a`` into ``out`` (a fresh array like ``a`` if None);
    validates everything, never touches ``a``."""
    if out is None:
        out = np.empty_like(a)
    if codes.size != sum(z.nnz for z in zones) or not codes.all():
        raise PatchCorruptError("values section disagrees with the zones, or a changed entry carries a zero change")
    if len(zones) == 1:
        return _decode_one_zone(a, dtype, zones[0], mask, codes, out)
    ctx = Context.of(dtype, a.dtype.itemsize)
    table = np.array([[z.hi, MODES.index(z.mode), z.count, z.width, z.size, z.nnz] for z in zones], dtype=np.int64)
    err, bad, act, los, his, zmode, bm_words, rk_cnt, val_cnt, bm, bm_off, ranks, rk_off, vals, val_off = (
        kernels.decode_layout(table, np.frombuffer(mask, dtype=np.uint8), codes, a.size)
    )
    if err:
        raise PatchCorruptError(
            {
                kernels.BAD_PADDING: f"bitmap zone {bad} has non-zero padding bits",
                kernels.BAD_GAP: f"zone {bad} has a rank gap past the tensor's {a.size} entries",
                kernels.STRAY_VALUES: f"zone {bad} lists no changes but declares {zones[bad].nnz} values",
                kernels.BAD_SIZE: f"zone sizes disagree with their counts or the mask/values sections (zone {bad})",
            }[err]
        )
    kernels.require_little_endian()
    # how to find each zone's members (for speed only): from a sample of the base's context bins
    est, _ = kernels.bin_histogram(a, a, np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins, max(1, a.size >> 11))
    cum = np.concatenate([[0], np.cumsum(est)])
    how = kernels.member_search(los, his, zmode, cum[his] - cum[los], cum[los[-1]], a.size, ctx.nbins)
    members, consumed, changed = kernels.decode_zones(
        a, out, np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins, los, his, zmode, how,
        bm, bm_off, bm_words, ranks, rk_off, vals, val_off, val_cnt, ctx.signmag, ctx.M, ctx.S, ctx.top,
    )  # fmt: skip
    bad = (((zmode == kernels.BITMAP) & (members != table[act, 2])) | (consumed != rk_cnt) | (changed != val_cnt)).nonzero()[0]
    if bad.size:
        j, z = bad[0], zones[act[bad[0]]]
        if z.mode == "bitmap" and z.count != members[j]:
            raise PatchCorruptError(f"bitmap zone {act[j]} has {z.count} flags, the base has {members[j]} members")
        if consumed[j] != rk_cnt[j]:
            raise PatchCorruptError(f"zone {act[j]} lists ranks outside the base's {members[j]} members")
        raise PatchCorruptError(f"zone {act[j]} decodes {changed[j]} changes, table says {val_cnt[j]}")
    return out
