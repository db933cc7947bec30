"""``pulsenet up``'s work directory: its marker, the run directories wiped per run, the signing
keys kept across runs (the tiny warm-up cache, ``cache/``, is kept too: ``up.warm_up_once``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from pulsenet.errors import ConfigError

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
