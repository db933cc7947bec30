"""The replay's version store (rl/versions.py): older versions as undo patches, rebuilt bit-exactly."""

from __future__ import annotations

import pytest
import torch

from pulsenet.rl.versions import VersionStore, undo


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` BF16 states, each a sparse change of the one before (as RL steps make them); the
    last tensor never changes and is shared by object between versions, as a subscriber shares it."""
    g = torch.Generator().manual_seed(seed)
    base = {"a": torch.randn(64, 32, generator=g).bfloat16(), "b": torch.randn(100, generator=g).bfloat16(),
            "c": torch.randn(7, 3, generator=g).bfloat16()}  # fmt: skip
    out = [base]
    for _ in range(n - 1):
        prev = out[-1]
        nxt = {}
        for name, t in prev.items():
            if name == "c":
                nxt[name] = t
                continue
            new = t.clone()
            flat = new.view(-1)
            hit = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 50]
            flat[hit] = (flat[hit].float() * 1.01 + 0.001).bfloat16()
            nxt[name] = new
        out.append(nxt)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)) for n in a)


def test_every_held_version_is_rebuilt_bit_exactly_into_fp32_params() -> None:
    states = _states(5)
    store = VersionStore(keep=3)
    for v, s in enumerate(states):
        store.remember(v, s)
    assert store.versions == [2, 3, 4] and 1 not in store and 4 in store
    for v in (4, 2, 3):
        assert _same(store.state(v), states[v])
        params = {n: torch.full(t.shape, float("nan")) for n, t in states[0].items()}
        store.load_into(v, params)
        assert _same({n: p.bfloat16() for n, p in params.items()}, states[v])
        assert all(torch.equal(p, states[v][n].float()) for n, p in params.items())
    with pytest.raises(KeyError):
        store.state(1)


def test_older_versions_cost_their_changes_not_a_copy() -> None:
    states = _states(3)
    store = VersionStore(keep=3)
    for v, s in enumerate(states):
        store.remember(v, s)
    full = sum(t.numel() * t.element_size() for t in states[0].values())
    held = store.nbytes()
    assert held["newest"] == full
    # 2% of "a" and "b" changed per version, 6 bytes (int32 position + BF16 value) each
    assert 0 < held["patches"] <= 2 * 6 * (64 * 32 + 100) // 50
    assert store.state(2)["c"] is states[2]["c"]  # the newest is held by reference, not copied


def test_an_older_version_starts_afresh() -> None:
    states = _states(3)
    store = VersionStore(keep=3)
    store.remember(5, states[0])
    store.remember(6, states[1])
    store.remember(2, states[2])  # a restart onto another chain
    assert store.versions == [2] and _same(store.state(2), states[2])


def test_undo_of_identical_or_shared_tensors_is_nothing() -> None:
    t = torch.randn(10).bfloat16()
    assert undo(t, t) is None and undo(t, t.clone()) is None
    neg = t.clone()
    neg[3] = -neg[3] if neg[3] != 0 else 1.0
    u = undo(t, neg)
    assert u is not None and u.positions.tolist() == [3]
    assert u.values.view(torch.int16).tolist() == t[3:4].view(torch.int16).tolist()


def test_a_mostly_changed_tensor_is_kept_whole_by_reference() -> None:
    old = torch.randn(1000).bfloat16()
    new = (old.float() + 1).bfloat16()  # every value moves: positions would cost 3x the tensor
    u = undo(old, new)
    assert u is not None and u.positions is None and u.values is old
    store = VersionStore(keep=2)
    store.remember(0, {"w": old})
    store.remember(1, {"w": new})
    assert store.nbytes()["patches"] == 2000 and _same(store.state(0), {"w": old})
    params = {"w": torch.zeros(1000)}
    store.load_into(0, params)
    assert torch.equal(params["w"], old.float())
