"""Eval: greedy scores on the held-out problems, from an engine the evaluator updates in place."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError
from pulsenet.rl.eval import EngineBuilder, Evaluator, evaluate
from pulsenet.rl.models import bf16_state_dict, build_tiny_model, model_hf_config, resolve_model
from pulsenet.rl.prompts import byte_codec
from pulsenet.rl.tasks import TaskConfig, build_task


def _cpu_engine(decode: Callable[[Sequence[int]], str]) -> EngineBuilder:
    """What the trainer node passes its Evaluator (nodes/trainer.py), on the CPU."""
    return functools.partial(
        TorchEngine.from_state, model_hf_config(resolve_model("tiny")), config=TorchEngineConfig(device="cpu"), decode=decode
    )


def test_evaluator_scores_versions_and_updates_in_place(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(40)))
    task = build_task(TaskConfig(task=str(data), eval_fraction=0.25, reward=["exact", "numeric"], max_new_tokens=4), seed=0)
    prompter = task.prompter(byte_codec(), max_positions=512)
    ev = Evaluator(task, prompter, _cpu_engine(prompter.codec.decode), batch_size=4)
    state = bf16_state_dict(build_tiny_model(0))
    first = ev.evaluate(0, state, model_digest(state))
    assert first.n == 10 and first.dropped == 0 and 0.0 <= first.reward <= 2.0
    assert set(first.by_reward) == {"exact", "numeric"} and first.as_dict() == {"version": 0, "reward": first.reward, "n": 10}
    engine = ev.engine
    assert isinstance(engine, TorchEngine)
    copied = engine.stats.tensors_copied
    moved = {**state, "model.norm.weight": (state["model.norm.weight"].float() * 3).to(torch.bfloat16)}
    second = ev.evaluate(1, moved)  # digest computed here when not given
    assert ev.engine is engine and engine.version == 1 and engine.stats.tensors_copied == copied + 1  # in place
    assert engine.weights_digest() == model_digest(moved)
    assert [r.version for r in ev.history] == [0, 1] and second.n == 10
    again = evaluate(engine, task, prompter, version=1, batch_size=10)  # greedy: the same scores
    assert again.reward == second.reward
    task.close()


def test_eval_needs_held_out_problems(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    task = build_task(TaskConfig(task=str(data)), seed=0)
    ev = Evaluator(task, task.prompter(byte_codec()), _cpu_engine(byte_codec().decode))
    state = bf16_state_dict(build_tiny_model(0))
    with pytest.raises(ConfigError, match="no held-out problems"):
        ev.evaluate(0, state)
    arith = build_task(TaskConfig(task="arith"), seed=0)
    assert len(arith.eval_problems) == 64  # generated tasks: a fixed draw of their own
    assert arith.eval_problems == build_task(TaskConfig(task="arith"), seed=0).eval_problems
