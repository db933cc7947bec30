"""signed.py: the object reference, document fetch and object fetch every channel shares."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.errors import (
    DocumentTooLarge,
    ManifestError,
    ObjectNotFound,
    SignatureError,
    SizeMismatch,
    VerificationError,
)
from pulsenet.signed import (
    ObjectRef,
    fetch_document,
    fetch_document_if_changed,
    fetch_file,
    fetch_object,
    fetch_unverified,
)
from pulsenet.signing import key_id, sign_document
from pulsenet.store import LocalStore

pytestmark = pytest.mark.timeout(60)
SHA = "ab" * 32


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"key": "k", "size": 1},
        {"key": "k", "size": 1, "sha256": SHA, "role": "patch"},
        {"key": "", "size": 1, "sha256": SHA},
        {"key": "k" * 1025, "size": 1, "sha256": SHA},
        {"key": 7, "size": 1, "sha256": SHA},
        {"key": "k", "size": -1, "sha256": SHA},
        {"key": "k", "size": True, "sha256": SHA},
        {"key": "k", "size": 1.0, "sha256": SHA},
        {"key": "k", "size": 2**63, "sha256": SHA},
        {"key": "k", "size": 1, "sha256": SHA.upper()},
        {"key": "k", "size": 1, "sha256": SHA[:-1]},
    ],
)
def test_object_ref_parse_refuses_anything_but_key_size_sha256(bad: object) -> None:
    with pytest.raises(ManifestError, match=r"^here: "):
        ObjectRef.parse(bad, "here")


def test_object_ref_round_trips() -> None:
    ref = ObjectRef("a/b", 10, SHA)
    assert ObjectRef.parse(ref.to_json(), "x") == ref


async def test_fetch_document_checks_size_first_then_signature(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    doc = sign_document({"x": 1}, key, context="ctx")
    await store.put("doc", doc)
    signed = await fetch_document(store, "doc", trusted, context="ctx", max_bytes=len(doc), timeout=5)
    assert signed.body == {"x": 1} and signed.signer == key_id(key.public_key())
    assert await fetch_unverified(store, "doc", max_bytes=len(doc), timeout=5) == {"x": 1}
    with pytest.raises(DocumentTooLarge):  # read capped at max_bytes
        await fetch_document(store, "doc", trusted, context="ctx", max_bytes=len(doc) - 1, timeout=5)
    with pytest.raises(DocumentTooLarge):  # refused from the listed size, unread
        await fetch_document(store, "gone", trusted, context="ctx", max_bytes=10, timeout=5, listed_size=11)
    with pytest.raises(SignatureError):
        await fetch_document(store, "doc", trusted, context="other", max_bytes=1 << 20, timeout=5)
    with pytest.raises(SignatureError):
        await fetch_document(store, "doc", {}, context="ctx", max_bytes=1 << 20, timeout=5)
    with pytest.raises(ObjectNotFound):
        await fetch_document(store, "gone", trusted, context="ctx", max_bytes=1 << 20, timeout=5)


async def test_fetch_document_if_changed_polls_for_a_304(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    opts = {"context": "ctx", "max_bytes": 1 << 16, "timeout": 5}
    await store.put("head", sign_document({"v": 1}, key, context="ctx"))
    got = await fetch_document_if_changed(store, "head", trusted, etag=None, **opts)
    assert got is not None and got.signed.body == {"v": 1}
    before = store.requests.snapshot()
    assert await fetch_document_if_changed(store, "head", trusted, etag=got.etag, **opts) is None
    assert (store.requests - before).get_not_modified == 1 and (store.requests - before).get == 0
    await store.put("head", sign_document({"v": 2}, key, context="ctx"))
    moved = await fetch_document_if_changed(store, "head", trusted, etag=got.etag, **opts)
    assert moved is not None and moved.signed.body == {"v": 2} and moved.etag != got.etag
    # A planted document is refused on every poll: it never passes for "unchanged".
    await store.put("head", sign_document({"v": 3}, Ed25519PrivateKey.generate(), context="ctx"))
    for _ in range(2):
        with pytest.raises(SignatureError):
            await fetch_document_if_changed(store, "head", trusted, etag=moved.etag, **opts)
    with pytest.raises(DocumentTooLarge):
        await fetch_document_if_changed(store, "head", trusted, etag=None, context="ctx", max_bytes=10, timeout=5)
    with pytest.raises(ObjectNotFound):
        await fetch_document_if_changed(store, "gone", trusted, etag=moved.etag, **opts)


async def test_fetch_object_and_file_check_size_and_sha256(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    data = b"0123456789"
    ref = ObjectRef("obj", len(data), hashlib.sha256(data).hexdigest())
    await store.put("obj", data)
    assert await fetch_object(store, ref, timeout=5) == data
    await fetch_file(store, ref, tmp_path / "out", timeout=5)
    assert (tmp_path / "out").read_bytes() == data
    for wrong, error in (
        (ObjectRef("obj", len(data) - 1, ref.sha256), SizeMismatch),  # larger than the ref: refused unread
        (ObjectRef("obj", len(data) + 1, ref.sha256), SizeMismatch),  # shorter
        (ObjectRef("obj", len(data), SHA), VerificationError),  # other bytes
    ):
        with pytest.raises(error):
            await fetch_object(store, wrong, timeout=5)
        with pytest.raises(error):
            await fetch_file(store, wrong, tmp_path / "bad", timeout=5)
        assert not (tmp_path / "bad").exists()  # a file that fails the check is not left behind
    with pytest.raises(ObjectNotFound):
        await fetch_object(store, ObjectRef("gone", 1, SHA), timeout=5)
