"""PULSELoCo payload v2: values coded relative to the base weights, bit-exact round trips, forgeries refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pulsenet.codec import payload as wire
from pulsenet.codec import relative
from pulsenet.codec.coding import compress, encode_positions, to_planes
from pulsenet.errors import PayloadError
from pulsenet.loco import algorithm as alg

pytestmark = pytest.mark.timeout(120)

SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0x3F7FFFFF,
    0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
    0x33800000, 0x4B800000, 0x3C23D70A,
]  # fmt: skip
"""±0, ±min subnormal, max subnormal, min normal, 1 and its neighbours and BF16 ties, ±max, ±inf, NaNs,
2^-24, 2^24, 0.01."""

u32 = st.integers(0, 0xFFFFFFFF)
bit_arrays = hnp.arrays(np.uint32, st.integers(1, 64), elements=st.one_of(u32, st.sampled_from(SPECIAL_BITS)))


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint32)


def _gated(seed: int, n: int = 20_000, scale: float = 3e-3) -> tuple[np.ndarray, np.ndarray]:
    """θ and the values the gate sends in a second round: error feedback from the first, an outer step between."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n, generator=g) * 0.05

    def local(t: torch.Tensor) -> torch.Tensor:  # a few inner steps of relative size ``scale``
        return t + torch.randn(n, generator=g) * t.abs() * scale

    idx, values, error = alg.gate(theta, alg.pseudo_gradient(theta, local(theta), None))
    theta = theta.clone()
    theta[idx] -= torch.from_numpy(values) * 0.7  # an outer step on the sent entries
    idx, values, _ = alg.gate(theta, alg.pseudo_gradient(theta, local(theta), error))
    return theta.numpy()[idx], values


# --- the value code ---------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(base=bit_arrays, data=st.data())
def test_relative_code_round_trips_any_bits(base: np.ndarray, data: st.DataObject) -> None:
    """Random θ and s, including ±0, subnormals, huge values, inf and NaN: bit-exact, via escapes."""
    values = data.draw(hnp.arrays(np.uint32, base.shape, elements=st.one_of(u32, st.sampled_from(SPECIAL_BITS))))
    codes, escaped = relative.encode(base, values.view(np.float32))
    assert codes.size == int((~escaped).sum())
    back = relative.decode(base[~escaped], codes)
    assert np.array_equal(_bits(back), values[~escaped])


@settings(max_examples=300, deadline=None)
@given(
    base=bit_arrays,
    k=st.integers(1, (1 << 24) - 1),
    sign=st.booleans(),
)
def test_relative_code_round_trips_multiples_of_the_ulp(base: np.ndarray, k: int, sign: bool) -> None:
    """s = ±k·ulp(θ): coded (not escaped) whenever k clears the threshold, and always bit-exact."""
    a = base.astype(np.int64) & 0x7FFFFFFF
    e = a >> 23
    with np.errstate(over="ignore"):  # k·ulp of a weight near FP32's maximum overflows to inf: escaped
        s = np.ldexp(np.full(base.shape, -k if sign else k, np.float64), np.maximum(e, 1) - 150)
        s = s.astype(np.float32)
    codes, escaped = relative.encode(base, s)
    back = np.empty_like(s)
    back[~escaped] = relative.decode(base[~escaped], codes)
    back[escaped] = s[escaped]
    assert np.array_equal(_bits(back), _bits(s))
    toward = (_bits(s) >> 31) == (base >> 31)
    expected_coded = (e < 255) & (k >= relative.threshold(a, toward))
    assert np.array_equal(~escaped, expected_coded)


@pytest.mark.parametrize("seed", range(4))
def test_gated_values_code_without_escapes_and_shrink(seed: int) -> None:
    theta, values = _gated(seed)
    assert values.size > 500
    codes, escaped = relative.encode(_bits(theta), values)
    # Escapes: values that are not multiples of ulp(θ) (a binade crossed between rounds), a few per mille.
    assert escaped.sum() <= values.size // 100
    assert np.array_equal(_bits(relative.decode(_bits(theta)[~escaped], codes)), _bits(values)[~escaped])
    raw = len(compress(to_planes(_bits(values))))
    coded = len(compress(to_planes(codes.astype(np.uint16 if codes.max() < 1 << 16 else np.uint32))))
    assert coded < 0.85 * raw, (coded, raw)


