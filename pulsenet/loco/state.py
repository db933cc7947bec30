"""What a PULSELoCo trainer must not lose, and how it is written so a SIGKILL cannot tear it.

Two kinds of state:

- ``GlobalState`` (θ, outer momentum m, round): identical on every trainer after every round.
  Shared through the store as a safetensors file (``theta/<name>``, ``momentum/<name>``, round in
  the metadata), so any trainer can adopt it: genesis, periodic checkpoints, repair, catch-up.
  safetensors, not pickle, because peers' files are loaded.
- ``TrainerState``: a trainer's own resume point: the global state plus its error feedback, the
  inner optimizer, RNGs and step counter. Written after every round to the local state directory
  (and every few rounds to the trainer's prefix in the store) with ``torch.save`` and read back with
  ``weights_only=True``.

Local writes are atomic and durable: a temporary file in the same directory, fsync, ``os.replace``,
fsync of the directory. After a crash the path holds the old file or the new one, never half.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from pulsenet.errors import VerificationError
from pulsenet.fsutil import atomic_path
from pulsenet.loco.algorithm import StateDict, global_digest

STATE_FORMAT = "pulseloco-state-v1"
TRAINER_FORMAT = "pulseloco-trainer-v1"


@dataclass(slots=True)
class GlobalState:
    """The agreed state after ``round`` (0 = genesis, before any outer step)."""

    round: int
    theta: StateDict
    momentum: StateDict

    @classmethod
    def genesis(cls, weights: StateDict) -> GlobalState:
        theta = {n: t.detach().to(torch.float32).clone().contiguous() for n, t in weights.items()}
        return cls(round=0, theta=theta, momentum={n: torch.zeros_like(t) for n, t in theta.items()})

    def digest(self) -> str:
        return global_digest(self.theta, self.momentum)

    def copy(self) -> GlobalState:
        return GlobalState(
            self.round,
            {n: t.clone() for n, t in self.theta.items()},
            {n: t.clone() for n, t in self.momentum.items()},
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in self.theta.items()}

    @staticmethod
    def max_size(shapes: dict[str, tuple[int, ...]]) -> int:
        """The largest file :meth:`save` writes for these shapes: θ and m in FP32, plus safetensors'
        8-byte length and JSON header (names, dtype, shape, offsets, padding, the metadata) with
        room to spare. A published state's signed size is bounded by it before it is downloaded."""
        data = sum(8 * int(math.prod(s)) for s in shapes.values())
        header = 4096 + sum(2 * (len(n.encode("utf-8")) + 160 + 24 * len(s)) for n, s in shapes.items())
        return 8 + header + data

    def save(self, path: Path) -> None:
        """Write as safetensors, atomically."""
        tensors = {f"theta/{n}": t.contiguous() for n, t in self.theta.items()}
        tensors.update({f"momentum/{n}": t.contiguous() for n, t in self.momentum.items()})
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": STATE_FORMAT, "round": str(self.round)})

    @classmethod
    def load(cls, path: Path, shapes: dict[str, tuple[int, ...]]) -> GlobalState:
        """Read a file written by :meth:`save`; names, shapes and dtypes must match ``shapes``."""
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except (SafetensorError, OSError, ValueError) as e:
            raise VerificationError(f"{path}: not a global state file: {e}") from e
        if meta.get("format") != STATE_FORMAT or not meta.get("round", "").isdigit():
            raise VerificationError(f"{path}: metadata {meta} is not a {STATE_FORMAT} file")
        want = {f"{kind}/{n}" for kind in ("theta", "momentum") for n in shapes}
        if set(tensors) != want:
            raise VerificationError(f"{path}: tensor names do not match the model")
        for key, t in tensors.items():
            if t.dtype != torch.float32 or tuple(t.shape) != tuple(shapes[key.split("/", 1)[1]]):
                raise VerificationError(
                    f"{path}: {key} is {t.dtype} {tuple(t.shape)}, not float32 as the model"
                )
        theta = {n: tensors[f"theta/{n}"].contiguous() for n in shapes}
        momentum = {n: tensors[f"momentum/{n}"].contiguous() for n in shapes}
        return cls(round=int(meta["round"]), theta=theta, momentum=momentum)


