"""Rollout batch manifests: the inference node's signed statement that a batch exists and what it is.

A manifest is a signed document (``pulsenet.signing``) whose body is::

    {"format": "pulsenet-rollout-manifest", "schema": 2,
     "node": "inf-0", "seq": 17, "version": 12,
     "model_digest": "<hex digest of the weights that served every row>",
     "payload": {"key": "rollouts/batches/v...-inf-0-00000017-<sha16>.parquet", "size": 81234, "sha256": "<hex>"},
     "rows": 64, "groups": 8, "tokens": 9120, "dropped": [3],
     "publisher": "<key id of the signer>", "created": "2025-01-01T00:00:00.000000+00:00"}

``dropped`` (schema 2, issue 38): the problem numbers of the batch's assignment the node left out
because its prompter drops them (over ``max_prompt_tokens`` or the model's context), sorted and
distinct: the trainer checks every assigned problem is answered or declared so, and declared only
when its own prompter drops it too (rl/answers.py). A schema 1 manifest (no ``dropped``) reads as
declaring none.

It is signed for the context ``RolloutLayout.context(run, store_url, node)`` (see there for why), written
create-only after the payload. Readers accept it only if a key trusted *for that node* signed it,
``publisher`` is that key, and its node/version/seq are the ones its own key names.

The node's **head** (``RolloutLayout.head``), signed for ``RolloutLayout.head_context``, is
overwritten after every manifest so that a trainer can poll the channel with one conditional GET
and list the manifests only when the head moved::

    {"format": "pulsenet-rollout-head", "schema": 1, "node": "inf-0", "seq": 1767225600000000,
     "next_seq": 18, "newest_version": 12, "publisher": "<key id>", "created": "..."}

``seq`` grows with every write (the writer's clock in microseconds, or the last + 1): a head whose
seq is below one already verified is a replayed copy. ``next_seq`` and ``newest_version`` say what
the node had written (diagnostics; nothing is accepted on a head's word: batches still come from
the listing and their own signed manifests).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.errors import ManifestError
from pulsenet.rollouts.layout import MAX_SEQ, MAX_VERSION, NODE, BatchName, RolloutLayout
from pulsenet.signed import ObjectRef, is_sha256
from pulsenet.signing import Signed, key_id, sign_document

FORMAT = "pulsenet-rollout-manifest"
SCHEMA = 2
"""2: ``dropped`` (issue 38); 1 is still read (no problem declared dropped)."""
HEAD_SCHEMA = 1
MAX_DROPPED = 1 << 16
"""Most problem numbers one manifest may declare dropped (``Demand.prompts_per_batch`` at most)."""
MAX_MANIFEST = 64 << 10
"""Largest batch manifest a writer reads back at start (a real one is about 700 bytes)."""
_FIELDS = frozenset(
    {
        "format",
        "schema",
        "node",
        "seq",
        "version",
        "model_digest",
        "payload",
        "rows",
        "groups",
        "tokens",
        "publisher",
        "created",
    }
)
_FIELDS_V1 = _FIELDS
_FIELDS_V2 = _FIELDS | {"dropped"}


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchManifest:
    """A validated manifest body (see the module docstring for the wire form)."""

    node: str
    seq: int
    version: int
    model_digest: str
    payload: ObjectRef
    """The Parquet payload: its key is the batch key ``layout.batch`` gives for this batch."""
    rows: int
    groups: int
    tokens: int
    """Prompt plus completion tokens over all rows."""
    publisher: str
    """Key id of the signer."""
    created: str
    dropped: tuple[int, ...] = ()
    """Problem numbers of the assignment left out: the node's prompter drops them (module docstring)."""

    @property
    def name(self) -> BatchName:
        return BatchName(self.version, self.node, self.seq)

    def to_body(self) -> dict:
        return {
            "format": FORMAT,
            "schema": SCHEMA,
            "node": self.node,
            "seq": self.seq,
            "version": self.version,
            "model_digest": self.model_digest,
            "payload": self.payload.to_json(),
            "rows": self.rows,
            "groups": self.groups,
            "tokens": self.tokens,
            "dropped": list(self.dropped),
            "publisher": self.publisher,
            "created": self.created,
        }

    @classmethod
    def from_body(cls, body: Mapping, layout: RolloutLayout) -> BatchManifest:
        """Validate a body's shape; ManifestError names what is wrong."""
        try:
            return _from_body(body, layout)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"malformed rollout manifest: {type(e).__name__}: {e}") from None


