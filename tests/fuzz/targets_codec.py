"""Fuzz targets for the codec's decoders: the PULSESync patch and the PULSELoCo payload.

``codec.patch``: parse, check against the base, rebuild, verify (``iter_apply``), against one tiny
fixed base; exact, since every tensor's SHA-256 and the model digest are checked. The base must
come out untouched.

``codec.payload``: ``payload.decode`` with the expected shapes and the base weights θ, as the
PULSELoCo collector calls it. Not exact (nothing is hashed at this layer): the invariant is a
typed error or a payload that holds what the decoder promises (names and shapes as expected,
strictly increasing in-range int64 indices, one float32 value per index).
"""

from __future__ import annotations

import json
import math
import random
import struct

import numpy as np
import torch
import zstandard

from pulsenet.codec import payload as wire
from pulsenet.codec.bf16 import bits
from pulsenet.codec.patch import HEADER_SIZE, PatchEncoder, iter_apply

_HEADER = struct.Struct("<8sHHIIQ")
HOSTILE = [-1, 0, 1, 2, 3, 7, 8, 9, 255, 256, 2**31, 2**32, 2**48, 2**62, 2**63, 2**64, 10**30, -(2**63), 1.5,
           1e308, float("nan"), True, False, None, "", "x", "BF16", "sparse", "ones", [], [0], [[]], {}, "0" * 64]


def _numel(shape: object) -> int:
    return math.prod(x for x in shape if type(x) is int) if isinstance(shape, list) else 1


def _int(rng: random.Random) -> int:
    return rng.choice([0, 1, 2, 7, 8, 255, 2**16, 2**31 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1, -1])


_MAX_FRAME = 1 << 26
"""The largest frame content a mutator decompresses (the seeds' are far smaller): an earlier
mutation may have left a frame that declares gigabytes, which is the decoder's to refuse."""


def _unzstd(frame: bytes) -> bytes:
    """A frame's content for a mutator to work on; ZstdError if invalid or larger than ``_MAX_FRAME``."""
    if zstandard.frame_content_size(frame) > _MAX_FRAME:
        raise zstandard.ZstdError("frame too large to mutate")
    return zstandard.ZstdDecompressor().decompress(frame, max_output_size=_MAX_FRAME)


def _recompress(raw: bytes, rng: random.Random) -> bytes:
    """A valid zstd frame of ``raw``: with or without its content size, sometimes with bytes after it."""
    frame = zstandard.ZstdCompressor(level=1, write_content_size=rng.random() < 0.8).compress(raw)
    if rng.random() < 0.1:
        frame += rng.choice((b"\0", zstandard.ZstdCompressor().compress(b"")))
    return frame


def _mutate_raw(raw: bytes, rng: random.Random) -> bytes:
    """Decompressed section content, changed so the frame around it stays valid zstd."""
    b = bytearray(raw)
    op = rng.randrange(6)
    if op == 0 and b:
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        w = rng.choice((1, 2, 4, 8))
        i = rng.randrange(len(b))
        b[i : i + w] = (_int(rng) & ((1 << (8 * w)) - 1)).to_bytes(w, "little")[: len(b) - i]
    elif op == 2:
        del b[rng.randrange(len(b) + 1) :]
    elif op == 3:
        b += rng.randbytes(rng.choice((1, 8, 64)))
    elif op == 4:
        b = bytearray(rng.choice((b"\0", b"\xff")) * len(b))
    else:
        b = bytearray(rng.randbytes(len(b)))
    return bytes(b)


# =========================================================================== PULSESync patch


def _base() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return {
        "f": torch.randn(40, generator=g),
        "gone": torch.randn(8, generator=g).to(torch.float16),
        "i": torch.randint(-1000, 1000, (50,), generator=g, dtype=torch.int32),
        "same": torch.randn(16, generator=g).to(torch.bfloat16),
        "w": (torch.randn(64, 96, generator=g) * 0.05).to(torch.bfloat16),
    }


