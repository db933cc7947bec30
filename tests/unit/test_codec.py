"""Patch codec v1: exact round trips, hostile input, streaming memory, CLI."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulsenet.checkpoint import Checkpoint, save_state
from pulsenet.codec import kernels
from pulsenet.codec.bf16 import bits, visible_change
from pulsenet.codec.coding import compress
from pulsenet.codec.digest import model_digest
from pulsenet.codec.dtypes import dtype_name
from pulsenet.codec.mask import Context
from pulsenet.codec.patch import HEADER_SIZE, PatchEncoder, apply_patch, parse_patch
from pulsenet.errors import (
    BaseMismatchError,
    DigestMismatchError,
    PatchCorruptError,
    PatchError,
    PatchFormatError,
    PatchSizeLimitError,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (``torch.equal`` says nan != nan and -0.0 == 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def assert_state_equal(x: dict, y: dict) -> None:
    assert sorted(x) == sorted(y)
    for k in x:
        assert same(x[k], y[k]), k


def random_bits(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns: NaN payloads, infinities, subnormals, both zeros all included."""
    w = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * w, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def realistic_bf16(rng: np.random.Generator, n: int, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A BF16 weight and the weight after one small update, like one RL step."""
    master = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02)
    a = master.to(torch.bfloat16)
    b = (master - lr * torch.from_numpy(np.sign(rng.standard_normal(n)).astype(np.float32))).to(torch.bfloat16)
    return a, b


def mutate(rng: np.random.Generator, t: torch.Tensor, rate: float) -> torch.Tensor:
    """Replace a fraction ``rate`` of entries with arbitrary bit patterns (or small steps)."""
    u = bits(t).copy()
    n = u.size
    if n == 0 or rate == 0:
        return t.clone()
    idx = rng.choice(n, size=max(1, int(n * rate)) if rate > 0 else 0, replace=False)
    w = u.dtype.itemsize
    if rng.random() < 0.5:
        u[idx] = rng.integers(0, 2 ** (8 * w) - 1, size=idx.size, dtype=np.uint64).astype(u.dtype)
    else:
        u[idx] += u.dtype.type(1)
    if t.dtype == torch.bool:
        u &= 1
    return torch.from_numpy(u).view(t.dtype).reshape(t.shape).clone()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.sampled_from([(), (0,), (1,), (7,), (33, 5), (4, 0, 3), (300, 70)]),
    rate=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    zones=st.sampled_from([1, 12]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_any_dtype(dtype, shape, rate, zones, seed):
    rng = np.random.default_rng(seed)
    a = {"t": random_bits(rng, dtype, shape), "other": torch.ones(3)}
    b = {"t": mutate(rng, a["t"], rate), "other": torch.ones(3)}
    data = PatchEncoder(max_zones=zones).encode(a, b)
    assert_state_equal(apply_patch(a, data), b)


@pytest.mark.parametrize("lr", [3e-6, 3e-5, 1e-3])
@pytest.mark.parametrize("zones", [1, 12])
def test_round_trip_realistic_bf16_and_beats_paper(lr, zones):
    from pulsenet.codec.paper import paper_patch_size

    rng = np.random.default_rng(0)
    a_w, b_w = realistic_bf16(rng, 200_000, lr)
    a, b = {"w": a_w.reshape(400, 500)}, {"w": b_w.reshape(400, 500)}
    data = PatchEncoder(max_zones=zones).encode(a, b)
    assert_state_equal(apply_patch(a, data), b)
    if zones > 1:
        assert len(data) < paper_patch_size(a, b) / 1.5


@pytest.mark.parametrize("density", [0.0, 0.001, 0.04, 0.12, 0.5, 0.97, 1.0])
def test_change_histogram_counts_every_change_whatever_a_group_holds(density):
    """The change count takes a group's first four changes without a branch and loops over the
    rest: groups of 0, 1-4 and 5-32 changes all count exactly (against one entry at a time)."""
    rng = np.random.default_rng(int(density * 1000))
    n = 40_037
    x = bits(torch.from_numpy(rng.standard_normal(n) * 0.05).to(torch.bfloat16)).copy()
    y = x.copy()
    moved = rng.random(n) < density
    y[moved] ^= rng.integers(1, 1 << 16, moved.sum(), dtype=np.uint16)  # any nonzero change of bits
    ctx = Context.of("BF16", 2)
    args = np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins
    exact = kernels.bin_histogram(x, y, *args, 1)
    _, k_bin, _ = kernels.change_histogram(x, y, kernels.packed_words(x)[1], kernels.packed_words(y)[1], *args, 17)
    assert (k_bin == exact[1]).all() and k_bin.sum() == (x != y).sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [50_001, 50_003, 50_007])  # tails past the last 64-bit word and 32-entry group
def test_zoned_kernels_every_mode_and_tail(dtype, n):
    """Realistic small-lr changes (bitmap/"zeros" zones among small weights) plus rare changes of
    large weights (a "ones" zone), with changed entries in the unaligned tail."""
    rng = np.random.default_rng(n)
    master = torch.from_numpy(rng.standard_normal(n) * 0.02)
    master[rng.choice(n, 500, replace=False)] *= 1e-4  # a population of tiny weights: all change
    step = {torch.bfloat16: 2e-6, torch.float16: 2e-7, torch.float32: 3e-11, torch.float64: 1e-19}[dtype]
    a = master.to(dtype)
    new = master - step * torch.from_numpy(np.sign(rng.standard_normal(n)))
    b = new.to(dtype)
    big = torch.from_numpy(rng.choice(n, 40, replace=False))
    b[big] = -b[big]  # rare large changes
    b[-3:] = b[-3:] + 1  # the tail changes too
    x, y = bits(a), bits(b)
    ctx = Context.of(dtype_name(dtype), x.itemsize)
    args = np.uint64(ctx.magmask), np.uint64(ctx.shift), ctx.nbins
    words = x, y, kernels.packed_words(x)[1], kernels.packed_words(y)[1], *args
    exact = kernels.bin_histogram(x, y, *args, 1)  # one entry at a time
    n_bin, k_bin, stride = kernels.change_histogram(*words, 1)
    assert stride == 1 and (n_bin == exact[0]).all() and (k_bin == exact[1]).all() and k_bin.sum() == (x != y).sum()
    n_est, k_bin, stride = kernels.change_histogram(*words, 17)  # 16-bit dtypes: entries sampled
    assert (k_bin == exact[1]).all() and (n_est >= k_bin).all()
    assert stride == (17 if x.itemsize == 2 else 1) and abs(n_est.sum() - n) < 0.05 * n
    patch = PatchEncoder().encode({"w": a}, {"w": b})
    modes = {z.mode for z in parse_patch(patch).tensors[0].zones if z.nnz}
    assert {"bitmap", "ones"} <= modes or {"zeros", "ones"} <= modes, modes
    assert same(apply_patch({"w": a}, patch)["w"], b)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_group_masks_follow_their_definition(dtype):
    """The vector compares behind the chunk scan and the change histogram, bit by bit against numpy,
    including magnitude ranges at either end of the width and unaligned starts."""
    from numba import njit

    @njit
    def masks(a, b, magmask, lo, span):
        n = (a.size - 1) // kernels.GROUP
        out = np.empty((2, n), dtype=np.uint32)
        for g in range(n):  # start at 1: unaligned loads
            out[0, g] = kernels._group_members(a, 1 + g * kernels.GROUP, magmask, lo, span)
            out[1, g] = kernels._group_changes(a, b, 1 + g * kernels.GROUP)
        return out

    rng = np.random.default_rng(0)
    width = np.dtype(dtype).itemsize * 8
    top = (1 << (width - 1)) - 1
    a = rng.integers(0, 1 << width, 32 * 64 + 1, dtype=np.uint64).astype(dtype)
    a[::7] = rng.integers(0, 4, a[::7].size).astype(dtype)  # values at the ends of the range
    a[::5] = (top - rng.integers(0, 4, a[::5].size)).astype(dtype)
    b = a.copy()
    b[rng.random(a.size) < 0.3] ^= dtype(1)
    for lo, hi in [(0, 3), (2, top - 1), (top - 2, top + 1), (0, top + 1)]:
        got = masks(a, b, dtype(top), dtype(lo), dtype(hi - lo))
        mag = (a & dtype(top)).astype(np.uint64)[1 : 1 + got.shape[1] * 32].reshape(-1, 32)
        changed = (a != b)[1 : 1 + got.shape[1] * 32].reshape(-1, 32)
        weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
        assert (got[0] == (((mag >= lo) & (mag < hi)) * weights).sum(1)).all(), (lo, hi)
        assert (got[1] == (changed * weights).sum(1)).all()


def test_zones_that_outgrow_their_estimate_are_recounted(monkeypatch):
    """Zones are sized from sampled counts; when a zone holds more members than the room left for
    the estimate's error, the encoder counts exactly and codes again: the same patch as exact
    counts from the start."""
    from pulsenet.codec import mask

    rng = np.random.default_rng(3)
    master = torch.from_numpy(rng.standard_normal(60_001) * 0.02)
    master[rng.choice(master.numel(), 2_000, replace=False)] *= 1e-3  # a small-weight zone
    a, b = master.to(torch.bfloat16), (master - 2e-6).to(torch.bfloat16)
    monkeypatch.setattr(mask, "SAMPLE_STRIDE", 1)
    exact = PatchEncoder().encode({"w": a}, {"w": b})
    real, strides = kernels.change_histogram, []

    def undercount(*args):  # an estimate far below the truth, claiming to be a fine sample
        n_bin, k_bin, stride = real(*args)
        strides.append(args[-1])
        return (np.maximum(n_bin // 8, k_bin), k_bin, 2) if args[-1] > 1 else (n_bin, k_bin, stride)

    monkeypatch.setattr(mask, "SAMPLE_STRIDE", 17)
    monkeypatch.setattr(kernels, "change_histogram", undercount)
    assert PatchEncoder().encode({"w": a}, {"w": b}) == exact and strides == [17, 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_way_of_finding_zone_members_codes_the_same(dtype, monkeypatch):
    """How the kernels find a zone's members (listed by zone, counted a word at a time, or the
    complement of what is below the top zone) is chosen for speed, separately by the encoder and
    the decoder: every choice must give the same patch and the same rebuilt tensor."""
    from pulsenet.codec import kernels

    rng = np.random.default_rng(7)
    n = 40_003
    master = torch.from_numpy(rng.standard_normal(n) * 0.02)
    master[rng.choice(n, 300, replace=False)] *= 1e-4
    step = 2e-6 if dtype == torch.bfloat16 else 3e-11
    a = master.to(dtype)
    b = (master - step * torch.from_numpy(np.sign(rng.standard_normal(n)))).to(dtype)
    big = torch.from_numpy(rng.choice(n, 60, replace=False))
    b[big] = b[big] * 1.5  # changes among the large weights: the top zone is coded
    b[-2:] = -b[-2:]

    def random_how(los, his, zmode, members, below_top, n, nbins):
        how = np.where(zmode == kernels.ONES, rng.integers(0, 2, zmode.size), kernels.BUCKET).astype(np.int8)
        if his[-1] == nbins and zmode[-1] == kernels.ONES and rng.random() < 0.5:
            how[-1] = kernels.COMPLEMENT
        seen.update(how.tolist())
        return how

    reference = PatchEncoder().encode({"w": a}, {"w": b})
    tables = [z for z in parse_patch(reference).tensors[0].zones if z.nnz]
    assert tables[-1].mode == "ones" and tables[-1].hi == 512 and len(tables) >= 3, tables
    seen: set[int] = set()
    monkeypatch.setattr(kernels, "member_search", random_how)
    for _ in range(12):
        assert PatchEncoder().encode({"w": a}, {"w": b}) == reference
        assert same(apply_patch({"w": a}, reference)["w"], b)
    assert {kernels.COUNT, kernels.COMPLEMENT, kernels.BUCKET} <= seen


def test_zoned_decoder_rejects_inconsistent_zones(monkeypatch):
    """Wrong zone contents or sizes (the multi-zone path) raise PatchCorruptError, base untouched."""
    from dataclasses import replace

    from pulsenet.codec import mask

    monkeypatch.setattr(mask, "SAMPLE_STRIDE", 1)  # the zone plan of exact counts has the zones tampered with below
    rng = np.random.default_rng(3)
    master = rng.standard_normal(30_001) * 0.02
    master[rng.choice(master.size, 300, replace=False)] *= 1e-4
    a = bits(torch.from_numpy(master).to(torch.bfloat16))
    b_t = torch.from_numpy(master - 2e-6 * np.sign(rng.standard_normal(master.size))).to(torch.bfloat16)
    b_t[rng.choice(master.size, 40, replace=False)] *= -1
    b = bits(b_t)
    zones, raw, codes = mask.encode_sparse(a, b, "BF16")
    assert same(torch.from_numpy(mask.decode_sparse(a, "BF16", zones, raw, codes)), torch.from_numpy(b))
    bm = next(i for i, z in enumerate(zones) if z.mode == "bitmap" and z.count % 8 > 1)
    ones = next(i for i, z in enumerate(zones) if z.mode == "ones" and z.count)
    starts = np.cumsum([0] + [z.size for z in zones])

    def tampered(at: int, data: bytes) -> bytes:
        return raw[:at] + data + raw[at + len(data) :]

    last = starts[bm + 1] - 1  # the bitmap's last byte: set a padding bit
    z = zones[ones]
    planes = bytearray(raw[starts[ones] : starts[ones + 1]])
    for k in range(z.width):  # the first gap: as far as the width allows (past the tensor or its members)
        planes[k * z.count] = 0xFF
    cases = {
        "padding": (zones, tampered(last, bytes([raw[last] | 0x80]))),
        "outside|rank gap": (zones, tampered(starts[ones], bytes(planes))),
        "declares": (
            [*zones[:ones], replace(z, count=0, size=0), *zones[ones + 1 :]],
            raw[: starts[ones]] + raw[starts[ones + 1] :],
        ),
        "flags": ([*zones[:bm], replace(zones[bm], count=zones[bm].count - 1), *zones[bm + 1 :]], raw),
        "disagree": ([*zones[:ones], replace(z, width=3), *zones[ones + 1 :]], raw),
    }
    for match, (zs, mk) in cases.items():
        before = a.copy()
        with pytest.raises(PatchCorruptError, match=match):
            mask.decode_sparse(a, "BF16", zs, mk, codes)
        assert (a == before).all()


def test_special_values_bit_exact():
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 1.0, -1.0])
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        a = specials.to(dtype).repeat(500)
        u = bits(a).copy()
        u[::7] ^= u.dtype.type(1 << (8 * u.dtype.itemsize - 1))  # sign flips, -0 <-> +0
        u[4::9] |= u.dtype.type(3)  # NaN payloads, subnormal steps
        b = torch.from_numpy(u).view(dtype)
        out = apply_patch({"x": a}, PatchEncoder().encode({"x": a}, {"x": b}))
        assert same(out["x"], b)


def test_added_removed_reshaped_and_retyped_tensors():
    a = {"keep": torch.arange(10.0), "gone": torch.ones(4), "reshaped": torch.zeros(6), "retyped": torch.ones(5)}
    b = {"keep": torch.arange(10.0), "new": torch.full((2, 2), 3.0), "reshaped": torch.zeros(2, 3),
         "retyped": torch.ones(5, dtype=torch.bfloat16)}
    data = PatchEncoder().encode(a, b)
    p = parse_patch(data)
    ops = {e.name: e.op for e in p.tensors}
    assert ops == {"keep": "keep", "new": "full", "reshaped": "full", "retyped": "full"}
    assert p.removed == ["gone"]
    out = apply_patch(a, data)
    assert_state_equal(out, b)
    assert out["keep"] is a["keep"]  # unchanged tensors are shared, never copied


def test_digests_in_patch_match_model_digest():
    rng = np.random.default_rng(1)
    a = {"w": realistic_bf16(rng, 5000, 1e-3)[0], "b": torch.zeros(3)}
    b = {"w": mutate(rng, a["w"], 0.1), "b": torch.ones(3)}
    p = parse_patch(PatchEncoder().encode(a, b))
    assert p.base_digest == model_digest(a)
    assert p.target_digest == model_digest(b)
    # the digest covers values, dtype, shape and names
    assert model_digest({"w2": a["w"], "b": a["b"]}) != model_digest(a)
    assert model_digest({"w": a["w"].reshape(50, 100), "b": a["b"]}) != model_digest(a)


# ----------------------------------------------------------------------------- hostile input


@pytest.fixture(scope="module")
def pair():
    rng = np.random.default_rng(7)
    a_w, b_w = realistic_bf16(rng, 60_000, 3e-5)
    a = {"w": a_w.reshape(200, 300), "n": torch.ones(300, dtype=torch.bfloat16), "i": torch.arange(20)}
    b = {"w": b_w.reshape(200, 300), "n": torch.ones(300, dtype=torch.bfloat16) * 1.5, "i": torch.arange(20) * 2}
    return a, b, PatchEncoder().encode(a, b)


def snapshot(state: dict) -> dict:
    return {k: bits(v).copy() for k, v in state.items()}


def assert_untouched(state: dict, snap: dict) -> None:
    for k, v in state.items():
        assert np.array_equal(bits(v), snap[k]), f"base tensor {k} changed"


def test_every_truncation_is_rejected(pair):
    a, _, data = pair
    snap = snapshot(a)
    for cut in sorted({0, 1, 7, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5, len(data) // 2, len(data) - 1}):
        with pytest.raises(PatchFormatError):
            apply_patch(a, data[:cut])
    assert_untouched(a, snap)


def test_flipped_bytes_never_yield_wrong_weights(pair):
    """Any single corrupted byte either raises a PatchError or (if it is immaterial) rebuilds B exactly."""
    a, b, data = pair
    snap = snapshot(a)
    rng = np.random.default_rng(3)
    positions = list(range(0, HEADER_SIZE)) + list(rng.choice(np.arange(HEADER_SIZE, len(data)), 150, replace=False))
    raised = 0
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = apply_patch(a, bytes(bad))
        except PatchError:
            raised += 1
            continue
        assert_state_equal(out, b)
    assert raised > len(positions) * 0.9
    assert_untouched(a, snap)


def test_wrong_base_is_named(pair):
    a, _, data = pair
    other = dict(a)
    other["n"] = torch.zeros(300, dtype=torch.bfloat16)
    with pytest.raises(BaseMismatchError, match="different version"):
        apply_patch(other, data)
    with pytest.raises(BaseMismatchError, match="patch expects"):
        apply_patch({**a, "w": a["w"].float()}, data)
    with pytest.raises(BaseMismatchError, match="no tensor"):
        apply_patch({k: v for k, v in a.items() if k != "w"}, data)


def _rewrite_table(data: bytes, edit) -> bytes:
    """Re-pack a patch after editing its (decompressed) table: a forger's tool."""
    magic, ver, flags, tsize, _traw, bsize = struct.unpack_from("<8sHHIIQ", data)
    table = json.loads(zstandard.ZstdDecompressor().decompress(data[HEADER_SIZE : HEADER_SIZE + tsize]))
    edit(table)
    raw = json.dumps(table).encode()
    zt = zstandard.ZstdCompressor().compress(raw)
    return struct.pack("<8sHHIIQ", magic, ver, flags, len(zt), len(raw), bsize) + zt + data[HEADER_SIZE + tsize :]


