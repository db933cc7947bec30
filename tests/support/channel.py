"""One inference node on one policy channel, for node tests that need a served model and no trainer:
t0 publishes the tiny model's v0 on a ``LocalStore`` under ``tmp``, and node i0 (its own key and
rollout bucket) follows that channel, trusting t0 only."""

from __future__ import annotations

from pathlib import Path

from pulsenet.nodes.build import compose_inference
from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.inference import InferenceNode
from pulsenet.rl import build_tiny_model
from pulsenet.rl.models import bf16_state_dict
from pulsenet.rl.prompts import TextCodec
from pulsenet.rl.tasks import Task
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import Publisher, PublisherConfig


async def node_on_a_tiny_channel(tmp: Path, config: InferenceConfig, *, task: Task, text: TextCodec) -> InferenceNode:
    """Node i0 built from ``config`` (run ``config.run``), with t0's channel at ``tmp/t0`` already
    carrying v0, the tiny model (whatever model ``config`` names: a mismatch is the node's to find),
    and its rollouts going to ``tmp/i0-store``. Keys: ``tmp/t0.key``, ``tmp/i0.key``."""
    for site in ("t0", "i0"):
        generate_keypair(tmp / f"{site}.key")
    pub = load_public_key(tmp / "t0.key.pub")
    channel = LocalStore(tmp / "t0")
    async with Publisher(channel, load_private_key(tmp / "t0.key"), PublisherConfig(run=config.run)) as p:
        await p.publish_now(bf16_state_dict(build_tiny_model(0)))
    return compose_inference(
        config,
        store=LocalStore(tmp / "i0-store"),
        policy_stores=[channel],
        trusted={key_id(pub): pub},
        key=load_private_key(tmp / "i0.key"),
        task=task,
        text=text,
    )
