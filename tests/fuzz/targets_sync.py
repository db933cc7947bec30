"""Fuzz targets of PULSESync (issue 12): every decoder of bytes a sync node reads from a store or disk.

- ``sync.manifest`` (exact): a signed manifest envelope through ``verify_manifest``. The signature
  covers the body, so any mutation that still verifies must give the seed's manifest.
- ``sync.manifest_body`` (not exact): a manifest body *signed by the trusted key* (what a
  compromised publisher key can send) through the body validation; mutated bodies may be valid.
- ``sync.head`` (exact): a signed head record through ``verify_document`` and ``head_from``.
- ``sync.state_weights`` (exact): a subscriber's ``model.safetensors`` through ``localstate.load``;
  the values are hashed against the digest and the version against the header check.
- ``sync.state_info`` (not exact): ``version.json`` through ``localstate.read_info``; it is
  informational and unsigned, so a mutated but well-formed record decodes to other values.

Shared interface: see ``tests/fuzz/harness.py``. Standard library and pulsenet only at module level.
"""

from __future__ import annotations

import functools
import json
import random
import tempfile
from pathlib import Path

from pulsenet.errors import VerificationError
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id, parse_envelope, sign_document, verify_document
from pulsenet.sync import localstate
from pulsenet.sync.layout import Layout
from pulsenet.sync.manifest import (
    Head,
    Manifest,
    head_from,
    sign_head,
    sign_manifest,
    verify_manifest,
)

LAYOUT = Layout("policy", run="fuzz", store_url="s3://bucket/prefix/")
CONTEXT = LAYOUT.context


@functools.cache
def _key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))  # deterministic: Ed25519 signs deterministically


def _trusted() -> dict:
    return {key_id(_key().public_key()): _key().public_key()}


def _manifests() -> list[Manifest]:
    kid = key_id(_key().public_key())

    def ref(role: str, v: int, size: int, fill: str) -> ObjectRef:
        return ObjectRef(key=LAYOUT.payload(v, role, fill * 64), size=size, sha256=fill * 64)

    common = {"full_bytes": 269_060_352, "publisher": kid, "created": "2025-01-01T00:00:00.000000+00:00"}
    return [
        Manifest(version=0, kind="anchor", model_digest="a" * 64, base_version=None, base_digest=None,
                 anchor=ref("anchor", 0, 1 << 20, "1"), patch=None, step=None, **common),
        Manifest(version=7, kind="patch", model_digest="b" * 64, base_version=6, base_digest="c" * 64,
                 anchor=None, patch=ref("patch", 7, 81_234, "2"), step=1234, **common),
        Manifest(version=10, kind="anchor", model_digest="d" * 64, base_version=9, base_digest="e" * 64,
                 anchor=ref("anchor", 10, 1 << 20, "3"), patch=ref("patch", 10, 4_000, "4"), step=0, **common),
    ]


# --- manifests -------------------------------------------------------------------------------------


def manifest_seeds() -> list[bytes]:
    return [sign_manifest(m, _key(), context=CONTEXT) for m in _manifests()]


def decode_manifest(data: bytes) -> Manifest:
    return verify_manifest(data, _trusted(), context=CONTEXT)


HOSTILE_VALUES = [
    None, True, -1, 0, 2**63, 10**30, 1.5, "", "x" * 5000, "\u0000", [], {}, [[[[[[[[]]]]]]]],
    {"role": "patch"}, "0" * 64, "../../etc/passwd",
]


def _hostile(rng: random.Random) -> object:
    v = rng.choice(HOSTILE_VALUES)
    if rng.random() < 0.1:  # deeper than any document may be
        for _ in range(rng.choice((31, 33, 200))):
            v = [v]
    return v


def _mutate_body(body: dict, rng: random.Random) -> dict:
    """Set, delete or retype one field, possibly inside a payload entry."""
    if not isinstance(body, dict):  # an earlier mutation retyped it: nothing to set a field in
        return body
    body = json.loads(json.dumps(body))
    target = body
    if isinstance(body.get("payloads"), list) and body["payloads"] and rng.random() < 0.4:
        target = rng.choice(body["payloads"])
    if not isinstance(target, dict) or not target:
        return body
    name = rng.choice(sorted(target))
    if rng.random() < 0.15:
        del target[name]
    else:
        target[name] = _hostile(rng)
    return body


def _envelope_field(data: bytes, rng: random.Random) -> bytes:
    """Retype a field of the envelope itself (key_id, context, sig, body) keeping the JSON valid."""
    try:
        env = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(env, dict) or not env:
        return data
    env[rng.choice(sorted(env))] = _hostile(rng)
    return json.dumps(env).encode()


def _body_field(data: bytes, rng: random.Random) -> bytes:
    """A hostile value in the body: the signature no longer matches (SignatureError expected)."""
    try:
        env = json.loads(data)
        env["body"] = _mutate_body(env["body"], rng)
    except (ValueError, TypeError, KeyError, RecursionError):  # input already mutated out of shape
        return data
    return json.dumps(env).encode()


def _json_tokens(data: bytes, rng: random.Random) -> bytes:
    """Splice a token JSON parsers trip on into the text: NaN, huge ints, lone surrogates, depth."""
    token = rng.choice([b"NaN", b"-Infinity", b"1e400", b"1" + b"0" * 5000, b'"\\ud800"', b"[" * 5000,
                        b'{"a":' * 40, b"\xff", b"\x00", b'"\\u0000"'])
    i = rng.randrange(len(data) + 1)
    return data[:i] + token + data[i:]


