"""``pulsenet bench loco --task grpo``: the GRPO side of the benchmark, per model, and real DDP.

:class:`GRPOBench` holds what every mode shares: the task, the text codec, the start model and
the held-out problems. ``inner(tid)`` is a worker's self-sampling ``GRPOInner`` (its GRPO steps
on rollouts it samples itself, on policy, from its current local weights), ``eval_reward`` the
greedy reward of some weights on the held-out problems.

Models and tasks:

- ``tiny``: the warmed-up byte-level model on its own task (single-digit ``a±b=``), sampled with
  the trainer's own forward (``rl.sampling.sample_group``: no KV cache, nothing to sync).
- ``smollm2``: SmolLM2-135M-Instruct on ``arith-shots`` (``rl.tasks.build_task``, the inference
  nodes' smollm2 task: ``FewShotTask(ArithmeticTask(max_operand=9), k=4)``):
  four solved examples, one per line, then the problem (``"2+8=10\\n...\\n7-3="``), no chat
  template, as the inference nodes prompt it. A completion ends at its first newline; the
  reward is the exact answer on that line. Sampled by a ``TorchEngine`` per worker (the
  inference nodes' engine: batched, KV-cached, FP32 maths on the BF16 weights) loaded with the
  worker's BF16 weights before every batch, so the rollouts are on policy; its log-probs come
  from the KV-cached forward, the trainer's from a full one, and TIS corrects the difference.

:func:`run_ddp` is the DDP learning baseline: N workers, each with its own ``GRPOTrainer`` (FP32
master, AdamW) and its own rollouts. Every step each worker computes the gradient of its own
batch (``GRPOTrainer.compute_gradients``); the gradients are averaged, parameter by parameter, in
worker order (``w0 + w1 + ... `` then ÷ N, on every worker alike: what an all-reduce hands every
rank) into every worker's ``.grad``; then every worker takes the same clipped AdamW step
(``apply_gradients``). Same weights, same optimizer state and same gradient give the same bits,
so the workers hold identical weights after every step, which is checked (SHA-256 of every
worker's FP32 weights) after every benchmark round. No store is involved: DDP's traffic is the
accounting, one dense FP32 gradient per worker per step (``loco_phases.ddp_bytes``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class GRPOBench:
    args: argparse.Namespace
    task: Any
    """The ``RewardTask`` the workers are rewarded by."""
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]
    """Token ids that end a completion besides EOS (SmolLM2: the newline)."""
    start: Callable[[], torch.nn.Module]
    """A fresh FP32 copy of the start model (the same weights for every worker and mode)."""
    default_lr: float
    held_out: list[Any]
    """Problems of the greedy eval."""
    _eval_engine: Any = None

    @property
    def uses_engine(self) -> bool:
        return self.args.model != "tiny"

    # --- the workers ---------------------------------------------------------

    def grpo_trainer(self, tid: str, lr: float) -> Any:
        from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
        from pulsenet.rl.inner import data_seed

        seed = data_seed(self.args.seed, tid)
        return GRPOTrainer(self.start(), GRPOConfig(lr=lr, seed=seed, forward=self.args.forward, pad_id=self.pad_id))

    def batches(self, tid: str, grpo: Any) -> Callable[[], list[Any]]:
        """``next_batch`` for ``tid``'s ``GRPOTrainer``: ``--prompts`` problems (assigned by worker and
        step) x ``--group`` completions sampled from its current weights, rewarded."""
        from pulsenet.codec.rollout import Rollout
        from pulsenet.rl.inner import data_seed
        from pulsenet.rl.tasks import assign_problems

        args, seed = self.args, data_seed(self.args.seed, tid)
        generator = torch.Generator().manual_seed(seed)
        engine = self._engine(grpo.local.model) if self.uses_engine else None

        def next_batch() -> list[Rollout]:
            version = grpo.steps  # the trainer's step count: fresh problems every step
            problems = assign_problems(self.task, node=tid, version=version, seed=args.seed, n=args.prompts)
            prompts = [tuple(self.encode(p.prompt)) for p in problems]
            if engine is None:
                samples = [self._sample_tiny(grpo.local, q, args.group, generator) for q in prompts]
            else:
                step_seed = int.from_bytes(hashlib.sha256(f"{seed}:{version}".encode()).digest()[:6], "little")
                samples = self._sample_engine(engine, grpo.local, prompts, args.group, 1.0, step_seed)
            batch = []
            for k, (p, q, group) in enumerate(zip(problems, prompts, samples, strict=True)):
                for ids, logprobs in group:
                    batch.append(Rollout(
                        group=f"{tid}-{version}-{k}", prompt_ids=q, completion_ids=ids, logprobs=logprobs,
                        reward=self.task.score(self.decode(list(ids)), p), version=version,
                        model_digest="self", node=tid, seed=args.seed,
                    ))  # fmt: skip
            return batch

        return next_batch

    def inner(self, tid: str, lr: float) -> Any:
        """A ``GRPOInner`` fed on policy; its ``rewards[i]`` is the mean reward of the i-th inner
        phase's steps (one per round)."""
        from pulsenet.rl.inner import GRPOInner

        grpo = self.grpo_trainer(tid, lr)
        next_batch = self.batches(tid, grpo)

        class SelfSampling(GRPOInner):
            def __init__(self) -> None:
                super().__init__(grpo)
                self.rewards: list[float] = []

            def train(self, steps: int) -> list[float]:
                metrics = [self.step(next_batch()) for _ in range(steps)]
                self.end_phase()
                self.rewards.append(statistics.mean(m.reward_mean for m in metrics))
                return [m.loss for m in metrics]

        return SelfSampling()

    def eval_reward(self, local: Any) -> float:
        """Greedy reward of ``local``'s weights on the held-out problems."""
        prompts = [tuple(self.encode(p.prompt)) for p in self.held_out]
        if self.uses_engine:
            if self._eval_engine is None:
                self._eval_engine = self._engine(local.model)
            groups = self._sample_engine(self._eval_engine, local, prompts, 1, 0.0, 0)
        else:
            groups = [self._sample_tiny(local, q, 1, None, temperature=0.0) for q in prompts]
        total = sum(
            self.task.score(self.decode(list(ids)), p) for p, ((ids, _),) in zip(self.held_out, groups, strict=True)
        )
        return total / len(prompts)

    # --- sampling ------------------------------------------------------------

    def _sample_tiny(
        self, local: Any, prompt: tuple[int, ...], n: int, generator: Any, temperature: float = 1.0
    ) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
        from pulsenet.rl.sampling import sample_group

        samples = sample_group(
            local.logits, prompt, n, max_new_tokens=self.args.max_new_tokens, eos_id=self.eos_id,
            temperature=temperature, generator=generator,
        )  # fmt: skip
        return [(s.completion_ids, s.logprobs) for s in samples]

    def _engine(self, model: torch.nn.Module) -> Any:
        from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig

        # no digests: the engine is loaded from its own worker's weights in this process
        return TorchEngine(copy.deepcopy(model), TorchEngineConfig(device="cpu", verify_updates=False))

    def _sample_engine(
        self, engine: Any, local: Any, prompts: list[tuple[int, ...]], n: int, temperature: float, seed: int
    ) -> list[list[tuple[tuple[int, ...], tuple[float, ...]]]]:
        from pulsenet.engines.base import SamplingParams

        engine.update(local.steps, local.bf16_state(), "self")  # copies only the tensors whose bits changed
        params = SamplingParams(
            temperature=temperature, max_new_tokens=self.args.max_new_tokens, stop_token_ids=self.stop_ids,
            seed=seed,
        )  # fmt: skip
        gens = engine.generate([q for q in prompts for _ in range(n)], params)
        return [[(g.completion_ids, g.logprobs) for g in gens[i * n : (i + 1) * n]] for i in range(len(prompts))]


