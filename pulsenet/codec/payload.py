"""PULSELoCo payload format v2: one trainer's FP32 pseudo-gradient for one round, sparse or dense.

Wire format (full spec: docs/format.md, "PULSELoCo payload v2"); all integers little-endian::

    offset  size  field
    0       8     magic  b"PULSELOC"
    8       2     version (u16) = 2
    10      1     mode (u8): 0 = sparse (gated PULSELoCo), 1 = dense (DiLoCo)
    11      1     reserved (u8) = 0
    12      4     n_tensors (u32)
    16      8     round (u64)
    24      ...   n_tensors sections, names in ascending UTF-8 byte order, each:
                    u16 name_len | name (UTF-8) | u8 ndim | u64 shape[ndim]
                    u64 count      entries carried (dense: = numel)
                    u8  pos_width  raw: byte width of the position gaps, 1, 2, 4 or 8; else 0
                    u64 pos_size   bytes of the positions frame (0 when count = 0 or dense)
                    u8  coding     0 = raw, 1 = relative to the base weights θ
                    u8  code_width 4 (raw); 1, 2 or 4 (relative)
                    u64 n_escapes  relative: entries carried as raw bits instead; raw: 0
                    u8  esc_width  byte width of the escape ordinal gaps: 1, 2, 4 or 8 (0 if none)
                    u64 val_size   bytes of the values frame
                    u64 esc_size   bytes of the escapes frame (0 if none)
                    positions frame: raw: zstd(byte planes of gap_i = pos_i - pos_{i-1} - 1);
                                     relative: per context (relative.context, from θ) the ranks of
                                     the sent entries within that context's entries, gap-coded
                    values frame:    zstd(byte planes of the raw FP32 bits (u32), or of the codes
                                     (relative.py), escapes skipped, ordered by θ's exponent)
                    escapes frame:   zstd(byte planes of the escapes' ordinal gaps, then of their
                                     raw FP32 bits)

Relative coding uses what every receiver already holds, the round's base weights θ: which entries
the gate sends depends mostly on how far θ sits from the edge of its BF16 cell (the position
context), and each sent value is an exact number of θ's ULPs past that edge (``relative.py``). On
SmolLM2 pseudo-gradients it makes payloads ~20% smaller than raw coding (docs/loco.md, section 9).
Every value, including -0.0, subnormals and non-finite ones, round-trips bit for bit (whatever
does not fit the code is an escape). The decoder checks the magic, version, tensor names and shapes
against what the caller expects, bounds every size before it allocates, rejects positions outside
the tensor and impossible codes, and never lets a zstd frame expand past its declared size or
carry bytes after it; any failure raises ``PayloadError``. Full spec: docs/format.md.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from pulsenet.codec import relative
from pulsenet.codec import relative_kernels as kernels
from pulsenet.codec.coding import (
    UINT,
    compress,
    decode_positions,
    decompress,
    encode_positions,
    from_planes,
    narrowest_width,
    to_planes,
)
from pulsenet.errors import PatchError, PayloadError

MAGIC = b"PULSELOC"
VERSION = 2
SPARSE, DENSE = 0, 1
MODES = {SPARSE: "sparse", DENSE: "dense"}
RAW, RELATIVE = 0, 1
"""Value codings of a section."""
_HEADER = struct.Struct("<8sHBBIQ")  # 24 bytes
_SECTION_TAIL = struct.Struct("<QBQBBQBQQ")
"""count, pos_width, pos_size, coding, code_width, n_escapes, esc_width, val_size, esc_size."""
MAX_TENSORS = 1 << 20
MAX_NDIM = 8
MAX_NUMEL = 1 << 40
ArrayLike = Any
"""A float32 array or CPU tensor (anything ``np.asarray`` views without copying)."""


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
class _Section:
    """One section's encoded positions and values (the fields after count)."""

    coding: int = RAW
    pos_width: int = 0
    positions: bytes = b""
    code_width: int = 4
    n_escapes: int = 0
    esc_width: int = 0
    values: bytes = b""
    escapes: bytes = b""

    @property
    def size(self) -> int:
        return len(self.positions) + len(self.values) + len(self.escapes)


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


