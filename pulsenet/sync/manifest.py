"""PULSESync manifests: the signed statement that version V exists, what it is, and how to build it.

A manifest is a signed document (``pulsenet.signing``) whose body is::

    {"format": "pulsenet-sync-manifest", "schema": 1,
     "version": 12, "kind": "anchor" | "patch",
     "model_digest": "<hex digest of version 12's weights>",
     "base_version": 11 | null, "base_digest": "<hex digest of version 11>" | null,
     "payloads": [{"role": "patch" | "anchor", "key": "...", "size": 81234, "sha256": "<hex>"}, ...],
     "codec_version": 1, "full_bytes": 269060352,
     "publisher": "<key id of the signer>", "created": "2025-01-01T00:00:00.000000+00:00",
     "step": 1234 | null,
     "model_config": {...}}   (optional: anchor versions of a publisher that knows its model)

``kind`` is "anchor" when the version carries an anchor payload (a patch against the empty model,
i.e. the full weights); an anchor version may also carry a patch from ``base_version``. A "patch"
version carries only the patch. ``full_bytes`` is the raw size of the weights (for ratios).
Each ``payloads`` entry is a ``signed.ObjectRef`` (the reference every channel uses) tagged with
its role. ``model_config`` is the model's Hugging Face ``config.json`` (its architecture), so a
reader such as ``pulsenet export`` rebuilds the right model from the channel alone; it is absent
when the publisher was not given one (and in every manifest written before it existed), and a
reader that does not know it ignores it (readers look up the fields they know).

The publisher writes a manifest after its payloads, create-only, so an object is trusted only once a
manifest names it (size and SHA-256) and a version can never be overwritten. Readers accept a
manifest only if a trusted key signed it, ``publisher`` is that key, and the body's version is the
one its key names (a copied old manifest is a replay).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec.patch import VERSION as CODEC_VERSION
from pulsenet.errors import ManifestError, ReplayError
from pulsenet.signed import ObjectRef, is_sha256
from pulsenet.signing import Signed, canonical, key_id, sign_document, verify_document
from pulsenet.sync.layout import MAX_VERSION

FORMAT = "pulsenet-sync-manifest"
SCHEMA = 1
_MAX_INT = 2**63 - 1
MAX_MANIFEST = 1 << 20
"""Largest manifest object a reader fetches: real ones are about 1 KB; bigger ones are refused
from the listed size, and the fetch itself is capped at this."""
MAX_MODEL_CONFIG = 64 << 10
"""Largest ``model_config`` (canonical JSON bytes) a manifest may carry: a config.json is 1-5 KB."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A validated manifest body (see the module docstring for the wire form)."""

    version: int
    kind: str
    """"anchor" if the version carries an anchor payload, else "patch"."""
    model_digest: str
    """Model digest of this version's weights (codec/digest.py)."""
    base_version: int | None
    """Version the patch payload applies to; None when there is no patch payload."""
    base_digest: str | None
    """Model digest of ``base_version``; None when there is no patch payload."""
    anchor: ObjectRef | None
    """The anchor payload: a patch from the empty model (the full weights)."""
    patch: ObjectRef | None
    """The patch payload, from ``base_version``."""
    full_bytes: int
    """Raw bytes of the weights (sum of numel x element size): the size of a full checkpoint."""
    publisher: str
    """Key id of the signer."""
    created: str
    """ISO-8601 UTC time the publisher signed it (informational: ordering comes from versions)."""
    codec_version: int = CODEC_VERSION
    step: int | None = None
    """The publisher's own label for this state (e.g. its optimizer step); informational."""
    model_config: Mapping[str, Any] | None = None
    """The model's HF ``config.json`` contents (anchor versions only; None when not known)."""

    def roles(self) -> list[tuple[str, ObjectRef]]:
        """``(role, ref)`` of each payload: the wire form tags every ref with its role."""
        return [(role, p) for role, p in (("anchor", self.anchor), ("patch", self.patch)) if p is not None]

    def to_body(self) -> dict:
        return {
            "format": FORMAT,
            "schema": SCHEMA,
            "version": self.version,
            "kind": self.kind,
            "model_digest": self.model_digest,
            "base_version": self.base_version,
            "base_digest": self.base_digest,
            "payloads": [{"role": role, **p.to_json()} for role, p in self.roles()],
            "codec_version": self.codec_version,
            "full_bytes": self.full_bytes,
            "publisher": self.publisher,
            "created": self.created,
            "step": self.step,
            **({"model_config": dict(self.model_config)} if self.model_config is not None else {}),
        }

    @classmethod
    def from_body(cls, body: Mapping) -> Manifest:
        """Validate a body's shape and consistency; ManifestError names what is wrong."""
        try:
            return _from_body(body)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as e:  # a missing field, an unhashable value
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {str(e)[:200]}") from None