BASE = _base()
_BASE_BITS = {k: bits(v).tobytes() for k, v in BASE.items()}


def _targets() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(13)
    a = BASE
    w32 = a["w"].float()
    # additive steps: small weights change more often than large ones, so the encoder splits the
    # mask into several context zones (bitmap, ones and zeros modes)
    small = (w32 + 2e-5 * torch.randn(w32.shape, generator=g)).to(torch.bfloat16)
    many = (w32 + 3e-4 * torch.randn(w32.shape, generator=g)).to(torch.bfloat16)
    mid = (w32 + 1e-4 * torch.randn(w32.shape, generator=g)).to(torch.bfloat16)
    i_few = a["i"].clone()
    i_few[::17] += 3
    i_most = a["i"] + 1
    i_most[::9] -= 1
    return [
        {**a, "w": small, "i": i_few},
        {**a, "w": many, "f": a["f"] * 1.5},
        {k: v for k, v in a.items() if k != "gone"} | {"f": a["f"].reshape(8, 5), "new": torch.arange(10.0)},
        {**a, "i": i_most, "w": mid},
        dict(a),
        {**a, "w": (w32 * (1 + 0.3 * torch.randn(w32.shape, generator=g))).to(torch.bfloat16)},
    ]


def patch_seeds() -> list[bytes]:
    seeds = [PatchEncoder(threads=1).encode(BASE, b) for b in _targets()]
    seeds.append(PatchEncoder(threads=1, max_zones=1).encode(BASE, _targets()[0]))  # single-zone masks
    return seeds


def decode_patch(data: bytes) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    out = {name: (str(t.dtype), tuple(t.shape), bits(t).tobytes()) for name, t in iter_apply(BASE, data, threads=1)}
    if any(bits(v).tobytes() != _BASE_BITS[k] for k, v in BASE.items()):
        raise AssertionError("decoding a patch changed its base")
    return out


def _split(data: bytes) -> tuple[dict, bytes] | None:
    """(table, body) of a patch whose header and table parse; None otherwise."""
    if len(data) < HEADER_SIZE:
        return None
    _, _, _, tsize, _, _ = _HEADER.unpack_from(data)
    try:
        table = json.loads(_unzstd(data[HEADER_SIZE : HEADER_SIZE + tsize]))
    except (zstandard.ZstdError, ValueError, RecursionError):
        return None
    return (table, data[HEADER_SIZE + tsize :]) if isinstance(table, dict) else None


def _join(table: dict | bytes, body: bytes, rng: random.Random | None = None) -> bytes:
    raw = table if isinstance(table, bytes) else json.dumps(table).encode()
    zt = zstandard.ZstdCompressor(level=1).compress(raw) if rng is None else _recompress(raw, rng)
    return _HEADER.pack(b"PULSEPAT", 1, 0, len(zt), len(raw), len(body)) + zt + body


def _entries(table: dict) -> list[dict]:
    t = table.get("tensors")
    return [e for e in t if isinstance(e, dict)] if isinstance(t, list) else []


def patch_header(data: bytes, rng: random.Random) -> bytes:
    """One header field (version, flags, table sizes, body size) set to a hostile value."""
    if len(data) < HEADER_SIZE:
        return data
    fields = list(_HEADER.unpack_from(data))
    i = rng.randrange(1, 6)
    fields[i] = _int(rng) & ((1 << (8 * _HEADER.size)) - 1)
    fields[i] &= (1 << {1: 16, 2: 16, 3: 32, 4: 32, 5: 64}[i]) - 1
    return _HEADER.pack(*fields) + data[HEADER_SIZE:]


