"""Start a node from its config: open stores with the site's credentials, load keys, build the
node, serve its status, run it until SIGTERM/SIGINT. What ``pulsenet trainer`` and
``pulsenet inference`` call; ``pulsenet up`` starts each node as such a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pulsenet.errors import ConfigError
from pulsenet.nodes.common import (
    initial_model,
    key_map,
    make_task,
    open_site_store,
    site_map,
    stop_on_signals,
    text_codec,
)
from pulsenet.nodes.inference import InferenceConfig, InferenceNode
from pulsenet.nodes.status import StatusServer
from pulsenet.nodes.trainer import TrainerConfig, TrainerNode
from pulsenet.signing import load_private_key, trusted_keys

log = logging.getLogger(__name__)


def build_trainer(c: TrainerConfig) -> TrainerNode:
    from pulsenet.rollouts import RolloutSource

    if not c.store:
        raise ConfigError("trainer: set store (this site's bucket, e.g. s3://pulsenet-t0)")
    sources_urls = site_map(c.inference, "inference")
    keys = key_map(c.trust_inference, "inference")
    missing = sorted(set(sources_urls) - set(keys))
    if missing:
        raise ConfigError(f"trainer: no trusted key for inference node(s) {missing} (trust_inference ID=PATH)")
    sources = [RolloutSource(n, open_site_store(url), keys[n]) for n, url in sources_urls.items()]
    text = text_codec(c.model)
    c.grpo.pad_id = text.pad_id
    model = initial_model(c.model, c.cache_dir, seed=c.seed, warmup_steps=c.warmup_steps)
    return TrainerNode(
        c,
        store=open_site_store(c.store),
        key=load_private_key(c.key),
        sources=sources,
        model=model,
        loco_store=open_site_store(c.loco_store) if c.loco_store else None,
    )


def build_inference(c: InferenceConfig) -> InferenceNode:
    if not c.store or not c.policy or not c.trust:
        raise ConfigError(
            "inference: set store (this site's bucket), policy (trainer store URLs) and trust (trainer public keys)"
        )
    return InferenceNode(
        c,
        store=open_site_store(c.store),
        policy_stores=[open_site_store(url) for url in c.policy],
        trusted=trusted_keys(c.trust),
        key=load_private_key(c.key),
        task=make_task(c.task, c.seed),
        text=text_codec(c.model),
    )


async def serve(node: TrainerNode | InferenceNode, host: str, port: int, stuck_after_s: float) -> None:
    """Run ``node`` with its status server until it finishes or a signal stops it."""
    stop = asyncio.Event()
    async with StatusServer(node.state, host=host, port=port, stuck_after_s=stuck_after_s) as status:
        log.info("%s %s: status on %s", node.state.role, node.state.node_id, status.url, extra={"status_url": status.url})
        with stop_on_signals(stop):
            try:
                await node.run(stop)
            except BaseException as e:
                node.state.error(e)
                raise


def run_node(node: TrainerNode | InferenceNode, host: str, port: int, stuck_after_s: float) -> None:
    """The process's event loop: uvloop where available."""
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # not on Windows; the default loop works the same, slower
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(serve(node, host, port, stuck_after_s))
