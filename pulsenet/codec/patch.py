"""PULSESync patch format v1: the exact change from model state A to state B, tensor by tensor.

Wire format (full spec: docs/format.md)::

    offset  size  field
    0       8     magic  b"PULSEPAT"
    8       2     version (u16 LE) = 1
    10      2     flags (u16 LE) = 0
    12      4     table_size (u32 LE): bytes of the zstd-compressed table
    16      4     table_raw (u32 LE): bytes of the table JSON once decompressed (<= 64 MiB)
    20      8     body_size (u64 LE)
    28      ...   table: one zstd frame holding UTF-8 JSON (tensors sorted by name)
    28+ts   ...   body: the sections the table points to as [offset, size, raw_size]

A tensor is ``keep`` (identical), ``full`` (byte planes of its raw values, zstd), or ``sparse``:
a change mask coded against the base (codec/mask.py) plus, for each changed entry in zone order,
``zigzag(ordered(B) - ordered(A))`` as a wrapping integer of the element width, byte planes, zstd.
Integer arithmetic on bit patterns makes the rebuild exact: -0.0, NaN payloads, subnormals and
sign flips all round-trip. The table carries the SHA-256 of every tensor of B and the model digest
of A and B (codec/digest.py).

The decoder parses and cross-checks the whole table against the base before it produces any
tensor, never writes into the base, and checks each rebuilt tensor's SHA-256 before handing it out.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pulsenet.codec import mask as maskcode
from pulsenet.codec.bf16 import bits, from_bits
from pulsenet.codec.buffers import BufferPool
from pulsenet.codec.coding import (
    compress,
    decompress,
    from_planes,
    to_planes,
)
from pulsenet.codec.digest import model_digest_from_records, sha256_array, tensor_record
from pulsenet.codec.dtypes import dtype_from_name, dtype_name
from pulsenet.codec.threads import codec_threads
from pulsenet.errors import (
    BaseMismatchError,
    DigestMismatchError,
    PatchCorruptError,
    PatchError,
    PatchFormatError,
    PatchSizeLimitError,
)

MAGIC = b"PULSEPAT"
VERSION = 1
_HEADER = struct.Struct("<8sHHIIQ")
HEADER_SIZE = _HEADER.size  # 28
MAX_TABLE_RAW = 64 << 20
MAX_NUMEL = 1 << 48  # elements in one tensor: far above any model, far below what overflows a size
TABLE_BYTES_PER_TENSOR = 4 << 10  # a real table entry is 0.1-1 KB: name, SHA-256, up to 12 zones
MIN_OUTPUT_CAP = 1 << 30
"""Floor of the default cap on a rebuilt model's bytes (``output_cap``): room for an anchor of a
small model against the empty base. Callers that rebuild large anchors pass their own maximum."""
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
PATCH_ZSTD_LEVEL = 1  # mask and value planes are near-random: level 1 is as small as 3 on SmolLM2 pairs, 20-30% faster
FULL_CHECK_RATE = 0.25  # above this change rate, also try the full encoding and keep the smaller

StateDict = Mapping[str, torch.Tensor]


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    op: str  # keep | full | sparse
    nnz: int = 0
    zones: list[maskcode.Zone] = field(default_factory=list)
    sections: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # name -> (off, size, raw)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return dtype_from_name(self.dtype).itemsize

    def to_json(self) -> dict:
        d: dict = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "sha256": self.sha256, "op": self.op}
        if self.op == "sparse":
            d["nnz"] = self.nnz
            d["zones"] = [z.to_json() for z in self.zones]
        d.update({k: list(v) for k, v in self.sections.items()})
        return d


class Sliceable(Protocol):
    """Bytes with a length, sliced ``x[start:stop]`` into something bytes-like (``memoryview``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice, /) -> bytes | memoryview: ...