def _from_body(body: Mapping) -> Manifest:
    if body.get("format") != FORMAT or body.get("schema") != SCHEMA:
        raise ManifestError(
            f"not a {FORMAT} v{SCHEMA} manifest (format {_short(body.get('format'))}, schema {_short(body.get('schema'))})"
        )
    version = _int(body, "version", MAX_VERSION)
    codec = _int(body, "codec_version")
    if codec != CODEC_VERSION:
        raise ManifestError(
            f"manifest v{version} uses patch codec v{codec}; this build reads v{CODEC_VERSION}"
        )
    raw_payloads = body["payloads"]
    if not isinstance(raw_payloads, list) or len(raw_payloads) > 2:
        raise ManifestError(f"manifest v{version}: payloads must be a list of at most 2 objects")
    payloads: dict[str, ObjectRef] = {}
    for p in raw_payloads:
        if not isinstance(p, dict):
            raise ManifestError(f"manifest v{version}: a payload entry is not an object: {_short(p)}")
        role = p.get("role")
        if role not in ("anchor", "patch") or role in payloads:
            raise ManifestError(f"manifest v{version}: bad or repeated payload role {_short(role)}")
        payloads[role] = ObjectRef.parse({k: v for k, v in p.items() if k != "role"}, f"manifest v{version} {role}")
    base_version, base_digest = body["base_version"], body["base_digest"]
    if ("patch" in payloads) != (base_version is not None) or (base_version is None) != (base_digest is None):
        raise ManifestError(
            f"manifest v{version}: a patch payload needs base_version and base_digest, and only it"
        )
    if base_version is not None and not (
        isinstance(base_version, int) and not isinstance(base_version, bool) and 0 <= base_version < version
    ):
        raise ManifestError(f"manifest v{version}: base_version {_short(base_version)} must be an earlier version")
    if base_digest is not None and not is_sha256(base_digest):
        raise ManifestError(f"manifest v{version}: malformed base_digest")
    kind = body["kind"]
    if kind not in ("anchor", "patch") or (kind == "anchor") != ("anchor" in payloads) or not payloads:
        raise ManifestError(
            f"manifest v{version}: kind {_short(kind)} does not match its payloads {sorted(payloads)}"
        )
    if not is_sha256(body["model_digest"]):
        raise ManifestError(f"manifest v{version}: malformed model_digest")
    step = body.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or abs(step) > _MAX_INT):
        raise ManifestError(f"manifest v{version}: step must be a 64-bit int or null")
    publisher, created = body["publisher"], body["created"]
    if not isinstance(publisher, str) or not isinstance(created, str) or len(created) > 64:
        raise ManifestError(f"manifest v{version}: publisher and created must be short strings")
    model_config = body.get("model_config")
    if model_config is not None:
        check_model_config(model_config, f"manifest v{version}", ManifestError)
    return Manifest(
        version=version,
        kind=kind,
        model_digest=body["model_digest"],
        base_version=base_version,
        base_digest=base_digest,
        anchor=payloads.get("anchor"),
        patch=payloads.get("patch"),
        full_bytes=_int(body, "full_bytes"),
        publisher=publisher,
        created=created,
        codec_version=codec,
        step=step,
        model_config=model_config,
    )


def public_model_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``config.json``'s contents as a manifest carries them: private fields (``_name_or_path``, a
    path on the publisher's machine) stay there."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def check_model_config(config: object, where: str, error: type[Exception]) -> None:
    """``error`` unless ``config`` is a JSON object with a string ``model_type`` whose canonical
    encoding is at most ``MAX_MODEL_CONFIG`` bytes (what transformers makes of it is the reader's
    check: ``pulsenet export``)."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise error(f"{where}: model_config must be a config.json object with a model_type")
    try:
        size = len(canonical(config))
    except ManifestError as e:
        raise error(f"{where}: model_config is not plain JSON: {e}") from None
    if size > MAX_MODEL_CONFIG:
        raise error(f"{where}: model_config is {size} bytes, over {MAX_MODEL_CONFIG}")


def _int(body: Mapping, name: str, limit: int | None = None) -> int:
    """A non-negative int field, at most ``limit`` (default: 2**63 - 1, any real size)."""
    v = body.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= (limit if limit is not None else _MAX_INT):
        raise ManifestError(f"field {name!r} must be an int in 0..{limit or _MAX_INT}, got {_short(v)}")
    return v


def _short(v: object, limit: int = 80) -> str:
    """A bounded repr for error messages: a hostile value must not flood a log (depth is already capped)."""
    r = repr(v)
    return r if len(r) <= limit else f"{r[:limit]}… ({len(r)} chars)"


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def sign_manifest(manifest: Manifest, key: Ed25519PrivateKey, *, context: str) -> bytes:
    """The signed envelope bytes, valid only in ``context``; ``manifest.publisher`` must be the key's id."""
    if manifest.publisher != key_id(key.public_key()):
        raise ManifestError(
            f"manifest publisher {manifest.publisher!r} is not the signing key {key_id(key.public_key())!r}"
        )
    return sign_document(manifest.to_body(), key, context=context)