def _sparse(table: dict) -> dict:
    return next(t for t in table["tensors"] if t["op"] == "sparse" and t["name"] == "w")


@pytest.mark.parametrize(
    "edit,error",
    [
        (lambda t: _sparse(t).update(sha256="0" * 64), DigestMismatchError),
        (lambda t: t.update(target_digest="0" * 64), DigestMismatchError),
        (lambda t: _sparse(t).update(nnz=_sparse(t)["nnz"] + 1), PatchCorruptError),
        (lambda t: _sparse(t).update(shape=[100, 600]), BaseMismatchError),
        (lambda t: _sparse(t).update(dtype="F16"), PatchCorruptError),
        (lambda t: _sparse(t).update(dtype="X99"), PatchError),
        (lambda t: _sparse(t).update(op="rewrite"), PatchCorruptError),
        (lambda t: _sparse(t)["mask"].__setitem__(0, 10**9), PatchCorruptError),
        (lambda t: _sparse(t)["values"].__setitem__(2, 10**12), PatchCorruptError),
        (lambda t: _sparse(t)["zones"].reverse(), PatchCorruptError),
        (lambda t: t["tensors"].reverse(), PatchCorruptError),
        (lambda t: t.update(removed=["w"]), PatchCorruptError),
        (lambda t: t.update(removed=["ghost"]), BaseMismatchError),
        (lambda t: t["tensors"].pop(0), BaseMismatchError),
        (lambda t: t.update(version=2), PatchCorruptError),
    ],
)
def test_forged_tables_are_rejected(pair, edit, error):
    a, _, data = pair
    snap = snapshot(a)
    with pytest.raises(error):
        apply_patch(a, _rewrite_table(data, edit))
    assert_untouched(a, snap)


