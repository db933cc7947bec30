"""Exact integer transforms and safe compression, shared by every pulsenet format.

- ``ordered``: map sign-magnitude float bits to integers that sort like the values, so the
  difference of two patterns counts rounding steps in value space (a sign flip near zero is a small
  step, not 0x8000). The map is a bijection on bit patterns: NaN payloads and -0.0 survive.
- ``zigzag``: small signed deltas -> small unsigned codes.
- byte planes: the k-th byte of every word together, so zstd's entropy stage sees each byte
  position's own statistics (high planes of small numbers are runs of zeros).
- positions: strictly increasing indices as gaps, downcast to the narrowest width, byte planes.
- ``decompress``: zstd with the output size fixed in advance; a frame that would expand past it is
  rejected before anything is allocated (no zstd bomb gets through), and so are bytes after it.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from pulsenet.errors import PatchCorruptError, PatchSizeLimitError

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}

ZSTD_LEVEL = 3


def ordered(u: np.ndarray) -> np.ndarray:
    """Sign-magnitude float bits -> order-preserving unsigned integers (same width)."""
    w = u.dtype.itemsize
    sign = u.dtype.type(1 << (8 * w - 1))
    neg = (u & sign) != 0
    return np.where(neg, ~u, u | sign)


def unordered(o: np.ndarray) -> np.ndarray:
    """Inverse of :func:`ordered`."""
    w = o.dtype.itemsize
    sign = o.dtype.type(1 << (8 * w - 1))
    pos = (o & sign) != 0
    return np.where(pos, o & ~sign, ~o)


def zigzag(d: np.ndarray) -> np.ndarray:
    """Wrapping unsigned difference -> zigzag code (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...)."""
    w = d.dtype.itemsize
    s = d.view(SINT[w])
    return ((s << 1) ^ (s >> (8 * w - 1))).view(UINT[w])


def unzigzag(z: np.ndarray) -> np.ndarray:
    w = z.dtype.itemsize
    one = z.dtype.type(1)
    return ((z >> one) ^ (-(z & one).view(SINT[w])).view(UINT[w])).view(UINT[w])


def to_planes(u: np.ndarray) -> bytes:
    """Byte planes of a flat unsigned array: all low bytes, then the next byte, ..."""
    w = u.dtype.itemsize
    if w == 1:
        return u.tobytes()
    return np.ascontiguousarray(u.view(np.uint8).reshape(-1, w).T).tobytes()


def from_planes(buf: bytes, width: int, count: int) -> np.ndarray:
    if len(buf) != width * count:
        raise PatchCorruptError(f"byte planes hold {len(buf)} bytes, expected {width} x {count}")
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(width, count)
    out = np.empty(count, dtype=UINT[width])
    lanes = out.view(np.uint8).reshape(count, width)
    for k in range(width):  # a strided store per plane: 5-9x a transposing copy for widths 2 and 4
        lanes[:, k] = planes[k]
    return out


def narrowest_width(max_value: int) -> int:
    for w in (1, 2, 4, 8):
        if max_value < (1 << (8 * w)):
            return w
    raise ValueError(f"{max_value} does not fit in 64 bits")


def encode_positions(pos: np.ndarray) -> tuple[int, bytes]:
    """Strictly increasing int64 positions -> (gap width, byte planes of gaps)."""
    if pos.size == 0:
        return 1, b""
    gaps = np.diff(pos, prepend=-1) - 1
    w = narrowest_width(int(gaps.max()))
    return w, to_planes(gaps.astype(UINT[w]))


def decode_positions(buf: bytes, width: int, count: int, limit: int) -> np.ndarray:
    """Inverse of :func:`encode_positions`; checks every position is < ``limit``.

    Gaps are unsigned and each adds at least one, so the result is strictly increasing by
    construction; only the upper bound needs checking, on the unsigned gaps and their (float) sum
    before the int64 cumsum, which then cannot wrap.
    """
    if width not in UINT:
        raise PatchCorruptError(f"position width {width} is not 1, 2, 4 or 8")
    if count > limit:
        raise PatchCorruptError(f"{count} positions for a tensor of {limit} elements")
    if count == 0:
        if buf:
            raise PatchCorruptError("positions section has bytes but declares no positions")
        return np.zeros(0, dtype=np.int64)
    gaps = from_planes(buf, width, count)
    if int(gaps.max()) >= limit or gaps.sum(dtype=np.float64) >= limit:  # before int64 can wrap
        raise PatchCorruptError(f"position gaps run out of range for a tensor of {limit} elements")
    pos = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if int(pos[-1]) >= limit:
        raise PatchCorruptError(f"position {int(pos[-1])} out of range for a tensor of {limit} elements")
    return pos


_local = threading.local()  # zstd contexts are not thread-safe: one per thread (and level)


def compress(data: bytes, level: int = ZSTD_LEVEL) -> bytes:
    """One zstd frame with the content size in its header (the decoder checks it)."""
    cache = _local.__dict__.setdefault("cctx", {})
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx.compress(data)


_STREAM_CHUNK = 8 << 20  # a frame without a content size is read this much at a time


def decompress(data: bytes, raw_size: int) -> bytes:
    """Decompress one zstd frame to exactly ``raw_size`` bytes, or raise.

    The caller bounds ``raw_size`` (by the base, a format limit or a configured maximum); this
    never allocates more than that. Anything after the frame (padding, a second frame) is refused:
    one payload has one encoding, so a store cannot hide bytes in it that a digest never covers.
    """
    if raw_size == 0 and not data:
        return b""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise PatchCorruptError(f"not a zstd frame: {e}") from None
    if declared not in (-1, raw_size):
        raise PatchSizeLimitError(f"zstd frame declares {declared} bytes, section declares {raw_size}")
    dctx = _local.__dict__.get("dctx")
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    if declared == -1:  # no content size in the header: stream under the cap before trusting it
        _check_stream(dctx, data, raw_size)
    try:  # one allocation of the size we accept; zstd checks the content against it
        out = dctx.decompress(data, max_output_size=raw_size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise PatchCorruptError(f"corrupt zstd section: {e}") from None
    except (MemoryError, OverflowError):  # the frame header names a size no buffer can hold
        raise PatchSizeLimitError(f"cannot allocate the {raw_size} bytes a zstd frame declares") from None
    if len(out) != raw_size:
        raise PatchCorruptError(f"section decompressed to {len(out)} bytes, expected {raw_size}")
    return out


def _check_stream(dctx: zstandard.ZstdDecompressor, data: bytes, raw_size: int) -> None:
    """Raise unless the frame decompresses to exactly ``raw_size`` bytes, holding one chunk at a time."""
    n = 0
    try:
        with dctx.stream_reader(data) as reader:
            while n <= raw_size:
                more = reader.read(min(_STREAM_CHUNK, raw_size + 1 - n))
                if not more:
                    break
                n += len(more)
    except zstandard.ZstdError as e:
        raise PatchCorruptError(f"corrupt zstd section: {e}") from None
    if n > raw_size:
        raise PatchSizeLimitError(f"section decompressed to more than {raw_size} bytes")
    if n < raw_size:
        raise PatchCorruptError(f"section decompressed to {n} bytes, expected {raw_size}")
