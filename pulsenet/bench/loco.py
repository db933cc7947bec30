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

``--task grpo``: every inner step is a GRPO step (``GRPOInner``) on rollouts the trainer samples
itself, on policy, from its current local weights (no inference nodes), ``--prompts`` problems x
``--group`` completions per step: the tiny model (warmed up as the nodes do) on its byte-level
task, or SmolLM2 (``--model smollm2``) on few-shot single-digit arithmetic, sampled by a
``TorchEngine`` (``bench/loco_grpo.py``). Per round: the mean reward of the round's inner steps
(averaged over the workers) and the greedy reward of the global weights on held-out problems.
Mode ``ddp`` is real data-parallel GRPO (``loco_grpo.run_ddp``): every step the workers' gradients
are averaged and every worker takes the same AdamW step, so their weights stay bit-identical
(checked every round); no store is involved and its bytes are the accounting (H dense FP32
gradients per round).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from pulsenet.bench import BenchSettings, config_of
from pulsenet.errors import ConfigError
from pulsenet.loco.config import LocoConfig  # torch: this module is imported when the bench runs
from pulsenet.rl.inner import SupervisedSettings
from pulsenet.settings import fields_of

RICH_MODES = ("diloco", "pulseloco")
GRPO_MODES = ("ddp", *RICH_MODES)

OuterStep = fields_of(LocoConfig, "inner_steps", "outer_lr", "outer_momentum", "gate_scale", "overlap")
"""The run settings the bench varies; it sets the protocol's (deadlines, quorum, polling) itself."""


@dataclass(kw_only=True)
class BenchInner(SupervisedSettings):
    """``pulsenet loco train``'s inner loop, with the bench's defaults for two of its settings."""

    model: Literal["tiny", "smollm2"] | None = None
    """Model to train: smollm2 (SmolLM2-135M) or tiny (built from the seed); None: smollm2 with
    --task sft, tiny with --task grpo."""
    threads: int | None = None
    """Torch threads (None: all cores)."""


@dataclass(kw_only=True)
class LocoBenchSettings(BenchSettings):
    """PULSELoCo vs DiLoCo vs DDP on the same seeds: N real trainers per mode in this process,
    through a temporary file:// store; bytes per worker per round and a learning metric
    (docs/bench.md). Older spelling accepted: --H (--inner-steps)."""

    task: Literal["sft", "grpo"] = "sft"
    """Inner loop: supervised batches (sft) or GRPO on self-sampled rollouts (grpo)."""
    workers: int = 4
    """Trainers per mode."""
    rounds: int = 3
    """Outer rounds per mode."""
    modes: str | None = None
    """Comma-separated subset of diloco,pulseloco (grpo: also ddp); None: all of them."""
    prompts: int = 8
    """grpo: problems per inner step."""
    group: int = 8
    """grpo: completions per problem."""
    max_new_tokens: int = 5
    """grpo: completion limit."""
    eval_prompts: int = 32
    """grpo: held-out problems for the greedy eval reward."""
    eval_batches: int = 4
    """sft: held-out batches (of --batch x --seq) per evaluation."""
    link_mbps: float | None = None
    """Give each worker its own emulated link of this many Mbit/s each way (None: no link)."""
    workdir: Path | None = None
    """Store and keys here (None: a temporary directory, deleted)."""
    plot: Path | None = None
    """Write a PNG here: the learning metric and the bytes per worker, per round and mode."""
    inner: Annotated[BenchInner, tyro.conf.arg(name="")] = field(default_factory=lambda: BenchInner(batch=2))
    # a dataclass made at import time (settings.fields_of): a type checker has no static class to name
    outer: Annotated[OuterStep, tyro.conf.arg(name="")] = field(default_factory=OuterStep)  # type: ignore[valid-type]


