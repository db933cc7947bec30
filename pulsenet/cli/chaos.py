"""``pulsenet chaos``: ``pulsenet up``'s local network under a seeded fault schedule, then an audit
of its records (``pulsenet/chaos``; docs/reliability.md).

Settings follow the one schema (``pulsenet/settings.py``): ``ChaosConfig`` (every ``pulsenet up``
setting plus the schedule's), filled from the ``[chaos]`` table of ``--config FILE``, then
``PULSENET_<FIELD>``, then flags (``--help`` lists every field).
"""

from __future__ import annotations

import argparse

from pulsenet.cli import add_settings_command, command_settings

HELP = "run the local network under seeded faults (kills, store stalls, cut links), audit it, print a verdict"


def register(sub: argparse._SubParsersAction) -> None:
    add_settings_command(sub, "chaos", HELP, "chaos", _run)


def _run(args: argparse.Namespace) -> int:
    from pulsenet.chaos.faults import ChaosConfig
    from pulsenet.chaos.run import run_chaos

    return run_chaos(command_settings(args, ChaosConfig))