def test_threshold_is_a_lower_bound_and_mostly_tight() -> None:
    """|k| = T - 1 never leaves θ's BF16 cell; |k| = T nearly always does."""
    from pulsenet.codec.bf16 import visible_change

    rng = np.random.default_rng(1)
    theta = np.concatenate(
        [
            (rng.standard_normal(20_000) * 0.05).astype(np.float32),
            # near binade edges and BF16 ties, both signs, subnormals
            _edge_values(rng, 20_000),
        ]
    )
    tb = _bits(theta).astype(np.int64)
    a = tb & 0x7FFFFFFF
    u = np.ldexp(1.0, np.maximum(a >> 23, 1) - 150)
    below = tight = total = 0
    for neg in (False, True):
        t = relative.threshold(a, (tb >> 31) == int(neg))
        for k, is_below in ((t - 1, True), (t, False)):
            s = (np.where(neg, -1.0, 1.0) * k * u).astype(np.float32)
            ok = (k >= 1) & np.isfinite(s) & (s.astype(np.float64) == np.where(neg, -1.0, 1.0) * k * u)
            vis = visible_change(torch.from_numpy(theta[ok]), torch.from_numpy(s[ok])).numpy()
            if is_below:
                below += int(vis.sum())
            else:
                tight, total = tight + int(vis.sum()), total + int(ok.sum())
    assert below == 0
    assert tight > 0.95 * total  # half the θ here sit on binade edges, where T is a bound, not exact


def _edge_values(rng: np.random.Generator, n: int) -> np.ndarray:
    exp = rng.integers(0, 254, n).astype(np.int64) << 23
    jitter = rng.integers(-0x20000, 0x20000, n)
    sign = rng.integers(0, 2, n).astype(np.int64) << 31
    return (np.clip(exp + jitter, 0, 0x7F7FFFFF) | sign).astype(np.uint32).view(np.float32)


def test_context_follows_the_spec() -> None:
    """max(E, 1) + bitlen(|(a & 0xFFFF) - 0x8000|) (docs/format.md) for every low half, exponent and sign."""
    low = np.arange(1 << 16, dtype=np.uint32)
    for e in (0, 1, 2, 117, 254, 255):
        for sign in (0, 1):
            bits = (np.uint32(sign << 31) | np.uint32(e << 23) | np.uint32(0x10000 * 37) | low).astype(np.uint32)
            bitlen = np.frexp(np.abs(low.astype(np.int64) - 0x8000).astype(np.float64))[1]  # frexp(0) -> 0
            assert np.array_equal(relative.context(bits), max(e, 1) + bitlen)


def test_positions_frame_follows_the_spec() -> None:
    """Per context (ascending), the sent entries' ordinals within the context's group, as gaps in
    byte planes of the narrowest width: built here the slow way, by sorting entries by context."""
    rng = np.random.default_rng(5)
    theta = (rng.standard_normal(50_000) * 0.05).astype(np.float32)
    indices = np.flatnonzero(rng.random(theta.size) < 0.07)
    ctx = relative.context(_bits(theta)).astype(np.int64)
    order = np.argsort(ctx, kind="stable")
    ordinal = np.empty(theta.size, np.int64)
    ordinal[order] = np.arange(theta.size) - np.searchsorted(ctx[order], ctx[order])
    table, planes = [], []
    for c in np.unique(ctx[indices]):
        width, gaps = encode_positions(ordinal[indices[ctx[indices] == c]])
        table.append(struct.pack("<HQB", c, int((ctx[indices] == c).sum()), width))
        planes.append(gaps)
    want = struct.pack("<H", len(table)) + b"".join(table) + compress(b"".join(planes))
    assert wire._encode_grouped_positions(_bits(theta), indices) == want
    assert np.array_equal(wire._decode_grouped_positions(want, _bits(theta), indices.size), indices)


# --- whole payloads -----------------------------------------------------------------------------------


