"""``pulsenet bench sync|e2e|loco|rl``: benchmarks with JSON output and a table on the terminal.

Each benchmark lives in ``pulsenet/bench/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> dict`` (the JSON document); this module only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

BENCHES = {
    "sync": "PULSESync codec on real checkpoint pairs: sizes, ratios, speed, entropy bounds",
    "e2e": "publish -> every subscriber verified, through a real S3 server on an emulated link",
    "loco": "PULSELoCo vs DiLoCo vs DDP: bytes per worker per round, learning metric",
    "rl": "asynchronous GRPO through storage: a trainer and K inference engines, reward and bytes",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, help_ in BENCHES.items():
        try:
            module = importlib.import_module(f"pulsenet.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pulsenet.bench.{name}":
                raise
            continue
        b = bsub.add_parser(name, help=help_)
        b.add_argument("--json", type=Path, default=None, help="write the JSON result here")
        module.add_arguments(b)
        b.set_defaults(func=_runner(module))


def _runner(module):
    def run(args: argparse.Namespace) -> int:
        result = module.run(args)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
            print(f"JSON written to {args.json}")
        return 0

    return run
