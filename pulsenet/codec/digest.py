"""Tensor and model digests: SHA-256 of raw values, never of a file header.

Model digest (spec in docs/format.md, "Model digest")::

    sha256( b"pulsenet-model-digest-v1\\n"
            || for each tensor, sorted by name (UTF-8 bytes):
                 u32 len(name) || name || u8 len(dtype) || dtype || u8 ndim || u64 shape[i]...
                 || sha256(raw little-endian C-order value bytes) )

Two levels so the per-tensor hashes run in parallel threads (hashlib releases the GIL) and a
patch can carry and check each tensor's hash on its own while the whole model stays one digest.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pulsenet.codec.bf16 import bits
from pulsenet.codec.dtypes import dtype_name
from pulsenet.codec.threads import codec_threads

DIGEST_DOMAIN = b"pulsenet-model-digest-v1\n"


def sha256_array(u: np.ndarray) -> bytes:
    """SHA-256 of an array's raw bytes (C order, native little-endian)."""
    h = hashlib.sha256()
    mv = memoryview(np.ascontiguousarray(u)).cast("B")
    step = 1 << 26  # hash in 64 MiB slices so a huge tensor never needs a second copy
    for off in range(0, len(mv), step):
        h.update(mv[off : off + step])
    return h.digest()


def tensor_sha256(t: torch.Tensor) -> bytes:
    return sha256_array(bits(t))


def tensor_record(name: str, dtype: str, shape: Iterable[int], value_sha256: bytes) -> bytes:
    """One tensor's contribution to the model digest."""
    nb, db = name.encode("utf-8"), dtype.encode("ascii")
    shape = tuple(int(s) for s in shape)
    return b"".join(
        (
            struct.pack("<I", len(nb)),
            nb,
            struct.pack("<B", len(db)),
            db,
            struct.pack("<B", len(shape)),
            struct.pack(f"<{len(shape)}Q", *shape),
            value_sha256,
        )
    )


def model_digest_from_records(records: Mapping[str, bytes]) -> str:
    """Combine per-tensor records (name -> :func:`tensor_record`) into the hex model digest."""
    h = hashlib.sha256(DIGEST_DOMAIN)
    for name in sorted(records, key=lambda n: n.encode("utf-8")):
        h.update(records[name])
    return h.hexdigest()


def tensor_hashes(tensors: Mapping[str, torch.Tensor], threads: int = 0) -> dict[str, bytes]:
    """SHA-256 of every tensor's values, hashed in parallel threads (0: ``codec_threads``)."""
    names = list(tensors)
    with ThreadPoolExecutor(max_workers=codec_threads(threads)) as pool:
        digests = list(pool.map(lambda n: tensor_sha256(tensors[n]), names))
    return dict(zip(names, digests, strict=True))


def model_digest(tensors: Mapping[str, torch.Tensor], threads: int = 0) -> str:
    """Hex model digest of a state dict (see module docstring)."""
    hashes = tensor_hashes(tensors, threads)
    return model_digest_from_records(
        {n: tensor_record(n, dtype_name(t.dtype), t.shape, hashes[n]) for n, t in tensors.items()}
    )
