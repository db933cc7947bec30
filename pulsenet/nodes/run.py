"""Start a node from its config: open stores with the site's credentials, load keys, build the
node, serve its status, run it until SIGTERM/SIGINT. What ``pulsenet trainer`` and
``pulsenet inference`` call; ``pulsenet up`` starts each node as such a process.

``pulsenet trainer`` under ``torchrun`` (``RANK``/``WORLD_SIZE`` set: docs/distributed.md) is a
data-parallel rank group: rank 0 runs the whole trainer node, the other ranks only its GRPO steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

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
from pulsenet.settings import to_toml_table
from pulsenet.signing import load_private_key, trusted_keys
from pulsenet.store.base import ObjectStore
from pulsenet.tracking import make_tracker

log = logging.getLogger(__name__)


def run_trainer(c: TrainerConfig) -> None:
    """``pulsenet trainer``: one trainer node, or one rank of its ``torchrun`` rank group.

    Rank 0 is the trainer node (store, intake, PULSELoCo, publishing, checkpoints, status); when it
    returns, however (its last step, SIGTERM/SIGINT, an error), it releases the other ranks, which
    then exit too. A restarted job resumes from rank 0's checkpoint and hands it to every rank.
    """
    from pulsenet.rl.distributed import GroupGRPOInner, exit_rank, init_rank_group, torchrun_rank

    rank = torchrun_rank(os.environ)
    if rank is None:
        run_node(build_trainer(c), c.status_host, c.status_port, c.stuck_after_s)
        return
    import torch.distributed as dist

    backend = init_rank_group(rank)
    clean = False  # every rank stopped on rank 0's word, no collective failed
    try:
        if rank.rank != 0:
            log.info("%s: rank %d of %d (%s) serves rank 0", c.id, rank.rank, rank.world, backend)
            _serve_rank(c)
            log.info("%s: rank %d released by rank 0", c.id, rank.rank)
        else:
            log.info("%s: speaks for a rank group of %d (%s)", c.id, rank.world, backend)
            node = build_trainer(c, ranks=True)
            group = node.policy
            assert isinstance(group, GroupGRPOInner)
            try:
                run_node(node, c.status_host, c.status_port, c.stuck_after_s)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the process group may be what failed
                    group.stop()
                raise
            group.stop()
        clean = True
    finally:
        if clean:
            # A last barrier on a clean stop: no rank tears down its gloo pairs while another still
            # has messages of the stop in flight.
            dist.barrier()
        dist.destroy_process_group()
    exit_rank(0)  # only a clean stop gets here; see exit_rank for why not a normal return


def _serve_rank(c: TrainerConfig) -> None:
    """A rank > 0: the GRPO steps rank 0 sends, nothing else (no store, no keys, no status port).

    SIGTERM/SIGINT are ignored: torchrun and a terminal signal every rank at once, and this one
    must finish the step in hand with rank 0, then leave when rank 0 says stop. If rank 0 dies
    instead, the process group fails here and torchrun ends the job."""
    from pulsenet.rl import build_tiny_model
    from pulsenet.rl.distributed import serve_rank
    from pulsenet.rl.grpo import GRPOTrainer

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    c.grpo.pad_id = text_codec(c.model).pad_id
    # Rank 0 sends its weights first: the tiny model needs no warm-up here, only its shape.
    model = build_tiny_model(c.seed) if c.model == "tiny" else initial_model(c.model, c.cache_dir, seed=c.seed)
    serve_rank(grpo=GRPOTrainer(model, c.grpo_config()))


def build_trainer(
    c: TrainerConfig, *, ranks: bool = False, open_store: Callable[[str], ObjectStore] = open_site_store
) -> TrainerNode:
    """The trainer node of ``c``. ``ranks``: as rank 0 of a torchrun rank group (the default
    process group is up, the other ranks run ``rl.distributed.serve_rank``). ``open_store``: a
    store URL with this site's credentials (default: from the environment's AWS_* variables)."""
    from pulsenet.rl.distributed import GroupGRPOInner, RankGroup
    from pulsenet.rl.grpo import GRPOTrainer
    from pulsenet.rl.inner import GRPOInner
    from pulsenet.rl.local import resolve_device
    from pulsenet.rollouts import RolloutSource

    resolve_device(c.device)  # a GPU-less host fails here, before the warm-up
    if not c.store:
        raise ConfigError("trainer: set store (this site's bucket, e.g. s3://pulsenet-t0)")
    sources_urls = site_map(c.inference, "inference")
    open_only = c.intake.open_inference and not c.trust_inference  # every node open: no keys to load
    keys = {} if open_only else key_map(c.trust_inference, "inference")
    missing = sorted(set(sources_urls) - set(keys))
    if missing and not c.intake.open_inference:  # with it, a node without a key is open (rollouts/trust.py)
        raise ConfigError(f"trainer: no trusted key for inference node(s) {missing} (trust_inference ID=PATH)")
    sources = [RolloutSource(n, open_store(url), keys.get(n, {})) for n, url in sources_urls.items()]
    text = text_codec(c.model)
    c.grpo.pad_id = text.pad_id
    task = make_task(c.task, c.seed)  # before the model: a bad task or reward fails fast
    grpo = GRPOTrainer(initial_model(c.model, c.cache_dir, seed=c.seed, warmup_steps=c.warmup_steps), c.grpo_config())
    return TrainerNode(
        c,
        store=open_store(c.store),
        key=load_private_key(c.key, allow_open=c.allow_open_key),
        sources=sources,
        policy=GroupGRPOInner(RankGroup(grpo=grpo)) if ranks else GRPOInner(grpo),
        task=task,
        text=text,
        loco_store=open_store(c.loco_store) if c.loco_store else None,
        tracker=make_tracker(c.tracker, name=f"{c.run}-{c.id}", config=to_toml_table(c), directory=Path(c.state_dir) / "tracking"),
    )


def build_inference(c: InferenceConfig, *, open_store: Callable[[str], ObjectStore] = open_site_store) -> InferenceNode:
    """The inference node of ``c`` (``open_store``: as for ``build_trainer``)."""
    if not c.store or not c.policy or not c.trust:
        raise ConfigError(
            "inference: set store (this site's bucket), policy (trainer store URLs) and trust (trainer public keys)"
        )
    channels = [entry.partition("=") for entry in c.policy]
    return InferenceNode(
        c,
        store=open_store(c.store),
        policy_stores=[open_store(url if sep else ident) for ident, sep, url in channels],
        trainers=[ident if sep else None for ident, sep, _ in channels],
        trusted=trusted_keys(c.trust),
        key=load_private_key(c.key, allow_open=c.allow_open_key),
        task=make_task(c.task, c.seed),
        text=text_codec(c.model),
    )


async def serve(node: TrainerNode | InferenceNode, host: str, port: int, stuck_after_s: float) -> None:
    """Run ``node`` with its status server until it finishes or a signal stops it."""
    stop = asyncio.Event()
    async with StatusServer(node.state, host=host, port=port, stuck_after_s=stuck_after_s, stores=node.stores) as status:
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