def test_forged_ranks_and_values_are_rejected(pair):
    """Consistent sizes but out-of-range ranks or zero changes: caught by the decoder, not by the hash."""
    a, _, data = pair

    def forge(section: str, payload: bytes, **zone_edit) -> bytes:
        body = bytearray(data)
        p = parse_patch(data)
        w = next(e for e in p.tensors if e.name == "w")
        off, size, _ = w.sections[section]
        new = compress(payload)
        start = p.body_start + off

        def edit(t):
            s = _sparse(t)
            s[section] = [off, len(new), len(payload)]
            if zone_edit:
                s["zones"] = zone_edit["zones"]

        body[start : start + size] = new + b"\0" * (size - len(new)) if len(new) <= size else new[:size]
        return _rewrite_table(bytes(body), edit) if len(new) <= size else data

    p = parse_patch(data)
    w = next(e for e in p.tensors if e.name == "w")
    zero_values = np.zeros(w.nnz, dtype=np.uint16).tobytes()
    forged = forge("values", zero_values)
    if forged is not data:
        with pytest.raises(PatchCorruptError):
            apply_patch(a, forged)
    # one ones-zone listing a rank far beyond the tensor
    ranks = np.array([10**6], dtype=np.uint32).tobytes()
    zones = [[512, "ones", 1, 4, 4, 1]]
    forged = forge("mask", ranks, zones=zones)

    def fix_nnz(t):
        s = _sparse(t)
        s["nnz"] = 1
        s["values"] = [s["values"][0], s["values"][1], 2]

    with pytest.raises(PatchCorruptError):
        apply_patch(a, _rewrite_table(forged, fix_nnz))


