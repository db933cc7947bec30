"""Catch rates of the row-choosing hostile behaviours (issue 38: pulsenet/nodes/hostile_rows.py)
under the trainer's batch check (rl/answers.py), and its false refusals of honest batches.

In one process, no store: a ``TorchEngine`` serving the model draws ``--batches`` honest batches of
``--prompts`` x ``--group`` rows for node i1 (problems ``assign_problems``, public draw keys), each
scored by the task; each behaviour turns every batch into what it sends, and the trainer's
``BatchCheck`` (the same one ``compose_trainer`` builds, G and ``prompts_per_batch`` set) plus the
once-per-batch-id rule decide. A batch sent unchanged counts as honest (not "touched").

    python scripts/choosing_rates.py --model tiny-warm --batches 50
    python scripts/choosing_rates.py --model smollm2 --batches 12 --prompts 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from pulsenet.codec.digest import model_digest
from pulsenet.codec.rollout import Rollout, decode_columns, encode_batch
from pulsenet.engines.torch_engine import TorchEngine
from pulsenet.errors import RolloutRowError
from pulsenet.nodes.common import initial_model, text_codec
from pulsenet.nodes.hostile_rows import REWORKS, rework
from pulsenet.rl.answers import BatchCheck
from pulsenet.rl.draw import DrawId
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.shape import RowShape
from pulsenet.rl.tasks import Assignment, TaskConfig, assign_problems, build_task, group_id

RUN = "choosing-rates"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny-warm", "smollm2"), default="tiny-warm")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    if a.model == "smollm2":
        model, codec = initial_model("smollm2"), text_codec("smollm2")
        task = build_task(TaskConfig(task="arith-shots", max_new_tokens=16), seed=0)
    else:
        model, codec, task = initial_model("tiny"), text_codec("tiny"), build_task("arith", seed=0)
    prompter = task.prompter(codec, max_positions=getattr(model.config, "max_position_embeddings", None))
    params0 = prompter.sampling_params()
    state = GRPOTrainer(model, GRPOConfig(pad_id=codec.pad_id)).bf16_state()
    digest = model_digest(state)
    engine = TorchEngine.from_state(model.config, state, digest, version=0, decode=codec.decode)
    check = BatchCheck(
        Assignment(a.batches + 1, a.prompts, max_group_rows=a.prompts * a.group, group_size=a.group), task, prompter,
        seed=0, shape=RowShape.of(params0, getattr(model.config, "eos_token_id", None), prompter.stopped),
    )  # fmt: skip

    t0 = time.perf_counter()
    batches: list[tuple[list[Rollout], tuple[int, ...], list]] = []  # rows, dropped, the problem of each row
    for b in range(a.batches):
        problems = assign_problems(task, node="i1", version=0, seed=0, n=a.prompts, batch=b)
        asked = [(k, q, ids) for k, q in enumerate(problems) if (ids := prompter.encode(q.prompt)) is not None]
        dropped = tuple(sorted(set(range(a.prompts)) - {k for k, _, _ in asked}))
        keys = tuple(DrawId(RUN, digest, "i1", 0, b, k, i).key() for k, _, _ in asked for i in range(a.group))
        gens = engine.generate([ids for _, _, ids in asked for _ in range(a.group)], dataclasses.replace(params0, draws=keys))
        probs = [q for _, q, _ in asked for _ in range(a.group)]
        groups = [group_id("i1", 0, b, k) for k, _, _ in asked for _ in range(a.group)]
        rewards = task.score_texts(probs, [prompter.completion_text(g.completion_ids) for g in gens]).total
        rows = [g.to_rollout(group=grp, reward=r, node="i1") for g, grp, r in zip(gens, groups, rewards, strict=True)]
        batches.append((rows, dropped, probs))
    print(f"{a.model}: {a.batches} honest batches of {a.prompts} x {a.group} in {time.perf_counter() - t0:.0f} s", flush=True)

    results = {}
    for name in ("honest", *REWORKS):
        answered: set[str] = set()
        sent = touched = refused = 0
        reasons: dict[str, int] = {}
        previous = None
        for rows, dropped, probs in batches:
            def score(i: int, ids, probs=probs) -> float:
                return task.score(prompter.completion_text(ids), probs[i])

            sends = [rows] if name == "honest" else rework(name, rows, score, previous=previous, n=2, copies=32)
            previous = rows
            for batch in sends:
                sent += 1
                touched += batch is not rows and batch != rows
                try:
                    answer = check(decode_columns(encode_batch(batch)), dropped)
                    if answer in answered:
                        raise RolloutRowError("batch_repeated", answer)
                    answered.add(answer)
                except RolloutRowError as e:
                    refused += 1
                    reasons[e.reason] = reasons.get(e.reason, 0) + 1
        results[name] = {"sent": sent, "touched": touched, "refused": refused, "reasons": reasons}
        print(f"{name:12s} sent {sent:3d}, touched {touched:3d}, refused {refused:3d} {reasons}", flush=True)
    task.close()
    if a.out:
        out = {"model": a.model, "prompts": a.prompts, "group": a.group, "results": results}
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