def encode(payload: Payload, base: Mapping[str, ArrayLike] | None = None, *, threads: int = 2) -> bytes:
    """Serialize ``payload`` (see the module docstring for the layout).

    With ``base`` (name -> the FP32 weights θ the payload was gated against, which every receiver
    holds) the values are coded relative to θ; without it they travel as raw FP32 bits. Sections
    are coded on ``threads`` threads (the kernels and zstd release the GIL); the bytes do not
    depend on it.
    """
    if payload.mode not in MODES:
        raise PayloadError(f"unknown payload mode {payload.mode}")
    names = sorted(payload.tensors, key=lambda n: n.encode("utf-8"))

    def section(name: str) -> bytes:
        t = payload.tensors[name]
        nb = name.encode("utf-8")
        values = np.ascontiguousarray(t.values, dtype=np.float32).reshape(-1)
        count = int(values.size)
        if payload.mode == DENSE and (count != t.numel or t.indices is not None):
            raise PayloadError(f"{name}: a dense section carries all {t.numel} entries and no indices")
        if payload.mode == SPARSE and (t.indices is None or t.indices.size != count):
            raise PayloadError(f"{name}: a sparse section needs one index per value ({count})")
        flat = None if base is None else _base_flat(base, name, t.shape)
        sec = _encode_section(t.indices, values, flat)
        tail = (count, sec.pos_width, len(sec.positions), sec.coding, sec.code_width, sec.n_escapes)
        return b"".join([
            struct.pack("<H", len(nb)),
            nb,
            struct.pack(f"<B{len(t.shape)}Q", len(t.shape), *t.shape),
            _SECTION_TAIL.pack(*tail, sec.esc_width, len(sec.values), len(sec.escapes)),
            sec.positions,
            sec.values,
            sec.escapes,
        ])  # fmt: skip

    with ThreadPoolExecutor(max(1, threads)) as pool:  # map raises the first failing section's error
        sections = list(pool.map(section, names))
    return b"".join([_HEADER.pack(MAGIC, VERSION, payload.mode, 0, len(names), payload.round), *sections])


