"""What a node holds (nodes/memory.py): holders by storage, the budget, and the engines' own copies."""

from __future__ import annotations

import os

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.engines.torch_engine import TorchEngine
from pulsenet.engines.vllm_engine import HostMirror
from pulsenet.nodes.memory import BUDGETS, GiB, Probe, budget_for, held, proc_memory, report
from pulsenet.nodes.status import NodeState
from pulsenet.rl.models import bf16_state_dict, build_tiny_model


def test_each_storage_counts_once_for_its_first_holder() -> None:
    a, b = torch.zeros(10), torch.zeros(4, dtype=torch.bfloat16)
    view = a[2:5]  # a view of a's storage: not another copy
    out = held({"first": [a, None], "second": [view, b, torch.empty(3, device="meta")], "none": []})
    assert out == {"first": 40, "second": 8, "none": 0}


def test_budgets_are_the_issue_formulas() -> None:
    p = 361_821_120  # the 0.35B directory
    assert BUDGETS["trainer"].limit(p) == 24 * p + 2 * GiB
    assert budget_for("inference").limit(p) == 6 * p + 3 * GiB // 2
    assert budget_for("inference", "vllm").limit(p) == 2 * p + 3 * GiB // 2


def test_report_reads_this_process_and_judges_the_peak() -> None:
    mem = proc_memory(os.getpid())
    assert mem is not None and 0 < mem["rss"] <= mem["peak_rss"]
    r = report({"x": 5}, params=1, budget=BUDGETS["trainer"])
    assert r["held"] == 5 and r["budget"] == 24 + 2 * GiB
    assert r["within_budget"] is (r["peak_rss"] <= r["budget"])  # this worker's own peak, whatever tests ran before
    roomy = report({}, params=1, budget=type(BUDGETS["trainer"])(0, 10**15))
    assert roomy["within_budget"] is True
    tight = report({}, params=1, budget=type(BUDGETS["trainer"])(0, 1))
    assert tight["within_budget"] is False
    assert report({}, params=None, budget=BUDGETS["trainer"])["within_budget"] is None


def test_status_calls_the_probe_and_survives_asdict() -> None:
    state = NodeState("trainer", "t0")
    calls = []
    state.memory = Probe(lambda held: calls.append(held) or {"holders": held, "peak_rss": 2, "budget": 3},
                         counted=lambda: {"a": 1})  # fmt: skip
    assert state.to_json()["memory"]["holders"] is None  # not counted until a refresh (a trainer: between steps)
    state.memory.refresh()
    d = state.to_json()
    assert d["memory"]["holders"] == {"a": 1} and calls == [None, {"a": 1}]
    assert NodeState("inference", "i0").to_json()["memory"] is None


def test_the_torch_engine_holds_only_its_compute_copy_and_the_mirror_shares_the_state() -> None:
    model = build_tiny_model(0)
    state = bf16_state_dict(model)
    engine = TorchEngine.from_state(model.config, state, model_digest(state), version=0)
    holders = held({"verified_bf16": list(state.values()), **engine.held_tensors()})
    numel = sum(t.numel() for t in state.values())
    assert holders == {"verified_bf16": 2 * numel, "engine_F32": 4 * numel}
    assert engine.weights_digest() == model_digest(state)
    served = engine.served_state()  # a copy, never the parameters' own memory
    assert all(served[n].data_ptr() != p.data_ptr() for n, p in engine._params.items())
    mirror = HostMirror(state)  # the vLLM engine's: the verified tensors themselves
    assert held({"verified_bf16": list(state.values()), "mirror": list(mirror.tensors.values())})["mirror"] == 0
    new = dict(state)
    name = "model.norm.weight"
    new[name] = (state[name].float() + 0.5).to(torch.bfloat16)
    engine.update(1, new, model_digest(new), changed={name})
    assert engine.stats.bytes_last_update == new[name].numel() * 2 and engine.digest == model_digest(new)
    mirror.commit(*mirror.stage(new, model_digest(new)))
    assert mirror.tensors[name].data_ptr() == new[name].data_ptr()  # taken in, not copied


def _moved(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` with new bits (a fresh tensor each)."""
    return {n: (t.float() * 1.5 + 0.25).to(torch.bfloat16) for n, t in state.items()}


@pytest.mark.parametrize("warned", [False, True])
async def test_a_mirror_released_before_a_rebuild_in_place_lets_the_old_copy_go(tmp_path, warned: bool) -> None:
    """A consumer that holds the delivered tensors by reference (the vLLM engine's host mirror) and
    lets go of them when warned (``Subscriber(on_consume=)``) costs no second copy: by the time the
    rebuilt version is handed over, not one tensor of the old one is alive. Unwarned, it keeps the
    whole old copy resident beside the new one (issue 37: 0.72 GB at 0.35B)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from pulsenet.store import LocalStore
    from pulsenet.sync import Publisher, PublisherConfig, Subscriber, SubscriberConfig
    from tests.support.sync_support import keypair

    key, trusted = keypair()
    store = LocalStore(tmp_path / "store")
    v0 = bf16_state_dict(build_tiny_model(0))
    mirror: list[HostMirror] = []
    old: list[StorageWeakRef] = []
    alive_at_handover: list[int] = []

    def on_update(version: int, state: dict[str, torch.Tensor], digest: str, *, changed: frozenset[str]) -> None:
        if not mirror:
            mirror.append(HostMirror(state))
            return
        alive_at_handover.append(sum(not r.expired() for r in old))
        m = mirror[0]
        m.commit(*m.stage(state, digest, changed), state)
        assert m.digest == digest == model_digest(m.tensors)
        assert all(m.tensors[n].data_ptr() == state[n].data_ptr() for n in state)  # its own tensors, no copy

    sub = Subscriber(store, trusted, SubscriberConfig(state_dir=tmp_path / "state"), on_update=on_update,
                     on_consume=(lambda: mirror[0].release()) if warned else None)  # fmt: skip
    async with Publisher(store, key, PublisherConfig(anchor_every=10)) as pub, sub:
        await pub.publish_now(v0, step=0)
        assert await sub.sync_once() == 0
        assert sub.state is not None
        old.extend(StorageWeakRef(t.untyped_storage()) for t in sub.state.values())
        await pub.publish_now(_moved(v0), step=1)
        assert await sub.sync_once() == 1
    assert alive_at_handover == [0 if warned else len(old)], (warned, alive_at_handover)