def test_zstd_bomb_is_refused(pair):
    a, _, data = pair
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))  # 64 MiB of zeros in a few KB
    p = parse_patch(data)
    w = next(e for e in p.tensors if e.name == "w")
    body = bytes(p.data[p.body_start :]) + bomb
    off = len(body) - len(bomb)

    def edit(t):
        _sparse(t)["values"] = [off, len(bomb), w.sections["values"][2]]

    magic, ver, flags, tsize, traw, _ = struct.unpack_from("<8sHHIIQ", data)
    grown = struct.pack("<8sHHIIQ", magic, ver, flags, tsize, traw, len(body)) + data[HEADER_SIZE : HEADER_SIZE + tsize] + body
    with pytest.raises(PatchSizeLimitError):
        apply_patch(a, _rewrite_table(grown, edit))
    # a table that declares an absurd size is refused before decompression
    magic, ver, flags, tsize, traw, bsize = struct.unpack_from("<8sHHIIQ", data)
    huge = struct.pack("<8sHHIIQ", magic, ver, flags, tsize, 1 << 31, bsize) + data[HEADER_SIZE:]
    with pytest.raises(PatchSizeLimitError):
        parse_patch(huge)


def test_bad_magic_and_version(pair):
    _, _, data = pair
    with pytest.raises(PatchFormatError, match="magic"):
        parse_patch(b"NOTAPTCH" + data[8:])
    with pytest.raises(PatchFormatError, match="version"):
        parse_patch(data[:8] + struct.pack("<H", 9) + data[10:])


