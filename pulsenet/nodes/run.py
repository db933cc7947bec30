"""Start a node from its config: build it (``nodes/build.py``: stores with the site's credentials,
keys, every component), serve its status, run it until SIGTERM/SIGINT. What ``pulsenet trainer`` and
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

from pulsenet.nodes.build import build_inference, build_rank, build_trainer
from pulsenet.nodes.common import stop_on_signals
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.nodes.inference import InferenceNode
from pulsenet.nodes.status import StatusServer
from pulsenet.nodes.trainer import TrainerNode

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


def run_inference(c: InferenceConfig) -> None:
    """``pulsenet inference``: one inference node."""
    run_node(build_inference(c), c.status_host, c.status_port, c.stuck_after_s)


def _serve_rank(c: TrainerConfig) -> None:
    """A rank > 0: the GRPO steps rank 0 sends, nothing else (no store, no keys, no status port).

    SIGTERM/SIGINT are ignored: torchrun and a terminal signal every rank at once, and this one
    must finish the step in hand with rank 0, then leave when rank 0 says stop. If rank 0 dies
    instead, the process group fails here and torchrun ends the job."""
    from pulsenet.rl.distributed import serve_rank

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    serve_rank(grpo=build_rank(c))


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
