"""Golden vectors: fixed tiny inputs and the exact bytes every release must read (and, with the same
zstd, write). Sites upgrade one at a time, so a node on release N+1 must decode what release N wrote.

``python tests/golden/vectors.py --write`` regenerates the files; do that only for a deliberate
format change, together with a format version bump and a note in docs/format.md.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from pulsenet.codec import payload as loco_payload  # noqa: E402
from pulsenet.codec.digest import model_digest  # noqa: E402
from pulsenet.codec.patch import PatchEncoder  # noqa: E402


def _bits(tag: str, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """``n`` pseudo-random words from SHAKE-256 of ``tag``: the same on every machine and numpy."""
    size = np.dtype(dtype).itemsize
    return np.frombuffer(hashlib.shake_256(tag.encode()).digest(n * size), dtype=dtype).copy()


def _bf16(tag: str, shape: tuple[int, ...]) -> torch.Tensor:
    """BF16 weights of magnitude ~0.01-1: random sign and mantissa, exponent 120..126."""
    b = _bits(tag, int(np.prod(shape)), np.uint16)
    b = (b & 0x807F) | (((b >> 7) % 7 + 120).astype(np.uint16) << 7)
    return torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16).reshape(shape)


def states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Base A and target B: a sparse change, a kept tensor, a replaced shape, an added and a removed one."""
    a = {
        "layers.0.attn.weight": _bf16("attn", (32, 48)),
        "layers.0.mlp.weight": _bf16("mlp", (48, 32)),
        "norm.weight": _bf16("norm", (48,)),
        "old.bias": _bf16("old", (8,)),
        "step": torch.tensor([7, -1, 2**31 - 1], dtype=torch.int32),
    }
    b = {k: v.clone() for k, v in a.items() if k != "old.bias"}
    attn = b["layers.0.attn.weight"].view(torch.int16).flatten()
    picks = torch.from_numpy((_bits("picks", 40, np.uint16) % attn.numel()).astype(np.int64))
    attn[picks] += torch.from_numpy(_bits("steps", 40, np.uint16).astype(np.int16) % 3 + 1)
    b["norm.weight"] = _bf16("norm2", (6, 8))  # same numel, new shape: a full tensor
    b["new.bias"] = _bf16("new", (12,))
    b["step"] = torch.tensor([8, -1, 2**31 - 1], dtype=torch.int32)
    return a, b


def payload_inputs() -> tuple[dict[str, np.ndarray], loco_payload.Payload, loco_payload.Payload]:
    """Base FP32 weights θ, a sparse payload (coded relative to θ) and a dense one."""
    theta = {
        "w": _bf16("theta-w", (24, 16)).float().numpy(),
        "v": _bf16("theta-v", (40,)).float().numpy(),
    }
    idx = np.unique(_bits("idx", 30, np.uint16).astype(np.int64) % theta["w"].size)
    ulps = (_bits("ulps", idx.size, np.uint16) % 5 + 1).astype(np.int64)
    w = theta["w"].ravel()
    values = (w[idx] * (2.0 ** -8) * ulps).astype(np.float32)  # steps of a few BF16 cells
    values[0] = np.float32(-0.0)
    sparse = loco_payload.Payload(
        round=3,
        mode=loco_payload.SPARSE,
        tensors={
            "v": loco_payload.SparseTensor((40,), np.array([], dtype=np.int64), np.array([], dtype=np.float32)),
            "w": loco_payload.SparseTensor((24, 16), idx, values),
        },
    )
    dense = loco_payload.Payload(
        round=4,
        mode=loco_payload.DENSE,
        tensors={
            "v": loco_payload.SparseTensor((40,), None, (theta["v"] * 1e-3).astype(np.float32)),
            "w": loco_payload.SparseTensor((24, 16), None, (theta["w"].ravel() * -2e-3).astype(np.float32)),
        },
    )
    return theta, sparse, dense


def signing_key():
    """A fixed Ed25519 key (Ed25519 signatures are deterministic: same key, same bytes)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"pulsenet golden key").digest())


def documents() -> dict[str, bytes]:
    """Signed documents: a PULSESync manifest and head, a PULSELoCo payload manifest."""
    from pulsenet.loco.documents import KIND_MANIFEST, RoundStore
    from pulsenet.loco.layout import LocoLayout
    from pulsenet.signed import ObjectRef
    from pulsenet.signing import key_id
    from pulsenet.store import LocalStore
    from pulsenet.sync.layout import Layout
    from pulsenet.sync.manifest import Head, Manifest, sign_head, sign_manifest

    key = signing_key()
    kid = key_id(key.public_key())
    layout = Layout("policy", run="golden", store_url="s3://pulsenet-golden/run/")
    digests = {"base": "ab" * 32, "target": "cd" * 32}
    manifest = Manifest(
        version=7,
        kind="patch",
        model_digest=digests["target"],
        base_version=6,
        base_digest=digests["base"],
        anchor=None,
        patch=ObjectRef(key=layout.payload(7, "patch", "ef" * 32), size=961, sha256="ef" * 32),
        full_bytes=269060352,
        publisher=kid,
        created="2026-12-01T00:00:00.000000+00:00",
        step=7,
    )
    head = Head(version=7, model_digest=digests["target"], publisher=kid, time_ms=1_795_000_000_000)
    rs = RoundStore(LocalStore("/nonexistent-golden"), "t0", key, {"t0": key.public_key()}, run="golden")
    loco = {
        "kind": KIND_MANIFEST,
        "trainer": "t0",
        "round": 3,
        "payload": {"key": LocoLayout().payload("t0", 3, "ef" * 32), "size": 368, "sha256": "ef" * 32},
        "mode": "pulseloco",
        "sent": 30,
        "total": 424,
        "base_digest": digests["base"],
    }
    return {
        "sync-manifest.json": sign_manifest(manifest, key, context=layout.context),
        "sync-head.json": sign_head(head, key, context=layout.context),
        "loco-manifest.json": rs.sign(loco),
    }


def build() -> dict[str, bytes]:
    """Every golden file's exact bytes, from the current encoders."""
    a, b = states()
    theta, sparse, dense = payload_inputs()
    out = {
        "patch-v1.pnp": PatchEncoder(threads=1).encode(a, b),
        "anchor-v1.pnp": PatchEncoder(threads=1).encode({}, b),
        "payload-sparse-v2.bin": loco_payload.encode(sparse, theta, threads=1),
        "payload-dense-v2.bin": loco_payload.encode(dense, theta, threads=1),
    }
    out.update(documents())
    digests = {"base": model_digest(a), "target": model_digest(b)}
    out["digests.json"] = (json.dumps(digests, indent=1, sort_keys=True) + "\n").encode()
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/golden/vectors.py --write   (regenerates the golden files)")
    for name, data in build().items():
        (HERE / name).write_bytes(data)
        print(f"wrote {name} ({len(data)} bytes)")
