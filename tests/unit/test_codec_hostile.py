"""Hostile patches and payloads (issue 12, items 5, 6 and 10): each defect ends in a typed error.

Every test here failed on the code before the fix (item 5: the bomb decoded to 1.4 GB; item 6:
RecursionError, ValueError, IndexError, OverflowError, MemoryError; item 10: trailing bytes were
accepted).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from pulsenet.checkpoint import save_state
from pulsenet.codec import payload as wire
from pulsenet.codec.bf16 import bits
from pulsenet.codec.coding import compress, decompress, to_planes
from pulsenet.codec.digest import model_digest, model_digest_from_records, sha256_array, tensor_record
from pulsenet.codec.patch import HEADER_SIZE, PatchEncoder, apply_patch, parse_patch
from pulsenet.errors import PatchCorruptError, PatchError, PatchSizeLimitError, PayloadError

EMPTY = model_digest({})


def forge(table: dict | bytes, body: bytes = b"", *, tail: bytes = b"") -> bytes:
    """A patch around a hand-made table (``tail``: bytes appended to the table's zstd frame)."""
    raw = table if isinstance(table, bytes) else json.dumps(table).encode()
    zt = compress(raw) + tail
    return struct.pack("<8sHHIIQ", b"PULSEPAT", 1, 0, len(zt), len(raw), len(body)) + zt + body


def table_of(tensors: list[dict], base_digest: str = EMPTY, target_digest: str | None = None) -> dict:
    """A table whose target digest is, by default, the one its tensor hashes make: iter_apply checks
    that before decoding anything, and a hostile table that got it wrong would never reach the
    decoder paths these tests aim at."""
    if target_digest is None:
        try:
            records = {t["name"]: tensor_record(t["name"], t["dtype"], tuple(t["shape"]), bytes.fromhex(t["sha256"]))
                       for t in tensors}  # fmt: skip
            target_digest = model_digest_from_records(records)
        except (KeyError, TypeError, ValueError):  # too malformed to hash: the parser refuses it first
            target_digest = "0" * 64
    return {"format": "pulsenet-patch", "version": 1, "base_digest": base_digest, "target_digest": target_digest,
            "tensors": tensors, "removed": []}


def full_bomb(n_tensors: int, numel: int, base_digest: str, keep: dict[str, torch.Tensor]) -> bytes:
    """A *valid* patch whose ``n_tensors`` added F32 tensors of zeros all share one tiny section."""
    zeros = np.zeros(numel, np.uint32)
    section = compress(to_planes(zeros), 1)
    sha = sha256_array(zeros)
    names = [f"bomb{i:04d}" for i in range(n_tensors)]
    records = {n: tensor_record(n, "F32", (numel,), sha) for n in names}
    entries = [{"name": n, "dtype": "F32", "shape": [numel], "sha256": sha.hex(), "op": "full",
                "data": [0, len(section), 4 * numel]} for n in names]
    for n, t in keep.items():
        digest = sha256_array(bits(t))
        records[n] = tensor_record(n, "F32", tuple(t.shape), digest)
        entries.append({"name": n, "dtype": "F32", "shape": list(t.shape), "sha256": digest.hex(), "op": "keep"})
    entries.sort(key=lambda e: e["name"].encode())
    return forge(table_of(entries, base_digest, model_digest_from_records(records)), section)


# --------------------------------------------------------------------------- item 5: the zstd bomb


def test_full_tensor_bomb_is_refused_before_decoding():
    """100 added tensors of 14 MB (1.4 GB) from one ~1 KB section: valid, digests and all."""
    bomb = full_bomb(100, 3_500_000, EMPTY, {})
    assert len(bomb) < 16 << 10
    with pytest.raises(PatchSizeLimitError, match="max_output_bytes"):
        apply_patch({}, bomb)
    # the same model within an explicit maximum is a legitimate anchor (kept small here)
    small = full_bomb(2, 1000, EMPTY, {})
    assert len(apply_patch({}, small)) == 2
    with pytest.raises(PatchSizeLimitError):
        apply_patch({}, small, max_output_bytes=7999)
    assert len(apply_patch({}, small, max_output_bytes=8000)) == 2


def test_default_cap_follows_the_base():
    """A normal step patch decodes under the default; the cap is twice the base, at least 1 GiB."""
    from pulsenet.codec.patch import MIN_OUTPUT_CAP, output_cap

    a = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    b = {"w": a["w"] * 1.01, "b": a["b"]}
    out = apply_patch(a, PatchEncoder().encode(a, b))
    assert torch.equal(out["w"], b["w"])
    assert output_cap(0) == MIN_OUTPUT_CAP and output_cap(MIN_OUTPUT_CAP) == 2 * MIN_OUTPUT_CAP
    with pytest.raises(PatchSizeLimitError):
        apply_patch(a, PatchEncoder().encode(a, b), max_output_bytes=64 * 64 * 4)


def test_cli_apply_refuses_the_bomb_with_small_rss(tmp_path):
    """``pulsenet patch apply`` on an untrusted 16 KB file: refused, peak RSS far below 1.4 GB."""
    base = {"a": torch.arange(16, dtype=torch.float32)}
    save_state(tmp_path / "base.safetensors", base)
    (tmp_path / "bomb.pnp").write_bytes(full_bomb(100, 3_500_000, model_digest(base), base))
    (tmp_path / "table.pnp").write_bytes(table_bomb())
    script = textwrap.dedent(
        f"""
        import re
        from pulsenet.cli import main
        d = {str(tmp_path)!r}
        for name in ("bomb", "table"):
            rc = main(["patch", "apply", d + "/base.safetensors", d + f"/{{name}}.pnp", "-o", d + "/out.safetensors"])
            # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report pytest's peak
            hwm = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
            print(rc, int(hwm) // 1024, flush=True)
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    (rc, rss_mb), (rc2, rss2_mb) = (map(int, line.split()) for line in r.stdout.splitlines())
    assert rc == rc2 == 2 and r.stderr.count("PatchSizeLimitError") == 2, r.stderr
    assert rss_mb < 700 and rss2_mb < 700, f"peak RSS {rss_mb} / {rss2_mb} MB"
    assert not (tmp_path / "out.safetensors").exists()


def table_bomb() -> bytes:
    """A 6 KB patch whose table is 64 MiB of empty JSON lists: 1.5 GB of Python objects parsed."""
    return forge(b'{"tensors":[' + b"[]," * ((64 << 20) // 3 - 10) + b"1]}")


def test_table_bomb_is_refused_against_a_known_base():
    bomb = table_bomb()
    assert len(bomb) < 8 << 10
    with pytest.raises(PatchSizeLimitError, match="table declares"):
        apply_patch({"a": torch.zeros(3)}, bomb)


# --------------------------------------------------------------------------- item 6: untyped errors


def test_deeply_nested_table_is_a_patch_error():
    with pytest.raises(PatchCorruptError, match="RecursionError"):
        parse_patch(forge(b"[" * 100_000 + b"]" * 100_000))


def test_huge_integer_in_table_is_a_patch_error():
    raw = json.dumps(table_of([])).replace('"removed": []', '"removed": [' + "9" * 5000 + "]").encode()
    with pytest.raises(PatchCorruptError):
        parse_patch(forge(raw))


def test_single_zone_gap_past_int64_is_a_patch_error():
    """A width-8 rank gap of 2^63 turned negative in int64 and indexed out of bounds (IndexError)."""
    base = {"w": torch.zeros(16, dtype=torch.int32)}
    mask = compress(to_planes(np.array([1 << 63], np.uint64)))
    values = compress(to_planes(np.array([2], np.uint32)))
    entry = {"name": "w", "dtype": "I32", "shape": [16], "sha256": "0" * 64, "op": "sparse", "nnz": 1,
             "zones": [[1, "ones", 1, 8, 8, 1]], "mask": [0, len(mask), 8],
             "values": [len(mask), len(values), 4]}
    for mode in ("ones", "zeros"):
        entry["zones"][0][1] = mode
        with pytest.raises(PatchCorruptError, match="out of range"):
            apply_patch(base, forge(table_of([entry], model_digest(base)), mask + values))


@pytest.mark.parametrize("shape", [[1 << 47, 1 << 47], [1 << 40]])
def test_huge_declared_shape_is_a_patch_error(shape):
    """OverflowError (a size past ssize_t) or MemoryError (a 4 TiB buffer) before the fix."""
    import zstandard

    n = int(np.prod(shape, dtype=object))
    section = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)  # streamed path
    entry = {"name": "w", "dtype": "F32", "shape": shape, "sha256": "0" * 64, "op": "full",
             "data": [0, len(section), 4 * n]}
    with pytest.raises(PatchSizeLimitError):
        apply_patch({}, forge(table_of([entry]), section))


def test_decompress_refuses_a_frame_declaring_an_impossible_size():
    """A 13-byte frame whose header claims 2^60 bytes: the allocation must not escape untyped."""
    import zstandard

    # magic, descriptor (8-byte content size, window descriptor follows), window, size, one raw block
    frame = b"\x28\xb5\x2f\xfd\xc0\x00" + struct.pack("<Q", 1 << 60) + b"\x09\x00\x00x"
    assert zstandard.frame_content_size(frame) == 1 << 60
    with pytest.raises(PatchError):
        decompress(frame, 1 << 60)


# --------------------------------------------------------------------------- item 10: trailing bytes


@pytest.mark.parametrize("tail", [b"\0", compress(b"")], ids=["padding", "second-frame"])
def test_trailing_bytes_after_a_patch_frame_are_refused(tail):
    a = {"w": torch.randn(32, 32)}
    data = PatchEncoder().encode(a, {"w": a["w"] * 1.5})
    magic, ver, flags, tsize, traw, bsize = struct.unpack_from("<8sHHIIQ", data)
    padded = (struct.pack("<8sHHIIQ", magic, ver, flags, tsize + len(tail), traw, bsize)
              + data[HEADER_SIZE : HEADER_SIZE + tsize] + tail + data[HEADER_SIZE + tsize :])
    parse_patch(data)
    with pytest.raises(PatchCorruptError, match="unused data"):
        parse_patch(padded)


def _payload_with_padded_values(tail: bytes) -> tuple[bytes, bytes]:
    """A one-tensor raw sparse payload, and the same with ``tail`` after its values frame."""
    p = wire.Payload(round=1, mode=wire.SPARSE, tensors={
        "w": wire.SparseTensor((100,), np.array([3, 50, 99]), np.array([1.0, -2.0, 0.5], np.float32))})
    data = wire.encode(p)
    at = 24 + 2 + 1 + 1 + 8  # header, name_len, "w", ndim, shape
    tail_fmt = struct.Struct("<QBQBBQBQQ")
    f = list(tail_fmt.unpack_from(data, at))
    end = at + tail_fmt.size + f[2] + f[7]  # after the positions and values frames
    f[7] += len(tail)
    return data, data[:at] + tail_fmt.pack(*f) + data[at + tail_fmt.size : end] + tail + data[end:]


@pytest.mark.parametrize("tail", [b"\0", compress(b"")], ids=["padding", "second-frame"])
def test_trailing_bytes_after_a_payload_frame_are_refused(tail):
    data, padded = _payload_with_padded_values(tail)
    assert wire.decode(data).tensors["w"].values.tolist() == [1.0, -2.0, 0.5]
    with pytest.raises(PayloadError, match="unused data"):
        wire.decode(padded)


# --------------------------------------------------------------------------- numba bounds checking

_BOUNDSCHECK_SCRIPT = """
import sys
import numpy as np, torch
from numba.core import config
assert config.BOUNDSCHECK, "NUMBA_BOUNDSCHECK did not take"
from pulsenet.codec.bf16 import bits
from pulsenet.codec.patch import PatchEncoder, apply_patch
from pulsenet.codec import payload as wire
from pulsenet.loco.algorithm import gate

g = torch.Generator().manual_seed(5)
w = (torch.randn(192, 256, generator=g) * 0.05).to(torch.bfloat16)
a = {"w": w, "i": torch.randint(-9, 9, (300,), generator=g, dtype=torch.int32), "f": torch.randn(77, generator=g)}
steps = [  # additive steps of several sizes: multi-zone masks in every mode
    {**a, "w": (w.float() + eps * torch.randn(w.shape, generator=g)).to(torch.bfloat16)} for eps in (1e-5, 1e-4, 3e-4)
] + [
    {**a, "w": (w.float() * (1 + 2e-3 * torch.randn(w.shape, generator=g))).to(torch.bfloat16)},
    {**a, "w": (w.float() * (1 + 0.3 * torch.randn(w.shape, generator=g))).to(torch.bfloat16), "i": a["i"] + 1},
    {**a, "f": a["f"].reshape(7, 11), "new": torch.ones(3)},
]
for b in steps:
    for zones in (1, 4, 12):
        out = apply_patch(a, PatchEncoder(threads=2, max_zones=zones).encode(a, b), threads=2)
        assert all(np.array_equal(bits(out[k]), bits(b[k])) for k in b)

theta = {"w": (np.random.default_rng(1).standard_normal((64, 50)) * 0.05).astype(np.float32)}
local = theta["w"] + (np.random.default_rng(2).standard_normal((64, 50)) * 2e-4).astype(np.float32)
s = theta["w"] - local
idx, vals, _ = gate(torch.from_numpy(theta["w"]), torch.from_numpy(s))
for p in (wire.Payload(1, wire.SPARSE, {"w": wire.SparseTensor((64, 50), idx, vals)}),
          wire.Payload(1, wire.DENSE, {"w": wire.SparseTensor((64, 50), None, s.reshape(-1))})):
    for base in (theta, None):
        q = wire.decode(wire.encode(p, base), {"w": (64, 50)}, theta)
        assert np.array_equal(q.tensors["w"].values.view(np.uint32), p.tensors["w"].values.view(np.uint32))

sys.path.insert(0, sys.argv[1])
import harness
stats = [harness.run_target(t, int(sys.argv[2])) for t in harness.load_targets(["codec"])]
for st in stats:
    print(st.row())
    for c in st.crashes[:5]:
        print("CRASH", c.mutators, c.error, c.trace)
print("BOUNDSCHECK-OK" if not any(st.crashes for st in stats) else "BOUNDSCHECK-CRASHES")
"""


def test_kernels_under_numba_boundscheck(tmp_path):
    """The codec and payload kernels, on valid and fuzzed input, with numba's bounds checks on.

    A fresh ``NUMBA_CACHE_DIR`` keeps the bounds-checked builds out of the normal cache (and
    makes this test compile every kernel: most of its ~1 min).
    """
    import os
    from pathlib import Path

    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    fuzz_dir = str(Path(__file__).parents[1] / "fuzz")
    r = subprocess.run([sys.executable, "-c", _BOUNDSCHECK_SCRIPT, fuzz_dir, "300"], capture_output=True, text=True,
                       timeout=600, env=env, cwd=str(Path(__file__).parents[2]))
    assert r.returncode == 0 and "BOUNDSCHECK-OK" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
    assert "IndexError" not in r.stdout + r.stderr
