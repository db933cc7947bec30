"""PULSELoCo payload format v1: one trainer's FP32 pseudo-gradient for one round, sparse or dense.

Wire format (full spec: docs/loco.md, "Payload format"); all integers little-endian::

    offset  size  field
    0       8     magic  b"PULSELOC"
    8       2     version (u16) = 1
    10      1     mode (u8): 0 = sparse (gated PULSELoCo), 1 = dense (DiLoCo)
    11      1     reserved (u8) = 0
    12      4     n_tensors (u32)
    16      8     round (u64)
    24      ...   n_tensors sections, names in ascending UTF-8 byte order, each:
                    u16 name_len | name (UTF-8) | u8 ndim | u64 shape[ndim]
                    u64 count      entries carried (dense: = numel)
                    u8  pos_width  byte width of the position gaps: 1, 2, 4 or 8 (dense: 0)
                    u64 pos_size   bytes of the positions frame (0 when count = 0 or dense)
                    u64 val_size   bytes of the values frame (0 when count = 0)
                    positions frame: zstd(byte planes of gap_i = pos_i - pos_{i-1} - 1, pos_{-1} = -1),
                                     decompressing to exactly count * pos_width bytes
                    values frame:    zstd(byte planes of the raw FP32 bit patterns, as u32),
                                     decompressing to exactly count * 4 bytes

Positions are flat C-order indices into the tensor, strictly increasing (the gap coding makes
that true by construction); the codec's ``encode_positions`` picks the narrowest gap width.
Values are carried as raw bits, so every FP32 value (including -0.0 and subnormals) round-trips
exactly. The decoder checks the magic, version, tensor names and shapes against what the caller
expects, bounds every size before it allocates, rejects positions outside the tensor and never
lets a zstd frame expand past its declared size; any failure raises ``PayloadError``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pulsenet.codec.coding import (
    compress,
    decode_positions,
    decompress,
    encode_positions,
    from_planes,
    to_planes,
)
from pulsenet.errors import PatchError, PayloadError

MAGIC = b"PULSELOC"
VERSION = 1
SPARSE, DENSE = 0, 1
MODES = {SPARSE: "sparse", DENSE: "dense"}
_HEADER = struct.Struct("<8sHBBIQ")  # 24 bytes
_SECTION_TAIL = struct.Struct("<QBQQ")  # count, pos_width, pos_size, val_size
MAX_TENSORS = 1 << 20
MAX_NDIM = 8
MAX_NUMEL = 1 << 40


@dataclass(slots=True)
class SparseTensor:
    """The entries one trainer sends for one tensor: flat positions and their FP32 values."""

    shape: tuple[int, ...]
    indices: np.ndarray | None
    """int64, strictly increasing flat C-order positions; None in dense payloads (every entry, in order)."""
    values: np.ndarray
    """float32, one per index (dense: one per entry)."""

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(slots=True)
class Payload:
    """A decoded (or to-be-encoded) payload: what one trainer contributes to one round."""

    round: int
    mode: int
    """``SPARSE`` or ``DENSE``."""
    tensors: dict[str, SparseTensor]

    @property
    def sent(self) -> int:
        return sum(int(t.values.size) for t in self.tensors.values())

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors.values())


def encode(payload: Payload) -> bytes:
    """Serialize ``payload`` (see the module docstring for the layout)."""
    if payload.mode not in MODES:
        raise PayloadError(f"unknown payload mode {payload.mode}")
    names = sorted(payload.tensors, key=lambda n: n.encode("utf-8"))
    out = [_HEADER.pack(MAGIC, VERSION, payload.mode, 0, len(names), payload.round)]
    for name in names:
        t = payload.tensors[name]
        nb = name.encode("utf-8")
        values = np.ascontiguousarray(t.values, dtype=np.float32)
        count = int(values.size)
        if payload.mode == DENSE:
            if count != t.numel or t.indices is not None:
                raise PayloadError(f"{name}: a dense section carries all {t.numel} entries and no indices")
            width, pos = 0, b""
        else:
            if t.indices is None or t.indices.size != count:
                raise PayloadError(f"{name}: a sparse section needs one index per value ({count})")
            width, raw_pos = encode_positions(np.asarray(t.indices, dtype=np.int64))
            pos = compress(raw_pos) if count else b""
        vals = compress(to_planes(values.view(np.uint32))) if count else b""
        out += [
            struct.pack("<H", len(nb)),
            nb,
            struct.pack(f"<B{len(t.shape)}Q", len(t.shape), *t.shape),
            _SECTION_TAIL.pack(count, width, len(pos), len(vals)),
            pos,
            vals,
        ]
    return b"".join(out)


def decode(data: bytes, expected: Mapping[str, tuple[int, ...]] | None = None) -> Payload:
    """Parse and bounds-check a payload; with ``expected`` (name -> shape) the names and shapes must match.

    Raises ``PayloadError`` for anything malformed. Values are not checked for finiteness here:
    that is ``algorithm.validate``'s job, so a payload can be inspected before it is judged.
    """
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise PayloadError(f"payload is {len(view)} bytes, shorter than its {_HEADER.size}-byte header")
    magic, version, mode, reserved, n, rnd = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise PayloadError(f"not a PULSELoCo payload (magic {bytes(magic)!r})")
    if version != VERSION:
        raise PayloadError(f"payload version {version} is not supported (this build reads {VERSION})")
    if mode not in MODES or reserved != 0:
        raise PayloadError(f"bad payload mode {mode} or reserved byte {reserved}")
    if n > MAX_TENSORS or (expected is not None and n != len(expected)):
        want = "" if expected is None else f", expected {len(expected)}"
        raise PayloadError(f"payload declares {n} tensors{want}")
    reader = _Reader(view, _HEADER.size)
    tensors: dict[str, SparseTensor] = {}
    previous = b""
    for _ in range(n):
        nb = reader.take(reader.unpack("<H")[0])
        if nb <= previous and tensors:
            raise PayloadError("tensor sections are not in strictly ascending name order")
        previous = nb
        try:
            name = nb.decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError("tensor name is not UTF-8") from None
        (ndim,) = reader.unpack("<B")
        if ndim > MAX_NDIM:
            raise PayloadError(f"{name}: {ndim} dimensions")
        shape = tuple(int(s) for s in reader.unpack(f"<{ndim}Q"))
        if expected is not None and (name not in expected or tuple(expected[name]) != shape):
            raise PayloadError(f"{name}: shape {shape} does not match the model's {expected.get(name)}")
        numel = int(np.prod(shape, dtype=np.int64))
        if any(s > MAX_NUMEL for s in shape) or numel > MAX_NUMEL:
            raise PayloadError(f"{name}: shape {shape} is larger than any tensor this format carries")
        count, width, pos_size, val_size = reader.unpack(_SECTION_TAIL.format)
        pos_frame, val_frame = reader.take(pos_size), reader.take(val_size)
        if count > numel:
            raise PayloadError(f"{name}: {count} entries for a tensor of {numel}")
        try:
            if mode == DENSE:
                if count != numel or width != 0 or pos_size != 0:
                    raise PayloadError(
                        f"{name}: a dense section must carry all {numel} entries, no positions"
                    )
                indices = None
            elif count == 0:
                if pos_size or val_size:
                    raise PayloadError(f"{name}: an empty section has frames")
                indices = np.zeros(0, dtype=np.int64)
            else:
                indices = decode_positions(decompress(pos_frame, count * width), width, count, numel)
            raw_vals = decompress(val_frame, 4 * count) if count else b""
            values = from_planes(raw_vals, 4, count).view(np.float32) if count else np.zeros(0, np.float32)
        except PatchError as e:  # codec helpers speak PatchError; at this layer it is a bad payload
            raise PayloadError(f"{name}: {e}") from e
        tensors[name] = SparseTensor(shape=shape, indices=indices, values=values)
    if reader.offset != len(view):
        raise PayloadError(f"{len(view) - reader.offset} trailing bytes after the last section")
    return Payload(round=rnd, mode=mode, tensors=tensors)


class _Reader:
    """Bounds-checked sequential reads over the payload bytes."""

    def __init__(self, view: memoryview, offset: int) -> None:
        self.view, self.offset = view, offset

    def take(self, size: int) -> bytes:
        end = self.offset + size
        if end > len(self.view):
            raise PayloadError(f"section runs past the end of the payload ({end} > {len(self.view)})")
        out = bytes(self.view[self.offset : end])
        self.offset = end
        return out

    def unpack(self, fmt: str) -> tuple:
        s = struct.Struct(fmt)
        return s.unpack(self.take(s.size))
