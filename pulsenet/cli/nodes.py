"""``pulsenet trainer`` and ``pulsenet inference``: the node daemons.

Settings follow the one schema (``pulsenet/settings.py``): the node's dataclass, filled from the
``[trainer]`` / ``[inference]`` table of ``--config FILE``, then ``PULSENET_<FIELD>``, then flags
(``--help`` lists every field with its docstring).
"""

from __future__ import annotations

import argparse
import os

COMMANDS = {
    "trainer": "run a trainer node: verified rollouts in, GRPO, policy versions out (PULSESync)",
    "inference": "run an inference node: follow the policy, generate rollouts, upload them",
}


def register(sub: argparse._SubParsersAction) -> None:
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_run, node=name, settings_table=name)


def _run(args: argparse.Namespace) -> int:
    from pulsenet.nodes import run as node_run
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
    from pulsenet.settings import load_settings

    rest, config = _config_option(list(args.rest), args.config or os.environ.get("PULSENET_CONFIG"))
    cls = TrainerConfig if args.node == "trainer" else InferenceConfig
    c = load_settings(cls, table=args.node, argv=rest, config=config, prog=f"pulsenet {args.node}")
    if args.node == "trainer":
        node_run.run_trainer(c)  # also one rank of a torchrun site
    else:
        node_run.run_inference(c)
    return 0


def _config_option(rest: list[str], default: str | None) -> tuple[list[str], str | None]:
    """``--config FILE`` may also follow the command (``pulsenet trainer --config configs/trainer.toml``)."""
    config = default
    out = []
    it = iter(rest)
    for a in it:
        if a == "--config":
            config = next(it, None)
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            out.append(a)
    return out, config
