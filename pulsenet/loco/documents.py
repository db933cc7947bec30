"""The PULSELoCo round protocol on an object store: key layout, signed documents, fetch and verify.

Key layout, relative to the run's store URL (spec and the safety argument: docs/loco.md)::

    members/<id>                                   signed: this trainer takes part in the run
    trainers/<id>/<round:08d>/<sha16>.payload      payload bytes (content-addressed, written first)
    trainers/<id>/<round:08d>/manifest             signed: key, size, SHA-256 of the payload (create-only)
    trainers/<id>/<round:08d>/digest               signed: SHA-256 digest of (θ, m) after the round (create-only)
    trainers/<id>/checkpoint/<round:08d>/<sha16>.pt  the trainer's own resume point (every few rounds)
    trainers/<id>/checkpoint/<round:08d>/manifest    signed: its key, size, SHA-256
    rounds/<round:08d>/record                      signed: the round's participant set (create-only: first writer wins)
    state/<round:08d>/<sha16>.safetensors          agreed global state after the round (genesis = 0)
    state/<round:08d>/manifest                     signed: its key, size, SHA-256 and global digest (create-only)

Each trainer writes only under ``trainers/<id>/``, plus the two shared create-only kinds
(``rounds/``, ``state/``), which can never be overwritten once they exist.

Trust: every document is signed for the context ``pulseloco/<run>/<store url>`` (a document from
another run or store fails), and carries the run id, its kind, and the trainer and round it is
about, checked against the key it was read from. The run's trainers are a map ``trainer id ->
public key``: ``members/<id>`` and everything under ``trainers/<id>/`` verify against ``<id>``'s key
only, so one compromised key cannot speak for another trainer; records and state manifests verify
against the key of the trainer they name as ``writer``. An object a document points to is used
only if its size and SHA-256 match, and is never read past the size the document gives; documents
are read up to ``max_document`` bytes. Every store call runs under a timeout; hashing and other CPU
work runs in threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import tempfile
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.deadlines import SMALL_CALL_S, TRANSFER_S
from pulsenet.errors import (
    ConditionFailed,
    ConfigError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    SignatureError,
    VerificationError,
)
from pulsenet.loco.state import GlobalState, file_sha256
from pulsenet.signing import key_id, load_public_key, sign_document, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)
T = TypeVar("T")

TRAINER_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PROTOCOL = "pulseloco"
MAX_DOCUMENT = 1 << 20
"""Largest round document read (records are the largest: ~200 bytes per trainer)."""
MAX_ROUND = 10**8 - 1
"""Rounds are 8 digits in keys."""
KIND_MEMBER = "pulseloco-member"
KIND_MANIFEST = "pulseloco-payload"
KIND_RECORD = "pulseloco-round"
KIND_DIGEST = "pulseloco-digest"
KIND_STATE = "pulseloco-state"
KIND_CHECKPOINT = "pulseloco-checkpoint"


def check_trainer_id(tid: str) -> str:
    if not isinstance(tid, str) or not TRAINER_ID.fullmatch(tid):
        raise ConfigError(
            f"trainer id {tid!r} must be 1-63 lowercase letters, digits, '-' or '_' (it is part of keys)"
        )
    return tid


def check_run_id(run: str) -> str:
    if not isinstance(run, str) or not RUN_ID.fullmatch(run):
        raise ConfigError(f"run id {run!r} must be 1-128 letters, digits, '.', '-' or '_'")
    return run


def signing_context(run: str, store_url: str) -> str:
    """What every document of ``run`` in the store at ``store_url`` is signed for (endpoint-free)."""
    return f"{PROTOCOL}/{check_run_id(run)}/{store_url.rstrip('/')}"


def trainer_keys(specs: Iterable[str | Path]) -> dict[str, Ed25519PublicKey]:
    """``trainer id -> public key`` from ``ID=PATH`` or ``PATH`` specs.

    A bare path names the trainer by its file name up to the first dot (``keys/t0.pub`` and
    ``keys/t0.key.pub`` are both ``t0``): trainer ids contain no dots.
    """
    keys: dict[str, Ed25519PublicKey] = {}
    for spec in specs:
        text = str(spec)
        tid, sep, path = text.partition("=")
        if not sep:
            tid, path = Path(text).name.split(".", 1)[0], text
        check_trainer_id(tid)
        if tid in keys:
            raise ConfigError(f"trainer {tid!r} is given two public keys ({text})")
        keys[tid] = load_public_key(path)
    if not keys:
        raise ConfigError("no trainer public keys given")
    return keys


async def all_of(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all, in a TaskGroup: the first failure cancels the rest and is raised as itself (not
    an ExceptionGroup), so callers keep catching typed errors and nothing is left running."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_awaited(a)) for a in aws]
    except BaseExceptionGroup as eg:
        raise first_error(eg) from None
    return [t.result() for t in tasks]


async def _awaited(a: Awaitable[T]) -> T:
    return await a


def first_error(eg: BaseExceptionGroup) -> BaseException:
    """What the caller of a TaskGroup should see: the first error in it that is not a cancellation."""
    for e in eg.exceptions:
        if isinstance(e, BaseExceptionGroup):
            return first_error(e)
        if not isinstance(e, asyncio.CancelledError):
            return e
    return eg.exceptions[0]


def _r(round_: int) -> str:
    return f"{round_:08d}"


def member_key(tid: str) -> str:
    return f"members/{tid}"


def round_prefix(tid: str, round_: int) -> str:
    return f"trainers/{tid}/{_r(round_)}/"


def manifest_key(tid: str, round_: int) -> str:
    return round_prefix(tid, round_) + "manifest"


def payload_key(tid: str, round_: int, sha256: str) -> str:
    return round_prefix(tid, round_) + f"{sha256[:16]}.payload"


def digest_key(tid: str, round_: int) -> str:
    return round_prefix(tid, round_) + "digest"


def record_key(round_: int) -> str:
    return f"rounds/{_r(round_)}/record"


def state_manifest_key(round_: int) -> str:
    return f"state/{_r(round_)}/manifest"


def checkpoint_manifest_key(tid: str, round_: int) -> str:
    return f"trainers/{tid}/checkpoint/{_r(round_)}/manifest"


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """An object a signed document vouches for."""

    key: str
    size: int
    sha256: str

    @classmethod
    def parse(cls, d: Any, where: str) -> ObjectRef:
        if not isinstance(d, dict):
            raise ManifestError(f"{where}: object reference is a {type(d).__name__}, not an object")
        ref = cls(
            key=_str(d, "key", where, limit=1024),
            size=_int(d, "size", where, limit=1 << 50),
            sha256=_str(d, "sha256", where, limit=64),
        )
        if not re.fullmatch(r"[0-9a-f]{64}", ref.sha256):
            raise ManifestError(f"{where}: bad SHA-256 {ref.sha256!r}")
        return ref


def _int(body: Mapping[str, Any], name: str, where: str, *, limit: int = MAX_ROUND) -> int:
    """``body[name]`` as an int in ``[0, limit]`` (bools, floats and strings are not ints here)."""
    v = body.get(name)
    if type(v) is not int or not 0 <= v <= limit:
        raise ManifestError(f"{where}: {name} must be an integer in [0, {limit}], got {str(v)[:40]!r}")
    return v


def _str(body: Mapping[str, Any], name: str, where: str, *, limit: int = 4096) -> str:
    v = body.get(name)
    if not isinstance(v, str) or len(v) > limit:
        raise ManifestError(f"{where}: {name} must be a string of at most {limit} characters")
    return v


def _reasons(body: Mapping[str, Any], name: str, where: str) -> dict[str, str]:
    v = body.get(name, {})
    if not isinstance(v, dict):
        raise ManifestError(f"{where}: {name} must be an object")
    return {check_doc_trainer(t, where): _str(v, t, where) for t in v}


def check_doc_trainer(tid: Any, where: str) -> str:
    if not isinstance(tid, str) or not TRAINER_ID.fullmatch(tid):
        raise ManifestError(f"{where}: {str(tid)[:80]!r} is not a trainer id")
    return tid


@dataclass(frozen=True, slots=True)
class Manifest:
    """A trainer's signed statement: 'my round-r payload is this object'."""

    trainer: str
    round: int
    payload: ObjectRef
    mode: str
    sent: int
    total: int
    base_digest: str
    """Digest of the global state the payload was trained from (diagnostics)."""


