"""``pulsenet loco train``: run one PULSELoCo trainer (start one per shell / machine).

Example, three trainers on one S3 run prefix::

    pulsenet keygen --out keys/a   # likewise b, c; every trainer is given all three .pub files
    pulsenet loco train --store s3://pulsenet-a/run1 --run run1 --id a --key keys/a --trust keys/*.pub \\
        --workers-expected 3 --rounds 20 --state-dir state/a

``--trust`` maps each trainer id to its public key (``ID=PATH``, or a bare ``PATH`` whose file name
up to the first dot is the id: ``keys/a.pub`` is trainer ``a``). A trainer's documents verify only
under its own key; every document is signed for ``pulseloco/<run>/<store url>``.

Settings: one dataclass, ``LocoTrainSettings`` (``pulsenet/cli/loco_train.py``, imported when the
command runs since it needs torch): this trainer's own fields, the ``InnerLoop`` below and the run's
``LocoConfig`` itself, from ``[loco.train]`` of ``--config``, ``PULSENET_<FIELD>`` and flags.

S3 endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...), read here at the edge and nowhere else.
"""

from __future__ import annotations

import argparse
import hashlib
from dataclasses import dataclass
from typing import Literal, get_args

from pulsenet.cli import add_settings_command

Forward = Literal["bf16-weights", "autocast-bf16", "fp32"]
FORWARDS = get_args(Forward)
"""``pulsenet.rl.local.FORWARDS``, spelled out so that ``pulsenet --help`` need not import torch
(tests/test_rl_local.py checks the two agree)."""


ALIASES = {
    "--H": "--inner-steps",
    "--deadline": "--deadline-s",
    "--join-wait": "--join-wait-s",
    "--poll": "--poll-s",
    "--digest-wait": "--digest-wait-s",
    "--round-timeout": "--round-timeout-s",
    "--store-timeout": "--timeouts.small-s",
    "--transfer-timeout": "--timeouts.transfer-s",
}
"""Flag spellings from before the schema (docs and scripts use them) -> the LocoConfig field's flag."""


@dataclass(kw_only=True)
class InnerLoop:
    """The inner loop of a trainer (``pulsenet loco train``, ``pulsenet bench loco``)."""

    model: Literal["tiny", "smollm2"] = "tiny"
    """Model to train: tiny (built from the seed) or smollm2 (SmolLM2-135M)."""
    lr: float | None = None
    """Inner AdamW learning rate (None: 1e-3 tiny, 3e-6 smollm2)."""
    batch: int = 4
    """Rows per inner step."""
    seq: int = 32
    """Tokens per row."""
    forward: Forward = "bf16-weights"
    """Inner forward: bf16-weights (FP32 maths on the BF16-rounded weights, fast on any CPU),
    autocast-bf16 (torch.autocast, for CPUs/GPUs with native BF16), fp32 (sees sub-BF16 updates the
    PULSELoCo gate withholds)."""
    seed: int = 0
    """Run seed: model init (same on every trainer) and data streams."""
    threads: int | None = None
    """Torch threads for this process (None: torch's default)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    group = subparsers.add_parser("loco", help="PULSELoCo: sparse DiLoCo trainers through object storage")
    sub = group.add_subparsers(dest="loco_command", required=True, metavar="ACTION")
    add_settings_command(
        sub, "train", "run one trainer until the run reaches --rounds", "loco.train", _train, aliases=ALIASES
    )


def _train(ns: argparse.Namespace) -> int:
    import asyncio

    from pulsenet.cli.loco_train import load_train_settings, run_trainer

    s = load_train_settings(ns)
    reports = asyncio.run(run_trainer(s))
    last = reports[-1] if reports else None
    if last is not None:
        print(f"{s.id}: round {last.round} digest {last.digest}")
    return 0


def data_seed(seed: int, trainer_id: str) -> int:
    """Each trainer's own data stream, stable across restarts and machines."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{trainer_id}".encode()).digest()[:4], "little") >> 1
