"""``pulsenet loco train``: run one PULSELoCo trainer (start one per shell / machine).

Example, three trainers on one S3 run prefix::

    pulsenet keygen --out keys/a   # likewise b, c; every trainer is given all three .pub files
    pulsenet loco train --store s3://pulsenet-a/run1 --run run1 --id a --key keys/a --trust keys/*.pub \\
        --workers-expected 3 --rounds 20 --state-dir state/a

``--trust`` maps each trainer id to its public key (``ID=PATH``, or a bare ``PATH`` whose file name
up to the first dot is the id: ``keys/a.pub`` is trainer ``a``). A trainer's documents verify only
under its own key; every document is signed for ``pulseloco/<run>/<store url>``.

Settings: one dataclass, ``LocoTrainSettings`` (``pulsenet/cli/loco_train.py``, imported when the
command runs since it needs torch): this trainer's own fields, the supervised inner loop's
(``pulsenet.rl.inner.SupervisedSettings``) and the run's
``LocoConfig`` itself, from ``[loco.train]`` of ``--config``, ``PULSENET_<FIELD>`` and flags.

S3 endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...), read here at the edge and nowhere else.
"""

from __future__ import annotations

import argparse

from pulsenet.cli import add_settings_command

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