def _payload_and_base(seed: int) -> tuple[wire.Payload, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    base = {
        "w": (rng.standard_normal((64, 100)) * 0.05).astype(np.float32),
        "b": np.array(SPECIAL_BITS, dtype=np.uint32).view(np.float32).copy(),
        "empty": np.ones((4, 4), np.float32),
        "scalar": np.array(0.5, np.float32),
    }
    local = base["w"] + (rng.standard_normal((64, 100)) * 0.05 * 4e-3).astype(np.float32)
    s_w = base["w"] - local  # exact multiples of ulp(θ), like real pseudo-gradients
    s_w.reshape(-1)[:5] = [0.0, -0.0, np.nan, 1e30, 1e-42]  # escapes amid coded values
    idx, vals, _ = alg.gate(torch.from_numpy(base["w"]), torch.from_numpy(s_w))
    b_vals = np.array(list(reversed(SPECIAL_BITS)), dtype=np.uint32).view(np.float32)
    tensors = {
        "w": wire.SparseTensor((64, 100), np.concatenate([[0, 1, 2, 3, 4], idx[idx > 4]]),
                               np.concatenate([s_w.reshape(-1)[:5], vals[idx > 4]])),
        "b": wire.SparseTensor((len(SPECIAL_BITS),), np.arange(len(SPECIAL_BITS)), b_vals),
        "empty": wire.SparseTensor((4, 4), np.zeros(0, np.int64), np.zeros(0, np.float32)),
        "scalar": wire.SparseTensor((), np.array([0]), np.array([2.0**-10], np.float32)),
    }  # fmt: skip
    return wire.Payload(round=3, mode=wire.SPARSE, tensors=tensors), base


def _shapes(p: wire.Payload) -> dict[str, tuple[int, ...]]:
    return {n: t.shape for n, t in p.tensors.items()}


def _assert_same(p: wire.Payload, q: wire.Payload) -> None:
    assert (q.round, q.mode, sorted(q.tensors)) == (p.round, p.mode, sorted(p.tensors))
    for n, t in p.tensors.items():
        assert np.array_equal(q.tensors[n].indices, t.indices)
        assert np.array_equal(_bits(q.tensors[n].values), _bits(t.values)), n


@pytest.mark.parametrize("seed", range(3))
def test_payload_with_base_round_trips_bit_exactly(seed: int) -> None:
    p, base = _payload_and_base(seed)
    data = wire.encode(p, base)
    assert struct.unpack_from("<H", data, 8)[0] == 2
    assert wire.encode(p, base, threads=1) == data == wire.encode(p, base, threads=3)  # sections coded in parallel
    _assert_same(p, wire.decode(data, _shapes(p), base))
    torch_base = {n: torch.from_numpy(t) for n, t in base.items()}  # CPU tensors work as the base too
    _assert_same(p, wire.decode(wire.encode(p, torch_base), _shapes(p), torch_base))
    assert len(data) < len(wire.encode(p))
    noise = wire.Payload(p.round, p.mode, dict(p.tensors))
    t = p.tensors["w"]
    noise.tensors["w"] = wire.SparseTensor(t.shape, t.indices, (t.values * np.float32(1.0001)).astype(np.float32))
    # Mostly escapes (not multiples of the ulp): the section falls back to raw bits, never larger.
    assert len(wire.encode(noise, base)) <= len(wire.encode(noise))
    _assert_same(noise, wire.decode(wire.encode(noise, base), _shapes(p), base))


def test_dense_payload_round_trips_with_and_without_base() -> None:
    rng = np.random.default_rng(0)
    base = {"w": (rng.standard_normal(500) * 0.05).astype(np.float32)}
    local = base["w"] + (rng.standard_normal(500) * 1e-4).astype(np.float32)
    p = wire.Payload(1, wire.DENSE, {"w": wire.SparseTensor((500,), None, base["w"] - local)})
    for b in (None, base):
        _assert_same(p, wire.decode(wire.encode(p, b), {"w": (500,)}, base))


def test_decoding_against_another_base_refuses_or_gives_other_values() -> None:
    """Positions and values are relative to θ: a trainer on a diverged θ cannot read the payload as sent.

    Most often the position groups no longer fit (a PayloadError: the payload is unusable to it);
    otherwise it decodes other values, which its digest then exposes.
    """
    p, base = _payload_and_base(0)
    data = wire.encode(p, base)
    outcomes = set()
    for factor in (1.5, 1.0001, 0.999):
        other = {**base, "w": base["w"] * np.float32(factor)}
        try:
            q = wire.decode(data, _shapes(p), other)
        except PayloadError:
            outcomes.add("refused")
            continue
        same = all(np.array_equal(_bits(q.tensors[n].values), _bits(t.values)) for n, t in p.tensors.items())
        same &= all(np.array_equal(q.tensors[n].indices, t.indices) for n, t in p.tensors.items())
        assert not same
        outcomes.add("other values")
    assert "refused" in outcomes


def test_relative_sections_need_a_matching_base() -> None:
    p, base = _payload_and_base(0)
    data = wire.encode(p, base)
    with pytest.raises(PayloadError, match="none were given"):
        wire.decode(data, _shapes(p))
    with pytest.raises(PayloadError, match="lack"):
        wire.decode(data, _shapes(p), {n: t for n, t in base.items() if n != "w"})
    with pytest.raises(PayloadError, match="float32"):
        wire.decode(data, _shapes(p), {**base, "w": base["w"].astype(np.float64)})
    with pytest.raises(PayloadError, match="float32"):
        wire.decode(data, _shapes(p), {**base, "w": base["w"].reshape(100, 64)})


def test_version_1_payloads_are_refused() -> None:
    p, base = _payload_and_base(0)
    data = wire.encode(p, base)
    with pytest.raises(PayloadError, match="version 1"):
        wire.decode(data[:8] + struct.pack("<H", 1) + data[10:], _shapes(p), base)


# --- forged sections ------------------------------------------------------------------------------


def _forge(
    *,
    base: np.ndarray,
    indices: np.ndarray,
    coding: int = wire.RELATIVE,
    code_width: int = 2,
    codes: bytes = b"",
    escapes: tuple[np.ndarray, np.ndarray] | None = None,
    count: int | None = None,
    esc_width: int | None = None,
    n_escapes: int | None = None,
    positions: bytes | None = None,
) -> bytes:
    """A one-section sparse payload for tensor "w" (shape = base.shape) with hand-picked fields."""
    count = indices.size if count is None else count
    width, pos_frame = 0, positions
    if pos_frame is None and coding == wire.RELATIVE:
        pos_frame = wire._encode_grouped_positions(_bits(base).reshape(-1), indices.astype(np.int64))
    elif pos_frame is None:
        width, pos = encode_positions(indices.astype(np.int64))
        pos_frame = compress(pos)
    val_frame = compress(codes) if codes else b""
    esc_frame, n_esc, e_width = b"", 0, 0
    if escapes is not None:
        ordinals, raw = escapes
        e_width, gaps = encode_positions(ordinals)
        esc_frame, n_esc = compress(gaps + to_planes(raw.astype(np.uint32))), ordinals.size
    head = struct.pack("<8sHBBIQ", wire.MAGIC, 2, wire.SPARSE, 0, 1, 1)
    name = struct.pack("<H", 1) + b"w" + struct.pack(f"<B{base.ndim}Q", base.ndim, *base.shape)
    tail = struct.pack(
        "<QBQBBQBQQ", count, width, len(pos_frame), coding, code_width,
        n_esc if n_escapes is None else n_escapes, e_width if esc_width is None else esc_width,
        len(val_frame), len(esc_frame),
    )  # fmt: skip
    return head + name + tail + pos_frame + val_frame + esc_frame


BASE = np.full(16, 0.75, np.float32)


def test_forged_sections_decode_when_well_formed() -> None:
    # The helper itself is right: a code of 0 (|k| = T, positive) decodes to the smallest visible step.
    data = _forge(base=BASE, indices=np.array([2, 5]), codes=to_planes(np.array([0, 1], np.uint16)))
    vals = wire.decode(data, {"w": (16,)}, {"w": BASE}).tensors["w"].values
    assert np.array_equal(_bits(vals), _bits(relative.decode(_bits(BASE[[2, 5]]), np.array([0, 1]))))
    assert vals[0] > 0 > vals[1]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"codes": to_planes(np.array([0x7FFFFFF0], np.uint32)), "code_width": 4}, "2\\^24"),
        ({"codes": to_planes(np.array([1, 2], np.uint16))}, "decompressed|expected|bytes"),
        ({"coding": 7}, "coding 7"),
        ({"code_width": 3}, "code width 3"),
        ({"coding": wire.RAW, "code_width": 2}, "raw values"),
        ({"positions": struct.pack("<H", 0) + compress(b"")}, "add up"),
        ({"escapes": (np.array([5]), np.array([1]))}, "out of range"),
        ({"escapes": (np.array([0]), np.array([1])), "esc_width": 3}, "width 3"),
        ({"escapes": (np.array([0]), np.array([1])), "n_escapes": 9}, "escapes"),
        ({"escapes": (np.array([0]), np.array([1])), "esc_width": 0}, "escapes"),
        ({"count": 3}, "add up"),
    ],
)
def test_forged_sections_are_refused(fields: dict, message: str) -> None:
    args = {"codes": to_planes(np.array([0], np.uint16))} | fields
    data = _forge(base=BASE, indices=np.array([4]), **args)
    with pytest.raises(PayloadError, match=message):
        wire.decode(data, {"w": (16,)}, {"w": BASE})