def grpo_bench(args: argparse.Namespace) -> GRPOBench:
    from pulsenet.nodes.common import CACHE_DIR, text_codec
    from pulsenet.rl.tasks import assign_problems, build_task
    from pulsenet.rl.warmup import tiny_task, warm_tiny_model

    codec = text_codec(args.model)
    if args.model == "tiny":
        task: Any = tiny_task(args.seed)
        model = warm_tiny_model(CACHE_DIR.expanduser(), seed=args.seed)
        stop_ids: tuple[int, ...] = ()
        lr = 1e-3
    else:
        from pulsenet.rl import load_model, smollm2_checkpoint

        task = build_task("arith-shots", seed=args.seed)  # what the inference nodes run for smollm2
        model = load_model(smollm2_checkpoint())
        stop_ids = tuple(codec.encode("\n"))
        lr = 3e-6
    held_out = assign_problems(task, node="eval", version=0, seed=10_007 + args.seed, n=args.eval_prompts)
    return GRPOBench(
        args=args, task=task, encode=codec.encode, decode=codec.decode, eos_id=codec.eos_id, pad_id=codec.pad_id,
        stop_ids=stop_ids, start=lambda: copy.deepcopy(model), default_lr=lr, held_out=held_out,
    )  # fmt: skip


def average_gradients(params: list[list[torch.Tensor]]) -> None:
    """Set every worker's ``.grad`` to the mean of all workers' (``params[w][i]``: worker w's i-th
    parameter): ``((g0 + g1) + g2 ...) / N`` in worker order, into worker 0's gradient, then copied
    to the others, so every worker holds the same bits (in place: no 0.5 GB allocation per step)."""
    n = len(params)
    for same in zip(*params, strict=True):
        grads = [p.grad for p in same]
        if any(g is None for g in grads):
            if all(g is None for g in grads):
                continue  # unused by the loss on every worker (the same graph everywhere)
            raise RuntimeError("a parameter has a gradient on some workers only")
        total = grads[0]
        for g in grads[1:]:
            total += g
        total /= n
        for g in grads[1:]:
            g.copy_(total)


