"""``pulsenet up``: a trainer and inference nodes on this machine, each its own process, through a
local S3 server (or ``--s3-endpoint``), with a live table and an end-of-run report.

Settings follow the one schema (``pulsenet/settings.py``): ``UpConfig``, filled from the ``[up]``
table of ``--config FILE``, then ``PULSENET_<FIELD>``, then flags (``--help`` lists every field).
"""

from __future__ import annotations

import argparse
import os

HELP = "run a local network: trainer(s) and inference nodes as processes, async GRPO, report"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help=HELP, add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run, settings_table="up")


def _run(args: argparse.Namespace) -> int:
    from pulsenet.cli.nodes import _config_option
    from pulsenet.nodes.up import UpConfig, run_up
    from pulsenet.settings import load_settings

    rest, config = _config_option(list(args.rest), args.config or os.environ.get("PULSENET_CONFIG"))
    c = load_settings(UpConfig, table="up", argv=rest, config=config, prog="pulsenet up")
    return run_up(c)
