"""A node whose model does not fit the channel stops, naming the tensor (issue 22 item 1), and a
trainer shows per node the rewards it re-scored differently (item 5), in /status and /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pulsenet.errors import ConfigError
from pulsenet.nodes.common import make_task, text_codec
from pulsenet.nodes.inference import InferenceConfig, InferenceNode
from pulsenet.nodes.status import NodeState, StatusServer
from pulsenet.rl import build_tiny_model
from pulsenet.rl.models import bf16_state_dict
from pulsenet.rl.rescore import RescoreStats
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import SubscriberConfig
from tests.support.model_dirs import llama_dir


@pytest.mark.timeout(120)
async def test_an_inference_node_whose_model_does_not_fit_the_channel_stops_naming_the_tensor(tmp_path: Path) -> None:
    generate_keypair(tmp_path / "t0.key")
    generate_keypair(tmp_path / "i0.key")
    pub = load_public_key(tmp_path / "t0.key.pub")
    channel = LocalStore(tmp_path / "t0")
    async with Publisher(channel, load_private_key(tmp_path / "t0.key"), PublisherConfig(run="r")) as p:
        await p.publish_now(bf16_state_dict(build_tiny_model(0)))  # the channel carries the tiny model
    model = str(llama_dir(tmp_path / "llama"))  # the node was configured with another architecture
    config = InferenceConfig(id="i0", run="r", model=model, state_dir=tmp_path / "i0", subscribe=SubscriberConfig(interval_s=0.1))
    node = InferenceNode(
        config,
        store=LocalStore(tmp_path / "i0-store"),
        policy_stores=[channel],
        trusted={key_id(pub): pub},
        key=load_private_key(tmp_path / "i0.key"),
        task=make_task("arith", 0),
        text=text_codec(model),
    )
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