def test_visibility_gate_compares_bits():
    theta = torch.tensor([1.0, 1.0, 0.0, -0.0, 1e-3], dtype=torch.float32)
    upd = torch.tensor([1e-9, 0.01, 0.0, 0.0, 1e-3])
    assert visible_change(theta, upd).tolist() == [False, True, False, False, True]


# ----------------------------------------------------------------------------- streaming + CLI


def test_streaming_memory_is_bounded(tmp_path):
    """Encode + apply a 384 MB checkpoint pair; peak RSS growth stays far below the model size."""
    script = textwrap.dedent(
        f"""
        import resource, sys, numpy as np, torch
        from pulsenet.checkpoint import Checkpoint, write_safetensors
        from pulsenet.codec.patch import PatchEncoder, apply_patch, iter_apply, parse_patch
        from pulsenet.runtime import return_large_buffers_to_os
        return_large_buffers_to_os()  # as the CLI and the nodes do
        x = {{"w": torch.randn(1 << 16).to(torch.bfloat16)}}
        apply_patch(x, PatchEncoder().encode(x, {{"w": x["w"] * 2}}))  # JIT-load the kernels first
        d = {str(tmp_path)!r}
        n, count = 8 << 20, 24  # 24 BF16 tensors of 16 MiB: 384 MiB per checkpoint
        meta = {{f"t{{i:02d}}": ("BF16", (n,)) for i in range(count)}}
        def gen(step):
            for i in range(count):
                g = torch.Generator().manual_seed(i)
                w = torch.randn(n, generator=g) * 0.02
                if step:
                    w = w - 1e-5 * torch.sign(torch.randn(n, generator=g))
                yield f"t{{i:02d}}", w.to(torch.bfloat16)
        write_safetensors(d + "/a.safetensors", meta, gen(0))
        write_safetensors(d + "/b.safetensors", meta, gen(1))
        base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        a, b = Checkpoint(d + "/a.safetensors"), Checkpoint(d + "/b.safetensors")
        data = PatchEncoder(threads=2).encode(a, b)
        p = parse_patch(data)
        write_safetensors(d + "/c.safetensors", {{e.name: (e.dtype, e.shape) for e in p.tensors}}, iter_apply(a, p))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - base_rss) * 1024, len(data))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    growth, patch_size = map(int, out.stdout.split())
    model = 24 * (16 << 20)
    # bound: 2 threads x (base + new + temporaries) of one 16 MiB tensor, plus the payload twice
    assert growth < 10 * (16 << 20) + 2 * patch_size, f"RSS grew {growth / 2**20:.0f} MiB for a {model >> 20} MiB model"
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulsenet", *args], capture_output=True, text=True, timeout=300)


def test_cli_round_trip_on_hf_directories(tmp_path):
    rng = np.random.default_rng(5)
    a_w, b_w = realistic_bf16(rng, 100_000, 1e-4)
    a = {"model.w": a_w.reshape(100, 1000), "model.norm": torch.ones(64, dtype=torch.bfloat16)}
    b = {"model.w": b_w.reshape(100, 1000), "model.norm": torch.ones(64, dtype=torch.bfloat16) * 2}
    # OLD as a sharded HF directory, NEW as a single file
    old = tmp_path / "old"
    old.mkdir()
    save_state(old / "model-00001-of-00002.safetensors", {"model.w": a["model.w"]})
    save_state(old / "model-00002-of-00002.safetensors", {"model.norm": a["model.norm"]})
    (old / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.w": "model-00001-of-00002.safetensors", "model.norm": "model-00002-of-00002.safetensors"}}))
    (old / "config.json").write_text("{}")
    save_state(tmp_path / "new.safetensors", b)

    r = run_cli("patch", "encode", str(old), str(tmp_path / "new.safetensors"), "-o", str(tmp_path / "p.pnp"))
    assert r.returncode == 0, r.stderr
    r = run_cli("patch", "apply", str(old), str(tmp_path / "p.pnp"), "-o", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    out = Checkpoint(tmp_path / "out")
    assert_state_equal({k: out[k] for k in out}, b)
    assert (tmp_path / "out" / "config.json").exists()
    digest = run_cli("digest", str(tmp_path / "out")).stdout.strip()
    assert digest == model_digest(b)
    r = run_cli("patch", "inspect", str(tmp_path / "p.pnp"), "--json")
    info = json.loads(r.stdout)
    assert info["target_digest"] == digest and {t["name"] for t in info["tensors"]} == set(b)

    # a wrong base: clear message, non-zero exit, output left as it was
    save_state(tmp_path / "wrong.safetensors", b)
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    r = run_cli("patch", "apply", str(tmp_path / "wrong.safetensors"), str(tmp_path / "p.pnp"),
                "-o", str(tmp_path / "out" / "model.safetensors"))
    assert r.returncode != 0 and "BaseMismatchError" in r.stderr
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    r = run_cli("patch", "apply", str(tmp_path / "missing"), str(tmp_path / "p.pnp"), "-o", str(tmp_path / "x"))
    assert r.returncode == 2 and "does not exist" in r.stderr
