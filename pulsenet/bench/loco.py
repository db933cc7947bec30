"""``pulsenet bench loco``: PULSELoCo vs DiLoCo vs DDP on the same seeds, through a real store.

Each mode runs N real ``LocoTrainer``s in this process against a fresh ``file://`` store in a
temporary directory: the same code path as ``pulsenet loco train`` (payloads, signed manifests,
round records, digests), with the heavy phases taking turns on the cores. Bytes per worker per
round: DDP and DiLoCo are accounting on one basis, raw FP32 as the methods are published (H dense
gradients; one dense pseudo-gradient); ``diloco_zstd`` and ``pulseloco`` are the payloads the
trainers actually put into the store (manifests and digests, a few hundred bytes, not counted).
Phase times exclude the time a trainer queued for the shared cores (reported as ``queued``), but
``wait`` (for peers' payloads) includes the peers' turns on them, unlike separate machines.

The learning metric is the loss of the global weights on held-out batches after every round, with
the trainers' forward (``--forward``; by default FP32 maths on the BF16-rounded weights), on the
same seeds for DiLoCo and PULSELoCo, plus the mean inner training loss.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pulsenet.errors import ConfigError

RICH_MODES = ("diloco", "pulseloco")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pulsenet.cli.loco import FORWARDS

    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--workers", type=int, default=4, help="trainers per mode (default: %(default)s)")
    p.add_argument(
        "--H", dest="inner_steps", type=int, default=8, help="inner steps per round (default: %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=3, help="outer rounds per mode (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="inner AdamW lr (default: 3e-6 smollm2, 1e-3 tiny)")
    p.add_argument("--batch", type=int, default=2, help="rows per inner step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=32, help="tokens per row (default: %(default)s)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument(
        "--gate-scale", type=float, default=1.0, help="send where bf16(θ - scale·s) != bf16(θ) (default 1: as specified)"
    )
    p.add_argument(
        "--overlap", action="store_true", help="one-round-delayed outer step (train the next round while exchanging)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--forward", choices=FORWARDS, default="bf16-weights", help="inner forward (pulsenet loco train --help)"
    )
    p.add_argument(
        "--eval-batches", type=int, default=4, help="held-out batches (of --batch x --seq) per evaluation"
    )
    p.add_argument("--modes", default="diloco,pulseloco", help="comma-separated subset of diloco,pulseloco")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--link-mbps", type=float, default=None,
        help="give each worker its own emulated link of this many Mbit/s each way (default: none)",
    )  # fmt: skip
    p.add_argument(
        "--workdir", type=Path, default=None, help="store and keys here (default: a temp dir, deleted)"
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(RICH_MODES):
        raise ConfigError(f"--modes must be a subset of {','.join(RICH_MODES)}, got {args.modes!r}")
    if args.link_mbps is not None and args.link_mbps <= 0:
        raise ConfigError(f"--link-mbps must be > 0, got {args.link_mbps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix=f"pulseloco-bench-{mode}-", dir=args.workdir) as tmp:
                results[mode] = asyncio.run(_run_mode(args, mode, Path(tmp)))
        doc = _document(args, results, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    _print(doc)
    return doc


async def _run_mode(args: argparse.Namespace, mode: str, tmp: Path) -> dict[str, Any]:

    from rich.console import Console

    from pulsenet.bench.loco_phases import SharedCores, SharedPayloads
    from pulsenet.cli.loco import data_seed
    from pulsenet.loco import LocoConfig, LocoTrainer, RoundReport
    from pulsenet.loco.documents import trainer_keys
    from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.inner import SupervisedInner
    from pulsenet.signing import generate_keypair, load_private_key
    from pulsenet.store import LocalStore

    ids = [f"w{k}" for k in range(args.workers)]
    for tid in ids:
        generate_keypair(tmp / "keys" / tid)
    trusted = trainer_keys([f"{t}={tmp / 'keys' / t}.pub" for t in ids])
    config = LocoConfig(
        mode=mode,
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        gate_scale=args.gate_scale,
        overlap=args.overlap,
        workers_expected=args.workers,
        min_quorum=args.workers,  # every round averages every worker: the figures compare like with like
        deadline_s=24 * 3600.0,
        round_timeout_s=24 * 3600.0,
        digest_wait_s=3600.0,
        poll_s=0.05,
        state_every=1 << 30,  # genesis only: periodic full states would dominate the disk traffic
        checkpoint_every=0,
    )
    # with emulated links each worker opens the store through its own link and pays every download
    stores = [LocalStore(tmp / "store", default_timeout=600.0, link_mbps=args.link_mbps) for _ in ids]
    cores, cache = SharedCores(), SharedPayloads(shares_downloads=args.link_mbps is None)
    tokenizer, default_lr, make_model = _model_factory(args.model, args.seed)
    lr = args.lr if args.lr is not None else default_lr
    held_out = ArithmeticTask(10_007 + args.seed, tokenizer)
    eval_loss: dict[int, float] = {}
    console, started = Console(stderr=True), time.perf_counter()

    async def evaluate(trainer: LocoTrainer, report: RoundReport | None) -> None:
        async with cores.turn:
            loss = await asyncio.to_thread(_eval_global, trainer, held_out, args)
        eval_loss[report.round if report is not None else 0] = loss
        if report is not None:  # progress: long runs take minutes per round
            sent = f", sent {report.sent / report.total:.2%}" if report.total else ""
            console.print(
                f"{mode}: round {report.round}/{args.rounds}: eval loss {loss:.4f}, {trainer.id} put "
                f"{report.payload_bytes / 1e6:.2f} MB{sent} ({time.perf_counter() - started:.0f} s)"
            )

    trainers = []
    for k, tid in enumerate(ids):
        local = LocalTrainer(
            make_model(),
            LocalTrainerConfig(
                lr=lr,
                batch_size=args.batch,
                seq_len=args.seq,
                seed=data_seed(args.seed, tid),
                forward=args.forward,
            ),
        )
        task = ArithmeticTask(data_seed(args.seed, tid), tokenizer)
        trainers.append(
            LocoTrainer(
                tid, stores[k], load_private_key(tmp / "keys" / tid), trusted, SupervisedInner(local, task), config,
                on_phase=cores.hook(tid), payload_cache=cache.view(stores[k]),
                on_round=evaluate if k == 0 else None,
            )
        )  # fmt: skip
    for t in trainers:  # announce all first, so the first start() publishes genesis and the rest find it
        await t.rs.join()
    for t in trainers:
        await t.start()
    await evaluate(trainers[0], None)
    t0 = time.perf_counter()
    await asyncio.gather(*(t.run(args.rounds) for t in trainers))
    wall = time.perf_counter() - t0
    n_params = sum(v.numel() for v in trainers[0].state.theta.values())  # type: ignore[union-attr]
    rounds = []
    for r in range(1, args.rounds + 1):
        reps = [next(x for x in t.reports if x.round == r) for t in trainers]
        trained = [x for x in reps if x.payload_bytes]
        times = [cores.round_s(x.trainer, r) for x in trained]
        rounds.append(
            {
                "round": r,
                "payload_bytes": statistics.mean(x.payload_bytes for x in trained),
                "sent_fraction": sum(x.sent for x in trained) / sum(x.total for x in trained),
                "eval_loss": eval_loss.get(r),
                "train_loss": statistics.mean(x.loss for x in trained if x.loss is not None),
                "digests_equal": len({x.digest for x in reps}) == 1,
                **{f"{k}_s": statistics.mean(t[k] for t in times)
                   for k in ("inner", "encode", "upload", "wait", "apply", "verify", "queued")},
            }
        )  # fmt: skip
    return {
        "n_params": n_params,
        "initial_eval_loss": eval_loss[0],
        "rounds": rounds,
        "digests_equal": all(x["digests_equal"] for x in rounds) and len({t.digest for t in trainers}) == 1,
        "final_digest": trainers[0].digest,
        "wall_s": wall,
    }


def _model_factory(name: str, seed: int) -> tuple[Any, float, Any]:
    from pulsenet.rl import build_tiny_model, load_model, load_tokenizer, smollm2_checkpoint

    if name == "tiny":
        return None, 1e-3, lambda: build_tiny_model(seed)
    path = smollm2_checkpoint()
    return load_tokenizer(path), 3e-6, lambda: load_model(path)


def _eval_global(trainer: Any, task: Any, args: argparse.Namespace) -> float:
    """The global weights' loss, evaluated in the trainer's model. With ``--overlap`` the local
    weights hold the next round's progress when a round closes, so they are set aside and put back."""
    if trainer.state is None:
        return _eval(trainer.inner.local, task, args)
    saved = trainer.inner.state_fp32()
    trainer.inner.load_state_fp32(trainer.state.theta)
    try:
        return _eval(trainer.inner.local, task, args)
    finally:
        trainer.inner.load_state_fp32(saved)