def _reencode(data: bytes, rng: random.Random) -> bytes:
    """The same document with other whitespace and key order: must still verify to the same manifest."""
    try:
        env = json.loads(data)
        return json.dumps(env, indent=rng.choice((None, 1, 4)), sort_keys=rng.random() < 0.5).encode()
    except (ValueError, RecursionError):
        return data


# --- manifest bodies under a trusted (compromised) key --------------------------------------------


def body_seeds() -> list[bytes]:
    return [json.dumps(m.to_body(), sort_keys=True).encode() for m in _manifests()]


def decode_body(data: bytes) -> Manifest:
    """Parse like an envelope body (the shared hostile-JSON guards), sign with the trusted key, verify."""
    body = parse_envelope(b'{"body":' + data + b"}")["body"]
    return verify_manifest(sign_document(body, _key(), context=CONTEXT), _trusted(), context=CONTEXT)


def _body_value(data: bytes, rng: random.Random) -> bytes:
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        return data
    if not isinstance(body, dict):
        return data
    return json.dumps(_mutate_body(body, rng)).encode()


# --- head records ------------------------------------------------------------------------------------


def head_seeds() -> list[bytes]:
    kid = key_id(_key().public_key())
    heads = [Head(version=v, model_digest=d * 64, publisher=kid, time_ms=t)
             for v, d, t in ((0, "a", 0), (12, "b", 1_764_000_000_000))]
    return [sign_head(h, _key(), context=CONTEXT) for h in heads]


def decode_head(data: bytes) -> Head:
    return head_from(verify_document(data, _trusted(), context=CONTEXT))


# --- local state ---------------------------------------------------------------------------------------


@functools.cache
def _state() -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
        "layers.0.norm": torch.randn(4, generator=gen).to(torch.bfloat16),
        "step": torch.tensor([3], dtype=torch.int64),
    }


def weights_seeds() -> list[bytes]:
    from pulsenet.codec.digest import model_digest

    state = _state()
    with tempfile.TemporaryDirectory(prefix="pulsenet-fuzz-") as tmp:
        localstate.save(Path(tmp), 7, model_digest(state), state, channel="policy")
        return [(Path(tmp) / localstate.WEIGHTS).read_bytes()]


def decode_weights(data: bytes) -> tuple:
    with tempfile.TemporaryDirectory(prefix="pulsenet-fuzz-") as tmp:
        (Path(tmp) / localstate.WEIGHTS).write_bytes(data)
        loaded = localstate.load(Path(tmp), threads=1)
    if loaded is None:  # a file without our metadata is "no state", the same typed outcome as refused
        raise VerificationError("not a pulsenet state file")
    return (
        loaded.version,
        loaded.digest,
        tuple((n, str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch_uint8()).numpy().tobytes())
              for n, t in sorted(loaded.state.items())),
    )


def torch_uint8():
    import torch

    return torch.uint8


def _safetensors_header(data: bytes, rng: random.Random) -> bytes:
    """Rewrite one entry of the safetensors JSON header (dtype, shape, offsets, metadata)."""
    if len(data) < 8:
        return data
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return data
    if not isinstance(header, dict) or not header:
        return data
    name = rng.choice(sorted(header))
    entry = header[name]
    if isinstance(entry, dict) and entry:
        field = rng.choice(sorted(entry))
        entry[field] = rng.choice([
            _hostile(rng), "F16", "BF16", "I64", [0, 2**40], [2**62, 2**62], [8, 4, 0], [-1], "7", "6",
            "1" * 5000,
        ])
    else:
        header[name] = _hostile(rng)
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def info_seeds() -> list[bytes]:
    with tempfile.TemporaryDirectory(prefix="pulsenet-fuzz-") as tmp:
        localstate.write_info(Path(tmp), 7, "a" * 64, channel="policy")
        return [(Path(tmp) / localstate.INFO).read_bytes()]


def decode_info(data: bytes) -> dict:
    with tempfile.TemporaryDirectory(prefix="pulsenet-fuzz-") as tmp:
        (Path(tmp) / localstate.INFO).write_bytes(data)
        info = localstate.read_info(Path(tmp))
    if info is None:
        raise VerificationError("no version record")
    return info


TARGETS: list[dict] = [
    {
        "name": "sync.manifest",
        "seeds": manifest_seeds,
        "decode": decode_manifest,
        "exact": True,
        "mutators": [_envelope_field, _body_field, _json_tokens, _reencode],
    },
    {
        "name": "sync.manifest_body",
        "seeds": body_seeds,
        "decode": decode_body,
        "exact": False,
        "mutators": [_body_value, _json_tokens],
    },
    {
        "name": "sync.head",
        "seeds": head_seeds,
        "decode": decode_head,
        "exact": True,
        "mutators": [_envelope_field, _body_field, _json_tokens, _reencode],
    },
    {
        "name": "sync.state_weights",
        "seeds": weights_seeds,
        "decode": decode_weights,
        "exact": True,
        "mutators": [_safetensors_header],
    },
    {
        "name": "sync.state_info",
        "seeds": info_seeds,
        "decode": decode_info,
        "exact": False,
        "mutators": [_body_value, _json_tokens],
    },
]
