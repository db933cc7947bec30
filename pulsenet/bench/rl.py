"""``pulsenet bench rl``: asynchronous GRPO through storage, one trainer and K inference engines.

Everything a deployment runs, in one process on this machine: an embedded SeaweedFS with one
bucket and one write identity per site (the trainer writes only its bucket, each inference node
only its own), the trainer node (rollout intake -> GRPO step -> PULSESync version) and K inference
nodes (PULSESync subscriber -> engine -> signed rollout batches), each with its own store client
and, with ``--link-mbps``, its own emulated link. The nodes are the daemons' own classes
(``pulsenet.nodes``), so the benchmark measures the code that ships.

Summary (JSON ``summary``): reward per version (a round's mean), the staleness histogram, dropped batches (stale in
flight / in the queue), mismatch KL per step, bytes per channel (rollouts, PULSESync downloads,
what full checkpoints would have cost), update apply times, and ``digests_equal``: every version
every engine served has the digest the trainer published for it, and every engine's own weights
hash to the digest it claims at the end.
"""

from __future__ import annotations

import asyncio
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulsenet.bench import BenchSettings, config_of
from pulsenet.bench import workdir as bench_workdir
from pulsenet.nodes.config import NetworkSettings

SCHEMA = "pulsenet.bench.rl/1"


@dataclass(kw_only=True)
class RLBenchSettings(BenchSettings, NetworkSettings):
    """Asynchronous GRPO through the embedded S3 server: one trainer (or --trainers N with PULSELoCo
    rounds) and K inference engines, the daemons' own node classes, planned as ``pulsenet up``
    plans them (nodes/plan.py, docs/rl.md). --steps is --rounds."""

    trainers: int = 1
    """Trainers; more than one train PULSELoCo rounds of --inner-steps GRPO steps."""
    inner_steps: int = 4
    """GRPO steps per PULSELoCo round (H), with --trainers > 1."""
    link_mbps: float | None = None
    """Emulated link per node, each way (Mbit/s; None: no link)."""
    workdir: Path | None = None
    """Keep keys, states and caches here (None: a temporary directory)."""


def run(args: RLBenchSettings) -> dict[str, Any]:
    return asyncio.run(_run(args))


async def _run(args: RLBenchSettings) -> dict[str, Any]:
    from rich.console import Console

    from pulsenet.store.seaweed import SeaweedServer

    console = Console(stderr=True)
    if args.rounds < 1 or args.inference < 1 or args.max_staleness < 0:
        raise SystemExit("pulsenet bench rl: --rounds and --inference must be >= 1, --max-staleness >= 0")
    with bench_workdir(args.workdir, "rl") as workdir, tempfile.TemporaryDirectory(dir=workdir) as run_tmp:
        rundir = Path(run_tmp)  # a fresh store and fresh node states every run
        sites = [*(f"t{j}" for j in range(args.trainers)), *(f"i{k}" for k in range(args.inference))]
        trainers = [s for s in sites if s.startswith("t")]
        with SeaweedServer(rundir / "s3", sites=sites, shared={"loco": trainers}) as server:
            server.create_buckets()
            network = _Network(args, workdir, rundir, server)
            console.print(
                f"[bold]bench rl[/]: {args.model}, {args.rounds} rounds, {args.trainers} trainer(s), "
                f"{args.inference} inference nodes, max staleness {args.max_staleness}, "
                f"{'unlimited' if args.link_mbps is None else f'{args.link_mbps:g} Mbit/s'} links"
            )
            t0 = time.perf_counter()
            await network.run(console)
            wall = time.perf_counter() - t0
            return network.result(wall)


