"""Benchmarks (``pulsenet bench ...``): real training, real stores, JSON out."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def workdir(given: Path | None, name: str) -> Iterator[Path]:
    """``given`` (created if missing, kept afterwards), or a temporary directory deleted afterwards."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=f"pulsenet-bench-{name}-") as tmp:
        yield Path(tmp)