def patch_table_field(data: bytes, rng: random.Random) -> bytes:
    """A top-level or per-tensor table field set to a hostile JSON value, or dropped."""
    split = _split(data)
    if split is None:
        return data
    table, body = split
    entries = _entries(table)
    target = rng.choice(entries) if entries and rng.random() < 0.8 else table
    key = rng.choice([*sorted(target), "extra"])
    if rng.random() < 0.1:
        target.pop(key, None)
    else:
        target[key] = rng.choice(HOSTILE)
    return _join(table, body)


def patch_huge_sizes(data: bytes, rng: random.Random) -> bytes:
    """Declared shapes, raw sizes and change counts far beyond the base (zstd bomb material)."""
    split = _split(data)
    if split is None or not _entries(split[0]):
        return data
    table, body = split
    e = rng.choice(_entries(table))
    what = rng.randrange(4)
    if what == 0:  # a full tensor of a huge shape, its frame without a content size (streamed)
        e["shape"] = rng.choice([[1 << 47, 1 << 47], [1 << 40], [3_500_000], [1 << 20, 1 << 20], [2**48 - 1] * 2])
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * rng.choice((0, 64, 1 << 16)))
        e["op"], e["dtype"] = "full", "F32"
        e["data"] = [len(body), len(frame), 4 * _numel(e["shape"])]
        body += frame
    elif what == 1:
        for s in ("data", "mask", "values"):
            if isinstance(e.get(s), list) and len(e[s]) == 3:
                e[s][rng.randrange(3)] = _int(rng)
    elif what == 2:
        e["nnz"] = _int(rng)
    else:  # an added full tensor of a huge shape sharing an existing section
        sec = next((e[s] for s in ("data", "mask", "values") if isinstance(e.get(s), list)), [0, 0, 0])
        n = rng.choice([1 << 20, 1 << 28, 3_500_000])
        table.setdefault("tensors", []).append({"name": "zz" + str(n), "dtype": "F32", "shape": [n], "sha256": "0" * 64,
                                                "op": "full", "data": [sec[0], sec[1], 4 * n]})
    return _join(table, body)


def patch_zones(data: bytes, rng: random.Random) -> bytes:
    """Hostile zone tables: bounds, modes, counts, widths, sizes and change counts."""
    split = _split(data)
    sparse = [e for e in _entries(split[0]) if isinstance(e.get("zones"), list) and e["zones"]] if split else []
    if not sparse:
        return data
    table, body = split
    e = rng.choice(sparse)
    zones = e["zones"]
    op = rng.randrange(5)
    if op == 0:
        z = rng.choice(zones)
        if isinstance(z, list) and len(z) == 6:
            z[rng.choice((0, 2, 3, 4, 5))] = _int(rng)
    elif op == 1:
        z = rng.choice(zones)
        if isinstance(z, list) and len(z) == 6:
            z[1], z[3] = rng.choice(("bitmap", "ones", "zeros")), rng.choice((0, 1, 2, 4, 8))
    elif op == 2:
        rng.shuffle(zones)
    elif op == 3:
        zones.append(list(rng.choice(zones)))
    else:
        e["zones"] = zones[: rng.randrange(len(zones) + 1)] or [[1, "ones", 1, 8, 8, 1]]
    return _join(table, body)


def patch_rank_gaps(data: bytes, rng: random.Random) -> bytes:
    """One ones/zeros zone whose width-8 rank gaps take hostile values (past the tensor, past int64)."""
    split = _split(data)
    sparse = [e for e in _entries(split[0]) if e.get("op") == "sparse" and isinstance(e.get("zones"), list)
              and e["zones"] and isinstance(e["zones"][-1], list) and type(e.get("nnz")) is int] if split else []
    if not sparse:
        return data
    table, body = split
    e = rng.choice(sparse)
    n = _numel(e.get("shape"))
    mode, count = rng.choice(("ones", "zeros")), max(1, min(e["nnz"], 8))
    hostile = [0, 1, n - 1, n, n + 1, 1 << 62, 1 << 63, (1 << 64) - 1, (1 << 64) - n]
    gaps = [rng.choice(hostile) & ((1 << 64) - 1) for _ in range(count)]
    raw = b"".join(bytes(((g >> (8 * k)) & 0xFF) for g in gaps) for k in range(8))  # byte planes
    frame = zstandard.ZstdCompressor().compress(raw)
    e["zones"] = [[e["zones"][-1][0], mode, count, 8, len(raw), e["nnz"]]]
    e["mask"] = [len(body), len(frame), len(raw)]
    return _join(table, body + frame)


