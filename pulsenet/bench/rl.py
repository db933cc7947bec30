"""``pulsenet bench rl``: asynchronous GRPO through storage, one trainer and K inference engines.

Everything a deployment runs, in one process on this machine: an embedded SeaweedFS with one
bucket and one write identity per site (the trainer writes only its bucket, each inference node
only its own), the trainer node (rollout intake -> GRPO step -> PULSESync version) and K inference
nodes (PULSESync subscriber -> engine -> signed rollout batches), each with its own store client
and, with ``--link-mbps``, its own emulated link. The nodes are the daemons' own classes
(``pulsenet.nodes``), so the benchmark measures the code that ships.

Summary (JSON ``summary``): reward per step, the staleness histogram, dropped batches (stale in
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from pulsenet.bench import BenchSettings, config_of
from pulsenet.bench import workdir as bench_workdir
from pulsenet.nodes.launcher import UpConfig
from pulsenet.settings import fields_of

SCHEMA = "pulsenet.bench.rl/1"

OuterStep = fields_of(UpConfig, "outer_lr", "outer_momentum")
"""With several trainers, the outer step ``pulsenet up`` runs (plain averaging, docs/rl.md)."""


@dataclass(kw_only=True)
class RLBenchSettings(BenchSettings):
    """Asynchronous GRPO through the embedded S3 server: one trainer (or --trainers N with PULSELoCo
    rounds) and K inference engines, the daemons' own node classes (docs/rl.md)."""

    model: Literal["tiny", "smollm2"] = "tiny"
    """Policy model: tiny or smollm2 (SmolLM2-135M)."""
    steps: int = 60
    """GRPO steps = policy versions published."""
    inference: int = 2
    """Inference nodes (engines)."""
    trainers: int = 1
    """Trainers; more than one train PULSELoCo rounds of --inner-steps GRPO steps."""
    inner_steps: int = 4
    """GRPO steps per PULSELoCo round (H), with --trainers > 1."""
    max_staleness: int = 2
    """Versions a rollout batch may lag behind the trainer's policy."""
    link_mbps: float | None = None
    """Emulated link per node, each way (Mbit/s; None: no link)."""
    prompts: int = 32
    """Prompts per rollout batch."""
    group_size: int = 8
    """Completions per prompt (G)."""
    rows_per_step: int = 512
    """Completions per GRPO step at least."""
    batches_per_version: int | None = None
    """Batches each engine generates per policy version (None: what the trainers consume per
    version, plus one so generation overlaps training)."""
    lr: float | None = None
    """GRPO learning rate (None: 5e-4 tiny, 3e-6 smollm2)."""
    task: str = "arith"
    """arith, chain or a .jsonl file."""
    max_new_tokens: int | None = None
    """Completion limit (None: 5 tiny, 16 smollm2)."""
    seed: int = 0
    """Run seed."""
    workdir: Path | None = None
    """Keep keys, states and caches here (None: a temporary directory)."""
    outer: Annotated[OuterStep, tyro.conf.arg(name="")] = field(default_factory=OuterStep)  # type: ignore[valid-type]


def run(args: RLBenchSettings) -> dict[str, Any]:
    return asyncio.run(_run(args))


async def _run(args: RLBenchSettings) -> dict[str, Any]:
    from rich.console import Console

    from pulsenet.store.seaweed import SeaweedServer

    console = Console(stderr=True)
    if args.steps < 1 or args.inference < 1 or args.max_staleness < 0:
        raise SystemExit("pulsenet bench rl: --steps and --inference must be >= 1, --max-staleness >= 0")
    with bench_workdir(args.workdir, "rl") as workdir, tempfile.TemporaryDirectory(dir=workdir) as run_tmp:
        rundir = Path(run_tmp)  # a fresh store and fresh node states every run
        sites = [*(f"t{j}" for j in range(args.trainers)), *(f"i{k}" for k in range(args.inference))]
        trainers = [s for s in sites if s.startswith("t")]
        with SeaweedServer(rundir / "s3", sites=sites, shared={"loco": trainers}) as server:
            server.create_buckets()
            network = _Network(args, workdir, rundir, server)
            console.print(
                f"[bold]bench rl[/]: {args.model}, {args.steps} GRPO steps, {args.inference} inference "
                f"nodes, max staleness {args.max_staleness}, "
                f"{'unlimited' if args.link_mbps is None else f'{args.link_mbps:g} Mbit/s'} links"
            )
            t0 = time.perf_counter()
            await network.run(console)
            wall = time.perf_counter() - t0
            return network.result(wall)