@dataclass(frozen=True, slots=True)
class Record:
    """The round's decision, fixed by whoever writes it first; every trainer applies exactly this."""

    round: int
    writer: str
    participants: dict[str, ObjectRef]
    """Payloads to average, by trainer id."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Trainers whose payload failed validation (malformed, non-finite, outsized), with the reason."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Trainers whose payload was announced but could not be fetched or verified, with the reason."""
    base_digest: str = ""


@dataclass(frozen=True, slots=True)
class StateRef:
    round: int
    state: ObjectRef
    digest: str
    writer: str


@dataclass(kw_only=True, slots=True)
class Timeouts:
    """Store deadlines for the protocol's calls."""

    small_s: float = SMALL_CALL_S
    """Documents, listings, deletes."""
    transfer_s: float = TRANSFER_S
    """Payloads, states and checkpoints (size varies by 1000x between tiny and real models)."""


class RoundStore:
    """One trainer's view of a PULSELoCo run in an object store: it signs what it writes, verifies what it reads.

    ``keys``: ``trainer id -> public key`` of every trainer of the run (:func:`trainer_keys`).
    """

    def __init__(
        self,
        store: ObjectStore,
        trainer_id: str,
        key: Ed25519PrivateKey,
        keys: Mapping[str, Ed25519PublicKey],
        timeouts: Timeouts | None = None,
        *,
        run: str = "default",
        max_document: int = MAX_DOCUMENT,
    ) -> None:
        self.store = store
        self.id = check_trainer_id(trainer_id)
        self.key = key
        self.keys = {check_trainer_id(t): k for t, k in keys.items()}
        self.run = check_run_id(run)
        self.context = signing_context(run, store.url)
        self.max_document = max_document
        self.t = timeouts or Timeouts()
        self._kid = {t: key_id(k) for t, k in self.keys.items()}
        self._all = {self._kid[t]: k for t, k in self.keys.items()}

    # --- signed documents ---------------------------------------------------------------------

    def sign(self, body: Mapping[str, Any]) -> bytes:
        """The document this trainer writes for ``body``: the run id added, signed for the run's context."""
        return sign_document({**body, "run": self.run}, self.key, context=self.context)

    async def _put_doc(self, key: str, body: dict[str, Any], *, create_only: bool) -> None:
        await self.store.put(key, self.sign(body), if_none_match=create_only, timeout=self.t.small_s)

    async def _get_raw(self, key: str) -> bytes | None:
        """The bytes at ``key`` (at most ``max_document``, else ObjectTooLarge), or None if absent."""
        try:
            return await self.store.get(key, timeout=self.t.small_s, max_bytes=self.max_document)
        except ObjectNotFound:
            return None

    async def _get_doc(self, key: str, kind: str, *, signer: str | None) -> dict[str, Any] | None:
        data = await self._get_raw(key)
        return None if data is None else self._verify(key, data, kind, signer=signer)

    def _verify(self, key: str, data: bytes, kind: str, *, signer: str | None) -> dict[str, Any]:
        """The verified body of the document ``data`` read at ``key``.

        ``signer``: the trainer whose key alone may have signed it (its own slot); None: any
        trainer of the run, which the body must name as its ``writer``. Any malformed, foreign or
        misattributed document raises a ManifestError (SignatureError: the wrong key or context).
        """
        if signer is not None and signer not in self.keys:
            raise SignatureError(f"{key}: {signer!r} is not a trainer of this run (no public key for it)")
        trusted = self._all if signer is None else {self._kid[signer]: self.keys[signer]}
        signed = verify_document(data, trusted, context=self.context)
        body = signed.body
        if body.get("kind") != kind:
            raise ManifestError(f"{key}: expected a {kind} document, got kind {str(body.get('kind'))[:40]!r}")
        if body.get("run") != self.run:
            raise ManifestError(f"{key}: document of run {str(body.get('run'))[:80]!r}, not {self.run!r}")
        if signer is not None:
            if body.get("trainer") != signer:
                raise ManifestError(
                    f"{key}: document is about trainer {str(body.get('trainer'))[:80]!r}, not {signer!r}"
                )
            who = signer
        else:
            who = check_doc_trainer(body.get("writer"), key)
            if who not in self._kid:
                raise SignatureError(f"{key}: writer {who!r} is not a trainer of this run")
        if self._kid[who] != signed.signer:
            raise SignatureError(f"{key}: signed by key {signed.signer}, not by {who}'s key")
        return body

    # --- membership ---------------------------------------------------------------------------

    async def join(self) -> None:
        await self._put_doc(member_key(self.id), {"kind": KIND_MEMBER, "trainer": self.id}, create_only=False)

    async def members(self) -> list[str]:
        """Trainers of the run that announced themselves (ids only; their documents are verified when
        used). A listed id with no public key is not a trainer of this run and is ignored."""
        infos = await self.store.list("members/", timeout=self.t.small_s)
        ids = [i.key.removeprefix("members/") for i in infos]
        return sorted(t for t in ids if t in self.keys)

    # --- payloads -----------------------------------------------------------------------------

    async def publish_payload(
        self, round_: int, data: bytes, *, mode: str, sent: int, total: int, base_digest: str
    ) -> tuple[Manifest, bool]:
        """Upload the payload, then its manifest (create-only). Returns ``(manifest, fresh)``.

        ``fresh`` is False when a manifest for this round already existed (a restarted trainer
        redoing a round it had published before dying): the stored one stands and is returned.
        The payload key is content-addressed, so re-uploading never alters an object a manifest names.
        """
        existing = await self.read_manifest(self.id, round_)
        if existing is not None:
            return existing, False
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        ref = ObjectRef(payload_key(self.id, round_, sha), len(data), sha)
        await self.store.put(ref.key, data, timeout=self.t.transfer_s)
        manifest = Manifest(self.id, round_, ref, mode, sent, total, base_digest)
        body = {"kind": KIND_MANIFEST, **asdict(manifest)}
        try:
            await self._put_doc(manifest_key(self.id, round_), body, create_only=True)
        except ConditionFailed:
            stored = await self.read_manifest(self.id, round_)
            if stored is None:
                raise
            return stored, False
        return manifest, True

    async def read_manifest(self, tid: str, round_: int) -> Manifest | None:
        data = await self._get_raw(manifest_key(tid, round_))
        return None if data is None else self.parse_manifest(data, tid, round_)

    def parse_manifest(self, data: bytes, tid: str, round_: int) -> Manifest:
        """``tid``'s round-``round_`` manifest from its bytes: verified under ``tid``'s key and checked."""
        key = manifest_key(tid, round_)
        body = self._verify(key, data, KIND_MANIFEST, signer=tid)
        m = Manifest(
            trainer=tid,
            round=_int(body, "round", key),
            payload=ObjectRef.parse(body.get("payload"), key),
            mode=_str(body, "mode", key, limit=64),
            sent=_int(body, "sent", key, limit=1 << 50),
            total=_int(body, "total", key, limit=1 << 50),
            base_digest=_str(body, "base_digest", key, limit=64),
        )
        if m.trainer != tid or m.round != round_ or not m.payload.key.startswith(round_prefix(tid, round_)):
            raise ManifestError(
                f"{key}: manifest claims trainer {m.trainer!r} round {m.round} key {m.payload.key!r}"
            )
        return m

    async def fetch(self, ref: ObjectRef) -> bytes:
        """Download an object a verified document names and check its size and SHA-256."""
        data = await self.store.get(ref.key, timeout=self.t.transfer_s, max_bytes=ref.size)
        if len(data) != ref.size:
            raise VerificationError(f"{ref.key}: {len(data)} bytes, the manifest says {ref.size}")
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        if sha != ref.sha256:
            raise VerificationError(
                f"{ref.key}: SHA-256 {sha[:16]}... does not match the manifest's {ref.sha256[:16]}..."
            )
        return data

    # --- round records ------------------------------------------------------------------------

    async def read_record(self, round_: int) -> Record | None:
        data = await self._get_raw(record_key(round_))
        return None if data is None else self.parse_record(data, round_)

    def parse_record(self, data: bytes, round_: int) -> Record:
        """Round ``round_``'s record from its bytes: verified under its writer's key and checked."""
        key = record_key(round_)
        body = self._verify(key, data, KIND_RECORD, signer=None)
        participants = body.get("participants")
        if not isinstance(participants, dict):
            raise ManifestError(f"{key}: participants must be an object")
        rec = Record(
            round=_int(body, "round", key),
            writer=_str(body, "writer", key),
            participants={
                check_doc_trainer(t, key): ObjectRef.parse(r, key) for t, r in participants.items()
            },
            rejected=_reasons(body, "rejected", key),
            unavailable=_reasons(body, "unavailable", key),
            base_digest=_str(body, "base_digest", key, limit=64),
        )
        if not set(rec.participants) <= set(self.keys):
            raise ManifestError(f"{key}: names participants that are not trainers of this run")
        if rec.round != round_ or not rec.participants:
            raise ManifestError(
                f"{key}: record for round {rec.round} with {len(rec.participants)} participants"
            )
        for tid, ref in rec.participants.items():
            if not ref.key.startswith(round_prefix(tid, round_)):
                raise ManifestError(
                    f"{key}: participant {tid} points at {ref.key!r}, outside its round prefix"
                )
        return rec

    async def propose_record(self, record: Record) -> tuple[Record, bool]:
        """Write ``record`` create-only. Returns ``(the record that stands, we_won)``.

        If another trainer wrote first, theirs stands and is what every trainer applies.
        """
        body = {
            "kind": KIND_RECORD,
            "round": record.round,
            "writer": record.writer,
            "participants": {t: asdict(r) for t, r in record.participants.items()},
            "rejected": dict(record.rejected),
            "unavailable": dict(record.unavailable),
            "base_digest": record.base_digest,
        }
        try:
            await self._put_doc(record_key(record.round), body, create_only=True)
            return record, True
        except ConditionFailed:
            winner = await self.read_record(record.round)
            if winner is None:  # 412 yet absent: only a store that lost an object could say this
                raise
            return winner, False

    async def latest_record_round(self) -> int:
        """Highest round with a record (0 if none): how far the run has got."""
        infos = await self.store.list("rounds/", timeout=self.t.small_s)
        rounds = [int(m.group(1)) for i in infos if (m := re.fullmatch(r"rounds/(\d{8})/record", i.key))]
        return max(rounds, default=0)

    # --- digests ------------------------------------------------------------------------------

    async def publish_digest(self, round_: int, digest: str) -> str:
        """Publish our post-round digest (create-only); returns the one that stands in the store."""
        body = {"kind": KIND_DIGEST, "trainer": self.id, "round": round_, "digest": digest}
        try:
            await self._put_doc(digest_key(self.id, round_), body, create_only=True)
            return digest
        except ConditionFailed:
            stored = await self.read_digest(self.id, round_)
            return stored if stored is not None else digest

    async def read_digest(self, tid: str, round_: int) -> str | None:
        data = await self._get_raw(digest_key(tid, round_))
        return None if data is None else self.parse_digest(data, tid, round_)

    def parse_digest(self, data: bytes, tid: str, round_: int) -> str:
        """``tid``'s post-round digest from its document's bytes (verified under ``tid``'s key)."""
        key = digest_key(tid, round_)
        body = self._verify(key, data, KIND_DIGEST, signer=tid)
        if _int(body, "round", key) != round_:
            raise ManifestError(f"{key}: digest document is for round {body['round']}")
        digest = _str(body, "digest", key, limit=64)
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ManifestError(f"{key}: {digest!r} is not a SHA-256 digest")
        return digest

    # --- global state -------------------------------------------------------------------------

    async def publish_state(self, state: GlobalState, digest: str) -> StateRef:
        """Upload the global state and its manifest (create-only); the first one for a round stands."""
        with tempfile.TemporaryDirectory(prefix="pulseloco-state-") as tmp:
            path = Path(tmp) / "state.safetensors"
            await asyncio.to_thread(state.save, path)
            sha = await asyncio.to_thread(file_sha256, path)
            size = path.stat().st_size
            ref = ObjectRef(f"state/{_r(state.round)}/{sha[:16]}.safetensors", size, sha)
            await self.store.put_file(ref.key, path, timeout=self.t.transfer_s)
        body = {
            "kind": KIND_STATE,
            "round": state.round,
            "state": asdict(ref),
            "digest": digest,
            "writer": self.id,
        }
        try:
            await self._put_doc(state_manifest_key(state.round), body, create_only=True)
        except ConditionFailed:
            stored = await self.read_state_ref(state.round)
            if stored is None:
                raise
            return stored
        return StateRef(state.round, ref, digest, self.id)

    async def read_state_ref(self, round_: int) -> StateRef | None:
        data = await self._get_raw(state_manifest_key(round_))
        return None if data is None else self.parse_state_ref(data, round_)

    def parse_state_ref(self, data: bytes, round_: int) -> StateRef:
        """Round ``round_``'s global-state manifest from its bytes (verified under its writer's key)."""
        key = state_manifest_key(round_)
        body = self._verify(key, data, KIND_STATE, signer=None)
        ref = StateRef(
            round=_int(body, "round", key),
            state=ObjectRef.parse(body.get("state"), key),
            digest=_str(body, "digest", key, limit=64),
            writer=_str(body, "writer", key),
        )
        if ref.round != round_ or not ref.state.key.startswith(f"state/{_r(round_)}/"):
            raise ManifestError(f"{key}: state manifest does not match its key")
        return ref

    async def state_rounds(self) -> list[int]:
        """Rounds that have a global state manifest, ascending."""
        infos = await self.store.list("state/", timeout=self.t.small_s)
        return sorted(int(m.group(1)) for i in infos if (m := re.fullmatch(r"state/(\d{8})/manifest", i.key)))

    async def fetch_state(self, ref: StateRef, shapes: dict[str, tuple[int, ...]]) -> GlobalState:
        """Download, verify (size, SHA-256, shapes, round, digest) and load a global state."""
        with tempfile.TemporaryDirectory(prefix="pulseloco-state-") as tmp:
            path = Path(tmp) / "state.safetensors"
            await self.store.get_file(
                ref.state.key, path, timeout=self.t.transfer_s, max_bytes=ref.state.size
            )
            size, sha = path.stat().st_size, await asyncio.to_thread(file_sha256, path)
            if size != ref.state.size or sha != ref.state.sha256:
                raise VerificationError(f"{ref.state.key}: size/SHA-256 do not match its manifest")
            state = await asyncio.to_thread(GlobalState.load, path, shapes)
        if state.round != ref.round:
            raise VerificationError(f"{ref.state.key}: holds round {state.round}, manifest says {ref.round}")
        digest = await asyncio.to_thread(state.digest)
        if digest != ref.digest:
            raise VerificationError(f"{ref.state.key}: digest {digest[:16]} != manifest's {ref.digest[:16]}")
        return state

    # --- the trainer's own checkpoints ----------------------------------------------------------

    async def publish_checkpoint(self, round_: int, path: Path) -> None:
        sha = await asyncio.to_thread(file_sha256, path)
        ref = ObjectRef(f"trainers/{self.id}/checkpoint/{_r(round_)}/{sha[:16]}.pt", path.stat().st_size, sha)
        await self.store.put_file(ref.key, path, timeout=self.t.transfer_s)
        body = {"kind": KIND_CHECKPOINT, "trainer": self.id, "round": round_, "checkpoint": asdict(ref)}
        await self._put_doc(checkpoint_manifest_key(self.id, round_), body, create_only=False)

    async def latest_checkpoint(self) -> tuple[int, ObjectRef] | None:
        prefix = f"trainers/{self.id}/checkpoint/"
        infos = await self.store.list(prefix, timeout=self.t.small_s)
        rounds = sorted(
            (
                int(m.group(1))
                for i in infos
                if (m := re.fullmatch(re.escape(prefix) + r"(\d{8})/manifest", i.key))
            ),
            reverse=True,
        )
        for r in rounds:
            key = checkpoint_manifest_key(self.id, r)
            try:
                body = await self._get_doc(key, KIND_CHECKPOINT, signer=self.id)
                if body is None:
                    continue
                ref = ObjectRef.parse(body.get("checkpoint"), key)
                if _int(body, "round", key) != r or not ref.key.startswith(f"{prefix}{_r(r)}/"):
                    raise ManifestError(f"{key}: checkpoint manifest does not match its key")
            except (ManifestError, ObjectTooLarge) as e:  # planted or torn: an older one may do
                log.warning("%s: ignoring checkpoint manifest %s: %s", self.id, key, e)
                continue
            return r, ref
        return None

    async def fetch_checkpoint(self, ref: ObjectRef, path: Path) -> None:
        await self.store.get_file(ref.key, path, timeout=self.t.transfer_s, max_bytes=ref.size)
        if path.stat().st_size != ref.size or await asyncio.to_thread(file_sha256, path) != ref.sha256:
            raise VerificationError(f"{ref.key}: size/SHA-256 do not match its manifest")

    # --- retention ----------------------------------------------------------------------------

    async def delete_own_before(self, round_: int) -> int:
        """Delete this trainer's round objects older than ``round_``, and its checkpoints older than
        both ``round_`` and its newest checkpoint (a resume point always survives). Returns the count."""
        prefix = f"trainers/{self.id}/"
        infos = await self.store.list(prefix, timeout=self.t.small_s)
        rounds = re.compile(re.escape(prefix) + r"(\d{8})/")
        ckpts = re.compile(re.escape(prefix) + r"checkpoint/(\d{8})/")
        newest_ckpt = max((int(m.group(1)) for i in infos if (m := ckpts.match(i.key))), default=0)

        def is_old(key: str) -> bool:
            if m := rounds.match(key):
                return int(m.group(1)) < round_
            if m := ckpts.match(key):
                return int(m.group(1)) < min(round_, newest_ckpt)
            return False

        old = [i.key for i in infos if is_old(i.key)]
        await self.store.delete(old, timeout=self.t.small_s)
        return len(old)