def run(settings: LocoBenchSettings) -> dict[str, Any]:
    import torch

    # The benchmark reads its settings flat, as its JSON records them (``config``).
    args = argparse.Namespace(**config_of(settings))
    grpo = args.task == "grpo"
    if args.model is None:
        args.model = "tiny" if grpo else "smollm2"
    if grpo and min(args.prompts, args.group, args.max_new_tokens, args.eval_prompts) < 1:
        raise ConfigError("--prompts, --group, --max-new-tokens and --eval-prompts must be >= 1")
    allowed = GRPO_MODES if grpo else RICH_MODES
    if args.modes is None:
        args.modes = ",".join(allowed)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(allowed):
        raise ConfigError(f"--modes must be a subset of {','.join(allowed)}, got {args.modes!r}")
    if args.link_mbps is not None and args.link_mbps <= 0:
        raise ConfigError(f"--link-mbps must be > 0, got {args.link_mbps}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    try:
        for mode in modes:
            if mode == "ddp":  # real data-parallel GRPO, no store (bench/loco_grpo.py)
                results[mode] = _run_ddp(args)
                continue
            with tempfile.TemporaryDirectory(prefix=f"pulseloco-bench-{mode}-", dir=args.workdir) as tmp:
                results[mode] = asyncio.run(_run_mode(args, mode, Path(tmp)))
        doc = _document(args, results, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    _print(doc)
    if args.plot is not None:
        plot(doc, Path(args.plot))
    return doc


def _run_ddp(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    from pulsenet.bench.loco_grpo import grpo_bench, run_ddp

    bench = grpo_bench(args)
    lr = args.lr if args.lr is not None else bench.default_lr
    return run_ddp(args, bench, lr, Console(stderr=True))


async def _run_mode(args: argparse.Namespace, mode: str, tmp: Path) -> dict[str, Any]:
    from rich.console import Console

    from pulsenet.bench.loco_phases import SharedCores, SharedPayloads
    from pulsenet.loco import LocoConfig, LocoTrainer, RoundReport
    from pulsenet.loco.documents import trainer_keys
    from pulsenet.rl import ArithmeticTask
    from pulsenet.signing import generate_keypair, load_private_key
    from pulsenet.store import LocalStore

    ids = [f"w{k}" for k in range(args.workers)]
    for tid in ids:
        generate_keypair(tmp / "keys" / tid)
    trusted = trainer_keys([f"{t}={tmp / 'keys' / t}.pub" for t in ids])
    grpo = args.task == "grpo"
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
    if grpo:
        from pulsenet.bench.loco_grpo import grpo_bench

        bench = grpo_bench(args)
        lr = args.lr if args.lr is not None else bench.default_lr
    else:
        tokenizer, default_lr, make_model = _model_factory(args.model, args.seed)
        lr = args.lr if args.lr is not None else default_lr
        held_out = ArithmeticTask(10_007 + args.seed, tokenizer)
    eval_loss: dict[int, float] = {}
    console, started = Console(stderr=True), time.perf_counter()

    async def evaluate(trainer: LocoTrainer, report: RoundReport | None) -> None:
        r = report.round if report is not None else 0
        async with cores.turn:
            if grpo:
                fn = bench.eval_reward
            else:
                fn = lambda local: _eval(local, held_out, args)  # noqa: E731
            loss = await asyncio.to_thread(_eval_global, trainer, fn)
        eval_loss[r] = loss
        if report is not None:  # progress: long runs take minutes per round
            sent = f", sent {report.sent / report.total:.2%}" if report.total else ""
            what = "eval reward" if grpo else "eval loss"
            reward = f", inner reward {trainer.inner.rewards[-1]:.3f}" if grpo else ""
            console.print(
                f"{mode}: round {r}/{args.rounds}: {what} {loss:.4f}{reward}, {trainer.id} put "
                f"{report.payload_bytes / 1e6:.2f} MB{sent} ({time.perf_counter() - started:.0f} s)"
            )

    trainers = []
    for k, tid in enumerate(ids):
        if grpo:
            inner: Any = bench.inner(tid, lr)
        else:
            inner = _supervised_inner(args, tid, lr, make_model, tokenizer)
        trainers.append(
            LocoTrainer(
                tid, stores[k], load_private_key(tmp / "keys" / tid), trusted, inner, config,
                on_phase=cores.hook(tid), payload_cache=cache.view(stores[k]),
            )
        )  # fmt: skip
    for t in trainers:  # announce all first, so the first start() publishes genesis and the rest find it
        await t.rs.join()
    for t in trainers:
        await t.start()
    await evaluate(trainers[0], None)
    t0 = time.perf_counter()

    async def drive(t: LocoTrainer, observe: bool) -> None:
        async with t.session():
            while t.round < args.rounds:
                report = await t.next_round(until=args.rounds)
                if observe and report is not None:
                    await evaluate(t, report)

    await asyncio.gather(*(drive(t, k == 0) for k, t in enumerate(trainers)))
    wall = time.perf_counter() - t0
    state = trainers[0].state
    assert state is not None  # set by start() above
    n_params = sum(v.numel() for v in state.theta.values())
    rounds = []
    for r in range(1, args.rounds + 1):
        reps = [next(x for x in t.reports if x.round == r) for t in trainers]
        trained = [x for x in reps if x.payload_bytes]
        times = [cores.round_s(x.trainer, x.round) for x in trained]
        row = {
            "round": r,
            "payload_bytes": statistics.mean(x.payload_bytes for x in trained),
            "sent_fraction": sum(x.sent for x in trained) / sum(x.total for x in trained),
            "eval_reward" if grpo else "eval_loss": eval_loss.get(r),
            "train_loss": statistics.mean(x.loss for x in trained if x.loss is not None),
            "digests_equal": len({x.digest for x in reps}) == 1,
            **{f"{k}_s": statistics.mean(t[k] for t in times)
               for k in ("inner", "encode", "upload", "wait", "apply", "verify", "queued")},
        }  # fmt: skip
        if grpo:  # the mean reward of the round's inner steps, averaged over the workers
            row["reward"] = statistics.mean(t.inner.rewards[r - 1] for t in trainers)
        rounds.append(row)
    return {
        "n_params": n_params,
        "initial_eval_loss": eval_loss[0],
        "rounds": rounds,
        "digests_equal": all(x["digests_equal"] for x in rounds) and len({t.digest for t in trainers}) == 1,
        "final_digest": trainers[0].digest,
        "wall_s": wall,
    }


def _supervised_inner(args: argparse.Namespace, tid: str, lr: float, make_model: Any, tokenizer: Any) -> Any:
    from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.inner import SupervisedInner, data_seed

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
    return SupervisedInner(local, task)


def _model_factory(name: str, seed: int) -> tuple[Any, float, Any]:
    from pulsenet.rl import build_tiny_model, load_model, load_tokenizer, smollm2_checkpoint

    if name == "tiny":
        return None, 1e-3, lambda: build_tiny_model(seed)
    path = smollm2_checkpoint()
    return load_tokenizer(path), 3e-6, lambda: load_model(path)


def _eval_global(trainer: Any, fn: Any) -> float:
    """``fn(local)`` on the global weights, in the trainer's model. With ``--overlap`` the local
    weights hold the next round's progress when a round closes, so they are set aside and put back."""
    if trainer.state is None:
        return fn(trainer.inner.local)
    saved = trainer.inner.state_fp32()
    trainer.inner.load_state_fp32(trainer.state.theta)
    try:
        return fn(trainer.inner.local)
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
        if "ddp" in results:  # the learning baseline; bytes_per_worker stays the accounting
            row["ddp"] |= {k: v for k, v in results["ddp"]["rounds"][r].items() if k != "round"}
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
        "eval_loss": {m: [x.get("eval_loss") for x in res["rounds"]] for m, res in results.items()},
        "final_eval_loss": {m: res["rounds"][-1].get("eval_loss") for m, res in results.items()},
        "time_s": {
            m: {
                k: sum(x[f"{k}_s"] for x in res["rounds"])
                for k in ("inner", "encode", "upload", "wait", "apply", "verify", "queued")
            }
            | {"wall": res["wall_s"], "wall_per_round": res["wall_s"] / args.rounds}
            for m, res in results.items()
        },
    }
    if args.task == "grpo":  # the eval "loss" of the initial weights is their greedy reward here
        summary["initial_eval_reward"] = summary.pop("initial_eval_loss")
        summary["reward"] = {m: [x["reward"] for x in res["rounds"]] for m, res in results.items()}
        summary["eval_reward"] = {m: [x["eval_reward"] for x in res["rounds"]] for m, res in results.items()}
        for k in ("eval_loss", "final_eval_loss"):
            del summary[k]
    if "pulseloco" in results:
        p = results["pulseloco"]["rounds"]
        summary["sent_fraction"] = statistics.mean(x["sent_fraction"] for x in p)
        for base in ("ddp", "diloco", "diloco_zstd"):
            if base in bytes_round:
                summary[f"ratio_vs_{base}"] = bytes_round[base] / bytes_round["pulseloco"]
    return {
        "bench": "loco",
        "config": dict(vars(args)),
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


def plot(doc: dict[str, Any], path: Path) -> None:
    """The run's curves (matplotlib, Agg): learning metric per round per mode, bytes per worker per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpo = doc["config"]["task"] == "grpo"
    metric, ylabel = ("reward", "mean inner reward") if grpo else ("eval_loss", "eval loss")
    labels = {"ddp": "DDP", "diloco": "DiLoCo", "diloco_zstd": "DiLoCo zstd", "pulseloco": "PULSELoCo"}
    colors = {"ddp": "C0", "diloco": "C1", "diloco_zstd": "C4", "pulseloco": "C2"}
    xs = [r["round"] for r in doc["rounds"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode in GRPO_MODES:
        ys = [r.get(mode, {}).get(metric) for r in doc["rounds"]]
        if any(y is not None for y in ys):
            left.plot(xs, ys, marker="o", label=labels[mode], color=colors[mode])
    for key in ("ddp", "diloco", "diloco_zstd", "pulseloco"):
        ys = [r.get(key, {}).get("bytes_per_worker") for r in doc["rounds"]]
        if any(y is not None for y in ys):
            right.plot(xs, ys, marker=".", label=labels[key], color=colors[key])
    c = doc["config"]
    left.set(xlabel="round", ylabel=ylabel, title=f"{c['model']}, {c['workers']} workers, H={c['inner_steps']}")
    right.set(xlabel="round", ylabel="bytes per worker (log)", yscale="log", title="Bytes per worker per round")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(doc: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    s = doc["summary"]
    grpo = doc["config"]["task"] == "grpo"
    modes = [m for m in GRPO_MODES if m in s["time_s"]]
    metrics = ("reward", "eval_reward") if grpo else ("eval_loss",)
    names = {"reward": "reward", "eval_reward": "eval reward", "eval_loss": "eval loss"}
    sizes = [k for k in ("ddp", "diloco", "diloco_zstd", "pulseloco") if k in s["bytes_per_worker_round"]]
    ratios = [k for k in ("ddp", "diloco", "diloco_zstd") if f"ratio_vs_{k}" in s]
    labels = {"ddp": "DDP", "diloco": "DiLoCo", "diloco_zstd": "DiLoCo zstd", "pulseloco": "PULSELoCo"}
    table = Table(title=f"PULSELoCo bench ({doc['config']['task']}): {doc['config']['model']}, "
                  f"{doc['config']['workers']} workers, "
                  f"H={doc['config']['inner_steps']}, {doc['n_params']:,} params; MB per worker per round")  # fmt: skip
    table.add_column("round", justify="right")
    for k in sizes:
        table.add_column(f"{labels[k]} MB", justify="right")
    if "pulseloco" in modes:
        table.add_column("sent %", justify="right")
    for k in ratios:
        table.add_column(f"x vs {labels[k]}", justify="right")
    for metric in metrics:
        for m in modes:
            table.add_column(f"{labels[m]} {names[metric]}", justify="right")
    for m in modes:
        table.add_column(f"{labels[m]} enc/up/wait s", justify="right")

    def row(label: str, per: dict[str, dict[str, Any]]) -> list[str]:
        cells = [label] + [f"{per[k]['bytes_per_worker'] / 1e6:.2f}" for k in sizes]
        if "pulseloco" in modes:
            cells.append(f"{100 * per['pulseloco']['sent_fraction']:.2f}")
        ours = per.get("pulseloco", {}).get("bytes_per_worker")
        cells += [f"{per[k]['bytes_per_worker'] / ours:.1f}" for k in ratios]
        for metric in metrics:
            cells += [f"{per[m][metric]:.4f}" if per[m].get(metric) is not None else "-" for m in modes]
        cells += [f"{per[m]['encode_s']:.1f}/{per[m]['upload_s']:.1f}/{per[m]['wait_s']:.1f}" for m in modes]
        return cells

    for r in doc["rounds"]:
        table.add_row(*row(str(r["round"]), r))
    mean: dict[str, dict[str, Any]] = {
        k: {"bytes_per_worker": v} for k, v in s["bytes_per_worker_round"].items()
    }
    for m in modes:
        mean[m] |= {"sent_fraction": s.get("sent_fraction", 0.0)}
        if grpo:  # mean reward over the rounds; the final eval reward
            mean[m] |= {"reward": statistics.mean(s["reward"][m]), "eval_reward": s["eval_reward"][m][-1]}
        else:
            mean[m] |= {"eval_loss": s["final_eval_loss"][m]}
        mean[m] |= {f"{k}_s": v / len(doc["rounds"]) for k, v in s["time_s"][m].items()}
    table.add_row(*row("mean", mean), style="bold")
    console = Console()
    console.width = max(console.width, 190)  # the table is wide; let a narrow or piped terminal wrap it
    console.print(table)
    console.print(
        "DDP and DiLoCo: raw FP32 as published (H dense gradients; one dense pseudo-gradient); "
        "DiLoCo zstd and PULSELoCo: the payloads the workers put into the store"
    )
    if grpo:
        console.print(
            "reward: mean GRPO reward of the round's inner steps (on-policy, self-sampled), over the workers; "
            "eval reward: greedy, global weights, held-out problems (mean row: mean reward, final eval); "
            "DDP: gradients averaged over the workers every step, one AdamW step on every worker"
        )
    initial = (
        f"initial eval reward {s['initial_eval_reward']:.4f}"
        if grpo
        else f"initial eval loss {s['initial_eval_loss']:.4f}"
    )
    console.print(
        f"{initial}; digests equal across workers after every round: "
        f"{s['digests_equal']}; wall {doc['wall_s']:.0f} s"
    )