def _from_body(body: Mapping, layout: RolloutLayout) -> BatchManifest:
    schema = body.get("schema")
    fields = {1: _FIELDS_V1, 2: _FIELDS_V2}.get(schema) if type(schema) is int else None
    if body.get("format") != FORMAT or set(body) != fields:
        raise ManifestError(f"not a {FORMAT} v1 or v2 manifest (fields {sorted(body)[:20]})")
    node = body["node"]
    if not isinstance(node, str) or not NODE.fullmatch(node):
        raise ManifestError(f"rollout manifest node {str(node)[:80]!r} is not a node id")
    seq, version = _int(body, "seq", MAX_SEQ), _int(body, "version", MAX_VERSION)
    ref = ObjectRef.parse(body["payload"], "rollout manifest payload")
    if ref.key != layout.batch(version, node, seq, ref.sha256):
        raise ManifestError(f"rollout manifest names payload {str(ref.key)[:200]!r}, not its own batch key")
    if not is_sha256(body["model_digest"]):
        raise ManifestError("rollout manifest model_digest is not 64 lowercase hex digits")
    rows, groups, tokens = (_int(body, n, 1 << 62) for n in ("rows", "groups", "tokens"))
    if not 0 < groups <= rows:
        raise ManifestError(f"rollout manifest: {groups} groups for {rows} rows")
    if not isinstance(body["publisher"], str) or not isinstance(body["created"], str):
        raise ManifestError("rollout manifest publisher and created must be strings")
    dropped = body.get("dropped", [])
    if (
        not isinstance(dropped, list)
        or len(dropped) > MAX_DROPPED
        or not all(type(k) is int and 0 <= k < MAX_DROPPED for k in dropped)
        or dropped != sorted(set(dropped))
    ):
        raise ManifestError(f"rollout manifest dropped must be sorted distinct ints below {MAX_DROPPED}")
    return BatchManifest(
        node=node,
        seq=seq,
        version=version,
        model_digest=body["model_digest"],
        payload=ref,
        rows=rows,
        groups=groups,
        tokens=tokens,
        publisher=body["publisher"],
        created=body["created"],
        dropped=tuple(dropped),
    )


def _int(body: Mapping, name: str, most: int) -> int:
    v = body[name]
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= most:
        raise ManifestError(f"rollout manifest field {name!r} must be an int in 0..{most}, got {str(v)[:40]}")
    return v


HEAD_FORMAT = "pulsenet-rollout-head"
MAX_HEAD = 4096
"""Largest head record a trainer fetches (a real one is about 330 bytes)."""
_HEAD_FIELDS = frozenset({"format", "schema", "node", "seq", "next_seq", "newest_version", "publisher", "created"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutHead:
    """A node's head record (module docstring)."""

    node: str
    seq: int
    next_seq: int
    newest_version: int
    publisher: str
    created: str

    def to_body(self) -> dict:
        return {
            "format": HEAD_FORMAT,
            "schema": HEAD_SCHEMA,
            "node": self.node,
            "seq": self.seq,
            "next_seq": self.next_seq,
            "newest_version": self.newest_version,
            "publisher": self.publisher,
            "created": self.created,
        }


def head_from(signed: Signed, node: str) -> RolloutHead:
    """The head record of ``node`` in a verified document, else ManifestError."""
    body = signed.body
    try:
        if body.get("format") != HEAD_FORMAT or body.get("schema") != HEAD_SCHEMA or set(body) != _HEAD_FIELDS:
            raise ManifestError(f"not a {HEAD_FORMAT} v{HEAD_SCHEMA} record")
        head = RolloutHead(
            node=body["node"],
            seq=_int(body, "seq", 1 << 62),
            next_seq=_int(body, "next_seq", MAX_SEQ + 1),
            newest_version=_int(body, "newest_version", MAX_VERSION),
            publisher=body["publisher"],
            created=body["created"],
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"malformed rollout head: {type(e).__name__}: {e}") from None
    if head.node != node or head.publisher != signed.signer or not isinstance(head.created, str):
        raise ManifestError(f"rollout head of {str(head.node)[:80]!r} by {head.publisher!r} in the slot of {node!r}")
    return head


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


def sign_batch_manifest(manifest: BatchManifest, key: Ed25519PrivateKey, *, context: str) -> bytes:
    if manifest.publisher != key_id(key.public_key()):
        raise ManifestError(f"manifest publisher {manifest.publisher!r} is not the signing key")
    return sign_document(manifest.to_body(), key, context=context)


def batch_manifest_from(signed: Signed, *, layout: RolloutLayout, name: BatchName | None = None) -> BatchManifest:
    """The batch manifest in a verified document, else ManifestError.

    ``name``: what the object's key says (layout.parse_manifest); a body naming another batch is a
    copy or a misplaced object.
    """
    m = BatchManifest.from_body(signed.body, layout)
    if m.publisher != signed.signer:
        raise ManifestError(
            f"rollout manifest claims publisher {m.publisher!r} but {signed.signer!r} signed it"
        )
    if name is not None and m.name != name:
        raise ManifestError(f"rollout manifest at {name} is signed for {m.name}: copied or misplaced")
    return m
