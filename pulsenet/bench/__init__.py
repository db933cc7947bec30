"""Benchmarks (``pulsenet bench ...``): real training, real stores, JSON out.

Each benchmark's settings are one dataclass (``<Name>BenchSettings`` in its module, a
``BenchSettings``), filled like every command's (``pulsenet/settings.py``): the ``[bench.<name>]``
table of ``--config``, then ``PULSENET_<FIELD>``, then flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass(kw_only=True)
class BenchSettings:
    """What every benchmark takes."""

    json: Path | None = None
    """Write the JSON result here."""


def config_of(settings: Any) -> dict[str, Any]:
    """The settings as a benchmark's JSON records them (``config``): one flat dict by field name
    (nested settings add no prefix: they lend their fields to the command), paths as strings."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        v = getattr(settings, f.name)
        if dataclasses.is_dataclass(v):
            out |= config_of(v)
        else:
            out[f.name] = str(v) if isinstance(v, Path) else v
    return out


@contextlib.contextmanager
def workdir(given: Path | None, name: str) -> Iterator[Path]:
    """``given`` (created if missing, kept afterwards), or a temporary directory deleted afterwards."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=f"pulsenet-bench-{name}-") as tmp:
        yield Path(tmp)
