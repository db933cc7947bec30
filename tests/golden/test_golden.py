"""Golden vectors (tests/golden/): the exact bytes of each wire format for fixed tiny inputs.

Round-trip tests pass even when encoder and decoder change together; nodes on different sites run
different releases and must agree on bytes. Decoding the stored bytes must always give the exact
inputs; encoding must reproduce them byte for byte (a zstd upgrade could, in principle, change the
compressed bytes without changing the format: the message says so). A deliberate format change
regenerates the files (``python tests/golden/vectors.py --write``) and bumps the format version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from pulsenet.codec import payload as loco_payload
from pulsenet.codec.bf16 import bits
from pulsenet.codec.digest import model_digest
from pulsenet.codec.patch import PatchEncoder, apply_patch, parse_patch

GOLDEN = Path(__file__).resolve().parent
sys.path.insert(0, str(GOLDEN))
import vectors  # noqa: E402


def _same_state(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and np.array_equal(bits(x[k]), bits(y[k])) for k in x
    )


def _same_payload(p: loco_payload.Payload, q: loco_payload.Payload) -> bool:
    if (p.round, p.mode, list(p.tensors)) != (q.round, q.mode, list(q.tensors)):
        return False
    for name, t in p.tensors.items():
        u = q.tensors[name]
        if t.shape != u.shape or (t.indices is None) != (u.indices is None):
            return False
        if t.indices is not None and not np.array_equal(t.indices, u.indices):
            return False
        if not np.array_equal(t.values.view(np.uint32), u.values.view(np.uint32)):
            return False
    return True


@pytest.fixture(scope="module")
def built() -> dict[str, bytes]:
    return vectors.build()


@pytest.mark.parametrize("name", sorted(p.name for p in GOLDEN.iterdir() if p.suffix in (".pnp", ".bin", ".json")))
def test_encoders_reproduce_golden_bytes(built: dict[str, bytes], name: str) -> None:
    stored = (GOLDEN / name).read_bytes()
    assert built[name] == stored, (
        f"{name}: the encoder's bytes changed (zstd {zstandard.ZSTD_VERSION}). If the format changed on "
        "purpose, bump its version, regenerate with `python tests/golden/vectors.py --write` and say so "
        "in docs/format.md; if only the zstd library changed, the decode tests below decide compatibility."
    )


def test_golden_patches_decode_to_the_exact_target() -> None:
    a, b = vectors.states()
    digests = json.loads((GOLDEN / "digests.json").read_text())
    assert model_digest(a) == digests["base"] and model_digest(b) == digests["target"]
    patch = parse_patch((GOLDEN / "patch-v1.pnp").read_bytes())
    assert {e.name: e.op for e in patch.tensors} == {
        "layers.0.attn.weight": "sparse",
        "layers.0.mlp.weight": "keep",
        "new.bias": "full",
        "norm.weight": "full",
        "step": "full",  # 1 of 3 entries changed: over FULL_CHECK_RATE, and full is smaller
    }
    assert patch.removed == ["old.bias"]
    assert (patch.base_digest, patch.target_digest) == (digests["base"], digests["target"])
    assert _same_state(apply_patch(a, patch), b)
    assert _same_state(apply_patch({}, (GOLDEN / "anchor-v1.pnp").read_bytes()), b)


def test_golden_payloads_decode_exactly() -> None:
    theta, sparse, dense = vectors.payload_inputs()
    shapes = {k: v.shape for k, v in theta.items()}
    got = loco_payload.decode((GOLDEN / "payload-sparse-v2.bin").read_bytes(), shapes, theta)
    assert _same_payload(got, sparse)
    got = loco_payload.decode((GOLDEN / "payload-dense-v2.bin").read_bytes(), shapes, theta)
    assert _same_payload(got, dense)


def test_encoding_does_not_depend_on_threads() -> None:
    a, b = vectors.states()
    assert PatchEncoder(threads=3).encode(a, b) == (GOLDEN / "patch-v1.pnp").read_bytes()
    theta, sparse, _ = vectors.payload_inputs()
    assert loco_payload.encode(sparse, theta, threads=2) == (GOLDEN / "payload-sparse-v2.bin").read_bytes()


def test_golden_documents_verify_to_their_bodies() -> None:
    """Signed documents a release wrote verify in this one, under the same key and context."""
    from pulsenet.loco.documents import KIND_MANIFEST, RoundStore
    from pulsenet.signing import key_id, verify_document
    from pulsenet.store import LocalStore
    from pulsenet.sync.layout import Layout
    from pulsenet.sync.manifest import head_from, verify_manifest

    key = vectors.signing_key()
    trusted = {key_id(key.public_key()): key.public_key()}
    layout = Layout("policy", run="golden", store_url="s3://pulsenet-golden/run/")
    m = verify_manifest((GOLDEN / "sync-manifest.json").read_bytes(), trusted, context=layout.context, key_version=7)
    assert (m.version, m.base_version, m.patch.size, m.full_bytes, m.step) == (7, 6, 961, 269060352, 7)
    h = head_from(verify_document((GOLDEN / "sync-head.json").read_bytes(), trusted, context=layout.context))
    assert (h.version, h.time_ms) == (7, 1_795_000_000_000)
    rs = RoundStore(LocalStore("/nonexistent-golden"), "t0", key, {"t0": key.public_key()}, run="golden")
    key3 = rs.layout.manifest("t0", 3)
    lm = rs._manifest(key3, rs._verify(key3, (GOLDEN / "loco-manifest.json").read_bytes(), KIND_MANIFEST, signer="t0"), "t0", 3)
    assert (lm.trainer, lm.round, lm.sent, lm.total, lm.payload.size) == ("t0", 3, 30, 424, 368)