class _Network:
    """The trainers and the inference nodes of one benchmark run, wired to one server: the plan
    ``pulsenet up`` runs as processes (``nodes/plan.py``), built here in one process, each node
    with its own store identity and, with ``--link-mbps``, its own emulated link."""

    def __init__(self, args: RLBenchSettings, workdir: Path, rundir: Path, server: Any) -> None:
        """``workdir`` keeps what runs may share (keys, the warm-up cache); ``rundir`` is this run's."""
        from pulsenet.nodes.build import build_inference, build_trainer
        from pulsenet.nodes.plan import Site, plan_network
        from pulsenet.signing import generate_keypair
        from pulsenet.store import S3Store

        self.args = args
        keys = workdir / "keys"
        ids = [*(f"t{j}" for j in range(args.trainers)), *(f"i{k}" for k in range(args.inference))]
        for site in ids:
            if not (keys / f"{site}.key").exists():
                generate_keypair(keys / f"{site}.key")
        sites = {s: Site(f"s3://{server.bucket(s)}", keys / f"{s}.key", rundir / s) for s in ids}
        loco = f"s3://{server.bucket('loco')}" if args.trainers > 1 else ""
        trainer_configs, inference_configs = plan_network(
            args, run="bench", sites=sites, public_keys=keys, loco_store=loco, cache_dir=workdir / "cache"
        )
        buckets = {server.bucket(s): s for s in [*ids, "loco"]}

        def opener(identity: str) -> Any:
            """Store URLs opened with ``identity``'s credentials (its own bucket writable, others readable)."""

            def open_url(url: str) -> S3Store:
                bucket = url.removeprefix("s3://").split("/", 1)[0]
                cfg = server.config(server.writer(identity), link_mbps=args.link_mbps)
                return S3Store(server.bucket(buckets[bucket]), "", cfg)

            return open_url

        self.trainers = [build_trainer(c, open_store=opener(c.id)) for c in trainer_configs]
        self.inference = [build_inference(c, open_store=opener(c.id)) for c in inference_configs]

    async def run(self, console: Any) -> None:
        from rich.live import Live

        stop_inference = asyncio.Event()
        stop = asyncio.Event()

        async def trainers() -> None:
            try:
                async with asyncio.TaskGroup() as tg:
                    for t in self.trainers:
                        tg.create_task(t.run(stop))
            finally:
                stop_inference.set()

        with Live(self._table(), console=console, refresh_per_second=2, transient=False) as live:

            async def refresh() -> None:
                while not stop_inference.is_set():
                    live.update(self._table())
                    await asyncio.sleep(0.5)
                live.update(self._table())

            async with asyncio.TaskGroup() as tg:
                tg.create_task(trainers())
                for node in self.inference:
                    tg.create_task(node.run(stop_inference))
                tg.create_task(refresh())

    def _table(self) -> Any:
        from rich.table import Table

        t = Table(title="pulsenet bench rl", expand=False)
        for col in ("node", "version", "reward", "staleness", "rollouts", "pulsesync B", "rollout B", "errors"):
            t.add_column(col, justify="right")
        for node in [*self.trainers, *self.inference]:
            s = node.state
            rollouts = s.rollouts["consumed"] if s.role == "trainer" else s.rollouts["produced"]
            t.add_row(
                s.node_id,
                "-" if s.version is None else str(s.version),
                "-" if s.reward is None else f"{s.reward:.3f}",
                "-" if s.staleness is None else str(s.staleness),
                str(rollouts),
                f"{s.bytes['pulsesync']:,}",
                f"{s.bytes['rollouts']:,}",
                str(s.errors),
            )
        return t

    def result(self, wall: float) -> dict[str, Any]:
        """The run's JSON, from the nodes' version events (``nodes/summary.py``, as ``pulsenet up``)."""
        from pulsenet.nodes.summary import efficiency, requests, summarize

        nodes = [*self.trainers, *self.inference]
        events = {n.config.id: n.events.events for n in nodes}
        roles = {n.config.id: n.state.role for n in nodes}
        s = summarize(events, roles, max_staleness=self.args.max_staleness)
        first = [e for e in events[self.trainers[0].config.id] if e.kind == "published"]
        steps = [m for e in first for m in e.steps]
        staleness: dict[int, int] = {}
        for t in self.trainers:
            for e in t.events.events:
                for lag in e.staleness:
                    staleness[lag] = staleness.get(lag, 0) + 1
        totals = [t.events.events[-1].totals for t in self.trainers if t.events.events]
        stopped = [n.events.last("stopped") for n in self.inference]
        full = {e.version: e.bytes.get("full", 0) for e in first}
        served = {n.config.id: [e for e in n.events.events if e.kind == "served"] for n in self.inference}
        rewards = [e.reward for e in first if e.reward is not None]  # per version (round)
        tenth = max(1, len(rewards) // 10)
        checks = s["checks"]
        summary = {
            "reward": rewards,
            "reward_first_last": [_mean(rewards[:tenth]), _mean(rewards[-tenth:])],
            "entropy": [m["entropy"] for m in steps],
            "mismatch_kl": [m["mismatch_kl"] for m in steps],
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "dropped": {
                "stale_in_flight": int(sum(t.get("stale_in_flight", 0) for t in totals)),
                "stale_queued": int(sum(t.get("stale_queued", 0) for t in totals)),
            },
            "rejected": int(sum(t.get("batches_rejected", 0) for t in totals)),
            "bytes": {
                "rollouts": int(sum(e.totals.get("rollout_bytes", 0) for e in stopped if e is not None)),
                "pulsesync": int(sum(e.totals.get("pulsesync_bytes", 0) for e in stopped if e is not None)),
                "pulsesync_published": sum(e.bytes.get("pulsesync", 0) for e in first),
                "full_sync": sum(full.get(e.version, 0) for ev in served.values() for e in ev),
            },
            "update_apply_s": [round(e.phases.get("apply", 0.0), 4) for ev in served.values() for e in ev],
            "versions_served": {n: [e.version for e in ev] for n, ev in served.items()},
            "digests_equal": all(checks[k] for k in ("served_verified", "own_weights_verified", "trainers_agree")),
            "pulseloco_bytes": sum(e.bytes.get("pulseloco", 0) for t in self.trainers for e in t.events.events),
            "final_version": self.trainers[0].version,
            "efficiency": efficiency(events, roles),
            "requests": requests(events, roles),
            "wall_s": round(wall, 2),
        }
        return {
            "schema": SCHEMA,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "args": config_of(self.args),
            "rounds": s["rounds"],
            "steps": [e.as_dict() for e in first],
            "summary": summary,
        }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None
