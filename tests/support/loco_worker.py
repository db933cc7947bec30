"""A ``pulsenet loco train`` process with fault injection, for the PULSELoCo process tests.

Takes every ``pulsenet loco train`` argument, plus:

- ``--hold-round R --hold-s S``: sleep S seconds in round R's inner phase (a straggler).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from pulsenet.cli.loco import ALIASES
from pulsenet.cli.loco_train import LocoTrainSettings, run_trainer
from pulsenet.loco import LocoTrainer
from pulsenet.settings import load_settings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hold-round", type=int, default=None)
    parser.add_argument("--hold-s", type=float, default=0.0)
    args, rest = parser.parse_known_args(argv)
    settings = load_settings(LocoTrainSettings, table="loco.train", argv=rest, aliases=ALIASES)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    class Straggler(LocoTrainer):
        """Its inner phase of ``--hold-round`` takes ``--hold-s`` longer (through the phase hook)."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, on_phase=self.hold, **kw)

        @contextlib.asynccontextmanager
        async def hold(self, name: str, r: int) -> AsyncIterator[None]:
            yield
            if name == "inner" and r == args.hold_round:
                logging.warning("%s: holding round %d for %g s", self.id, r, args.hold_s)
                await asyncio.sleep(args.hold_s)

    reports = asyncio.run(run_trainer(settings, factory=Straggler))
    print(f"{settings.id}: round {reports[-1].round} digest {reports[-1].digest}" if reports else "no rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
