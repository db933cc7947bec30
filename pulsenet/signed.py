"""Signed objects in a store: the one way every channel names, fetches and checks what it trusts.

PULSESync manifests, PULSELoCo round documents and rollout batch manifests all follow one pattern:

1. Payload objects are written first, under keys that carry their own SHA-256 (two writers can
   never overwrite each other's bytes).
2. A signed document (``signing.py``) is written last, create-only (``if_none_match``), naming
   each payload by an :class:`ObjectRef`: key, exact size and SHA-256. An object is trusted only
   once such a document names it, and a published document can never be replaced.
3. A reader fetches the document with :func:`fetch_document` (a size cap checked against the
   listing before any read and enforced by the store during it, then the signature verified in a
   thread), and each payload with :func:`fetch_object` or :func:`fetch_file` (never read past the
   signed size, then size and SHA-256 checked, hashing in a thread). A poller watching one
   overwritable document (a head, a demand record) uses :func:`fetch_document_if_changed`: one
   conditional GET, a 304 with no body while it is unchanged.

What a document's body means (and which keys may sign it) is each channel's business: its body is
a small dataclass on top (``sync/manifest.py``, ``loco/documents.py``, ``rollouts/manifest.py``),
and its key layout an object with the same shape of API (``sync/layout.py``, ``loco/layout.py``,
``rollouts/layout.py``). Wire format: docs/format.md, "Signed documents".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet.errors import DocumentTooLarge, ManifestError, ObjectTooLarge, SizeMismatch, VerificationError
from pulsenet.signing import Signed, parse_envelope, verify_document
from pulsenet.store.base import ObjectStore, check_key

_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_KEY = 1024
"""Longest object key a reference may carry (S3 allows 1024 bytes)."""
MAX_SIZE = 1 << 62
"""Largest object size a reference may carry (any real object; keeps sums far from overflow)."""


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object a signed document vouches for: its key, exact size and SHA-256.

    Wire form: ``{"key": "...", "size": 81234, "sha256": "<64 lowercase hex>"}``.
    """

    key: str
    """Store key, relative to the store URL."""
    size: int
    """Exact size in bytes."""
    sha256: str
    """Hex SHA-256 of the object's bytes."""

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "sha256": self.sha256}

    @classmethod
    def parse(cls, d: Any, where: str) -> ObjectRef:
        """A reference from a (verified) body: exactly ``{key, size, sha256}``, well formed, else a
        ManifestError naming ``where`` and what is wrong."""
        if not isinstance(d, dict) or set(d) != {"key", "size", "sha256"}:
            what = sorted(d)[:8] if isinstance(d, dict) else type(d).__name__
            raise ManifestError(f"{where}: an object reference must be {{key, size, sha256}}, got {_short(what)}")
        key, size, sha = d["key"], d["size"], d["sha256"]
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
            raise ManifestError(f"{where}: object key must be a string of 1-{MAX_KEY} characters, got {_short(key)}")
        if type(size) is not int or not 0 <= size <= MAX_SIZE:
            raise ManifestError(f"{where}: object size must be an integer in [0, {MAX_SIZE}], got {_short(size)}")
        if not is_sha256(sha):
            raise ManifestError(f"{where}: object SHA-256 must be 64 lowercase hex digits, got {_short(sha)}")
        return cls(key, size, sha)


def is_sha256(s: object) -> bool:
    """Whether ``s`` is a hex SHA-256 digest as pulsenet writes them (64 lowercase hex digits)."""
    return isinstance(s, str) and _HEX64.fullmatch(s) is not None


# --- documents ---------------------------------------------------------------------------------


async def fetch_document(
    store: ObjectStore,
    key: str,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    context: str,
    max_bytes: int,
    timeout: float | None,
    listed_size: int | None = None,
) -> Signed:
    """The document at ``key``, verified: signed for ``context`` by a key in ``trusted``.

    ``listed_size``: the size a listing gave; over ``max_bytes`` it is refused unread. The read is
    capped at ``max_bytes`` whatever the listing said. Raises ObjectNotFound, DocumentTooLarge,
    ManifestError or SignatureError (and store errors as they are). The caller checks the body.
    """
    data = await _get_document(store, key, max_bytes=max_bytes, timeout=timeout, listed_size=listed_size)
    return await asyncio.to_thread(verify_document, data, trusted, context=context)


@dataclass(frozen=True, slots=True)
class FetchedDocument:
    """A verified document and the ETag of the object it came from (:func:`fetch_document_if_changed`)."""

    signed: Signed
    etag: str


