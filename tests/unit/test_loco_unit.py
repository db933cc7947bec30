"""PULSELoCo unit tests: gate, error feedback, payload format, validation, aggregation, outer step, state files."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsenet.codec import payload as wire
from pulsenet.codec.bf16 import bits, visible_change
from pulsenet.errors import PayloadError, VerificationError
from pulsenet.loco import algorithm as alg
from pulsenet.loco.state import GlobalState, TrainerState

pytestmark = pytest.mark.timeout(60)


def _state(seed: int, shapes: dict[str, tuple[int, ...]] | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = shapes or {"a.weight": (8, 16), "b.bias": (16,), "c": (3, 4, 5)}
    return {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()}


def _near(theta: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """Local weights a few BF16 cells away from theta, so some entries cross a cell and some do not."""
    g = torch.Generator().manual_seed(seed)
    return {n: t + torch.randn(t.shape, generator=g) * scale * t.abs() for n, t in theta.items()}


def _same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    a = torch.as_tensor(a)
    b = torch.as_tensor(b)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


# --- gate and error feedback ------------------------------------------------------------------


def test_gate_sends_exactly_the_bf16_visible_entries() -> None:
    theta = _state(0)["a.weight"]
    s = theta - _near({"x": theta}, 0.01, 1)["x"]
    idx, values, residual = alg.gate(theta, s)
    mask = visible_change(theta, s).reshape(-1)
    assert 0 < idx.size < theta.numel()  # the test exercises both sides of the gate
    assert np.array_equal(idx, np.flatnonzero(mask.numpy()))
    assert _same_bits(values, s.reshape(-1)[mask])
    # Every sent entry really changes the BF16 view; every kept one does not.
    before = theta.to(torch.bfloat16).view(torch.int16).reshape(-1)
    after = (theta - s).to(torch.bfloat16).view(torch.int16).reshape(-1)
    assert torch.equal(before != after, mask)
    assert torch.all(residual.reshape(-1)[mask] == 0)


def test_gate_scale_gates_on_the_scaled_update_and_sends_s() -> None:
    """``gate_scale`` c sends where bf16(θ - c·s) != bf16(θ): a superset for c > 1, values still s."""
    theta = _state(0)["a.weight"]
    s = theta - _near({"x": theta}, 0.01, 1)["x"]
    idx1, _, _ = alg.gate(theta, s)
    idx, values, residual = alg.gate(theta, s, 1.33)
    mask = visible_change(theta, s * 1.33).reshape(-1)
    assert np.array_equal(idx, np.flatnonzero(mask.numpy())) and idx.size > idx1.size
    assert set(idx1.tolist()) <= set(idx.tolist())
    assert _same_bits(values, s.reshape(-1)[mask])
    assert _same_bits(torch.where(mask, s.reshape(-1), residual.reshape(-1)), s.reshape(-1))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=64),
    st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-0.0078125, max_value=0.0078125),
        min_size=1,
        max_size=64,
    ),
)
def test_error_feedback_loses_nothing(thetas: list[float], updates: list[float]) -> None:
    n = min(len(thetas), len(updates))
    theta = torch.tensor(thetas[:n], dtype=torch.float32)
    s = torch.tensor(updates[:n], dtype=torch.float32)
    idx, values, residual = alg.gate(theta, s)
    sent = torch.zeros_like(s)
    sent[torch.from_numpy(idx)] = torch.from_numpy(values)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(idx)] = True
    # sent + e == s exactly: disjoint supports, and together they are s bit for bit.
    assert _same_bits(torch.where(mask, sent, residual), s)
    assert torch.all(residual[mask] == 0)
    assert torch.all(sent[~mask] == 0)


def test_make_update_error_feedback_and_unsend() -> None:
    theta = _state(1)
    local = _near(theta, 0.01, 2)
    error = {n: torch.randn(t.shape) * 1e-5 for n, t in theta.items()}
    payload, new_error = alg.make_update(theta, local, error, round=3, sparse=True)
    assert payload.round == 3 and payload.mode == wire.SPARSE and 0 < payload.sent < payload.total
    assert new_error is not None
    s = {n: error[n] + (theta[n] - local[n]) for n in theta}
    alg.unsend(new_error, payload)  # e = s again, exactly
    for n in theta:
        assert _same_bits(new_error[n], s[n])


def test_dense_update_is_plain_pseudo_gradient() -> None:
    theta = _state(2)
    local = _near(theta, 0.01, 3)
    payload, new_error = alg.make_update(theta, local, None, round=1, sparse=False)
    assert new_error is None and payload.mode == wire.DENSE and payload.sent == payload.total
    for n, t in payload.tensors.items():
        assert _same_bits(t.values, (theta[n] - local[n]).reshape(-1))


# --- payload format -----------------------------------------------------------------------------


def _special_payload() -> wire.Payload:
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -2.5, 7e-6], dtype=np.float32)
    return wire.Payload(
        round=7,
        mode=wire.SPARSE,
        tensors={
            "w": wire.SparseTensor((1000,), np.array([0, 1, 2, 300, 301, 700, 998, 999]), specials),
            "empty": wire.SparseTensor((4, 4), np.zeros(0, np.int64), np.zeros(0, np.float32)),
            "big_gap": wire.SparseTensor((70000,), np.array([5, 69999]), np.array([1.5, -3.0], np.float32)),
            "scalar": wire.SparseTensor((), np.array([0]), np.array([2.0], np.float32)),
        },
    )


def test_payload_round_trip_is_bit_exact() -> None:
    p = _special_payload()
    q = wire.decode(wire.encode(p), {n: t.shape for n, t in p.tensors.items()})
    assert (q.round, q.mode, sorted(q.tensors)) == (7, wire.SPARSE, sorted(p.tensors))
    for n, t in p.tensors.items():
        assert np.array_equal(q.tensors[n].indices, t.indices)
        assert np.array_equal(q.tensors[n].values.view(np.uint32), t.values.view(np.uint32))


def test_payload_round_trip_real_update_both_modes() -> None:
    theta = _state(3)
    local = _near(theta, 0.02, 4)
    for sparse in (True, False):
        p, _ = alg.make_update(theta, local, None, round=2, sparse=sparse)
        data = wire.encode(p)
        assert data[:8] == wire.MAGIC
        q = wire.decode(data, {n: tuple(t.shape) for n, t in theta.items()})
        for n in theta:
            assert np.array_equal(q.tensors[n].indices, p.tensors[n].indices)
            assert np.array_equal(q.tensors[n].values.view(np.uint32), p.tensors[n].values.view(np.uint32))


def test_sparse_payload_is_much_smaller_when_few_entries_change() -> None:
    theta = _state(4, {"w": (256, 256)})
    g = torch.Generator().manual_seed(5)
    noise = theta["w"] * 1e-5 * torch.randn(256, 256, generator=g)  # below a BF16 cell: never sent
    jump = 1e-3 * torch.sign(theta["w"]) * (torch.rand(256, 256, generator=g) < 0.02)
    local = {"w": theta["w"] - noise - jump}
    sparse, _ = alg.make_update(theta, local, None, round=1, sparse=True)
    dense, _ = alg.make_update(theta, local, None, round=1, sparse=False)
    assert sparse.sent < 0.05 * sparse.total
    assert len(wire.encode(sparse)) * 10 < len(wire.encode(dense))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b"NOTLOCO!" + b[8:], "magic"),
        (lambda b: b[:8] + struct.pack("<H", 9) + b[10:], "version"),
        (lambda b: b[:10] + b"\x07" + b[11:], "mode"),
        (lambda b: b[:-3], "past the end"),
        (lambda b: b + b"\x00", "trailing"),
        (lambda b: b[:12] + struct.pack("<I", 99) + b[16:], "tensors"),
    ],
)
def test_payload_decode_rejects_malformed(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    p = _special_payload()
    shapes = {n: t.shape for n, t in p.tensors.items()}
    with pytest.raises(PayloadError, match=message):
        wire.decode(mutate(wire.encode(p)), shapes)


def test_payload_decode_rejects_wrong_shape_and_names() -> None:
    p = _special_payload()
    shapes = {n: t.shape for n, t in p.tensors.items()}
    with pytest.raises(PayloadError, match="shape"):
        wire.decode(wire.encode(p), {**shapes, "w": (999,)})
    with pytest.raises(PayloadError, match="shape"):
        wire.decode(wire.encode(p), {**{k: v for k, v in shapes.items() if k != "w"}, "v": (1000,)})


def test_payload_decode_rejects_out_of_range_index() -> None:
    bad = wire.Payload(
        1, wire.SPARSE, {"w": wire.SparseTensor((10,), np.array([3, 10]), np.ones(2, np.float32))}
    )
    with pytest.raises(PayloadError, match="out of range"):
        wire.decode(wire.encode(bad), {"w": (10,)})


def test_payload_decode_rejects_a_frame_that_expands_past_its_size() -> None:
    p = wire.Payload(1, wire.SPARSE, {"w": wire.SparseTensor((10,), np.array([3]), np.ones(1, np.float32))})
    data = bytearray(wire.encode(p))
    # The values frame of the single section declares 4 raw bytes; swap in a frame of 4 MiB of zeros.
    from pulsenet.codec.coding import compress

    bomb = compress(bytes(4 << 20))
    head_end = len(data) - len(compress(np.ones(1, np.float32).view(np.uint32).tobytes()))
    tail = struct.pack("<Q", len(bomb))
    data = data[: head_end - 8] + tail + bomb
    with pytest.raises(PayloadError):
        wire.decode(bytes(data), {"w": (10,)})


# --- validation ---------------------------------------------------------------------------------


def test_validate_rejects_non_finite_and_wrong_round_or_mode() -> None:
    ok = wire.Payload(
        2, wire.SPARSE, {"w": wire.SparseTensor((4,), np.array([1]), np.array([0.5], np.float32))}
    )
    assert alg.validate(ok, round=2, mode=wire.SPARSE) == pytest.approx(0.5)
    for v in (np.nan, np.inf, -np.inf):
        bad = wire.Payload(
            2, wire.SPARSE, {"w": wire.SparseTensor((4,), np.array([1]), np.array([v], np.float32))}
        )
        with pytest.raises(PayloadError, match="non-finite"):
            alg.validate(bad, round=2, mode=wire.SPARSE)
    with pytest.raises(PayloadError, match="round"):
        alg.validate(ok, round=3, mode=wire.SPARSE)
    with pytest.raises(PayloadError, match="mode"):
        alg.validate(ok, round=2, mode=wire.DENSE)


SCREEN = alg.NormScreen(factor=10.0, weights_factor=1.0, min_payloads=3)


def test_norm_screen_uses_the_median_with_enough_payloads_and_the_own_norm_below() -> None:
    big = 1000.0
    rejected = SCREEN.exclude({"a": 1.0, "b": 1.2, "c": big}, own="a", weights_norm=1e6)
    assert list(rejected) == ["c"] and "median" in rejected["c"]
    # Two trainers: the writer's own payload is the reference (the median of two proves nothing).
    rejected = SCREEN.exclude({"a": 1.0, "c": big}, own="a", weights_norm=1e6)
    assert list(rejected) == ["c"] and "own payload norm" in rejected["c"]
    # The hostile trainer as writer keeps both (nothing is larger than its own): the honest
    # reader then refuses that record (below) rather than average it.
    assert SCREEN.exclude({"a": 1.0, "c": big}, own="c", weights_norm=1e6) == {}
    assert list(SCREEN.refuse({"a": 1.0, "c": big}, own=1.0, weights_norm=1e6)) == ["c"]
    # No usable own reference and too few for a median: only the weights' scale bounds a payload.
    assert SCREEN.exclude({"a": 1.0, "c": big}, own=None, weights_norm=1e6) == {}
    over = SCREEN.exclude({"a": 1.0, "c": big}, own=None, weights_norm=10.0)
    assert list(over) == ["c"] and "weights norm" in over["c"]
    assert SCREEN.exclude({"a": 0.0, "b": 0.0, "c": 5.0}, own="a", weights_norm=1e6) == {}  # zero median
    # To a fixed point: dropping an outlier can leave fewer than min_payloads; the own norm takes over.
    rejected = SCREEN.exclude({"a": 1.0, "b": 30.0, "c": 1e4}, own="a", weights_norm=1e6)
    assert sorted(rejected) == ["b", "c"]


def test_reader_refuses_only_what_no_honest_writer_records() -> None:
    # An honest writer's 2-trainer record: a peer within factor of the writer, the reader's own
    # norm a factor 3 below the writer's: still followed (factor² room).
    assert SCREEN.refuse({"w": 3.0, "p": 25.0}, own=3.0 / 3, weights_norm=1e6) == {}
    # A record averaging a payload factor² over the reader's own is refused, as is one over ‖θ‖.
    assert list(SCREEN.refuse({"w": 3.0, "x": 1e30}, own=1.0, weights_norm=1e40)) == ["x"]
    assert list(SCREEN.refuse({"w": 3.0, "x": 11.0}, own=None, weights_norm=10.0)) == ["x"]
    # With a median: the writer's rule with a last-bit slack.
    assert SCREEN.refuse({"a": 1.0, "b": 1.0, "c": 10.005}, own=None, weights_norm=1e6) == {}
    assert list(SCREEN.refuse({"a": 1.0, "b": 1.0, "c": 10.02}, own=None, weights_norm=1e6)) == ["c"]


# --- aggregation and outer step ----------------------------------------------------------------


def _payloads(n: int) -> tuple[dict[str, torch.Tensor], dict[str, wire.Payload]]:
    theta = _state(10)
    out = {}
    for k in range(n):
        p, _ = alg.make_update(theta, _near(theta, 0.05, 100 + k), None, round=1, sparse=True)
        out[f"t{k}"] = p
    return theta, out


def test_aggregate_is_independent_of_arrival_order() -> None:
    theta, payloads = _payloads(4)
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    reference = dict(alg.aggregate(payloads, shapes))
    for perm in itertools.permutations(payloads):
        got = dict(alg.aggregate({k: payloads[k] for k in perm}, shapes))
        assert all(np.array_equal(got[n].view(np.uint32), reference[n].view(np.uint32)) for n in shapes)
    # And it is exactly the float32 sum in sorted-id order, divided by n.
    for n, shape in shapes.items():
        acc = np.zeros(int(np.prod(shape)), np.float32)
        for k in sorted(payloads):
            t = payloads[k].tensors[n]
            for i, v in zip(t.indices, t.values, strict=True):
                acc[i] = np.float32(acc[i] + v)
        acc = acc / np.float32(4)
        assert np.array_equal(acc.view(np.uint32), reference[n].reshape(-1).view(np.uint32))


def test_outer_step_is_nesterov_like_torch_sgd() -> None:
    theta, payloads = _payloads(3)
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    ours = {n: t.clone() for n, t in theta.items()}
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in theta.items()}
    sgd = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True, foreach=False)
    for _ in range(3):
        deltas = dict(alg.aggregate(payloads, shapes))
        alg.outer_step(ours, momentum, deltas.items(), lr=0.7, mu=0.9)
        for n, p in params.items():
            p.grad = torch.from_numpy(deltas[n].copy())
        sgd.step()
    for n in theta:
        torch.testing.assert_close(ours[n], params[n].detach(), rtol=1e-6, atol=1e-9)


def test_plain_averaging_recovers_the_mean_of_local_weights() -> None:
    theta = _state(11)
    locals_ = [_near(theta, 0.05, k) for k in range(3)]
    payloads = {
        f"t{k}": alg.make_update(theta, loc, None, round=1, sparse=False)[0] for k, loc in enumerate(locals_)
    }
    new = {n: t.clone() for n, t in theta.items()}
    alg.apply_round(new, {n: torch.zeros_like(t) for n, t in theta.items()}, payloads, lr=1.0, mu=0.0)
    for n in theta:
        mean = sum(loc[n] for loc in locals_) / 3
        torch.testing.assert_close(new[n], mean, rtol=1e-5, atol=1e-7)


def test_a_non_finite_outer_step_is_void_and_changes_nothing() -> None:
    theta, payloads = _payloads(2)
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    # Finite payloads whose mean overflows float32: 3e38 + 3e38 = inf before the division.
    for p in payloads.values():
        t = next(iter(p.tensors.values()))
        t.values[0] = np.float32(3e38)
    before = alg.global_digest(theta, momentum)
    why = alg.apply_round(theta, momentum, payloads, lr=1.0, mu=0.0)
    assert why is not None and "non-finite" in why
    assert alg.global_digest(theta, momentum) == before  # nothing was applied
    # A finite mean whose step overflows θ (lr x Δ past float32's range) is void too.
    theta2, payloads2 = _payloads(1)
    t = next(iter(payloads2["t0"].tensors.values()))
    t.values[0] = np.float32(-3e38)
    why = alg.apply_round(theta2, {n: torch.zeros_like(v) for n, v in theta2.items()}, payloads2, lr=2.0, mu=0.0)
    assert why is not None and "weights or the momentum" in why
    # And a sane round applies exactly what outer_step does.
    theta3, payloads3 = _payloads(3)
    ref = {n: v.clone() for n, v in theta3.items()}
    m3, mref = ({n: torch.zeros_like(v) for n, v in theta3.items()} for _ in range(2))
    assert alg.apply_round(theta3, m3, payloads3, lr=0.7, mu=0.9) is None
    shapes = {n: tuple(v.shape) for n, v in ref.items()}
    alg.outer_step(ref, mref, alg.aggregate(payloads3, shapes), lr=0.7, mu=0.9)
    assert alg.global_digest(theta3, m3) == alg.global_digest(ref, mref)


def test_digest_sees_one_bit() -> None:
    theta = _state(12)
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    d = alg.global_digest(theta, momentum)
    assert d == alg.global_digest({n: t.clone() for n, t in theta.items()}, momentum)
    flipped = {n: t.clone() for n, t in theta.items()}
    flipped["b.bias"].view(torch.int32)[3] ^= 1
    assert alg.global_digest(flipped, momentum) != d
    momentum["c"][0, 0, 0] = -0.0  # a sign bit in the momentum counts too
    assert alg.global_digest(theta, momentum) != d


# --- state files -------------------------------------------------------------------------------


def test_global_and_trainer_state_round_trip(tmp_path: Path) -> None:
    g = GlobalState.genesis(_state(13))
    g.round = 5
    g.momentum["b.bias"] += 1.0
    g.save(tmp_path / "g.safetensors")
    back = GlobalState.load(tmp_path / "g.safetensors", g.shapes())
    assert back.round == 5 and back.digest() == g.digest()
    with pytest.raises(VerificationError):
        GlobalState.load(tmp_path / "g.safetensors", {**g.shapes(), "b.bias": (17,)})
    ts = TrainerState(
        g,
        {n: torch.ones_like(t) for n, t in g.theta.items()},
        {"steps": 40, "rng": {"x": (1, 2)}, "optimizer": {}},
    )
    ts.save(tmp_path / "t.pt")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left
    back_ts = TrainerState.load(tmp_path / "t.pt")
    assert back_ts.global_.digest() == g.digest() and back_ts.inner["steps"] == 40
    (tmp_path / "bad.pt").write_bytes(b"garbage")
    with pytest.raises(VerificationError):
        TrainerState.load(tmp_path / "bad.pt")


# --- digest verdicts and config ------------------------------------------------------------------


def test_digest_verdicts() -> None:
    from pulsenet.loco.recovery import judge

    v = judge({"a": "x", "b": "x", "c": "x"}, "a")
    assert v.unanimous and v.ours_agreed and v.odd == []
    v = judge({"a": "x", "b": "x", "c": "y"}, "a")
    assert v.agreed == "x" and v.ours_agreed and v.odd == ["c"]
    v = judge({"a": "x", "b": "x", "c": "y"}, "c")
    assert v.agreed == "x" and not v.ours_agreed and v.odd == ["c"]
    v = judge({"a": "x", "b": "y"}, "a")  # two trainers disagree: nobody knows, both rebuild
    assert v.agreed is None and not v.ours_agreed and v.odd == ["b"]
    assert judge({"a": "x"}, "a").unanimous


def test_config_validation() -> None:
    from pulsenet.errors import ConfigError
    from pulsenet.loco import LocoConfig

    assert LocoConfig(workers_expected=4).quorum == 3
    assert LocoConfig(workers_expected=3, min_quorum=1).quorum == 1
    with pytest.raises(ConfigError, match="mode"):
        LocoConfig(mode="ddp")
    with pytest.raises(ConfigError, match="exceeds"):
        LocoConfig(workers_expected=2, min_quorum=3)