@dataclass(slots=True)
class TrainerState:
    """One trainer's complete resume point after ``global_.round``."""

    global_: GlobalState
    error: StateDict | None
    """Error feedback (PULSELoCo); None for DiLoCo."""
    inner: dict[str, Any]
    """``{"optimizer", "rng", "steps"}`` from the LocalTrainer (its weights equal θ at a round boundary)."""

    def save(self, path: Path) -> None:
        obj = {
            "format": TRAINER_FORMAT,
            "round": self.global_.round,
            "theta": self.global_.theta,
            "momentum": self.global_.momentum,
            "error": self.error,
            "inner": self.inner,
        }
        with atomic_path(path) as tmp:
            torch.save(obj, tmp)

    @classmethod
    def load(cls, path: Path, shapes: Mapping[str, tuple[int, ...]] | None = None) -> TrainerState:
        """Read a file written by :meth:`save`; VerificationError for anything else (torn, foreign,
        malformed), including tensors that do not match ``shapes`` (the model's) when given."""
        try:
            obj = torch.load(path, weights_only=True, map_location="cpu")
        except _TORCH_LOAD_ERRORS as e:
            raise VerificationError(f"{path}: unreadable trainer state: {type(e).__name__}: {e}") from e
        if not isinstance(obj, dict) or obj.get("format") != TRAINER_FORMAT:
            raise VerificationError(f"{path}: not a {TRAINER_FORMAT} file")
        round_, inner = obj.get("round"), obj.get("inner")
        if type(round_) is not int or not 0 <= round_ < 10**8:
            raise VerificationError(f"{path}: round {str(round_)[:40]!r} is not a round number")
        theta = _tensors(obj.get("theta"), "theta", path, shapes)
        want = {n: tuple(t.shape) for n, t in theta.items()}
        momentum = _tensors(obj.get("momentum"), "momentum", path, want)
        error = None if obj.get("error") is None else _tensors(obj["error"], "error", path, want)
        if (
            not isinstance(inner, dict)
            or not isinstance(inner.get("optimizer"), dict)
            or not isinstance(inner.get("rng"), dict)
            or type(inner.get("steps")) is not int
            or inner["steps"] < 0
        ):
            raise VerificationError(f"{path}: inner state is not {{optimizer, rng, steps}}")
        return cls(GlobalState(round_, theta, momentum), error, inner)


_TORCH_LOAD_ERRORS = (
    OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, KeyError, IndexError, TypeError,
    AttributeError, AssertionError, OverflowError, MemoryError, RecursionError, struct.error, zipfile.BadZipFile,
)  # fmt: skip
"""What ``torch.load(weights_only=True)`` raises on a torn or foreign file (it documents none):
corrupt zip members, truncated pickles, forbidden globals, tensors past their storage, and
``AssertionError`` for a malformed persistent id (found by tests/fuzz/targets_loco.py)."""


def _tensors(
    obj: object, what: str, path: Path, shapes: Mapping[str, tuple[int, ...]] | None
) -> dict[str, torch.Tensor]:
    """``obj`` as ``{name: FP32 tensor}``, with exactly ``shapes``' names and shapes when given."""
    if not isinstance(obj, dict) or not all(
        isinstance(n, str) and isinstance(t, torch.Tensor) and t.dtype == torch.float32
        for n, t in obj.items()
    ):
        raise VerificationError(f"{path}: {what} is not a map of float32 tensors")
    if shapes is not None and {n: tuple(t.shape) for n, t in obj.items()} != {
        n: tuple(s) for n, s in shapes.items()
    }:
        raise VerificationError(f"{path}: {what} does not match the model's names and shapes")
    return obj


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
