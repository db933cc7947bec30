"""Replay the learning dynamics of ``pulsenet up`` in one process, for sweeps: no store, no nodes.

N trainers (``GRPOTrainer``, each its own AdamW state, the nodes' tiny defaults) run H inner GRPO
steps per round on batches of ``--rows`` rollouts that a ``TorchEngine`` samples from the global
weights of version r-1-lag (``--lag``, in rounds: ``pulsenet up`` trains on batches up to
``max_staleness`` = 2 versions old); then the mean pseudo-gradient and the outer Nesterov step in
PyTorch's convention (docs/loco.md section 1), dense FP32 (DiLoCo: PULSELoCo's gate and error
feedback send ~90% of the entries of this model, docs/results/loco-grpo-2026-12-01.md).
``--trainers 1 --H 1 --rows 512 --outer-lr 1 --momentum 0`` is the lone trainer of
``pulsenet up --trainers 1``. One JSON line per run (reward per round, first and last tenth,
mean mismatch KL) on stdout and appended to ``--out``.

    python scripts/up_sim.py --trainers 2 --H 8 --rows 64 --outer-lr 0.7 --momentum 0.9 --lag 2

Measured with it: docs/results/up-two-trainers-2026-12-01.md.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch

from pulsenet.engines.base import SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.loco.algorithm import outer_step
from pulsenet.nodes.common import CACHE_DIR, initial_model, text_codec
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.tasks import assign_problems, build_task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--H", type=int, default=8, help="inner GRPO steps per round")
    p.add_argument("--rows", type=int, default=64, help="rollouts per inner step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--lr", type=float, default=5e-4, help="inner AdamW learning rate")
    p.add_argument("--outer-lr", type=float, default=1.0)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--lag", type=int, default=2, help="round r trains on rollouts of version r-1-lag")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=CACHE_DIR.expanduser(), help="tiny warm-up cache")
    p.add_argument("--out", type=Path, default=None, help="append the JSON line here too")
    p.add_argument("--label", default="")
    a = p.parse_args()

    torch.manual_seed(a.seed)
    text, task = text_codec("tiny"), build_task("arith", seed=a.seed)
    base = initial_model("tiny", a.cache_dir, seed=a.seed)
    engine_config = TorchEngineConfig(verify_updates=False, hash_threads=1)
    trainers = [GRPOTrainer(copy.deepcopy(base), GRPOConfig(lr=a.lr, seed=a.seed, pad_id=text.pad_id)) for _ in range(a.trainers)]
    theta = {n: t.clone() for n, t in trainers[0].local.state_fp32().items()}
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    versions = {0: {n: t.clone() for n, t in theta.items()}}
    engines: dict[int, TorchEngine] = {}
    drawn: dict[tuple[int, str], int] = {}

    def engine(v: int) -> TorchEngine:
        if v not in engines:
            model = copy.deepcopy(base)
            model.load_state_dict(versions[v], strict=False)
            engines[v] = TorchEngine(model, engine_config, version=v)
            for old in [x for x in engines if x < v - 3]:
                del engines[old]
        return engines[v]

    def batch(v: int, node: str) -> list:
        """One inference node's batch at version v, drawn as the node draws it (problems by (node, version, batch))."""
        i = drawn.get((v, node), 0)
        drawn[(v, node)] = i + 1
        problems = assign_problems(task, node=node, version=v, seed=a.seed, n=a.rows // a.group, batch=i)
        prompts = [text.encode(q.prompt) for q in problems for _ in range(a.group)]
        seed = int.from_bytes(hashlib.sha256(f"{a.seed}:{node}:{v}:{i}".encode()).digest()[:4], "big")
        gens = engine(v).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=seed))
        rows = []
        for j, g in enumerate(gens):
            q = problems[j // a.group]
            reward = task.score(text.decode([t for t in g.completion_ids if t != text.eos_id]), q)
            rows.append(g.to_rollout(group=f"{node}-{v}-{i}-{j // a.group}", reward=reward, node=node))
        return rows

    rewards, kls, t0 = [], [], time.perf_counter()
    for r in range(1, a.rounds + 1):
        source = max(0, r - 1 - a.lag)
        deltas, round_rewards = [], []
        for k, t in enumerate(trainers):
            t.local.load_state_fp32({n: x.clone() for n, x in theta.items()})
            for _ in range(a.H):
                m = t.step(batch(source, f"i{k}"))
                round_rewards.append(m.reward_mean)
                kls.append(m.mismatch_kl)
            local = t.local.state_fp32()
            deltas.append({n: theta[n] - local[n] for n in theta})
        mean = ((n, (sum(x[n] for x in deltas) / len(deltas)).numpy()) for n in theta)
        outer_step(theta, momentum, mean, lr=a.outer_lr, mu=a.momentum)  # the trainers' own step
        versions[r] = {n: x.clone() for n, x in theta.items()}
        for old in [x for x in versions if x < r - a.lag - 2]:
            del versions[old]
        rewards.append(statistics.mean(round_rewards))
    tenth = max(1, len(rewards) // 10)
    out = {
        "label": a.label,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "first_tenth": round(statistics.mean(rewards[:tenth]), 3),
        "last_tenth": round(statistics.mean(rewards[-tenth:]), 3),
        "mismatch_kl": round(statistics.mean(kls), 4),
        "reward": [round(x, 3) for x in rewards],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    line = json.dumps(out)
    print(line, flush=True)
    if a.out is not None:
        with a.out.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