async def fetch_document_if_changed(
    store: ObjectStore,
    key: str,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    etag: str | None,
    context: str,
    max_bytes: int,
    timeout: float | None,
) -> FetchedDocument | None:
    """:func:`fetch_document` for pollers: None while the object's ETag is still ``etag``.

    One request either way (``ObjectStore.get_if_changed``): a 304 with no body when unchanged, else
    the document, read under ``max_bytes`` and verified like :func:`fetch_document`, with its new
    ETag. Keep the ETag only of a document you accepted: a refused one raises (ManifestError,
    SignatureError, DocumentTooLarge) and, its ETag not kept, is fetched and refused again on the
    next poll, so a planted object costs each poll one GET and never passes for "unchanged".
    """
    check_key(key)
    try:
        got = await store.get_if_changed(key, etag, max_bytes=max_bytes, timeout=timeout)
    except ObjectTooLarge as e:
        raise DocumentTooLarge(f"{key}: {e}") from None
    if got is None:
        return None
    signed = await asyncio.to_thread(verify_document, got.data, trusted, context=context)
    return FetchedDocument(signed, got.etag)


async def fetch_unverified(
    store: ObjectStore, key: str, *, max_bytes: int, timeout: float | None, listed_size: int | None = None
) -> dict[str, Any]:
    """The body of the document at ``key``, shape-checked but NOT verified (listings, diagnostics:
    never trust it). Same limits and errors as :func:`fetch_document`, less the signature ones."""
    data = await _get_document(store, key, max_bytes=max_bytes, timeout=timeout, listed_size=listed_size)
    return parse_envelope(data)["body"]


async def _get_document(
    store: ObjectStore, key: str, *, max_bytes: int, timeout: float | None, listed_size: int | None
) -> bytes:
    if listed_size is not None and listed_size > max_bytes:
        raise DocumentTooLarge(f"{key} is listed at {listed_size} bytes, over the {max_bytes}-byte document limit")
    try:
        return await store.get(key, timeout=timeout, max_bytes=max_bytes)
    except ObjectTooLarge as e:
        raise DocumentTooLarge(f"{key}: {e}") from None


# --- payloads ----------------------------------------------------------------------------------


async def fetch_object(store: ObjectStore, ref: ObjectRef, *, timeout: float | None) -> bytes:
    """The bytes ``ref`` names, never read past ``ref.size``: ObjectNotFound if gone, SizeMismatch
    if another size, VerificationError if another SHA-256."""
    try:
        data = await store.get(ref.key, timeout=timeout, max_bytes=ref.size)
    except ObjectTooLarge as e:
        raise SizeMismatch(f"{ref.key} is larger than the {ref.size} bytes its reference gives: {e}") from None
    await asyncio.to_thread(check_bytes, ref, data)
    return data


async def fetch_streamed(
    store: ObjectStore, ref: ObjectRef, sink: Callable[[bytes], object], *, timeout: float | None
) -> None:
    """Hand the bytes ``ref`` names to ``sink`` in order as they land (``ObjectStore.get_stream``),
    never past ``ref.size``: ObjectNotFound if gone, SizeMismatch if another size.

    The bytes reach ``sink`` before the whole is checked: the caller runs :func:`check_bytes` on
    them once they have all landed, and whatever it builds from them before that must verify
    itself (a patch's tensors are checked one by one against the signed model digest).
    """
    try:
        size = await store.get_stream(ref.key, sink, max_bytes=ref.size, timeout=timeout)
    except ObjectTooLarge as e:
        raise SizeMismatch(f"{ref.key} is larger than the {ref.size} bytes its reference gives: {e}") from None
    if size != ref.size:
        raise SizeMismatch(f"{ref.key}: {size} bytes, its reference gives {ref.size}")


async def fetch_file(store: ObjectStore, ref: ObjectRef, path: str | os.PathLike[str], *, timeout: float | None) -> None:
    """Download the object ``ref`` names to ``path`` and check it, like :func:`fetch_object`.

    ``path`` is absent or whole (``ObjectStore.get_file``); a file that fails the check is deleted.
    """
    try:
        await store.get_file(ref.key, path, timeout=timeout, max_bytes=ref.size)
    except ObjectTooLarge as e:
        raise SizeMismatch(f"{ref.key} is larger than the {ref.size} bytes its reference gives: {e}") from None
    try:
        await asyncio.to_thread(check_file, ref, path)
    except VerificationError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def check_bytes(ref: ObjectRef, data: bytes) -> None:
    """SizeMismatch or VerificationError unless ``data`` is exactly the object ``ref`` names."""
    if len(data) != ref.size:
        raise SizeMismatch(f"{ref.key}: {len(data)} bytes, its reference gives {ref.size}")
    _check_sha(ref, hashlib.sha256(data).hexdigest())


def check_file(ref: ObjectRef, path: str | os.PathLike[str]) -> None:
    """:func:`check_bytes` for a file, hashed in chunks (blocking: call in a thread)."""
    size = os.stat(path).st_size
    if size != ref.size:
        raise SizeMismatch(f"{ref.key}: {size} bytes, its reference gives {ref.size}")
    _check_sha(ref, file_sha256(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file, read in 16 MiB chunks (blocking)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _check_sha(ref: ObjectRef, sha: str) -> None:
    if sha != ref.sha256:
        raise VerificationError(
            f"{ref.key}: SHA-256 {sha[:16]}… does not match its reference's {ref.sha256[:16]}…: corrupt or tampered"
        )


def _short(v: object, limit: int = 80) -> str:
    """A bounded repr for error messages: a hostile value must not flood a log."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}… ({len(r)} chars)"
