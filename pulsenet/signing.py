"""Ed25519 keys and signed JSON documents (manifests, round records, rollout batches, status).

A signed document is the JSON envelope ``{"body": {...}, "context": "...", "key_id": "...",
"sig": "<base64>"}`` where ``sig`` signs ``DOMAIN + context + "\\n" + canonical(body)``:
``canonical`` is sorted keys, no whitespace, UTF-8, no NaN. ``context`` names where the document
is valid (protocol, store location, channel, run): the reader supplies the context it expects, so a
document signed for ``staging`` or for another store fails in ``prod`` even under the same key.
``key_id`` is the first 16 hex digits of the SHA-256 of the raw 32-byte public key. Verification
accepts only keys the caller trusts: an envelope's own claims about its signer are never taken on
faith.

Every byte string from a store is hostile until verified: any malformed input (bad UTF-8, deep
nesting, NaN, lone surrogates, huge integers) ends in a ``ManifestError``, never another exception.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.errors import ConfigError, ManifestError, SignatureError

DOMAIN = b"pulsenet-signed-v2\n"
MAX_DOCUMENT = 16 << 20
"""Largest signed document read; callers check a listed size against it before fetching."""
MAX_DEPTH = 32
"""Deepest JSON nesting accepted: every pulsenet document is a few levels deep."""


@dataclass(frozen=True, slots=True)
class Signed:
    """A verified document: its body and the trusted key id that signed it."""

    body: dict[str, Any]
    signer: str


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_keypair(path: str | Path) -> str:
    """Write a new private key to ``path`` (PEM, mode 0600) and its public key to ``path.pub``.

    Refuses to overwrite either file: a replaced key silently splits a site from its readers.
    """
    path = Path(path)
    pub_path = Path(f"{path}.pub")
    for p in (path, pub_path):
        if p.exists():
            raise ConfigError(f"{p} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    path.parent.mkdir(parents=True, exist_ok=True)
    for p, data, mode in ((path, pem, 0o600), (pub_path, pub, 0o644)):
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            raise ConfigError(f"{p} already exists; refusing to overwrite a key") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return key_id(key.public_key())


OPEN_KEY_BITS = 0o077
"""Permission bits a private key file must not have: any access by group or others (what ssh refuses)."""


def load_private_key(path: str | Path, *, allow_open: bool = False) -> Ed25519PrivateKey:
    """The Ed25519 key in ``path`` (unencrypted PEM, as ``generate_keypair`` writes it).

    A key file that group or others may read or write is refused (``ConfigError`` naming the file
    and the fix) unless ``allow_open``: a copied or restored key that others can read is as good as
    theirs, and loading it silently hides that. The mode is read from the open file (no window
    between the check and the read). Not checked where the OS has no POSIX modes (Windows).
    """
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read()
    except OSError as e:
        raise ConfigError(f"private key {path}: {e.strerror or e}") from None
    if os.name == "posix" and mode & OPEN_KEY_BITS and not allow_open:
        raise ConfigError(
            f"private key {path} is open to group or others (mode {stat.S_IMODE(mode):04o}); "
            f"run: chmod 600 {path}  (or accept it explicitly: --allow-open-key, PULSENET_ALLOW_OPEN_KEY=true)"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
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
    """The signed encoding of a body; ManifestError for what JSON cannot carry exactly."""
    try:
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (ValueError, TypeError, RecursionError) as e:  # NaN, lone surrogates (UnicodeEncodeError), depth
        raise ManifestError(f"document body cannot be encoded canonically: {type(e).__name__}: {str(e)[:200]}") from None


def sign_document(body: Mapping, key: Ed25519PrivateKey, *, context: str) -> bytes:
    sig = key.sign(_message(context, canonical(body)))
    env = {"body": body, "context": context, "key_id": key_id(key.public_key()), "sig": base64.b64encode(sig).decode()}
    return json.dumps(env, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def verify_document(data: bytes, trusted: Mapping[str, Ed25519PublicKey], *, context: str) -> Signed:
    """The body and signer of an envelope a trusted key signed for ``context``.

    Else ManifestError (malformed, other context) or SignatureError (untrusted key, bad signature).
    """
    env = parse_envelope(data)
    kid, sig_b64 = env.get("key_id"), env.get("sig")
    if not isinstance(sig_b64, str):
        raise ManifestError("signed document has no signature string")
    try:
        sig = base64.b64decode(sig_b64, validate=True)
    except ValueError as e:
        raise ManifestError(f"signed document's signature is not base64: {e}") from None
    key = trusted.get(kid) if isinstance(kid, str) else None
    if key is None:
        raise SignatureError(f"document signed by untrusted key {_short(kid)}")
    if env.get("context") != context:
        raise SignatureError(f"document signed for context {_short(env.get('context'), 300)}, expected {context!r}")
    try:
        key.verify(sig, _message(context, canonical(env["body"])))
    except InvalidSignature:
        raise SignatureError(f"bad signature for key {kid}") from None
    return Signed(env["body"], kid)


def parse_envelope(data: bytes) -> dict[str, Any]:
    """The envelope as JSON, shape-checked but NOT verified (listings, diagnostics): never trust it."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ManifestError(f"signed document must be bytes, got {type(data).__name__}")
    if len(data) > MAX_DOCUMENT:
        raise ManifestError(f"signed document is {len(data)} bytes, over the {MAX_DOCUMENT}-byte limit")
    try:
        env = json.loads(
            bytes(data).decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_unique_keys
        )
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, NaN, 4300+ digit ints, deep nesting
        raise ManifestError(f"not a signed pulsenet document: {type(e).__name__}: {str(e)[:200]}") from None
    if _depth(env) > MAX_DEPTH:
        raise ManifestError(f"signed document nests deeper than {MAX_DEPTH} levels")
    if not isinstance(env, dict) or not isinstance(env.get("body"), dict):
        raise ManifestError("not a signed pulsenet document: no body object")
    return env


def _message(context: str, body: bytes) -> bytes:
    if not isinstance(context, str) or "\n" in context:
        raise ManifestError(f"signing context must be a one-line string, got {_short(context)}")
    try:
        return DOMAIN + context.encode() + b"\n" + body
    except UnicodeEncodeError as e:
        raise ManifestError(f"signing context is not valid text: {e}") from None


def _short(v: object, limit: int = 80) -> str:
    """A bounded repr for error messages: hostile values must not flood a log."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}… ({len(r)} chars)"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys repeat has two readings (JSON parsers keep the first or the last):
    refused, so a splice of two signed documents can never verify as either."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("repeated key in a JSON object")
    return obj


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed in a signed document")


def _depth(obj: object) -> int:
    """Nesting depth, iteratively (a recursive walk is what a hostile document targets)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict | list):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                return d
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest
