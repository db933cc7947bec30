"""Rollouts for the GRPO and PULSELoCo tests: fixed ones, and batches sampled from a model."""

from __future__ import annotations

import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.rl.models import BYTE_EOS
from pulsenet.rl.sampling import sample_group
from pulsenet.rl.tasks import assign_problems
from pulsenet.rl.warmup import tiny_task


def fake_rollouts(n_groups: int = 3, g: int = 4) -> list[Rollout]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(n_groups):
        prompt = tuple(f"{k}+{k}=".encode())
        for i in range(g):
            n = 1 + (i + k) % 3
            ids = tuple(int(t) for t in torch.randint(32, 127, (n,), generator=gen))
            out.append(
                Rollout(
                    group=f"g{k}",
                    prompt_ids=prompt,
                    completion_ids=ids,
                    logprobs=tuple([-2.0] * n),
                    reward=float((i + k) % 2),
                    version=0,
                    model_digest="d",
                    node="n",
                    seed=0,
                )
            )
    return out


WARM_STEPS = 20
"""A few supervised steps are enough: the rewards below are synthetic (the round is under test)."""


def sampled_batches(model: torch.nn.Module, tid: str, n: int) -> list[list[Rollout]]:
    """``n`` batches of 2 groups x 4 completions sampled from ``model`` for trainer ``tid``.

    Rewards alternate within each group (1, 0, 1, 0) so that every group has an advantage and
    every step moves the weights: this test is about the round, not about learning."""
    task, gen = tiny_task(0), torch.Generator().manual_seed(sum(tid.encode()))
    out = []
    with torch.no_grad():
        logits = lambda ids: model(input_ids=ids, use_cache=False).logits  # noqa: E731
        for b in range(n):
            batch = []
            for k, p in enumerate(assign_problems(task, node=tid, version=b, seed=3, n=2)):
                prompt = tuple(p.prompt.encode())
                for i, s in enumerate(
                    sample_group(logits, prompt, 4, max_new_tokens=4, eos_id=BYTE_EOS, generator=gen)
                ):
                    batch.append(Rollout(
                        group=f"{tid}-{b}-{k}", prompt_ids=prompt, completion_ids=s.completion_ids,
                        logprobs=s.logprobs, reward=float(i % 2 == 0), version=b, model_digest="test",
                        node=tid, seed=0,
                    ))  # fmt: skip
            out.append(batch)
    return out