def max_size(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The largest payload :func:`encode` writes for a model of these shapes, in bytes: a bound on
    every valid payload, known before a byte of one is read (a signed size is the sender's word).

    Per tensor of n entries, all sent, positions and ordinals ``w = narrowest_width(n - 1)`` bytes
    each, values 4 bytes: a raw section carries ``n (w + 4)`` bytes before zstd; a relative one at
    most that too, or, when :func:`encode` takes it unweighed (escapes at most one in 8), its
    positions, codes of at most 4 bytes and escapes of ``w + 4`` bytes each, plus the position
    groups' table. zstd adds at most ``x >> 7`` plus a frame header to a frame of x bytes (its
    ``compressBound`` is ``x + x >> 8 + 64``). Dense sections are covered by the same terms.
    """
    total = _HEADER.size
    for name, shape in shapes.items():
        numel = int(np.prod(shape, dtype=np.int64))
        w = narrowest_width(max(numel - 1, 0))
        content = numel * (w + 4) + (numel // 8 + 1) * (w + 4) + 2 + _GROUP.size * relative.N_CONTEXTS
        frames = content + (content >> 7) + 3 * 512
        total += 2 + len(name.encode("utf-8")) + 1 + 8 * len(shape) + _SECTION_TAIL.size + frames
    return total


def _encode_section(indices: np.ndarray | None, values: np.ndarray, base_flat: np.ndarray | None) -> _Section:
    """Relative coding when a base is given, unless escapes make raw coding the smaller section."""
    if not values.size:
        return _Section(pos_width=0 if indices is None else 1)
    raw = _raw_section(indices, values)
    if base_flat is None:
        return raw
    rel = _relative_section(indices, values, base_flat)
    if 8 * rel.n_escapes <= values.size:  # the usual case: no need to weigh both
        return rel
    return rel if rel.size < raw.size else raw


def _raw_section(indices: np.ndarray | None, values: np.ndarray) -> _Section:
    sec = _Section(values=compress(to_planes(values.view(np.uint32))))
    if indices is not None:
        sec.pos_width, gaps = encode_positions(np.asarray(indices, dtype=np.int64))
        sec.positions = compress(gaps)
    return sec


def _relative_section(indices: np.ndarray | None, values: np.ndarray, base_flat: np.ndarray) -> _Section:
    base_bits = base_flat if indices is None else base_flat[indices]
    codes, escaped = relative.encode(base_bits, values)
    sec = _Section(coding=RELATIVE, code_width=narrowest_width(int(codes.max())) if codes.size else 1)
    if indices is not None:
        sec.positions = _encode_grouped_positions(base_flat, np.asarray(indices, np.int64))
    if codes.size:
        order = _by_exponent(base_bits[~escaped])
        sec.values = compress(to_planes(codes[order].astype(UINT[sec.code_width])))
    ordinals = np.flatnonzero(escaped)
    if ordinals.size:
        sec.n_escapes = int(ordinals.size)
        sec.esc_width, gaps = encode_positions(ordinals)
        sec.escapes = compress(gaps + to_planes(values[ordinals].view(np.uint32)))
    return sec


_GROUP = struct.Struct("<HQB")  # context, entries sent in it, gap width


def _encode_grouped_positions(base_flat: np.ndarray, indices: np.ndarray) -> bytes:
    """The positions frame of a relative sparse section: per context, the sent ordinals within its group."""
    ctx, ordinals = kernels.context_ordinals(base_flat, indices, relative.N_CONTEXTS)
    contexts, counts, widths, planes = kernels.grouped_gap_planes(ctx, ordinals, relative.N_CONTEXTS)
    table = [struct.pack("<H", contexts.size)]
    table += [_GROUP.pack(*g) for g in zip(contexts.tolist(), counts.tolist(), widths.tolist(), strict=True)]
    return b"".join(table) + compress(planes.tobytes())


def _decode_grouped_positions(frame: bytes, base_flat: np.ndarray, count: int) -> np.ndarray:
    reader = _Reader(memoryview(frame), 0)
    (n_groups,) = reader.unpack("<H")
    groups = [reader.unpack(_GROUP.format) for _ in range(n_groups)]
    contexts = [c for c, _, _ in groups]
    if contexts != sorted(set(contexts)) or any(c >= relative.N_CONTEXTS for c in contexts):
        raise PayloadError("position groups are not in strictly ascending context order")
    if any(n == 0 or w not in UINT for _, n, w in groups) or sum(n for _, n, _ in groups) != count:
        raise PayloadError(f"position groups do not add up to {count} entries of a valid width")
    raw = decompress(reader.take(len(frame) - reader.offset), sum(n * w for _, n, w in groups))
    table = np.array(groups, dtype=np.int64).reshape(-1, 3)
    positions, err, c = kernels.positions_from_ordinals(
        base_flat, relative.N_CONTEXTS, table[:, 0], table[:, 1], table[:, 2],
        np.frombuffer(raw, dtype=np.uint8),
    )  # fmt: skip
    if err == kernels.MALFORMED:
        raise PayloadError(f"position group of context {c}: a position is out of range for {base_flat.size} entries")
    if err == kernels.OUT_OF_RANGE:
        raise PayloadError(f"position group of context {c}: an ordinal is out of range for the context's entries")
    return positions


def _by_exponent(base_bits: np.ndarray) -> np.ndarray:
    """The order of the coded values in their frame: by θ's exponent, then position (a stable sort).

    A code counts ULPs of θ, so its magnitude follows θ's exponent; grouping like with like lets
    zstd's entropy stage fit each group (SmolLM2 payloads: values frames 6-8% smaller).
    """
    return np.argsort((base_bits >> np.uint32(23)).astype(np.uint8), kind="stable")


def _base_flat(base: Mapping[str, ArrayLike], name: str, shape: tuple[int, ...]) -> np.ndarray:
    """θ's FP32 bit patterns (uint32, flat C order) for tensor ``name``."""
    if name not in base:
        raise PayloadError(f"{name}: values are coded relative to the base weights, which lack this tensor")
    theta = np.asarray(base[name])
    if theta.dtype != np.float32 or tuple(theta.shape) != tuple(shape):
        raise PayloadError(f"{name}: base weights are {theta.dtype} {theta.shape}, expected float32 {shape}")
    return np.ascontiguousarray(theta).reshape(-1).view(np.uint32)


def decode(
    data: bytes,
    expected: Mapping[str, tuple[int, ...]] | None = None,
    base: Mapping[str, ArrayLike] | None = None,
) -> Payload:
    """Parse and bounds-check a payload; with ``expected`` (name -> shape) the names and shapes must match.

    ``base``: the FP32 weights θ of the round (name -> array), needed for sections whose values
    are coded relative to them. Raises ``PayloadError`` for anything malformed. Values are not
    checked for finiteness here: that is ``algorithm.validate``'s job, so a payload can be
    inspected before it is judged.
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
        name, shape = _section_head(reader, expected, previous if tensors else None)
        previous = name.encode("utf-8")
        try:
            tensors[name] = _section_body(reader, name, shape, mode, base)
        except PatchError as e:  # codec helpers speak PatchError; at this layer it is a bad payload
            raise PayloadError(f"{name}: {e}") from e
    if reader.offset != len(view):
        raise PayloadError(f"{len(view) - reader.offset} trailing bytes after the last section")
    return Payload(round=rnd, mode=mode, tensors=tensors)


def _section_head(
    reader: _Reader, expected: Mapping[str, tuple[int, ...]] | None, previous: bytes | None
) -> tuple[str, tuple[int, ...]]:
    nb = reader.take(reader.unpack("<H")[0])
    if previous is not None and nb <= previous:
        raise PayloadError("tensor sections are not in strictly ascending name order")
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
    if any(s > MAX_NUMEL for s in shape) or int(np.prod(shape, dtype=np.float64)) > MAX_NUMEL:
        raise PayloadError(f"{name}: shape {shape} is larger than any tensor this format carries")
    return name, shape


def _section_body(
    reader: _Reader, name: str, shape: tuple[int, ...], mode: int, base: Mapping[str, ArrayLike] | None
) -> SparseTensor:
    numel = int(np.prod(shape, dtype=np.int64))
    count, width, pos_size, coding, code_width, n_esc, esc_width, val_size, esc_size = reader.unpack(
        _SECTION_TAIL.format
    )
    pos_frame, val_frame, esc_frame = reader.take(pos_size), reader.take(val_size), reader.take(esc_size)
    if count > numel:
        raise PayloadError(f"{name}: {count} entries for a tensor of {numel}")
    if mode == DENSE and (count != numel or width != 0 or pos_size != 0):
        raise PayloadError(f"{name}: a dense section must carry all {numel} entries, no positions")
    if count == 0:
        if pos_size or val_size or esc_size or n_esc or coding != RAW or code_width != 4:
            raise PayloadError(f"{name}: an empty section has frames or a value coding")
        return SparseTensor(shape=shape, indices=np.zeros(0, np.int64), values=np.zeros(0, np.float32))
    if coding == RAW:
        if code_width != 4 or n_esc or esc_width or esc_size:
            raise PayloadError(f"{name}: raw values take 4 bytes each and no escapes")
        indices = None
        if mode == SPARSE:
            indices = decode_positions(decompress(pos_frame, count * width), width, count, numel)
        raw = from_planes(decompress(val_frame, 4 * count), 4, count)
        return SparseTensor(shape=shape, indices=indices, values=raw.view(np.float32))
    if coding != RELATIVE:
        raise PayloadError(f"{name}: unknown value coding {coding}")
    if base is None:
        raise PayloadError(f"{name}: values are coded relative to the base weights; none were given")
    flat = _base_flat(base, name, shape)
    indices = None
    if mode == SPARSE:
        if width != 0:
            raise PayloadError(f"{name}: relative positions are grouped by context, pos_width must be 0")
        indices = _decode_grouped_positions(pos_frame, flat, count)
    base_bits = flat if indices is None else flat[indices]
    values = _decode_relative(base_bits, val_frame, esc_frame, count, code_width, n_esc, esc_width)
    return SparseTensor(shape=shape, indices=indices, values=values)


def _decode_relative(
    base_bits: np.ndarray,
    val_frame: bytes,
    esc_frame: bytes,
    count: int,
    code_width: int,
    n_esc: int,
    esc_width: int,
) -> np.ndarray:
    if code_width not in (1, 2, 4) or n_esc > count or (esc_width == 0) != (n_esc == 0):
        raise PayloadError(f"bad relative coding: code width {code_width}, {n_esc} escapes of width {esc_width}")
    if esc_width not in (0, *UINT):
        raise PayloadError(f"escape width {esc_width} is not 1, 2, 4 or 8")
    coded = count - n_esc
    out = np.empty(count, dtype=np.uint32)
    escaped = np.zeros(count, dtype=bool)
    if n_esc:
        raw = decompress(esc_frame, n_esc * (esc_width + 4))
        ordinals = decode_positions(raw[: n_esc * esc_width], esc_width, n_esc, count)
        escaped[ordinals] = True
        out[ordinals] = from_planes(raw[n_esc * esc_width :], 4, n_esc)
    elif esc_frame:
        raise PayloadError("an escapes frame without escapes")
    if coded:
        grouped = from_planes(decompress(val_frame, coded * code_width), code_width, coded)
        bits = base_bits[~escaped]
        codes = np.empty_like(grouped)
        codes[_by_exponent(bits)] = grouped
        out[~escaped] = relative.decode(bits, codes).view(np.uint32)
    elif val_frame:
        raise PayloadError("a values frame without coded values")
    return out.view(np.float32)


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
