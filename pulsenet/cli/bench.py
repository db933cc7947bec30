"""``pulsenet bench sync|e2e|loco|rl|scale|engines|fixture|size|replay|memory``: benchmarks with JSON
output and a table on the terminal.

Each benchmark lives in ``pulsenet/bench/<name>.py`` with its settings dataclass (one schema,
``pulsenet/settings.py``: table ``[bench.<name>]``, ``PULSENET_<FIELD>``, flags; ``--help`` lists
them) and ``run(settings) -> dict`` (the JSON document). This module only wires them; a benchmark
is imported when it runs, so that ``pulsenet --help`` and the other commands import no torch.
"""

from __future__ import annotations

import argparse
import importlib
import json

from pulsenet.cli import add_settings_command, command_settings

BENCHES = {
    "sync": (
        "PULSESync codec on real checkpoint pairs: sizes, ratios, speed, entropy bounds",
        "SyncBenchSettings",
    ),
    "e2e": (
        "publish -> every subscriber verified, through a real S3 server on an emulated link",
        "E2EBenchSettings",
    ),
    "loco": ("PULSELoCo vs DiLoCo vs DDP: bytes per worker per round, learning metric", "LocoBenchSettings"),
    "rl": (
        "asynchronous GRPO through storage: a trainer and K inference engines, reward and bytes",
        "RLBenchSettings",
    ),
    "scale": (
        "store requests measured per poll and version, projected to 10..10,000 nodes: rates, egress, S3/R2 bill",
        "ScaleBenchSettings",
    ),
    "engines": (
        "the PyTorch engine vs vLLM on one machine: start, update->first token, tokens/s, memory",
        "EnginesBenchSettings",
    ),
    "fixture": (
        "a random-init model at a published size (135M..3B, no download) and an update pair for it",
        "FixtureBenchSettings",
    ),
    "size": (
        "the codec and PULSESync at 135M..3B: SHA-256 floor, encode/apply on 1 and all cores, CLI memory, "
        "version latency through a throttled link",
        "SizeBenchSettings",
    ),
    "replay": (
        "the trainer's replay of rollout rows on the torch engine: cost vs the GRPO step, honest rows' margins",
        "ReplayBenchSettings",
    ),
    "memory": (
        "peak memory of every node of a pulsenet up run, measured from outside, against its budget",
        "MemoryBenchSettings",
    ),
}
"""name -> (help, the settings class in ``pulsenet.bench.<name>``, or in ``MODULES[name]``)."""

MODULES = {"fixture": "fixtures"}
"""Benchmarks whose module is not named after them."""

ALIASES = {"loco": {"--H": "--inner-steps"}, "rl": {"--steps": "--rounds"}}
"""Flag spellings from before the schema (docs and results use them) -> the field's flag."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON output)")
    bsub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (help_, _) in BENCHES.items():
        add_settings_command(bsub, name, help_, f"bench.{name}", _run, aliases=ALIASES.get(name))


def _run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"pulsenet.bench.{MODULES.get(args.bench, args.bench)}")
    settings = command_settings(args, getattr(module, BENCHES[args.bench][1]))
    result = module.run(settings)
    if settings.json is not None:
        settings.json.parent.mkdir(parents=True, exist_ok=True)
        settings.json.write_text(json.dumps(result, indent=1))
        print(f"JSON written to {settings.json}")
    return 0