def _groups(*groups: tuple[int, int, int], planes: bytes = b"") -> bytes:
    table = struct.pack("<H", len(groups)) + b"".join(struct.pack("<HQB", *g) for g in groups)
    return table + compress(planes)


CTX = int(relative.context(_bits(BASE))[0])  # every entry of BASE shares one context (16 of them)


@pytest.mark.parametrize(
    "positions, message",
    [
        (_groups((CTX, 1, 1), planes=b"\x10"), "out of range"),  # ordinal 16 in a group of 16
        (_groups((CTX, 1, 1), planes=b"\xff"), "out of range for 16"),  # a gap past the tensor
        (_groups((CTX, 1, 8), planes=b"\xff" * 8), "out of range for 16"),  # one that would wrap int64
        (_groups((CTX, 1, 3), planes=b"\x00\x00\x00"), "valid width"),
        (_groups((CTX, 0, 1), (CTX + 1, 1, 1), planes=b"\x00"), "valid width|add up"),
        (_groups((CTX + 1, 1, 1), planes=b"\x00"), "out of range"),  # a context with no entries
        (_groups((CTX, 1, 1), (CTX, 1, 1), planes=b"\x00\x00"), "ascending"),
        (_groups((relative.N_CONTEXTS, 1, 1), planes=b"\x00"), "ascending"),
        (_groups((CTX, 1, 1), planes=b"\x00\x00"), "decompressed|expected|bytes"),
        (_groups((CTX, 1, 1), planes=b"\x00")[:5], "past the end"),
    ],
)
def test_forged_position_groups_are_refused(positions: bytes, message: str) -> None:
    data = _forge(base=BASE, indices=np.array([4]), codes=to_planes(np.array([0], np.uint16)), positions=positions)
    with pytest.raises(PayloadError, match=message):
        wire.decode(data, {"w": (16,)}, {"w": BASE})


