"""``pulsenet loco train``: run one PULSELoCo trainer (start one per shell / machine).

Example, three trainers on one S3 run prefix::

    pulsenet keygen --out keys/a   # likewise b, c; every trainer is given all three .pub files
    pulsenet loco train --store s3://pulsenet-a/run1 --run run1 --id a --key keys/a --trust keys/*.pub \\
        --workers-expected 3 --rounds 20 --state-dir state/a

``--trust`` maps each trainer id to its public key (``ID=PATH``, or a bare ``PATH`` whose file name
up to the first dot is the id: ``keys/a.pub`` is trainer ``a``). A trainer's documents verify only
under its own key; every document is signed for ``pulseloco/<run>/<store url>``.

S3 endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...), read here at the edge and nowhere else.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulsenet.loco import LocoTrainer, RoundReport


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("loco", help="PULSELoCo: sparse DiLoCo trainers through object storage")
    sub = group.add_subparsers(dest="loco_command", required=True, metavar="ACTION")
    p = sub.add_parser(
        "train",
        help="run one trainer until the run reaches --rounds",
        description="Run one PULSELoCo trainer: H local AdamW steps per round, a gated sparse FP32 payload "
        "through the store, the round's deterministic average and outer Nesterov step, digest checks "
        "with repair from the store. Resumes from --state-dir (or its store checkpoint) after a crash.",
    )
    add_train_arguments(p)
    p.set_defaults(func=_train)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--store", required=True, help="run URL: s3://bucket/prefix or file:///abs/path")
    p.add_argument("--id", required=True, help="this trainer's id (lowercase letters, digits, '-', '_')")
    p.add_argument(
        "--key", required=True, type=Path, help="this trainer's Ed25519 private key (pulsenet keygen)"
    )
    p.add_argument(
        "--trust",
        required=True,
        nargs="+",
        metavar="[ID=]PUB",
        help="every trainer's public key: ID=PATH, or PATH whose file name up to the first '.' is the id",
    )
    p.add_argument(
        "--run",
        default="default",
        help="run id, signed into every document with the store URL (default: %(default)s)",
    )
    p.add_argument(
        "--workers-expected", type=int, default=1, help="trainers in the run (default: %(default)s)"
    )
    p.add_argument(
        "--min-quorum",
        type=int,
        default=None,
        help="fewest payloads a round may close with (default: majority)",
    )
    p.add_argument(
        "--H", dest="inner_steps", type=int, default=8, help="inner steps per round (default: %(default)s)"
    )
    p.add_argument(
        "--rounds", type=int, default=10, help="stop once the run reaches this round (default: %(default)s)"
    )
    p.add_argument("--mode", choices=("pulseloco", "diloco"), default="pulseloco")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--lr", type=float, default=None, help="inner AdamW lr (default: 1e-3 tiny, 3e-6 smollm2)")
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument(
        "--gate-scale",
        type=float,
        default=1.0,
        help="send where bf16(θ - scale·s) != bf16(θ) (default 1: as specified; see docs/loco.md section 9)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="one-round-delayed outer step: train round r+1 while round r is exchanged (docs/loco.md)",
    )
    p.add_argument("--batch", type=int, default=4, help="rows per inner step (default: %(default)s)")
    p.add_argument("--seq", type=int, default=32, help="tokens per row (default: %(default)s)")
    add_forward_argument(p)
    p.add_argument(
        "--seed", type=int, default=0, help="run seed: model init (same on every trainer) and data streams"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads for this process")
    p.add_argument(
        "--state-dir", type=Path, default=None, help="local resume point (default: ./loco-state/ID)"
    )
    p.add_argument(
        "--deadline", type=float, default=60.0, help="seconds to wait for peers before closing with a quorum"
    )
    p.add_argument("--round-timeout", type=float, default=1800.0)
    p.add_argument(
        "--join-wait", type=float, default=120.0, help="seconds to wait at start for the other trainers"
    )
    p.add_argument("--poll", type=float, default=0.5, help="mean store poll interval, seconds")
    p.add_argument("--digest-wait", type=float, default=15.0)
    p.add_argument(
        "--state-every", type=int, default=10, help="publish the agreed global state every N rounds"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=5, help="upload own resume point every N rounds (0: never)"
    )
    p.add_argument(
        "--retain-rounds", type=int, default=None, help="delete own round objects older than N rounds"
    )
    p.add_argument("--store-timeout", type=float, default=30.0, help="seconds per small store call")
    p.add_argument("--transfer-timeout", type=float, default=600.0, help="seconds per payload/state transfer")
    p.add_argument("--report", type=Path, default=None, help="write the per-round reports here as JSON")


FORWARDS = ("bf16-weights", "autocast-bf16", "fp32")
"""``pulsenet.rl.local.FORWARDS``, spelled out so that ``pulsenet --help`` need not import torch
(tests/test_rl_local.py checks the two agree)."""


def add_forward_argument(p: argparse.ArgumentParser) -> None:
    """``--forward``: how the inner loop (and the benchmark's evaluation) runs the model."""
    p.add_argument(
        "--forward",
        choices=FORWARDS,
        default="bf16-weights",
        help="inner forward: bf16-weights (FP32 maths on the BF16-rounded weights, fast on any CPU), "
        "autocast-bf16 (torch.autocast, for CPUs/GPUs with native BF16), fp32 (sees sub-BF16 updates "
        "the PULSELoCo gate withholds) (default: %(default)s)",
    )


def _train(args: argparse.Namespace) -> int:
    import asyncio

    reports = asyncio.run(run_trainer(args))
    last = reports[-1] if reports else None
    if last is not None:
        print(f"{args.id}: round {last.round} digest {last.digest}")
    return 0


def data_seed(seed: int, trainer_id: str) -> int:
    """Each trainer's own data stream, stable across restarts and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{trainer_id}".encode()).digest()[:4], "little") >> 1


async def run_trainer(args: argparse.Namespace, factory: Any = None) -> list[RoundReport]:
    """Build the trainer the arguments describe and run it; ``factory`` (a LocoTrainer subclass) for tests."""
    import torch

    from pulsenet.loco import LocoConfig, LocoTrainer
    from pulsenet.loco.documents import Timeouts, trainer_keys
    from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.inner import SupervisedInner
    from pulsenet.signing import load_private_key
    from pulsenet.store import S3Config, open_store

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, default_lr = _model(args.model, args.seed)
    lr = args.lr if args.lr is not None else default_lr
    local = LocalTrainer(
        model,
        LocalTrainerConfig(
            lr=lr,
            batch_size=args.batch,
            seq_len=args.seq,
            seed=data_seed(args.seed, args.id),
            forward=args.forward,
        ),
    )
    task = ArithmeticTask(data_seed(args.seed, args.id), tokenizer)
    config = LocoConfig(
        run=args.run,
        mode=args.mode,
        inner_steps=args.inner_steps,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        gate_scale=args.gate_scale,
        overlap=args.overlap,
        workers_expected=args.workers_expected,
        min_quorum=args.min_quorum,
        join_wait_s=args.join_wait,
        deadline_s=args.deadline,
        round_timeout_s=args.round_timeout,
        poll_s=args.poll,
        digest_wait_s=args.digest_wait,
        state_every=args.state_every,
        checkpoint_every=args.checkpoint_every,
        retain_rounds=args.retain_rounds,
        timeouts=Timeouts(small_s=args.store_timeout, transfer_s=args.transfer_timeout),
    )
    state_dir = args.state_dir if args.state_dir is not None else Path("loco-state") / args.id
    s3 = S3Config.from_env(timeout_s=args.store_timeout, transfer_timeout_s=args.transfer_timeout)
    cls: type[LocoTrainer] = factory or LocoTrainer
    async with open_store(args.store, s3) as store:
        trainer = cls(
            args.id,
            store,
            load_private_key(args.key),
            trainer_keys(args.trust),
            SupervisedInner(local, task),
            config,
            state_dir=state_dir,
        )
        reports = await trainer.run(args.rounds)
    if args.report is not None:
        from dataclasses import asdict

        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return reports


def _model(name: str, seed: int) -> tuple[Any, Any, float]:
    from pulsenet.rl import build_tiny_model, load_model, load_tokenizer, smollm2_checkpoint

    if name == "tiny":
        return build_tiny_model(seed), None, 1e-3
    path = smollm2_checkpoint()
    return load_model(path), load_tokenizer(path), 3e-6
