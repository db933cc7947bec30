"""A node whose model does not fit the channel stops, naming the tensor (issue 22 item 1), and a
trainer shows per node the rewards it re-scored differently (item 5), in /status and /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pulsenet.errors import ConfigError
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.status import NodeState, StatusServer
from pulsenet.rl.rescore import RescoreStats
from pulsenet.rl.tasks import build_task
from pulsenet.sync.subscriber import SubscriberConfig
from tests.support.channel import node_on_a_tiny_channel
from tests.support.model_dirs import llama_dir


@pytest.mark.timeout(120)
async def test_an_inference_node_whose_model_does_not_fit_the_channel_stops_naming_the_tensor(tmp_path: Path) -> None:
    model = str(llama_dir(tmp_path / "llama"))  # the node was configured with another architecture
    config = InferenceConfig(id="i0", run="r", model=model, state_dir=tmp_path / "i0", subscribe=SubscriberConfig(interval_s=0.1))
    # the channel carries the tiny model
    node = await node_on_a_tiny_channel(tmp_path, config, task=build_task("arith", seed=0), text=text_codec(model))
    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.timeout(60):
            await node.run(asyncio.Event())
    (err,) = info.value.exceptions
    assert isinstance(err, ConfigError) and "model." in str(err), err  # names the first tensor that does not fit
    assert node.engine is None and node.served == []  # nothing was ever served


def test_reward_disagreements_show_per_node() -> None:
    state = NodeState(role="trainer", node_id="t0")
    stats = RescoreStats()
    stats.node("i1").rows, stats.node("i1").disagreements = 64, 9
    state.rescored = stats.nodes
    text = generate_latest(StatusServer(state).registry).decode()
    assert 'pulsenet_reward_disagreements_total{node="t0",role="trainer",source="i1"} 9.0' in text
    assert state.to_json()["rescored"]["i1"]["disagreements"] == 9