def patch_deep_json(data: bytes, rng: random.Random) -> bytes:
    """A table value nested thousands deep, or a 5000-digit integer."""
    split = _split(data)
    if split is None:
        return data
    table, body = split
    raw = json.dumps(table)
    depth = rng.choice((100, 2000, 50_000))
    hostile = rng.choice(("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth, "9" * 5000, "1e999999"))
    key = rng.choice(('"removed": []', '"nnz": ', '"shape": [', '"tensors": ['))
    if key == '"removed": []':
        raw = raw.replace(key, f'"removed": [{hostile}]')
    elif key in raw:
        raw = raw.replace(key, key + hostile + ("," if key.endswith("[") else ", \"_\": "), 1)
    return _join(raw.encode(), body)


def patch_section(data: bytes, rng: random.Random) -> bytes:
    """Change a section's content and recompress it as valid zstd; offsets re-laid, raw size
    updated (or not)."""
    split = _split(data)
    if split is None:
        return data
    table, body = split
    refs = [(e, s) for e in _entries(table) for s in ("data", "mask", "values")
            if isinstance(e.get(s), list) and len(e[s]) == 3 and all(type(x) is int and x >= 0 for x in e[s])]
    if not refs:
        return data
    e, s = rng.choice(refs)
    off, size, raw_size = e[s]
    try:
        raw = _unzstd(body[off : off + size])
    except zstandard.ZstdError:
        return data
    new_raw = _mutate_raw(raw, rng)
    frame = _recompress(new_raw, rng)
    body = body + frame
    e[s] = [len(body) - len(frame), len(frame), len(new_raw) if rng.random() < 0.7 else raw_size]
    return _join(table, body)


def patch_swap(data: bytes, rng: random.Random) -> bytes:
    """Point a tensor at another tensor's section, or change its op."""
    split = _split(data)
    if split is None or not _entries(split[0]):
        return data
    table, body = split
    entries = _entries(table)
    e = rng.choice(entries)
    if rng.random() < 0.5:
        e["op"] = rng.choice(("keep", "full", "sparse"))
    else:
        other = rng.choice(entries)
        for s in ("data", "mask", "values"):
            if s in other:
                e[rng.choice(("data", "mask", "values"))] = other[s]
    return _join(table, body)


# =========================================================================== PULSELoCo payload


def _loco_base() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(21)
    return {
        "b": (rng.standard_normal(17) * 0.1).astype(np.float32),
        "e": np.ones((4, 4), np.float32),
        "s": np.array(0.5, np.float32),
        "w": (rng.standard_normal((32, 20)) * 0.05).astype(np.float32),
    }


THETA = _loco_base()
SHAPES = {k: v.shape for k, v in THETA.items()}
_THETA_BYTES = {k: v.tobytes() for k, v in THETA.items()}


def _loco_payloads() -> list[tuple[wire.Payload, bool]]:
    from pulsenet.loco.algorithm import gate

    rng = np.random.default_rng(22)
    sparse, dense = {}, {}
    for name, theta in THETA.items():
        local = theta + (rng.standard_normal(theta.shape) * np.abs(theta) * 4e-3).astype(np.float32)
        s = np.asarray(theta - local, np.float32)  # exact multiples of ulp(θ), like real pseudo-gradients
        idx, vals, _ = gate(torch.from_numpy(theta.copy()), torch.from_numpy(s))
        if name == "e":
            idx, vals = np.zeros(0, np.int64), np.zeros(0, np.float32)
        if name == "b":  # escapes amid coded values
            idx, vals = np.arange(5), np.array([0.0, -0.0, np.nan, 1e30, 1e-42], np.float32)
        sparse[name] = wire.SparseTensor(theta.shape, np.asarray(idx, np.int64), np.asarray(vals, np.float32))
        dense[name] = wire.SparseTensor(theta.shape, None, s.reshape(-1).astype(np.float32))
    return [
        (wire.Payload(3, wire.SPARSE, sparse), True),
        (wire.Payload(3, wire.SPARSE, sparse), False),
        (wire.Payload(4, wire.DENSE, dense), True),
        (wire.Payload(4, wire.DENSE, dense), False),
    ]


def payload_seeds() -> list[bytes]:
    return [wire.encode(p, THETA if relative else None, threads=1) for p, relative in _loco_payloads()]


def decode_payload(data: bytes) -> wire.Payload:
    p = wire.decode(data, SHAPES, THETA)
    if list(p.tensors) != sorted(SHAPES) or p.mode not in wire.MODES:
        raise AssertionError(f"decoded names {list(p.tensors)} or mode {p.mode} not as expected")
    for name, t in p.tensors.items():
        n = int(np.prod(SHAPES[name], dtype=np.int64))
        ok = t.shape == SHAPES[name] and t.values.dtype == np.float32 and t.values.ndim == 1
        if t.indices is None:
            ok = ok and p.mode == wire.DENSE and t.values.size == n
        else:
            idx = t.indices
            ok = ok and p.mode == wire.SPARSE and idx.dtype == np.int64 and idx.size == t.values.size
            ok = ok and (idx.size == 0 or (int(idx[0]) >= 0 and int(idx[-1]) < n and bool((np.diff(idx) > 0).all())))
        if not ok:
            raise AssertionError(f"{name}: decoded section breaks the decoder's own promises")
    if any(v.tobytes() != _THETA_BYTES[k] for k, v in THETA.items()):
        raise AssertionError("decoding a payload changed the base weights")
    return p


_PHEAD = struct.Struct("<8sHBBIQ")
_TAIL = struct.Struct("<QBQBBQBQQ")
_TAIL_BITS = [64, 8, 64, 8, 8, 64, 8, 64, 64]


def _sections(data: bytes) -> tuple[list, list[dict]] | None:
    """Header fields and sections (name, shape, tail fields, frames) of a well-formed payload."""
    try:
        head = list(_PHEAD.unpack_from(data))
        off, out = _PHEAD.size, []
        for _ in range(head[4]):
            (nlen,) = struct.unpack_from("<H", data, off)
            name = data[off + 2 : off + 2 + nlen]
            off += 2 + nlen
            ndim = data[off]
            shape = list(struct.unpack_from(f"<{ndim}Q", data, off + 1))
            off += 1 + 8 * ndim
            tail = list(_TAIL.unpack_from(data, off))
            off += _TAIL.size
            frames = []
            for size in (tail[2], tail[7], tail[8]):
                frames.append(data[off : off + size])
                off += size
            out.append({"name": name, "shape": shape, "tail": tail, "frames": frames})
    except (struct.error, IndexError, OverflowError):
        return None
    return head, out


def _pack(head: list, sections: list[dict], *, sizes_as_given: bool = False) -> bytes:
    parts = [_PHEAD.pack(*head)]
    for s in sections:
        tail = list(s["tail"])
        if not sizes_as_given:
            tail[2], tail[7], tail[8] = (len(f) for f in s["frames"])
        parts += [struct.pack("<H", len(s["name"])), s["name"],
                  struct.pack(f"<B{len(s['shape'])}Q", len(s["shape"]), *s["shape"]),
                  _TAIL.pack(*tail), *s["frames"]]  # fmt: skip
    return b"".join(parts)


def payload_header(data: bytes, rng: random.Random) -> bytes:
    """Mode, reserved byte, tensor count or round set to a hostile value."""
    if len(data) < _PHEAD.size:
        return data
    head = list(_PHEAD.unpack_from(data))
    i = rng.randrange(1, 6)
    head[i] = _int(rng) & ((1 << {1: 16, 2: 8, 3: 8, 4: 32, 5: 64}[i]) - 1)
    return _PHEAD.pack(*head) + data[_PHEAD.size :]


def payload_tail(data: bytes, rng: random.Random) -> bytes:
    """A section's count, widths, coding, escape count (frames kept consistent, or not)."""
    parsed = _sections(data)
    if parsed is None or not parsed[1]:
        return data
    head, sections = parsed
    s = rng.choice(sections)
    i = rng.choice((0, 1, 3, 4, 5, 6))
    s["tail"][i] = _int(rng) & ((1 << _TAIL_BITS[i]) - 1)
    if rng.random() < 0.3:  # raw sizes that disagree with the frames
        j = rng.choice((2, 7, 8))
        for t in sections:
            t["tail"][2], t["tail"][7], t["tail"][8] = (len(f) for f in t["frames"])
        s["tail"][j] = _int(rng) & ((1 << 64) - 1)
        return _pack(head, sections, sizes_as_given=True)
    return _pack(head, sections)


def payload_shape(data: bytes, rng: random.Random) -> bytes:
    """Huge or wrong shapes and dimensions, renamed or reordered tensors."""
    parsed = _sections(data)
    if parsed is None or not parsed[1]:
        return data
    head, sections = parsed
    s = rng.choice(sections)
    op = rng.randrange(4)
    if op == 0:
        s["shape"] = rng.choice([[1 << 40], [1 << 20, 1 << 20], [2**64 - 1], [0], [], [1] * 9, [*s["shape"], 1]])
    elif op == 1:
        s["name"] = rng.choice([b"", b"\xff", s["name"] + b"x", b"w\0", b"a"])
    elif op == 2:
        rng.shuffle(sections)
    else:
        sections.append(dict(rng.choice(sections)))
        head[4] = len(sections)
    return _pack(head, sections)


def payload_frame(data: bytes, rng: random.Random) -> bytes:
    """A positions, values or escapes frame changed and recompressed as valid zstd (the group
    table in front of a relative positions frame changed as it stands)."""
    parsed = _sections(data)
    if parsed is None or not parsed[1]:
        return data
    head, sections = parsed
    s = rng.choice(sections)
    k = rng.randrange(3)
    frame = s["frames"][k]
    prefix = b""
    if k == 0 and s["tail"][3] == wire.RELATIVE and len(frame) >= 2:
        n_groups = struct.unpack_from("<H", frame)[0]
        cut = min(len(frame), 2 + 11 * n_groups)
        prefix, frame = frame[:cut], frame[cut:]
        if rng.random() < 0.5 and prefix:
            s["frames"][k] = _mutate_raw(prefix, rng) + frame
            return _pack(head, sections)
    try:
        raw = _unzstd(frame) if frame else b""
    except zstandard.ZstdError:
        return data
    s["frames"][k] = prefix + _recompress(_mutate_raw(raw, rng), rng)
    return _pack(head, sections)


TARGETS = [
    {
        "name": "codec.patch",
        "seeds": patch_seeds,
        "decode": decode_patch,
        "exact": True,
        "mutators": [patch_header, patch_table_field, patch_huge_sizes, patch_zones, patch_rank_gaps, patch_deep_json,
                     patch_section, patch_section, patch_swap],
    },
    {
        "name": "codec.payload",
        "seeds": payload_seeds,
        "decode": decode_payload,
        "exact": False,
        "mutators": [payload_header, payload_tail, payload_tail, payload_shape, payload_frame, payload_frame],
    },
]
