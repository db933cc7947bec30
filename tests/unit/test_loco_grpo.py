"""PULSELoCo with a GRPO inner loop (``pulsenet.rl.inner.GRPOInner``): the trainer node's setup.

Three in-process trainers over a ``LocalStore``, each fed its own rollout batches through a
``queue.Queue`` that a producer task fills while the rounds run (the inner thread blocks on it).
"""

from __future__ import annotations

import asyncio
import math
import queue
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.loco.inner import InnerLoop
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.warmup import warm_tiny_model
from pulsenet.signing import load_private_key
from pulsenet.store import LocalStore
from tests.support.loco_helpers import make_keys
from tests.support.rl import WARM_STEPS, sampled_batches

IDS = ("g0", "g1", "g2")
H, ROUNDS = 2, 2


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)  # three trainers' inner threads share the cores
    return tmp_path_factory.mktemp("warm")


@pytest.mark.timeout(120)
async def test_pulseloco_rounds_with_a_grpo_inner_loop(tmp_path: Path, cache_dir: Path) -> None:
    keys, pubs = make_keys(tmp_path / "keys", IDS)
    cfg = LocoConfig(
        inner_steps=H, workers_expected=len(IDS), deadline_s=60.0, poll_s=0.02, digest_wait_s=30.0,
        state_every=100, checkpoint_every=0,
    )  # fmt: skip
    store = LocalStore(tmp_path / "store")
    feeds: dict[str, queue.Queue[Sequence[Rollout] | None]] = {t: queue.Queue() for t in IDS}
    warm = warm_tiny_model(cache_dir, steps=WARM_STEPS)
    batches = {t: sampled_batches(warm, t, H * ROUNDS) for t in IDS}
    trainers, inners = [], []
    for tid in IDS:
        inner = GRPOInner(GRPOTrainer(warm_tiny_model(cache_dir, steps=WARM_STEPS), GRPOConfig(lr=1e-3)))
        assert isinstance(inner, InnerLoop)
        inners.append(inner)
        trainers.append(LocoTrainer(tid, store, load_private_key(keys[tid]), trainer_keys(pubs), inner, cfg))
    theta0 = {n: p.detach().clone() for n, p in warm.named_parameters()}
    steps: dict[str, list[int]] = {t: [] for t in IDS}

    async def produce() -> None:  # the node's intake: batches arrive while the inner phases wait
        for b in range(H * ROUNDS):
            await asyncio.sleep(0.05)
            for tid in IDS:
                feeds[tid].put(batches[tid][b])

    async def drive(trainer: LocoTrainer, inner: GRPOInner) -> None:
        async def train(r: int) -> list[float]:  # the caller's inner phase: it takes the batches
            metrics = []
            for _ in range(H):
                batch = await asyncio.to_thread(feeds[trainer.id].get)
                metrics.append(await asyncio.to_thread(inner.step, batch))
            inner.end_phase()
            steps[trainer.id].append(len(metrics))
            return [m.loss for m in metrics]

        async with trainer.session():
            while trainer.round < ROUNDS:
                await trainer.next_round(train)

    await asyncio.gather(produce(), *(drive(t, i) for t, i in zip(trainers, inners, strict=True)))
    for r in range(1, ROUNDS + 1):
        reports = [next(rep for rep in t.reports if rep.round == r) for t in trainers]
        assert len({rep.digest for rep in reports}) == 1, f"round {r}: digests differ"
        assert all(rep.participants == list(IDS) and rep.sent > 0 for rep in reports), reports
        assert all(rep.loss is not None for rep in reports)
    assert all(i.grpo.steps == H * ROUNDS for i in inners) and all(v == [H] * ROUNDS for v in steps.values())
    theta = trainers[0].state.theta  # type: ignore[union-attr]
    assert any(not torch.equal(theta[n], theta0[n]) for n in theta0), "the outer steps changed nothing"
    for t in trainers:  # each local model was reset to the agreed θ after the round
        assert all(torch.equal(p, theta[n]) for n, p in t.inner.parameters().items())


@pytest.mark.timeout(60)
async def test_grpo_inner_steps_on_what_it_is_handed_and_restores(cache_dir: Path) -> None:
    warm = warm_tiny_model(cache_dir, steps=WARM_STEPS)
    inner = GRPOInner(GRPOTrainer(warm, GRPOConfig(lr=1e-3)))
    before = inner.checkpoint()
    metrics = await asyncio.to_thread(inner.step, sampled_batches(warm, "g0", 1)[0])
    inner.end_phase()
    assert math.isfinite(metrics.loss) and inner.grpo.steps == 1 and before["steps"] == 0
    assert all(p.grad is None for p in inner.grpo.local.model.parameters())  # freed between rounds
    inner.restore(before)
    assert inner.grpo.steps == 0 and inner.checkpoint()["optimizer"]["state"] == {}
