"""The trainer's device setting (``LocalTrainerConfig.device``, ``TrainerConfig.device``).

On a CPU-only host only the refusals run; the ``gpu`` test trains on CUDA and checks what leaves
the trainer (weights, BF16 state, checkpoints, a PULSELoCo round) is on the CPU and consistent.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from pulsenet.errors import ConfigError
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.nodes.build import build_trainer
from pulsenet.nodes.config import TrainerConfig
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
from pulsenet.rl.models import build_tiny_model
from pulsenet.rl.warmup import warm_tiny_model
from pulsenet.signing import load_private_key
from pulsenet.store import LocalStore
from tests.support.loco_helpers import make_keys
from tests.support.rl import WARM_STEPS, fake_rollouts, sampled_batches


def test_cuda_without_cuda_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"device = 'cuda'.*is_available\(\) is False"):
        LocalTrainer(build_tiny_model(0), LocalTrainerConfig(device="cuda"))
    with pytest.raises(ConfigError, match="device = 'cuda:1'"):
        GRPOTrainer(build_tiny_model(0), GRPOConfig(device="cuda:1"))
    # the node refuses before anything else (store, keys, the warm-up)
    with pytest.raises(ConfigError, match="device = 'cuda'"):
        build_trainer(TrainerConfig(device="cuda"))
    with pytest.raises(ConfigError, match="device must be cpu, cuda or cuda:N"):
        LocalTrainer(build_tiny_model(0), LocalTrainerConfig(device="tpu"))


def test_node_device_reaches_the_grpo_trainer() -> None:
    c = TrainerConfig(device="cuda:0", grpo=GRPOConfig(lr=1e-3, device="cpu"))
    assert c.grpo_config().device == "cuda:0" and c.grpo_config().lr == 1e-3 and c.grpo.device == "cpu"


def _all_cpu(state: dict[str, torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" for t in state.values())


@pytest.mark.gpu
@pytest.mark.timeout(600)
async def test_grpo_on_cuda(tmp_path: Path) -> None:
    """Never run where it was written (no GPU): GRPO steps, checkpoints and a PULSELoCo round on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the reruns below
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.set_num_threads(1)
        cfg = GRPOConfig(lr=1e-3, beta=0.1)
        cpu = GRPOTrainer(build_tiny_model(0), cfg)
        gpu = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, beta=0.1, device="cuda"))
        assert next(gpu.local.model.parameters()).is_cuda and gpu.reference is not None
        for n in (3, 2, 4):
            cpu.step(fake_rollouts(n))
            gpu.step(fake_rollouts(n))
        # what leaves the trainer is on the CPU; the GPU's arithmetic differs a little from the CPU's
        a, b = cpu.bf16_state(), gpu.bf16_state()
        assert _all_cpu(b) and _all_cpu(gpu.local.state_fp32()) and a.keys() == b.keys()
        assert all(torch.allclose(a[k].float(), b[k].float(), atol=2e-2, rtol=0) for k in a)
        # load_state_fp32 round-trips to the bit
        before = gpu.local.state_fp32()
        gpu.local.load_state_fp32(cpu.local.state_fp32())
        gpu.local.load_state_fp32(before)
        after = gpu.local.state_fp32()
        assert all(torch.equal(before[k], after[k]) for k in before)
        # a checkpoint (CPU tensors, CUDA RNG included) continues identically on the device
        ck = gpu.checkpoint()
        assert "cuda" in ck["rng"] and all(
            t.device.type == "cpu" for s in ck["optimizer"]["state"].values() for t in s.values()
        )
        ma = gpu.step(fake_rollouts(2))
        other = GRPOTrainer(build_tiny_model(5), GRPOConfig(lr=1e-3, beta=0.1, device="cuda"))
        other.restore(ck)
        mb = other.step(fake_rollouts(2))
        sa, sb = gpu.local.state_fp32(), other.local.state_fp32()
        assert ma == mb and all(torch.equal(sa[k], sb[k]) for k in sa)
        await _loco_round_on_cuda(tmp_path)
    finally:
        torch.use_deterministic_algorithms(False)


async def _loco_round_on_cuda(tmp_path: Path) -> None:
    """Two in-process trainers with CUDA inner loops agree on every round's digest."""
    ids, h, rounds = ("c0", "c1"), 2, 2
    keys, pubs = make_keys(tmp_path / "keys", ids)
    cfg = LocoConfig(
        inner_steps=h, workers_expected=len(ids), deadline_s=120.0, poll_s=0.02, digest_wait_s=60.0,
        state_every=100, checkpoint_every=0,
    )  # fmt: skip
    store = LocalStore(tmp_path / "store")
    warm = warm_tiny_model(tmp_path / "warm", steps=WARM_STEPS)
    trainers = []

    async def drive(trainer: LocoTrainer, inner: GRPOInner, batches: list) -> None:
        async def train(r: int) -> list[float]:  # the caller's inner phase, as the trainer daemon's
            metrics = [await asyncio.to_thread(inner.step, batches.pop(0)) for _ in range(h)]
            inner.end_phase()
            return [m.loss for m in metrics]

        async with trainer.session():
            while trainer.round < rounds:
                await trainer.next_round(train)

    drives = []
    for tid in ids:
        model = warm_tiny_model(tmp_path / "warm", steps=WARM_STEPS)
        inner = GRPOInner(GRPOTrainer(model, GRPOConfig(lr=1e-3, device="cuda")))
        trainers.append(LocoTrainer(tid, store, load_private_key(keys[tid]), trainer_keys(pubs), inner, cfg))
        drives.append(drive(trainers[-1], inner, sampled_batches(warm, tid, h * rounds)))
    await asyncio.gather(*drives)
    for r in range(1, rounds + 1):
        reports = [next(rep for rep in t.reports if rep.round == r) for t in trainers]
        assert len({rep.digest for rep in reports}) == 1 and all(rep.sent > 0 for rep in reports), reports
    theta = trainers[0].state.theta  # type: ignore[union-attr]
    for t in trainers:  # the round's view of the weights is a CPU snapshot of the agreed θ
        params = t.inner.parameters()
        assert _all_cpu(dict(params)) and all(torch.equal(p, theta[n]) for n, p in params.items())
