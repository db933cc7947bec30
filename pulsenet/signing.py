"""Ed25519 keys and signed JSON documents (manifests, round records).

A signed document is the JSON envelope ``{"body": {...}, "key_id": "...", "sig": "<base64>"}``
where ``sig`` signs the canonical encoding of ``body`` (sorted keys, no whitespace, UTF-8) with
the domain prefix ``b"pulsenet-signed-v1\\n"``. ``key_id`` is the first 16 hex digits of the
SHA-256 of the raw 32-byte public key. Verification accepts only keys the caller trusts: an
envelope's own claims about its signer are never taken on faith.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.errors import ConfigError, ManifestError, SignatureError

DOMAIN = b"pulsenet-signed-v1\n"
MAX_DOCUMENT = 16 << 20


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(path: str | Path) -> str:
    """Write a new private key to ``path`` (PEM, mode 0600) and its public key to ``path.pub``."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    Path(f"{path}.pub").write_bytes(pub)
    return key_id(key.public_key())


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} is not an Ed25519 key")
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    try:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
    except ValueError as e:
        raise ConfigError(f"{path} is not a PEM public key: {e}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{path} is not an Ed25519 public key")
    return key


def trusted_keys(paths: Iterable[str | Path]) -> dict[str, Ed25519PublicKey]:
    """``key_id -> public key`` for the given public-key files."""
    keys = {}
    for p in paths:
        k = load_public_key(p)
        keys[key_id(k)] = k
    if not keys:
        raise ConfigError("no trusted public keys given")
    return keys


def canonical(body: Mapping) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def sign_document(body: Mapping, key: Ed25519PrivateKey) -> bytes:
    sig = key.sign(DOMAIN + canonical(body))
    env = {"body": body, "key_id": key_id(key.public_key()), "sig": base64.b64encode(sig).decode()}
    return json.dumps(env, sort_keys=True, separators=(",", ":")).encode()


def verify_document(data: bytes, trusted: Mapping[str, Ed25519PublicKey]) -> dict:
    """The body of a signed envelope, if a trusted key signed it; else SignatureError/ManifestError."""
    if len(data) > MAX_DOCUMENT:
        raise ManifestError(f"signed document is {len(data)} bytes, over the {MAX_DOCUMENT}-byte limit")
    try:
        env = json.loads(data)
        body, kid, sig = env["body"], env["key_id"], base64.b64decode(env["sig"], validate=True)
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"not a signed pulsenet document: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ManifestError("signed document body is not an object")
    key = trusted.get(kid) if isinstance(kid, str) else None
    if key is None:
        raise SignatureError(f"document signed by untrusted key {kid!r}")
    try:
        key.verify(sig, DOMAIN + canonical(body))
    except InvalidSignature:
        raise SignatureError(f"bad signature for key {kid}") from None
    return body