def test_escape_count_must_match_its_frame() -> None:
    data = _forge(
        base=BASE, indices=np.array([1, 4, 9]), codes=to_planes(np.array([0, 0], np.uint16)),
        escapes=(np.array([1]), np.array([7])), n_escapes=2,
    )  # fmt: skip
    with pytest.raises(PayloadError, match=r"decompressed|expected|bytes"):
        wire.decode(data, {"w": (16,)}, {"w": BASE})


def test_a_code_on_a_non_finite_base_weight_is_refused() -> None:
    base = BASE.copy()
    base[4] = np.inf
    data = _forge(base=base, indices=np.array([4]), codes=to_planes(np.array([0], np.uint16)))
    with pytest.raises(PayloadError, match="non-finite base"):
        wire.decode(data, {"w": (16,)}, {"w": base})


def test_a_values_frame_that_expands_past_its_size_is_refused() -> None:
    bomb = compress(bytes(4 << 20))
    data = _forge(base=BASE, indices=np.array([4]), codes=to_planes(np.array([0], np.uint16)))
    good_frame = compress(to_planes(np.array([0], np.uint16)))
    i = data.rindex(good_frame)
    tail = struct.pack("<QQ", len(bomb), 0)
    forged = data[: i - 16 - len(compress(encode_positions(np.array([4]))[1]))]
    forged += tail + compress(encode_positions(np.array([4]))[1]) + bomb
    with pytest.raises(PayloadError):
        wire.decode(forged, {"w": (16,)}, {"w": BASE})


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_payloads_raise_payload_error_or_decode(data: st.DataObject) -> None:
    """Any flipped, dropped or inserted bytes: a PayloadError or a payload of the declared shapes, nothing else."""
    p, base = _payload_and_base(0)
    blob = bytearray(wire.encode(p, base))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        op = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        if op == "flip":
            blob[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "drop":
            del blob[i]
        else:
            blob.insert(i, data.draw(st.integers(0, 255)))
    try:
        q = wire.decode(bytes(blob), _shapes(p), base)
    except PayloadError:
        return
    for n, t in q.tensors.items():
        assert t.values.dtype == np.float32 and t.values.size <= int(np.prod(p.tensors[n].shape))
