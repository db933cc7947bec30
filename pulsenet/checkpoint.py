"""Safetensors checkpoints on local disk: lazy reading (one tensor at a time) and streaming,
atomic writing. The codec consumes any ``Mapping[str, Tensor]``; this module provides one backed
by files so a 7B model never has to sit in memory whole.

A *model path* is a ``.safetensors`` file or a Hugging Face directory holding ``model.safetensors``
or sharded ``model-0000x-of-0000y.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from pulsenet.codec.bf16 import bits
from pulsenet.codec.dtypes import dtype_from_name, dtype_name
from pulsenet.errors import ConfigError
from pulsenet.fsutil import atomic_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def weight_files(path: Path) -> list[Path]:
    """The safetensors files making up a model path, or a ConfigError saying what is wrong."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError(f"{path} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist")
    if (path / INDEX_NAME).is_file():
        index = json.loads((path / INDEX_NAME).read_text())
        return [path / f for f in sorted(set(index["weight_map"].values()))]
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise ConfigError(f"{path} holds no .safetensors weights (pytorch_model.bin is not supported)")
    return found


class Checkpoint(Mapping[str, torch.Tensor]):
    """A read-only, lazy ``name -> tensor`` view of a model path; tensors load on access."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        for f in weight_files(self.path):
            with safe_open(f, framework="pt") as h:
                for name in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in self._where:
                        raise ConfigError(f"tensor {name!r} appears in both {self._where[name]} and {f}")
                    self._where[name] = f

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._where[name], framework="pt") as h:
            return h.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    @property
    def files(self) -> list[Path]:
        return sorted(set(self._where.values()))

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    @property
    def is_dir(self) -> bool:
        return self.path.is_dir()


def write_safetensors(
    path: str | Path,
    meta: Mapping[str, tuple[str, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Stream tensors into a safetensors file, in the order ``tensors`` yields them.

    ``meta`` (name -> (safetensors dtype, shape)) fixes the header up front, so nothing has to be
    held in memory. The file is written beside ``path`` and renamed into place only after the
    iterator is exhausted without error: a failed rebuild leaves ``path`` as it was.
    """
    path = Path(path)
    header: dict[str, object] = {}
    offset = 0
    order = list(meta)
    for name in order:
        dt, shape = meta[name]
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty(0, dtype=dtype_from_name(dt)).element_size()
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for i, (name, t) in enumerate(tensors):
            if i >= len(order) or name != order[i]:
                raise ValueError(f"tensor {name!r} arrives out of the declared order")
            if (dtype_name(t.dtype), tuple(t.shape)) != (meta[name][0], tuple(meta[name][1])):
                raise ValueError(f"tensor {name!r} does not match its declared dtype/shape")
            f.write(memoryview(bits(t)).cast("B"))
        if f.tell() != 8 + len(hb) + offset:
            raise ValueError("fewer tensors written than declared")


def save_state(path: str | Path, state: Mapping[str, torch.Tensor]) -> None:
    """Write a whole in-memory state dict atomically (sorted by name)."""
    names = sorted(state)
    write_safetensors(path, {n: (dtype_name(state[n].dtype), tuple(state[n].shape)) for n in names},
                      ((n, state[n]) for n in names))


def copy_model_files(src_dir: Path, dst_dir: Path) -> None:
    """Copy a HF directory's non-weight files (config, tokenizer) next to rebuilt weights."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX_NAME:
            shutil.copy2(f, dst_dir / f.name)