def verify_manifest(
    data: bytes,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    context: str,
    key_version: int | None = None,
    current: int | None = None,
) -> Manifest:
    """A manifest a trusted key signed, from its bytes: :func:`manifest_from` of the verified document."""
    return manifest_from(verify_document(data, trusted, context=context), key_version=key_version, current=current)


def manifest_from(signed: Signed, *, key_version: int | None = None, current: int | None = None) -> Manifest:
    """The manifest in a verified document, else ManifestError/ReplayError.

    ``key_version``: the version the object's key names; a body naming another version is a copy of
    some other manifest: a ReplayError if that version is not newer than ``current`` (the reader's
    version), else a ManifestError. ``current``: manifests at or below it are ReplayErrors.
    """
    manifest = Manifest.from_body(signed.body)
    signer = signed.signer
    if manifest.publisher != signer:
        raise ManifestError(
            f"manifest v{manifest.version} claims publisher {manifest.publisher!r} but {signer!r} signed it"
        )
    if current is not None and manifest.version <= current:
        raise ReplayError(
            f"manifest for v{manifest.version} found at v{key_version}, not newer than the current v{current}: replay ignored"
        )
    if key_version is not None and manifest.version != key_version:
        raise ManifestError(
            f"manifest at v{key_version} is signed for v{manifest.version}: copied or misplaced"
        )
    return manifest


# --- head record -------------------------------------------------------------------------------

HEAD_FORMAT = "pulsenet-sync-head"
MAX_HEAD = 64 << 10
"""Largest head object a reader fetches (a real one is about 400 bytes)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Head:
    """The publisher's signed statement "the newest version is ``version``, as of ``time_ms``".

    Manifests are create-only, but whoever can delete objects can remove the newest ones, and a
    reader with no state would settle for the older version left. The head (``Layout.head``, one
    overwritable object, written after each manifest) lets it notice: a head naming a version whose
    manifest is gone, or a head older than the reader's freshness bound, is an alarm.
    """

    version: int
    model_digest: str
    publisher: str
    """Key id of the signer."""
    time_ms: int
    """Unix time in milliseconds when the publisher signed it."""

    def to_body(self) -> dict:
        return {
            "format": HEAD_FORMAT,
            "schema": SCHEMA,
            "version": self.version,
            "model_digest": self.model_digest,
            "publisher": self.publisher,
            "time_ms": self.time_ms,
        }

    @classmethod
    def from_body(cls, body: Mapping) -> Head:
        if body.get("format") != HEAD_FORMAT or body.get("schema") != SCHEMA:
            raise ManifestError(f"not a {HEAD_FORMAT} v{SCHEMA} record (format {_short(body.get('format'))})")
        digest, publisher = body.get("model_digest"), body.get("publisher")
        if not is_sha256(digest) or not isinstance(publisher, str):
            raise ManifestError("head record: malformed model_digest or publisher")
        return cls(
            version=_int(body, "version", MAX_VERSION),
            model_digest=digest,
            publisher=publisher,
            time_ms=_int(body, "time_ms"),
        )


def sign_head(head: Head, key: Ed25519PrivateKey, *, context: str) -> bytes:
    if head.publisher != key_id(key.public_key()):
        raise ManifestError(f"head publisher {head.publisher!r} is not the signing key")
    return sign_document(head.to_body(), key, context=context)


def head_from(signed: Signed) -> Head:
    """The head record in a verified document, else ManifestError."""
    head = Head.from_body(signed.body)
    if head.publisher != signed.signer:
        raise ManifestError(f"head record claims publisher {head.publisher!r} but {signed.signer!r} signed it")
    return head
