"""Experiment tracking (optional): the per-version metric records a run already makes, sent to a tracker.

``tracker = "none" | "wandb" | "trackio"``. A node (or ``pulsenet up``) builds one with
``make_tracker`` and calls ``log(record, step=version)`` with the same flat dict it logs as its
per-version JSON line, then ``close()``. Neither package is a dependency: choosing one that is not
installed is a ConfigError that says how to install it; ``none`` does nothing. Nested values are
flattened to ``a/b`` keys and non-numbers dropped, since trackers chart numbers.

``wandb`` honours its own settings (``WANDB_MODE=offline`` writes under ``dir`` and sends nothing;
``mode`` forces one); ``trackio`` is local-first (a SQLite database under its own cache).
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from pulsenet.errors import ConfigError

TRACKERS = ("none", "wandb", "trackio")


class Tracker(Protocol):
    def log(self, record: Mapping[str, Any], *, step: int) -> None: ...

    def close(self) -> None: ...


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"a": {"b": 1}, "c": "x", "d": 2.5}`` -> ``{"a/b": 1.0, "d": 2.5}`` (finite numbers only)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


class NoTracker:
    def log(self, record: Mapping[str, Any], *, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Module:
    """wandb and trackio share ``init(project=, name=, config=)``, ``log(dict, step=)``, ``finish()``."""

    def __init__(self, module: Any, run: Any) -> None:
        self.module, self.run = module, run

    def log(self, record: Mapping[str, Any], *, step: int) -> None:
        target = self.run if hasattr(self.run, "log") else self.module
        target.log(flatten(record), step=step)

    def close(self) -> None:
        target = self.run if hasattr(self.run, "finish") else self.module
        target.finish()


def make_tracker(
    kind: str,
    *,
    project: str = "pulsenet",
    name: str | None = None,
    config: Mapping[str, Any] | None = None,
    directory: Path | None = None,
    mode: str | None = None,
) -> Tracker:
    """A tracker of ``kind``; ``directory``: where wandb writes (offline runs land there);
    ``mode``: wandb's ``online``/``offline``/``disabled`` (None: wandb's own settings)."""
    if kind not in TRACKERS:
        raise ConfigError(f"tracker must be one of {TRACKERS}, got {kind!r}")
    if kind == "none":
        return NoTracker()
    try:
        module = importlib.import_module(kind)
    except ImportError:
        raise ConfigError(f"tracker {kind} needs the {kind} package: pip install {kind}") from None
    if kind == "wandb":
        kwargs: dict[str, Any] = {"project": project, "name": name, "config": dict(config or {})}
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(directory)
        if mode is not None:
            kwargs["mode"] = mode
        return _Module(module, module.init(**kwargs))
    return _Module(module, module.init(project=project, name=name, config=dict(config or {})))