def _eval(local: Any, task: Any, args: argparse.Namespace) -> float:
    # The trainers' own forward (--forward): PULSELoCo withholds exactly the updates a BF16 forward
    # cannot see, so an FP32 evaluation would credit DiLoCo with them.
    return local.eval_loss(task.batch(args.batch, args.seq, step=step) for step in range(args.eval_batches))


def _document(args: argparse.Namespace, results: dict[str, dict[str, Any]], wall: float) -> dict[str, Any]:
    n_params = next(iter(results.values()))["n_params"]
    bytes_round = _bytes_per_worker_round(args, results, n_params)
    per_round = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r + 1, "ddp": {"bytes_per_worker": bytes_round["ddp"]}}
        row["diloco"] = {"bytes_per_worker": bytes_round["diloco"]}
        if "diloco" in results:
            res = results["diloco"]["rounds"][r]
            row["diloco"] |= {k: v for k, v in res.items() if k != "round"}
            row["diloco_zstd"] = {"bytes_per_worker": res["payload_bytes"]}
        if "pulseloco" in results:
            res = results["pulseloco"]["rounds"][r]
            row["pulseloco"] = {k: v for k, v in res.items() if k != "round"}
            row["pulseloco"]["bytes_per_worker"] = res["payload_bytes"]
        per_round.append(row)
    summary: dict[str, Any] = {
        "bytes_per_worker_round": bytes_round,
        "bytes_per_worker_total": {k: v * args.rounds for k, v in bytes_round.items()},
        "digests_equal": all(res["digests_equal"] for res in results.values()),
        "initial_eval_loss": next(iter(results.values()))["initial_eval_loss"],
        "eval_loss": {m: [x["eval_loss"] for x in res["rounds"]] for m, res in results.items()},
        "final_eval_loss": {m: res["rounds"][-1]["eval_loss"] for m, res in results.items()},
        "time_s": {
            m: {
                k: sum(x[f"{k}_s"] for x in res["rounds"])
                for k in ("inner", "encode", "upload", "wait", "apply", "verify", "queued")
            }
            | {"wall": res["wall_s"], "wall_per_round": res["wall_s"] / args.rounds}
            for m, res in results.items()
        },
    }
    if "pulseloco" in results:
        p = results["pulseloco"]["rounds"]
        summary["sent_fraction"] = statistics.mean(x["sent_fraction"] for x in p)
        for base in ("ddp", "diloco", "diloco_zstd"):
            if base in bytes_round:
                summary[f"ratio_vs_{base}"] = bytes_round[base] / bytes_round["pulseloco"]
    return {
        "bench": "loco",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
            "threads": __import__("torch").get_num_threads(),
        },
        "n_params": n_params,
        "rounds": per_round,
        "summary": summary,
        "wall_s": wall,
    }