@dataclass(slots=True)
class Patch:
    """A parsed, structurally validated patch; its body's sections are decompressed on demand.

    ``data``: the patch's bytes, or anything sliced like them whose slices may block until their
    bytes arrive (``sync.arriving.ArrivingBytes``: a download decoded as it lands)."""

    base_digest: str
    target_digest: str
    tensors: list[TensorEntry]
    removed: list[str]
    data: Sliceable
    body_start: int
    size: int

    def section(self, entry: TensorEntry, name: str) -> bytes:
        off, size, raw = entry.sections[name]
        start = self.body_start + off
        try:
            return decompress(bytes(self.data[start : start + size]), raw)
        except PatchError as e:
            raise type(e)(f"tensor {entry.name!r} section {name!r}: {e}") from None


# --------------------------------------------------------------------------- encoder


@dataclass(slots=True)
class _Encoded:
    entry: TensorEntry
    blobs: dict[str, bytes]
    record: bytes
    base_record: bytes | None


class PatchEncoder:
    """Encode the change A -> B. Tensors are read one at a time from the (lazy) mappings, so
    memory stays near ``threads`` x 2 tensors plus the payload, whatever the model size."""

    def __init__(self, *, level: int = PATCH_ZSTD_LEVEL, threads: int = 0, max_zones: int = maskcode.MAX_ZONES) -> None:
        """``threads``: 0 = this node's share of its cores (``codec_threads``). ``max_zones``: context
        zones per tensor (1 = no context model: fastest, largest)."""
        if not 1 <= max_zones <= maskcode.MAX_ZONES:
            raise ValueError(f"max_zones must be in 1..{maskcode.MAX_ZONES}, got {max_zones}")
        self.level = level
        self.threads = codec_threads(threads)
        self.max_zones = max_zones

    def encode(
        self,
        old: StateDict,
        new: StateDict,
        *,
        base_digest: str | None = None,
        progress: Callable[[str, int], None] | None = None,
    ) -> bytes:
        """Patch bytes. ``base_digest``: the caller's known digest of ``old`` (skips hashing it)."""
        names = sorted(new, key=lambda n: n.encode("utf-8"))
        removed = sorted((n for n in old if n not in new), key=lambda n: n.encode("utf-8"))
        hash_base = base_digest is None

        def one(name: str) -> _Encoded:
            enc = self._encode_tensor(name, old.get(name, None), new[name], hash_base)
            if progress is not None:
                progress(name, enc.entry.numel * enc.entry.itemsize)
            return enc

        # largest first (the work goes with the size): the last tensors left are small ones, so no
        # core idles while another finishes a big one; the patch keeps name order
        by_size = sorted(names, key=lambda n: -new[n].numel() * new[n].element_size())
        with ThreadPoolExecutor(self.threads) as pool:
            done = dict(zip(by_size, pool.map(one, by_size), strict=True))
            encoded = [done[n] for n in names]
            base_records = {e.entry.name: e.base_record for e in encoded if e.base_record is not None}
            if hash_base:
                extra = [n for n in old if n not in new or n not in base_records]
                for n, rec in zip(extra, pool.map(lambda n: _record(n, old[n]), extra), strict=True):
                    base_records[n] = rec
        if base_digest is None:
            base_digest = model_digest_from_records(base_records)
        target_digest = model_digest_from_records({e.entry.name: e.record for e in encoded})

        body: list[bytes] = []
        off = 0
        for e in encoded:
            for key, blob in e.blobs.items():
                off0 = off
                body.append(blob)
                off += len(blob)
                e.entry.sections[key] = (off0, len(blob), e.entry.sections[key][2])
        table = {
            "format": "pulsenet-patch",
            "version": VERSION,
            "base_digest": base_digest,
            "target_digest": target_digest,
            "tensors": [e.entry.to_json() for e in encoded],
            "removed": removed,
        }
        raw = json.dumps(table, separators=(",", ":")).encode()
        if len(raw) > MAX_TABLE_RAW:
            raise PatchError(f"patch table is {len(raw)} bytes, over the {MAX_TABLE_RAW}-byte limit")
        ztable = compress(raw, self.level)
        header = _HEADER.pack(MAGIC, VERSION, 0, len(ztable), len(raw), off)
        return b"".join([header, ztable, *body])

    def _encode_tensor(self, name: str, a_t: torch.Tensor | None, b_t: torch.Tensor, hash_base: bool) -> _Encoded:
        dt = dtype_name(b_t.dtype)
        shape = tuple(b_t.shape)
        b = bits(b_t)
        digest = sha256_array(b)
        record = tensor_record(name, dt, shape, digest)
        entry = TensorEntry(name, dt, shape, digest.hex(), "full")
        base_record = None
        if a_t is not None and hash_base:
            base_record = _record(name, a_t)
        if a_t is None or a_t.dtype != b_t.dtype or tuple(a_t.shape) != shape:
            return _Encoded(entry, self._full(entry, b), record, base_record)  # added or replaced
        a = bits(a_t)
        coded = maskcode.encode_sparse(a, b, dt, self.max_zones)
        if coded is None:
            entry.op = "keep"
            return _Encoded(entry, {}, record, base_record)
        entry.zones, mask_raw, codes = coded
        changed = codes.size
        entry.op, entry.nnz = "sparse", int(changed)
        values = to_planes(codes)
        blobs = {"mask": compress(mask_raw, self.level), "values": compress(values, self.level)}
        entry.sections = {"mask": (0, 0, len(mask_raw)), "values": (0, 0, len(values))}
        if changed > FULL_CHECK_RATE * a.size:
            full_entry = TensorEntry(name, dt, shape, entry.sha256, "full")
            full = self._full(full_entry, b)
            if len(full["data"]) < sum(len(v) for v in blobs.values()):
                return _Encoded(full_entry, full, record, base_record)
        return _Encoded(entry, blobs, record, base_record)

    def _full(self, entry: TensorEntry, b: np.ndarray) -> dict[str, bytes]:
        raw = to_planes(b)
        entry.op = "full"
        entry.sections = {"data": (0, 0, len(raw))}
        return {"data": compress(raw, self.level)}


