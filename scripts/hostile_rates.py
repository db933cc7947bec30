"""Detection rates of the hostile behaviours (pulsenet/nodes/hostile.py) under the trainer's replay.

In one process, no store: a policy and ``--lag`` versions made from it by real GRPO steps (AdamW at
``--lr`` on honest batches; reward: the task's plus the share of digits in the completion, so a
step always has a signal and versions move as a learning run's do), a ``TorchEngine`` serving the
newest version V, and a ``Replayer`` (rl/replay.py, ``ReplayConfig()`` defaults: share 0.375,
min_rows 8; no node named, so no probation: the steady state of a node past its first batches)
holding every version, as a trainer does. For each behaviour, ``--batches`` batches of
``--prompts`` x ``--group`` rows answered at V by node i1 (problems ``assign_problems``, public
draw keys ``DrawId(run, digest(V), "i1", V, b, k, i)``: ``ReplayRows``' convention) go through
``Hostile.generate`` (``publish`` for withhold) and the replay; the share refused is the rate.
Honest batches give the false-refusal count and the margins (worst CDF margin, |Δ log-prob|).
``landed_before_refusal``: for a sparse cheat (``one-row``), the batches landed before each refusal
(issue 38's bound: < 2 in expectation).

    python scripts/hostile_rates.py --model tiny --batches 50
    python scripts/hostile_rates.py --model smollm2 --batches 12 --prompts 4

``tiny``: the tiny model peaked as tests/unit/test_replay.py's fixture (embeddings x4); ``tiny-warm``:
the warmed-up tiny model runs start from; ``smollm2``: SmolLM2-135M-Instruct on arith-shots (its
preset: lr 3e-6, 16 new tokens). Figures: docs/rollouts.md, "Adversaries and what catches them".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from pulsenet.codec.digest import model_digest
from pulsenet.codec.rollout import Rollout
from pulsenet.engines.torch_engine import TorchEngine
from pulsenet.nodes.common import initial_model, text_codec
from pulsenet.nodes.hostile import Hostile, HostileConfig
from pulsenet.rl.draw import DrawId
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.models import build_tiny_model
from pulsenet.rl.replay import ReplayConfig, Replayer, ReplayRow
from pulsenet.rl.tasks import TaskConfig, assign_problems, build_task, group_id

RUN = "hostile-rates"


def behaviours(weak: str) -> list[str]:
    return [
        "honest", "chosen", "best-of-n", "scaled-logprobs", "scaled-logprobs:scale=0.9", "wrong-temperature",
        "wrong-temperature:temperature=0.95", "stale:lag=1", "stale:lag=2", "stale:lag=3", "perturbed",
        f"perturbed:layer={weak}", "copy:victim=i0", "withhold", "one-row",
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "tiny-warm", "smollm2"), default="tiny")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--lr", type=float, default=None, help="default: the preset's (tiny 5e-4, smollm2 3e-6)")
    p.add_argument("--lag", type=int, default=3, help="versions made by GRPO steps (stale serves V - lag)")
    p.add_argument("--only", nargs="*", default=None, help="behaviours to run (default: all)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.manual_seed(0)

    if a.model == "smollm2":
        model, codec = initial_model("smollm2"), text_codec("smollm2")
        task = build_task(TaskConfig(task="arith-shots", max_new_tokens=16), seed=0)
        lr = a.lr or 3e-6
    else:
        model = build_tiny_model(0) if a.model == "tiny" else initial_model("tiny")
        if a.model == "tiny":
            with torch.no_grad():
                model.model.embed_tokens.weight.mul_(4.0)
        codec, task, lr = text_codec("tiny"), build_task("arith", seed=0), a.lr or 5e-4
    prompter = task.prompter(codec)
    hf = model.config
    layers = hf.num_hidden_layers
    weak = f"model.layers.{layers // 2}.self_attn.o_proj.weight"

    def problems(node: str, version: int, b: int) -> list:
        return [
            q
            for q in assign_problems(task, node=node, version=version, seed=0, n=a.prompts, batch=b)
            for _ in range(a.group)
        ]

    def score_for(probs: list) -> object:
        return lambda gens: list(task.score_texts(probs, [prompter.completion_text(g.completion_ids) for g in gens]).total)

    def ids_for(node: str, version: int, digest: str, b: int) -> list[DrawId]:
        return [DrawId(RUN, digest, node, version, b, k, i) for k in range(a.prompts) for i in range(a.group)]

    params0 = prompter.sampling_params()

    # --- versions by GRPO steps ------------------------------------------------------------------
    t0 = time.perf_counter()
    grpo = GRPOTrainer(model, GRPOConfig(lr=lr, pad_id=codec.pad_id))
    states = [grpo.bf16_state()]
    digests = [model_digest(states[0])]
    for v in range(a.lag):
        engine = TorchEngine.from_state(hf, states[v], digests[v], version=v, decode=codec.decode)
        probs = problems("t", v, 0)
        ids = ids_for("t", v, digests[v], 0)
        gens = engine.generate(
            [prompter.encode(q.prompt) for q in probs], dataclasses.replace(params0, draws=tuple(d.key() for d in ids))
        )
        rewards = score_for(probs)(gens)
        rows = []
        for j, (g, r) in enumerate(zip(gens, rewards, strict=True)):
            text = prompter.completion_text(g.completion_ids)
            shaped = r + sum(ch.isdigit() for ch in text) / max(len(text), 1)
            rows.append(Rollout(group=group_id("t", v, 0, j // a.group), prompt_ids=g.prompt_ids,
                                completion_ids=g.completion_ids, logprobs=g.logprobs, reward=shaped, version=v,
                                model_digest=digests[v], node="t", seed=j))  # fmt: skip
        grpo.step(rows)
        states.append(grpo.bf16_state())
        digests.append(model_digest(states[-1]))
    V = a.lag
    changed = [
        sum(int((states[v + 1][n].view(torch.int16) != states[v][n].view(torch.int16)).sum()) for n in states[v])
        / sum(t.numel() for t in states[v].values())
        for v in range(V)
    ]  # fmt: skip
    print(f"{a.model}: {V} GRPO steps at lr {lr} in {time.perf_counter() - t0:.0f} s; BF16 weights changed per version: "
          + ", ".join(f"{c:.2%}" for c in changed))  # fmt: skip

    replayer = Replayer(hf, params0, ReplayConfig(), keep=V + 1, stopped=prompter.stopped if prompter.config.stop else None)
    for v, s in enumerate(states):
        replayer.remember(v, s)
    engine = TorchEngine.from_state(hf, states[V], digests[V], version=V, decode=codec.decode)

    results = {}
    for name in a.only or behaviours(weak):
        t1 = time.perf_counter()
        hostile = None if name == "honest" else Hostile(HostileConfig.parse(name), hf, codec.decode)
        if hostile is not None:
            for v, s in enumerate(states):
                hostile.observe(v, s, digests[v])
        refused: dict[str, int] = {}
        margins, diffs, published = [], [], 0
        runs, landed = [], 0  # batches landed (published, not refused) before each refusal
        for b in range(a.batches):
            probs = problems("i1", V, b)
            ids = ids_for("i1", V, digests[V], b)
            prompts = [prompter.encode(q.prompt) for q in probs]
            params = dataclasses.replace(params0, draws=tuple(d.key() for d in ids))
            score = score_for(probs)
            gens = engine.generate(prompts, params) if hostile is None else hostile.generate(engine, prompts, params, ids, score)
            if hostile is not None and not hostile.publish(score(gens)):
                continue
            published += 1
            rows = [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, d.key()) for g, d in zip(gens, ids, strict=True)]
            verdict = replayer.check(V, rows)
            if verdict.reason is not None:
                refused[verdict.reason] = refused.get(verdict.reason, 0) + 1
                runs.append(landed)
                landed = 0
            else:
                landed += 1
            margins.append(verdict.margins)
            diffs.append(verdict.logprob_diffs)
        m, d = torch.cat(margins), torch.cat(diffs)
        n_ref = sum(refused.values())
        results[name] = {
            "batches": a.batches,
            "published": published,
            "touched": a.batches if hostile is None else hostile.stats.touched,
            "refused": n_ref,
            "rate": n_ref / published if published else None,
            "reasons": refused,
            # the trainer's picks are independent per batch: each run of landed batches ended by a
            # refusal is one sample of "batches landed before the first refusal" (issue 38)
            "landed_before_refusal": {"mean": sum(runs) / len(runs) if runs else None, "max": max(runs, default=None),
                                      "samples": len(runs), "after_last_refusal": landed},
            "tokens": int(m.numel()),
            "min_margin": float(m.min()),
            "share_margin_below_tol": float((m < -ReplayConfig().tolerances().cdf).float().mean()),
            "max_dlogprob": float(d.max()),
            "mean_dlogprob": float(d.mean()),
            "p99_dlogprob": float(d.quantile(0.99)) if d.numel() else None,
            "seconds": round(time.perf_counter() - t1, 1),
        }
        r = results[name]
        if a.out:  # after each behaviour: a long run's figures so far
            a.out.write_text(json.dumps(summary(a, lr, V, changed, weak, results), indent=1) + "\n")
        print(f"{name:40s} refused {n_ref:3d}/{published:3d} ({(r['rate'] or 0):6.1%}) {refused}  "
              f"min margin {r['min_margin']:+.4f}  "
              f"|dlogp| mean {r['mean_dlogprob']:.4f} max {r['max_dlogprob']:.4f}  {r['seconds']} s", flush=True)  # fmt: skip


def summary(a: argparse.Namespace, lr: float, lag: int, changed: list[float], weak: str, results: dict) -> dict:
    return {"model": a.model, "lr": lr, "lag": lag, "changed_per_version": changed, "prompts": a.prompts, "group": a.group,
            "replay": dataclasses.asdict(ReplayConfig()), "weak_layer": weak, "results": results}  # fmt: skip


if __name__ == "__main__":
    main()