def _bytes_per_worker_round(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], n_params: int
) -> dict[str, float]:
    """Bytes one worker sends per round, by method.

    ``ddp`` and ``diloco`` are accounting on one basis, raw FP32 as the methods are published:
    H dense gradients (all-reduce), one dense pseudo-gradient. ``diloco_zstd`` and ``pulseloco``
    are the payloads the benchmark's workers actually put into the store (DiLoCo's dense FP32 bits
    under zstd: a stronger baseline than the published method).
    """
    from pulsenet.bench.loco_phases import ddp_bytes
    from pulsenet.loco.algorithm import FP32_BYTES

    out: dict[str, float] = {"ddp": ddp_bytes(n_params, args.inner_steps), "diloco": FP32_BYTES * n_params}
    for mode, key in (("diloco", "diloco_zstd"), ("pulseloco", "pulseloco")):
        if mode in results:
            out[key] = statistics.mean(x["payload_bytes"] for x in results[mode]["rounds"])
    return out


def _print(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = doc["summary"]
    modes = [m for m in RICH_MODES if m in s["final_eval_loss"]]
    sizes = [k for k in ("ddp", "diloco", "diloco_zstd", "pulseloco") if k in s["bytes_per_worker_round"]]
    ratios = [k for k in ("ddp", "diloco", "diloco_zstd") if f"ratio_vs_{k}" in s]
    labels = {"ddp": "DDP", "diloco": "DiLoCo", "diloco_zstd": "DiLoCo zstd", "pulseloco": "PULSELoCo"}
    table = Table(title=f"PULSELoCo bench: {doc['config']['model']}, {doc['config']['workers']} workers, "
                  f"H={doc['config']['inner_steps']}, {doc['n_params']:,} params; MB per worker per round")  # fmt: skip
    table.add_column("round", justify="right")
    for k in sizes:
        table.add_column(f"{labels[k]} MB", justify="right")
    if "pulseloco" in modes:
        table.add_column("sent %", justify="right")
    for k in ratios:
        table.add_column(f"x vs {labels[k]}", justify="right")
    for m in modes:
        table.add_column(f"{labels[m]} eval loss", justify="right")
    for m in modes:
        table.add_column(f"{labels[m]} enc/up/wait s", justify="right")

    def row(label: str, per: dict[str, dict[str, Any]]) -> list[str]:
        cells = [label] + [f"{per[k]['bytes_per_worker'] / 1e6:.2f}" for k in sizes]
        if "pulseloco" in modes:
            cells.append(f"{100 * per['pulseloco']['sent_fraction']:.2f}")
        ours = per.get("pulseloco", {}).get("bytes_per_worker")
        cells += [f"{per[k]['bytes_per_worker'] / ours:.1f}" for k in ratios]
        cells += [f"{per[m]['eval_loss']:.4f}" if per[m].get("eval_loss") is not None else "-" for m in modes]
        cells += [f"{per[m]['encode_s']:.1f}/{per[m]['upload_s']:.1f}/{per[m]['wait_s']:.1f}" for m in modes]
        return cells

    for r in doc["rounds"]:
        table.add_row(*row(str(r["round"]), r))
    mean: dict[str, dict[str, Any]] = {k: {"bytes_per_worker": v} for k, v in s["bytes_per_worker_round"].items()}
    for m in modes:
        mean[m] |= {"sent_fraction": s.get("sent_fraction", 0.0), "eval_loss": s["final_eval_loss"][m]}
        mean[m] |= {f"{k}_s": v / len(doc["rounds"]) for k, v in s["time_s"][m].items()}
    table.add_row(*row("mean", mean), style="bold")
    console = Console()
    console.width = max(console.width, 190)  # the table is wide; let a narrow or piped terminal wrap it
    console.print(table)
    console.print(
        "DDP and DiLoCo: raw FP32 as published (H dense gradients; one dense pseudo-gradient); "
        "DiLoCo zstd and PULSELoCo: the payloads the workers put into the store"
    )
    console.print(
        f"initial eval loss {s['initial_eval_loss']:.4f}; digests equal across workers after every round: "
        f"{s['digests_equal']}; wall {doc['wall_s']:.0f} s"
    )