def _record(name: str, t: torch.Tensor) -> bytes:
    return tensor_record(name, dtype_name(t.dtype), tuple(t.shape), sha256_array(bits(t)))


# --------------------------------------------------------------------------- parsing


def parse_patch(data: bytes | memoryview | Sliceable, *, max_table_raw: int = MAX_TABLE_RAW) -> Patch:
    """Parse and structurally validate a patch (no base needed). Raises PatchFormatError/CorruptError.

    ``data`` may be a ``Sliceable`` whose slices block until their bytes arrive: only the header
    and the table are read here."""
    mv = memoryview(data) if isinstance(data, (bytes, bytearray, memoryview)) else data
    if len(mv) < HEADER_SIZE:
        raise PatchFormatError(f"patch is {len(mv)} bytes, shorter than the {HEADER_SIZE}-byte header")
    magic, version, flags, tsize, traw, bsize = _HEADER.unpack(mv[:HEADER_SIZE])
    if magic != MAGIC:
        raise PatchFormatError(f"bad magic {bytes(magic)!r}: not a pulsenet patch")
    if version != VERSION:
        raise PatchFormatError(f"patch format version {version} is not supported (this build reads {VERSION})")
    if flags != 0:
        raise PatchFormatError(f"unknown header flags {flags:#x}")
    if HEADER_SIZE + tsize + bsize != len(mv):
        raise PatchFormatError(
            f"header declares {HEADER_SIZE + tsize + bsize} bytes (table {tsize}, body {bsize}), "
            f"patch has {len(mv)}: truncated or padded"
        )
    if traw > max_table_raw:
        raise PatchSizeLimitError(f"table declares {traw} bytes, over the {max_table_raw}-byte limit")
    try:  # ValueError: bad UTF-8 or JSON, or an integer past Python's 4300-digit limit
        table = json.loads(decompress(bytes(mv[HEADER_SIZE : HEADER_SIZE + tsize]), traw))
    except (ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise PatchCorruptError(f"patch table is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    try:
        return _parse_table(table, mv, HEADER_SIZE + tsize)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError) as e:
        if isinstance(e, PatchError):
            raise
        raise PatchCorruptError(f"malformed patch table: {type(e).__name__}: {str(e)[:200]}") from None


def _parse_table(table: dict, data: Sliceable, body_start: int) -> Patch:
    body_size = len(data) - body_start
    if not isinstance(table, dict) or table.get("format") != "pulsenet-patch" or table.get("version") != VERSION:
        raise PatchCorruptError("table is not a pulsenet-patch v1 table")
    tensors: list[TensorEntry] = []
    prev: bytes | None = None
    for d in table["tensors"]:
        name = d["name"]
        if not isinstance(name, str) or not name:
            raise PatchCorruptError(f"bad tensor name {reprlib.repr(name)}")
        key = name.encode("utf-8")
        if prev is not None and key <= prev:
            raise PatchCorruptError(f"tensor names not strictly sorted at {name!r}")
        prev = key
        dtype_from_name(d["dtype"])
        shape = tuple(d["shape"])
        if len(shape) > 8 or not all(type(s) is int and 0 <= s < MAX_NUMEL for s in shape):
            raise PatchCorruptError(f"tensor {name!r}: bad shape {reprlib.repr(d['shape'])}")
        if math.prod(shape) > MAX_NUMEL:
            raise PatchSizeLimitError(f"tensor {name!r}: shape {list(shape)} is larger than any tensor this format carries")
        sha = d["sha256"]
        if not (isinstance(sha, str) and _SHA256_HEX.fullmatch(sha)):
            raise PatchCorruptError(f"tensor {name!r}: bad sha256 {reprlib.repr(sha)}")
        e = TensorEntry(name, d["dtype"], shape, sha, d["op"])
        want = {"keep": (), "full": ("data",), "sparse": ("mask", "values")}.get(e.op)
        if want is None:
            raise PatchCorruptError(f"tensor {name!r}: unknown op {reprlib.repr(e.op)}")
        for s in want:
            off, sz, raw = d[s]
            if not all(isinstance(x, int) and x >= 0 for x in (off, sz, raw)) or off + sz > body_size:
                raise PatchCorruptError(f"tensor {name!r}: section {s} [{off}, {sz}] outside the {body_size}-byte body")
            e.sections[s] = (off, sz, raw)
        n, w = e.numel, e.itemsize
        if e.op == "full" and e.sections["data"][2] != n * w:
            raise PatchCorruptError(f"tensor {name!r}: full data declares {e.sections['data'][2]} bytes, expected {n * w}")
        if e.op == "sparse":
            e.nnz = d["nnz"]
            if not (isinstance(e.nnz, int) and 0 < e.nnz <= n):
                raise PatchCorruptError(f"tensor {name!r}: nnz {reprlib.repr(e.nnz)} outside 1..{n}")
            e.zones = [maskcode.Zone.from_json(z) for z in d["zones"]]
            if e.sections["values"][2] != e.nnz * w:
                raise PatchCorruptError(f"tensor {name!r}: values declare {e.sections['values'][2]} bytes for nnz {e.nnz}")
            try:
                maskcode.check_zones(e.zones, e.dtype, w, n, e.nnz, e.sections["mask"][2])
            except PatchCorruptError as err:
                raise PatchCorruptError(f"tensor {name!r}: {err}") from None
        tensors.append(e)
    removed = table["removed"]
    if not all(isinstance(r, str) for r in removed) or set(removed) & {t.name for t in tensors}:
        raise PatchCorruptError("removed list is malformed or names a tensor the patch also carries")
    digests = (table["base_digest"], table["target_digest"])
    if not all(isinstance(x, str) and len(x) == 64 for x in digests):
        raise PatchCorruptError("base/target digest missing or malformed")
    return Patch(digests[0], digests[1], tensors, list(removed), data, body_start, len(data))


# --------------------------------------------------------------------------- decoder


def check_base(patch: Patch, base: StateDict) -> int:
    """Names, dtypes and shapes of the base against the table, before anything is rebuilt.

    Returns the bytes of the base tensors the patch names (what ``output_cap`` scales with).
    """
    carried = {e.name for e in patch.tensors}
    named = 0
    for e in patch.tensors:
        if e.op == "full":  # added, replaced or rewritten: the base may lack it or hold another shape
            if e.name in base:
                t = base[e.name]
                named += t.numel() * t.element_size()
            continue
        if e.name not in base:
            raise BaseMismatchError(f"base has no tensor {e.name!r}: this patch was made against another model")
        t = base[e.name]
        if dtype_name(t.dtype) != e.dtype or tuple(t.shape) != e.shape:
            raise BaseMismatchError(
                f"base tensor {e.name!r} is {dtype_name(t.dtype)}{list(t.shape)}, patch expects {e.dtype}{list(e.shape)}"
            )
        named += e.numel * e.itemsize
    missing = [r for r in patch.removed if r not in base]
    if missing:
        raise BaseMismatchError(f"patch removes tensors the base does not have: {missing[:5]}")
    unknown = [n for n in base if n not in carried and n not in patch.removed]
    if unknown:
        raise BaseMismatchError(f"base has tensors the patch does not account for: {sorted(unknown)[:5]}")
    return named


def table_cap(base_tensors: int) -> int:
    """The default cap on a table's raw bytes when the base is known: 4 MiB + 4 KiB per base tensor.

    Parsing JSON costs up to ~25x its size in Python objects (a 6 KB patch holding a 64 MiB table
    of empty lists took 1.5 GB), so a decoder that holds the base bounds the table by it.
    """
    return min(MAX_TABLE_RAW, (4 << 20) + TABLE_BYTES_PER_TENSOR * base_tensors)


def output_cap(base_bytes: int) -> int:
    """The default cap on a rebuilt model's bytes: twice the base, at least ``MIN_OUTPUT_CAP``.

    A step patch rebuilds a model of the base's size (plus the odd added tensor); only an anchor
    against the empty model rebuilds one from nothing, and its caller knows how large a model it
    expects. The table's shapes are an attacker's word until the digests check out, so without a
    cap a few kilobytes of zstd could make the decoder allocate gigabytes first.
    """
    return max(2 * base_bytes, MIN_OUTPUT_CAP)


def check_output_size(patch: Patch, max_output_bytes: int) -> int:
    """Refuse a patch whose rebuilt model would exceed ``max_output_bytes``, before anything is
    decompressed. Returns the rebuilt model's bytes."""
    out = sum(e.numel * e.itemsize for e in patch.tensors)
    if out > max_output_bytes:
        raise PatchSizeLimitError(
            f"patch rebuilds a {out}-byte model, over the {max_output_bytes}-byte limit "
            "(max_output_bytes; the default allows twice the base)"
        )
    return out


def iter_apply(
    base: StateDict,
    patch: Patch | bytes,
    *,
    base_digest: str | None = None,
    threads: int = 0,
    window_bytes: int | None = None,
    max_output_bytes: int | None = None,
    buffers: BufferPool | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rebuild B tensor by tensor, in name order, each SHA-256-verified before it is yielded.

    ``threads``: 0 = this node's share of its cores (``codec_threads``).
    ``base_digest``: the caller's verified digest of ``base``; compared with the patch's instead of
    hashing the base. Pass None to hash the base first (a wrong base is then named as such). The
    table's tensor hashes are checked against the patch's target digest before anything is decoded
    (a forged table fails before its bytes are read), then each tensor against its hash as it is
    rebuilt: a tensor yielded is the target's, but consume the whole iterator before trusting (or
    renaming into place) the model. The base is only read, never written.

    Workers run ahead of the consumer by up to ``window_bytes`` of rebuilt tensors (default: twice
    the largest), so a big tensor at the head of the line does not idle the other threads while
    memory stays bounded whatever the model size.

    ``max_output_bytes``: the most bytes the rebuilt model may hold (default: ``output_cap`` of
    the base); a patch declaring more raises ``PatchSizeLimitError`` before anything is decoded.
    Patch bytes are parsed with the table bounded by ``table_cap`` of the base.
    Rebuilding an anchor of a model over 1 GiB from the empty base needs it set explicitly.

    ``buffers``: where rebuilt tensors' memory comes from (None: fresh memory). A caller that
    rebuilds version after version passes its own pool, which keeps the window's worth of
    returned memory for the next tensors: the freed old tensors' memory is reused instead of
    fresh pages faulted in (``codec/buffers.py``).
    """
    if not isinstance(patch, Patch):
        patch = parse_patch(patch, max_table_raw=table_cap(len(base)))
    named = check_base(patch, base)
    check_output_size(patch, output_cap(named) if max_output_bytes is None else max_output_bytes)
    threads = codec_threads(threads)
    if base_digest is None:
        from pulsenet.codec.digest import model_digest

        base_digest = model_digest(base, threads)
    if base_digest != patch.base_digest:
        raise BaseMismatchError(
            f"base digest {base_digest[:16]}… does not match the patch's base {patch.base_digest[:16]}…: "
            "this patch applies to a different version"
        )
    records = {e.name: tensor_record(e.name, e.dtype, e.shape, bytes.fromhex(e.sha256)) for e in patch.tensors}
    if model_digest_from_records(records) != patch.target_digest:
        raise DigestMismatchError(f"the patch's tensor hashes do not make its target digest {patch.target_digest[:16]}…")
    sizes = [0 if e.op == "keep" else e.numel * e.itemsize for e in patch.tensors]  # keep: shared, no copy
    limit = window_bytes if window_bytes is not None else 2 * max(sizes, default=0)
    if buffers is None:
        buffers = BufferPool()  # keeps nothing: memory returned goes back to the system
    else:
        buffers.keep_at_least(limit + 2 * _Arena.SLAB)
    arena = _Arena(buffers)
    with ThreadPoolExecutor(threads) as pool:
        window: deque[tuple[Future, int]] = deque()
        ahead, nxt = 0, 0
        while True:
            while nxt < len(sizes) and (len(window) <= threads or ahead + sizes[nxt] <= limit):
                e = patch.tensors[nxt]
                window.append((pool.submit(_rebuild, patch, e, base.get(e.name), arena), sizes[nxt]))
                ahead += sizes[nxt]
                nxt += 1
            if not window:
                break
            future, size = window.popleft()
            entry, t = future.result()
            ahead -= size
            yield entry.name, t


def apply_patch(base: StateDict, patch: Patch | bytes, **kw) -> dict[str, torch.Tensor]:
    """Rebuild B in memory (unchanged tensors are shared with ``base``, never copied or mutated)."""
    return dict(iter_apply(base, patch, **kw))


class _Arena:
    """Rebuilt tensors' memory, from ``pool``. Small tensors are carved from 32 MiB slabs: numpy asks
    for transparent huge pages on large arrays, so a slab costs a page fault per 2 MiB where a
    tensor-sized array costs one per 4 KiB: 269 MB of 1.8 MB SmolLM2 tensors take 54 ms instead of
    230 ms to fault in on our 2-core VM, a third of a decode. A slab goes back to the pool with the
    last tensor carved from it; a large tensor's buffer with the tensor."""

    SLAB = 32 << 20

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self._slab = np.empty(0, dtype=np.uint8)
        self._off = 0

    def empty(self, like: np.ndarray) -> np.ndarray:
        nbytes = like.nbytes
        if nbytes > self.SLAB // 4:
            return self._pool.empty(nbytes).view(like.dtype)
        with self._lock:
            if self._off + nbytes > self._slab.size:
                self._slab, self._off = self._pool.empty(self.SLAB), 0
            buf = self._slab[self._off : self._off + nbytes]
            self._off += -(-nbytes // 64) * 64
        return buf.view(like.dtype)


def _rebuild(
    patch: Patch, e: TensorEntry, base_t: torch.Tensor | None, arena: _Arena
) -> tuple[TensorEntry, torch.Tensor]:
    dtype = dtype_from_name(e.dtype)
    w = e.itemsize
    if e.op == "keep":
        assert base_t is not None  # check_base guarantees it
        out_bits, out = bits(base_t), base_t
    elif e.op == "full":
        out_bits = from_planes(patch.section(e, "data"), w, e.numel)
        out = from_bits(out_bits, dtype, e.shape)
    else:
        assert base_t is not None
        code = from_planes(patch.section(e, "values"), w, e.nnz)
        try:
            a = bits(base_t)
            out_bits = maskcode.decode_sparse(a, e.dtype, e.zones, patch.section(e, "mask"), code, arena.empty(a))
        except PatchError as err:
            raise type(err)(f"tensor {e.name!r}: {err}") from None
        out = from_bits(out_bits, dtype, e.shape)
    if sha256_array(out_bits).hex() != e.sha256:
        raise DigestMismatchError(
            f"tensor {e.name!r}: rebuilt SHA-256 does not match the patch (corrupt patch or wrong base)"
        )
    return e, out
