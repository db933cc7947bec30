"""Issue 29, "silent stall": settings that cannot work fail at start, naming the fields; ``pulsenet
up``'s completion length fits the model; an inference node that drops every prompt says so in
/healthz, counts the drops per reason in /status and /metrics, and ``up`` names it when STUCK.

Found with ``pulsenet up --model <a 512-position HF dir> --task sums.jsonl``: the dataset task's
default of 512 new tokens left no room for any prompt, every prompt was dropped with a warning,
/healthz said ok and ``up`` said "no trainer reports a fault" after 300 s.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pulsenet.errors import ConfigError
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig, NetworkSettings
from pulsenet.nodes.plan import Site, plan_network
from pulsenet.nodes.status import StatusServer
from pulsenet.nodes.supervisor import TrainerView, holdup, with_inference
from pulsenet.rl.prompts import byte_codec
from pulsenet.rl.tasks import TaskConfig, build_task
from pulsenet.sync.subscriber import SubscriberConfig
from tests.support.channel import node_on_a_tiny_channel
from tests.support.model_dirs import llama_config, model_dir, smollm2_tokenizer
from tests.support.waiting import wait_until


def _sums(tmp_path: Path) -> Path:
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(20)))
    return data


def test_a_prompt_budget_of_zero_is_a_config_error_naming_the_fields(tmp_path: Path) -> None:
    task = build_task(TaskConfig(task=str(_sums(tmp_path))), seed=0)  # a dataset: 512 new tokens by default
    with pytest.raises(ConfigError, match=r"max_new_tokens = 512.*max_position_embeddings = 512"):
        task.prompter(byte_codec(), max_positions=512)
    task.prompter(byte_codec(), max_positions=513)  # one position for a prompt: not refused here
    task.close()


def _plan(tmp_path: Path, model: Path, **kw: object):
    ids = ["t0", "i0"]
    sites = {n: Site(store=f"file://{tmp_path / n}", key=tmp_path / f"{n}.key", state_dir=tmp_path / "state" / n) for n in ids}
    settings = NetworkSettings(model=str(model), task=str(_sums(tmp_path)), trainers=1, inference=1, **kw)  # type: ignore[arg-type]
    return plan_network(settings, run="r", sites=sites, public_keys=tmp_path)


def test_up_gives_the_nodes_a_completion_length_that_fits_the_model(tmp_path: Path) -> None:
    tok = smollm2_tokenizer()
    mistral_like = model_dir(tmp_path / "m512", llama_config(tok, max_position_embeddings=512), tok)
    (t,), (i,) = _plan(tmp_path, mistral_like)
    # the pretrained preset's [task] max-new-tokens = 64 reaches both nodes (7876ec8: None, so 512)
    assert t.task.max_new_tokens == i.task.max_new_tokens == 64
    assert t.task.prompt_config().max_new_tokens == 64
    short = model_dir(tmp_path / "m96", llama_config(tok, max_position_embeddings=96), tok)
    (t,), (i,) = _plan(tmp_path, short)
    assert t.task.max_new_tokens == i.task.max_new_tokens == 48  # half the context: room for prompts
    with pytest.raises(ConfigError, match=r"--max-new-tokens 600.*max_position_embeddings = 512"):
        _plan(tmp_path, mistral_like, max_new_tokens=600)


@pytest.mark.timeout(120)
async def test_an_inference_node_that_drops_every_prompt_reports_degraded_with_counts(tmp_path: Path) -> None:
    task = TaskConfig(max_prompt_tokens=2, max_new_tokens=2)  # every arith prompt ("3+4=") is longer
    config = InferenceConfig(id="i0", run="r", state_dir=tmp_path / "i0", task=task, batches_per_version=2,
                             subscribe=SubscriberConfig(interval_s=0.1))  # fmt: skip
    node = await node_on_a_tiny_channel(tmp_path, config, task=build_task(task, seed=0), text=text_codec("tiny"))
    status = StatusServer(node.state)
    stop = asyncio.Event()
    run = asyncio.create_task(node.run(stop))

    def dropped_a_batch() -> bool:  # the events asserted below, not a fixed half second after the first drop
        dropped = node.state.to_json()["prompts_dropped"].get("prompt_too_long", 0)
        return dropped >= 8 and status.health()["status"] == "degraded"

    await wait_until(lambda: dropped_a_batch() or run.done(), 60, "8 prompts dropped and /healthz degraded")
    assert not run.done(), run.exception()
    health = status.health()
    assert health["status"] == "degraded", health  # 7876ec8: "ok" while it generated nothing
    assert any("every prompt" in r and "prompt_too_long" in r for r in health["reasons"]), health
    assert node.state.to_json()["prompts_dropped"]["prompt_too_long"] >= 8
    text = generate_latest(status.registry).decode()
    assert 'pulsenet_prompts_dropped_total{node="i0",reason="prompt_too_long",role="inference"}' in text
    assert node.writer.stats.batches == 0
    stop.set()
    await run


def test_stuck_names_the_inference_node_that_makes_nothing() -> None:
    trainers = [TrainerView("t0", "running", "ok", 0, round=1, idle_s=3.0)]
    line = holdup(trainers)
    assert line.startswith("no trainer reports a fault")
    named = with_inference(line, [("i0", "degraded", ["every prompt of v0 batch 1 was dropped (8 context_too_long so far)"]),
                                  ("i1", "ok", [])])  # fmt: skip
    assert named.startswith("i0 is degraded: every prompt") and "i1" not in named
    assert with_inference("t0 is down (exit 1), restarting", [("i0", "degraded", ["x"])]) == "t0 is down (exit 1), restarting"


def test_up_refuses_groups_larger_than_a_step(tmp_path: Path) -> None:
    """A trainer refuses a group larger than a step (issue 29 item 2): a plan that makes only such
    groups would drop everything, so it is a ConfigError at once."""
    tok = smollm2_tokenizer()
    model = model_dir(tmp_path / "m", llama_config(tok), tok)
    with pytest.raises(ConfigError, match=r"--group-size 64 is larger than --rows-per-step 32"):
        _plan(tmp_path, model, group_size=64, rows_per_step=32)
