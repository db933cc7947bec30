"""The trainer scores: rollouts re-scored with the trainer's own task; a node whose reward column
lies is counted, a row that answered a prompt it was not assigned is rejected."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.rl.models import build_tiny_model
from pulsenet.rl.prompts import byte_codec
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.tasks import TaskConfig, assign_problems, build_task, group_id, parse_group_id

SEED = 3


def _rows(task, prompter, engine, node: str, version: int, batch: int, n: int, g: int) -> list:
    """What an inference node produces: assigned problems, G samples each, scored, as rollout rows."""
    problems = assign_problems(task, node=node, version=version, seed=SEED, n=n, batch=batch)
    prompts = [prompter.encode(p.prompt) for p in problems]
    gens = engine.generate([p for p in prompts for _ in range(g)], prompter.sampling_params(seed=1))
    texts = [prompter.completion_text(x.completion_ids) for x in gens]
    scores = task.score_texts([problems[i // g] for i in range(len(gens))], texts)
    return [
        x.to_rollout(group=group_id(node, version, batch, i // g), reward=r, node=node)
        for i, (x, r) in enumerate(zip(gens, scores.total, strict=True))
    ]


def test_honest_and_lying_nodes_on_sampled_rollouts() -> None:
    task = build_task(TaskConfig(task="arith"), seed=SEED)
    prompter = task.prompter(byte_codec())
    engine = TorchEngine(build_tiny_model(0), TorchEngineConfig(device="cpu"), version=4)
    honest = _rows(task, prompter, engine, "i0", 4, 0, n=6, g=4)
    right = assign_problems(task, node="i0", version=4, seed=SEED, n=1, batch=0)[0].answer.encode() + b"\n"
    honest[0] = replace(honest[0], completion_ids=tuple(right), logprobs=(0.0,) * len(right), reward=1.0)
    liar = [replace(r, reward=1.0 - r.reward) for r in _rows(task, prompter, engine, "i1", 4, 2, n=4, g=4)]
    assert 0 < sum(r.reward for r in honest) < len(honest)
    rescorer = Rescorer(task, prompter, seed=SEED)
    out = rescorer.rescore(honest + liar)
    assert [r.reward for r in out.rows[: len(honest)]] == [r.reward for r in honest]
    assert [r.reward for r in out.rows[len(honest) :]] == [1.0 - r.reward for r in liar]  # the trainer's value
    assert not out.rejected and len(out.disagreements) == len(liar)
    assert rescorer.stats.nodes["i0"].disagreements == 0 and rescorer.stats.nodes["i1"].disagreements == len(liar)
    assert rescorer.stats.nodes["i1"].max_abs_diff == 1.0
    other_prompt = replace(honest[0], prompt_ids=tuple(b"1+1="))
    wrong_node = replace(honest[1], node="i1")  # its group names i0
    garbage = replace(honest[2], group="whatever")
    out = rescorer.rescore([other_prompt, wrong_node, garbage, honest[3]])
    assert [why for _, why in out.rejected] == ["prompt", "group", "group"] and len(out.rows) == 1
    assert (
        rescorer.stats.nodes["i0"].rejected == {"prompt": 1, "group": 1}
        and rescorer.stats.nodes["i1"].rejected == {"group": 1}
    )
    task.close()


def test_dataset_rewards_are_recomputed_with_math_verify(tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}*3=", "answer": str(3 * a)}) + "\n" for a in range(20)))
    task = build_task(TaskConfig(task=str(data), stop=["\n"]), seed=SEED)
    codec = byte_codec()
    prompter = task.prompter(codec)
    problems = assign_problems(task, node="i0", version=1, seed=SEED, n=3, batch=0)
    from pulsenet.codec.rollout import Rollout

    completions = [f"\\boxed{{{problems[0].answer}}}\nextra 999", "7", f"{problems[2].answer}.0"]
    rows = [
        Rollout(group=group_id("i0", 1, 0, k), prompt_ids=tuple(prompter.encode(p.prompt)), completion_ids=tuple(codec.encode(c)),
                logprobs=(0.0,) * len(c), reward=0.0, version=1, model_digest="0" * 64, node="i0", seed=0)
        for k, (p, c) in enumerate(zip(problems, completions, strict=True))
    ]
    out = Rescorer(task, prompter, seed=SEED).rescore(rows)
    expected_1 = 1.0 if problems[1].answer == "7" else 0.0
    assert [r.reward for r in out.rows] == [1.0, expected_1, 1.0]  # cut at the stop; 21.0 verifies as 21
    assert parse_group_id(group_id("node-a.1", 12, 3, 7)) == ("node-a.1", 12, 3, 7)
    task.close()
