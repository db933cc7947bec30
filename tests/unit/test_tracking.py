"""Tracking: per-version records to none, wandb (offline: a local run directory, nothing sent)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pulsenet.errors import ConfigError
from pulsenet.tracking import NoTracker, flatten, make_tracker


def test_flatten_and_none() -> None:
    assert flatten(
        {"version": 3, "reward": 0.5, "eval": {"reward": 0.25, "n": 32}, "digest": "ab", "ok": True, "x": float("nan")}
    ) == {
        "version": 3.0, "reward": 0.5, "eval/reward": 0.25, "eval/n": 32.0
    }
    t = make_tracker("none")
    assert isinstance(t, NoTracker)
    t.log({"reward": 1.0}, step=0)
    t.close()
    with pytest.raises(ConfigError, match="tracker must be one of"):
        make_tracker("tensorboard")


def test_wandb_offline_writes_a_local_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where wandb is installed (it is on the dev VM; not a dependency), an offline run holds the
    records; where it is not, choosing it is a ConfigError that says how to install it."""
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="pip install wandb"):
            make_tracker("wandb")
        return
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = make_tracker("wandb", project="pulsenet-test", name="t", config={"lr": 3e-6}, directory=tmp_path, mode="offline")
    for v in range(3):
        t.log({"version": v, "reward": 0.1 * v, "eval": {"reward": 0.2}}, step=v)
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(p.suffix == ".wandb" for p in runs[0].iterdir())