class _Network:
    """The trainer and the inference nodes of one benchmark run, wired to one server."""

    def __init__(self, args: RLBenchSettings, workdir: Path, rundir: Path, server: Any) -> None:
        """``workdir`` keeps what runs may share (keys, the warm-up cache); ``rundir`` is this run's."""
        from pulsenet.nodes.common import initial_model, make_task, text_codec
        from pulsenet.nodes.inference import InferenceConfig, InferenceNode
        from pulsenet.nodes.trainer import TrainerConfig, TrainerNode
        from pulsenet.rl.grpo import GRPOConfig
        from pulsenet.rollouts import RolloutSource
        from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
        from pulsenet.store import S3Store

        self.args = args
        tiny = args.model == "tiny"
        lr = args.lr if args.lr is not None else (5e-4 if tiny else 3e-6)
        max_new = args.max_new_tokens if args.max_new_tokens is not None else (5 if tiny else 16)
        per_version = args.trainers * (args.inner_steps if args.trainers > 1 else 1) * args.rows_per_step
        per_batch = args.inference * args.prompts * args.group_size
        batches_per_version = args.batches_per_version or -(-per_version // per_batch) + 1
        trainers = [f"t{j}" for j in range(args.trainers)]
        keys = {}
        for site in [*trainers, *(f"i{k}" for k in range(args.inference))]:
            path = workdir / "keys" / f"{site}.key"
            if not path.exists():
                generate_keypair(path)
            keys[site] = (load_private_key(path), load_public_key(f"{path}.pub"))

        def store(identity_site: str, bucket_site: str) -> S3Store:
            cfg = server.config(server.writer(identity_site), link_mbps=args.link_mbps)
            return S3Store(server.bucket(bucket_site), "", cfg)

        text = text_codec(args.model)
        loco = args.trainers > 1
        self.trainers = []
        for t in trainers:
            tcfg = TrainerConfig(
                id=t,
                run="bench",
                model=args.model,
                steps=args.steps,
                rows_per_step=args.rows_per_step,
                max_staleness=args.max_staleness,
                anchor_every=max(args.steps + 1, 10),
                seed=args.seed,
                state_dir=rundir / t,
                grpo=GRPOConfig(lr=lr, pad_id=text.pad_id),
                peers=[f"{p}={workdir / 'keys' / f'{p}.key.pub'}" for p in trainers] if loco else [],
                inner_steps=args.inner_steps,
                outer_lr=args.outer.outer_lr,
                outer_momentum=args.outer.outer_momentum,
            )
            sources = [
                RolloutSource(f"i{k}", store(t, f"i{k}"), {key_id(keys[f"i{k}"][1]): keys[f"i{k}"][1]})
                for k in range(args.inference)
            ]
            self.trainers.append(
                TrainerNode(
                    tcfg,
                    store=store(t, t),
                    key=keys[t][0],
                    sources=sources,
                    model=initial_model(args.model, seed=args.seed),
                    loco_store=store(t, "loco") if loco else None,  # the run's bucket: trainers write it
                )
            )
        self.trainer = self.trainers[0]
        trusted = {key_id(keys[t][1]): keys[t][1] for t in trainers}
        self.inference = []
        for k in range(args.inference):
            icfg = InferenceConfig(
                id=f"i{k}",
                run="bench",
                model=args.model,
                prompts=args.prompts,
                group_size=args.group_size,
                max_new_tokens=max_new,
                max_staleness=args.max_staleness,
                batches_per_version=batches_per_version,
                seed=args.seed,
                state_dir=rundir / f"i{k}",
                poll_s=0.2,
            )
            self.inference.append(
                InferenceNode(
                    icfg,
                    store=store(f"i{k}", f"i{k}"),
                    policy_stores=[store(f"i{k}", t) for t in trainers],
                    trusted=trusted,
                    key=keys[f"i{k}"][0],
                    task=make_task(args.task, args.seed),
                    text=text,
                )
            )

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
        tr = self.trainer
        published = {h["version"]: h["digest"] for h in tr.history}
        # Every trainer publishes every version: the same digests, or the run diverged.
        trainers_agree = all({h["version"]: h["digest"] for h in t.history} == published for t in self.trainers)
        steps = [h for h in tr.history if h["metrics"] is not None]
        served_ok = all(published.get(v) == d for n in self.inference for v, d in n.served)
        own_ok = all(n.engine is not None and n.engine.weights_digest() == n.engine.digest for n in self.inference)
        full = {h["version"]: h["full_bytes"] for h in tr.history}
        stats = [t.intake.stats for t in self.trainers]
        staleness: dict[int, int] = {}
        for st in stats:
            for lag, n in st.staleness.items():
                staleness[lag] = staleness.get(lag, 0) + n
        rewards = [h["metrics"]["reward_mean"] for h in steps]
        tenth = max(1, len(rewards) // 10)
        summary = {
            "reward": rewards,
            "reward_first_last": [_mean(rewards[:tenth]), _mean(rewards[-tenth:])],
            "entropy": [h["metrics"]["entropy"] for h in steps],
            "mismatch_kl": [h["metrics"]["mismatch_kl"] for h in steps],
            "staleness": {str(k): v for k, v in sorted(staleness.items())},
            "dropped": {
                "stale_in_flight": sum(st.stale_in_flight for st in stats),
                "stale_queued": sum(st.stale_queued for st in stats),
            },
            "rejected": {r: sum(st.rejected.get(r, 0) for st in stats) for r in {r for st in stats for r in st.rejected}},
            "bytes": {
                "rollouts": sum(n.writer.stats.bytes_uploaded for n in self.inference),
                "pulsesync": sum(s.stats.bytes_downloaded for n in self.inference for s in n.subscribers),
                "pulsesync_published": sum(h["bytes"] for h in tr.history),
                "full_sync": sum(full.get(v, 0) for n in self.inference for v, _ in n.served),
            },
            "update_apply_s": [round(x, 4) for n in self.inference for x in n.update_apply_s],
            "versions_served": {n.config.id: [v for v, _ in n.served] for n in self.inference},
            "digests_equal": bool(served_ok and own_ok and trainers_agree and all(n.served for n in self.inference)),
            "pulseloco_bytes": sum(h.get("payload_bytes", 0) for t in self.trainers for h in t.history),
            "final_version": tr.version,
            "wall_s": round(wall, 2),
        }
        return {
            "schema": SCHEMA,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "args": config_of(self.args),
            "steps": tr.history,
            "summary": summary,
        }


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None