def weights_digest(local: Any) -> str:
    """The model digest (``codec.digest``) of a worker's FP32 master weights."""
    from pulsenet.codec.digest import model_digest

    return model_digest(local.state_fp32())


def run_ddp(args: argparse.Namespace, bench: GRPOBench, lr: float, console: Any = None) -> dict[str, Any]:
    """N data-parallel GRPO workers for ``--rounds`` x ``--H`` steps; the result ``_run_mode`` returns."""
    from pulsenet.bench.loco_phases import ddp_bytes

    ids = [f"w{k}" for k in range(args.workers)]
    trainers = [bench.grpo_trainer(tid, lr) for tid in ids]
    feeds = [bench.batches(tid, g) for tid, g in zip(ids, trainers, strict=True)]
    params = [list(g.local.model.parameters()) for g in trainers]
    n_params = sum(t.numel() for t in trainers[0].local.state_fp32().values())
    initial = bench.eval_reward(trainers[0].local)
    rounds, started = [], time.perf_counter()
    for r in range(1, args.rounds + 1):
        rewards, losses, inner_s, apply_s = [], [], 0.0, 0.0
        for _ in range(args.inner_steps):
            t = time.perf_counter()
            metrics = [g.compute_gradients(feed()) for g, feed in zip(trainers, feeds, strict=True)]
            inner_s += (time.perf_counter() - t) / len(trainers)  # each worker's share, as on its own machine
            t = time.perf_counter()
            average_gradients(params)  # the all-reduce
            norms = {g.apply_gradients() for g in trainers}
            apply_s += (time.perf_counter() - t) / len(trainers)
            if len(norms) != 1:
                raise RuntimeError(f"DDP workers clipped different gradient norms: {sorted(norms)}")
            rewards.append(statistics.mean(m.reward_mean for m in metrics))
            losses.append(statistics.mean(m.loss for m in metrics))
        for g in trainers:
            g.local.optimizer.zero_grad(set_to_none=True)
        digests = {weights_digest(g.local) for g in trainers}
        if len(digests) != 1:
            raise RuntimeError(f"DDP workers diverged in round {r}: {len(digests)} different weight digests")
        eval_reward = bench.eval_reward(trainers[0].local)
        rounds.append({
            "round": r, "payload_bytes": ddp_bytes(n_params, args.inner_steps), "sent_fraction": 1.0,
            "eval_reward": eval_reward, "train_loss": statistics.mean(losses), "digests_equal": True,
            "reward": statistics.mean(rewards), "inner_s": inner_s, "apply_s": apply_s,
            **{f"{k}_s": 0.0 for k in ("encode", "upload", "wait", "verify", "queued")},
        })  # fmt: skip
        if console is not None:
            console.print(
                f"ddp: round {r}/{args.rounds}: eval reward {eval_reward:.4f}, inner reward "
                f"{rounds[-1]['reward']:.3f} ({time.perf_counter() - started:.0f} s)"
            )
    return {
        "n_params": n_params,
        "initial_eval_loss": initial,
        "rounds": rounds,
        "digests_equal": True,
        "final_digest": digests.pop(),
        "wall_s": time.perf_counter() - started,
    }
