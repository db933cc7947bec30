"""The one ``pulsenet`` command. Each subcommand group lives in its own module with a ``register``.

Modules register lazily-imported handlers so ``pulsenet --help`` stays fast (no torch import).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from pulsenet.errors import PulsenetError

T = TypeVar("T")

# Each module exposes ``register(subparsers)``; add new groups here.
_MODULES = (
    "pulsenet.cli.patch",
    "pulsenet.cli.keys",
    "pulsenet.cli.sync",
    "pulsenet.cli.export",
    "pulsenet.cli.loco",
    "pulsenet.cli.s3",
    "pulsenet.cli.bench",
    "pulsenet.cli.nodes",
    "pulsenet.cli.up",
    "pulsenet.cli.chaos",
)


DESCRIPTION = """\
pulsenet moves policy updates for distributed RL post-training of LLMs over S3-compatible object
storage, sending only what changes the BF16 weights the next forward pass uses: PULSESync
(trainer -> inference: sparse, lossless, SHA-256-verified patches) and PULSELoCo (trainer <->
trainer: sparse DiLoCo with bit-identical global weights)."""

EPILOG = """\
first steps:
  pulsenet keygen --out keys/site-a.key                  a signing key pair for one site
  pulsenet s3 serve --dir ./s3data                       a local S3 server with per-site credentials
  pulsenet publish MODEL --store URL --key KEY           publish a version (trainer side)
  pulsenet pull --store URL --trust PUB --out DIR        rebuild the newest verified version
  pulsenet bench sync --model tiny                       measure the codec on this machine

Every command takes --help; settings come from --config TOML, then PULSENET_<FIELD>, then flags."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pulsenet",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="json: one JSON object per line (for collectors)"
    )
    parser.add_argument(
        "--config",
        metavar="TOML",
        help="command settings from a file (configs/*.toml; env PULSENET_CONFIG; also accepted after "
        "the command); PULSENET_<FIELD> env vars override it, command-line flags override both",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real missing dependency, not an absent module
                raise
            continue
        module.register(sub)
    return parser


def add_settings_command(
    sub: argparse._SubParsersAction,
    name: str,
    help_: str,
    table: str,
    func: Any,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """A command whose settings are one dataclass (pulsenet/settings.py): argparse only picks the
    command and hands the rest of the line to ``load_settings`` (which also answers ``--help``).
    ``aliases``: older flag spellings the command still accepts."""
    p = sub.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=func, settings_table=table, settings_aliases=dict(aliases or {}))


def command_settings(args: argparse.Namespace, cls: type[T], environ: Mapping[str, str] = os.environ) -> T:
    """The settings of a command registered with ``add_settings_command``: ``cls`` filled from its
    table of ``--config`` (given before or after the command, or ``PULSENET_CONFIG``), then
    ``PULSENET_<FIELD>``, then the flags after the command."""
    from pulsenet.cli.nodes import _config_option
    from pulsenet.settings import load_settings

    rest, config = _config_option(list(args.rest), args.config or environ.get("PULSENET_CONFIG"))
    table = args.settings_table
    prog = f"pulsenet {table.replace('.', ' ')}"
    return load_settings(cls, table=table, argv=rest, config=config, environ=environ, prog=prog, aliases=args.settings_aliases)


def parse_cli(argv: list[str] | None = None, environ: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Pick the command. A command's settings are loaded when it runs (``command_settings``), from
    ``--config``, ``environ`` and the flags after it; ``environ`` is unused here."""
    del environ
    return build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_cli(argv)
    except PulsenetError as e:
        print(f"pulsenet: error: {e}", file=sys.stderr)
        return 2
    from pulsenet.runtime import return_large_buffers_to_os

    return_large_buffers_to_os()
    from pulsenet.logs import setup_logging

    setup_logging(args.verbose, args.log_format)
    try:
        return int(args.func(args) or 0)
    except PulsenetError as e:
        print(f"pulsenet: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # missing files, permissions: say which path, no traceback
        print(f"pulsenet: error: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pulsenet: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
