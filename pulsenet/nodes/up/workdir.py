"""``pulsenet up``'s work directory: its marker, the run directories wiped per run, the signing
keys and the warm-up cache kept across runs."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsenet.errors import ConfigError

if TYPE_CHECKING:
    from pulsenet.nodes.config import TrainerConfig

MARKER = ".pulsenet-up"
"""Marks a work directory as ``pulsenet up``'s own: only then does a run wipe directories in it."""
RUN_DIRS = ("state", "config", "logs", "s3")
"""What belongs to one run and is wiped when the next starts (keys/ and cache/ are kept)."""


def fresh_run_dirs(workdir: Path) -> None:
    """Wipe the last run's directories, in a work directory ``pulsenet up`` made (marked) only."""
    marker = workdir / MARKER
    if workdir.is_dir() and any(workdir.iterdir()) and not marker.exists():
        raise ConfigError(
            f"pulsenet up: {workdir} is not empty and was not made by pulsenet up (no {MARKER}): "
            "pick a new or empty --workdir (each run wipes its state/, config/, logs/ and s3/)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("a pulsenet up work directory: keys/ and cache/ are kept, the rest is wiped per run\n")
    for name in RUN_DIRS:
        shutil.rmtree(workdir / name, ignore_errors=True)
    for name in (*RUN_DIRS, "cache"):
        (workdir / name).mkdir(exist_ok=True)


def ensure_keys(keys: Path, sites: list[str]) -> None:
    """A signing key pair per site, made once and kept across runs."""
    from pulsenet.signing import generate_keypair

    keys.mkdir(parents=True, exist_ok=True)
    for site in sites:
        if not (keys / f"{site}.key").exists() or not (keys / f"{site}.key.pub").exists():
            generate_keypair(keys / f"{site}.key")


def warm_up_once(trainer: TrainerConfig, console: Any) -> None:
    """Warm the tiny model up here, once, into the cache every trainer loads it from (``trainer``:
    a planned trainer's settings: its model, cache directory, seed and warm-up steps).

    Trainers warming it up at the same time oversubscribe a small machine's cores (measured: two
    250-step warm-ups with 2 torch threads each on 2 cores took 50 s each, one alone 3.5 s), and
    one cached copy is one genesis for all of them."""
    from pulsenet.nodes.common import initial_model

    t0 = time.perf_counter()
    initial_model(trainer.model, trainer.cache_dir, seed=trainer.seed, warmup_steps=trainer.warmup_steps)
    console.print(f"tiny model warmed up ({time.perf_counter() - t0:.1f} s, cached in {trainer.cache_dir})")
