"""The PULSELoCo round protocol's signed documents: what each says, who may sign it, and the
:class:`RoundStore` that writes and reads them.

Key layout and signing context: ``layout.py``. Each document is fetched and checked the one way every channel
does (``signed.py``): size-capped ``fetch_document``, then the body checked here; every object a
document names through ``fetch_object`` / ``fetch_file`` (size and SHA-256).

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
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.deadlines import SMALL_CALL_S, TRANSFER_S
from pulsenet.errors import (
    ConditionFailed,
    ConfigError,
    ManifestError,
    ObjectNotFound,
    SignatureError,
    VerificationError,
)
from pulsenet.loco.layout import MAX_ROUND, TRAINER_ID, LocoLayout, check_run_id, check_trainer_id
from pulsenet.loco.state import GlobalState
from pulsenet.signed import ObjectRef, fetch_document, fetch_file, fetch_object, file_sha256, is_sha256
from pulsenet.signing import Signed, key_id, load_public_key, sign_document, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)

MAX_DOCUMENT = 1 << 20
"""Largest round document read (records are the largest: ~200 bytes per trainer)."""
CHECKPOINT_READS = 8  # names read at most: a keyless writer can plant any number (retention leaves us 1 or 2)
KIND_MEMBER = "pulseloco-member"
KIND_MANIFEST = "pulseloco-payload"
KIND_RECORD = "pulseloco-round"
KIND_DIGEST = "pulseloco-digest"
KIND_STATE = "pulseloco-state"
KIND_CHECKPOINT = "pulseloco-checkpoint"
KIND_JOINING = "pulseloco-joining"


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

    def to_body(self) -> dict[str, Any]:
        return {
            "kind": KIND_MANIFEST,
            "trainer": self.trainer,
            "round": self.round,
            "payload": self.payload.to_json(),
            "mode": self.mode,
            "sent": self.sent,
            "total": self.total,
            "base_digest": self.base_digest,
        }


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

    Why 34 methods in one class: one signing and trust core (``sign``, ``_read``, ``_verify``,
    ``_trusted``, ``_check``: run, kind, author, the author's own key), then each of the seven
    document kinds' write, read and body check, and retention. Split by kind, seven classes would
    each hold the run's keys, context and layout, and the one trust rule would have seven doors.
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
        scratch_dir: Path | None = None,
    ) -> None:
        self.store = store
        self.scratch_dir = scratch_dir  # global states, checkpoints on disk in passing (None: system temp)
        self.id = check_trainer_id(trainer_id)
        self.key = key
        self.keys = {check_trainer_id(t): k for t, k in keys.items()}
        self.run = check_run_id(run)
        self.layout = LocoLayout(run, store.url)
        self.context = self.layout.context
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

    async def _read(self, key: str, kind: str, *, signer: str | None) -> dict[str, Any] | None:
        """The checked body of the document at ``key`` (see :meth:`_check`), or None if absent.

        Read up to ``max_document`` bytes (else DocumentTooLarge, a ManifestError) and verified in a thread."""
        try:
            signed = await fetch_document(
                self.store,
                key,
                self._trusted(key, signer),
                context=self.context,
                max_bytes=self.max_document,
                timeout=self.t.small_s,
            )
        except ObjectNotFound:
            return None
        return self._check(key, signed, kind, signer=signer)

    def _verify(self, key: str, data: bytes, kind: str, *, signer: str | None) -> dict[str, Any]:
        """:meth:`_read` for a document's bytes already in hand (the fuzz harness's entry point)."""
        signed = verify_document(data, self._trusted(key, signer), context=self.context)
        return self._check(key, signed, kind, signer=signer)

    def _trusted(self, key: str, signer: str | None) -> Mapping[str, Ed25519PublicKey]:
        """``signer``'s key alone (its own slot), or every trainer's (None: the body names its writer)."""
        if signer is None:
            return self._all
        if signer not in self.keys:
            raise SignatureError(f"{key}: {signer!r} is not a trainer of this run (no public key for it)")
        return {self._kid[signer]: self.keys[signer]}

    def _check(self, key: str, signed: Signed, kind: str, *, signer: str | None) -> dict[str, Any]:
        """The body of a document verified at ``key``, checked for its kind, run and author.

        ``signer``: the trainer whose key alone may have signed it (its own slot); None: any
        trainer of the run, which the body must name as its ``writer``. Any malformed, foreign or
        misattributed document raises a ManifestError (SignatureError: the wrong key or context).
        """
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
        await self._put_doc(self.layout.member(self.id), {"kind": KIND_MEMBER, "trainer": self.id}, create_only=False)

    async def announce_joining(self, round_: int) -> None:
        """Say we train round ``round_`` after missing the one before (peers wait for us again)."""
        body = {"kind": KIND_JOINING, "trainer": self.id, "round": round_}
        await self._put_doc(self.layout.joining(self.id, round_), body, create_only=False)

    async def is_joining(self, tid: str, round_: int) -> bool:
        """Whether ``tid`` announced, under its own key, that it trains round ``round_``."""
        key = self.layout.joining(tid, round_)
        body = await self._read(key, KIND_JOINING, signer=tid)
        return body is not None and self._joining(key, body, round_)

    def _joining(self, key: str, body: dict[str, Any], round_: int) -> bool:
        if _int(body, "round", key) != round_:
            raise ManifestError(f"{key}: joining document is for round {body['round']}")
        return True

    async def members(self) -> list[str]:
        """Trainers of the run that announced themselves (ids only; their documents are verified when
        used). A listed id with no public key is not a trainer of this run and is ignored."""
        infos = await self.store.list(self.layout.members, timeout=self.t.small_s)
        return sorted(t for i in infos if (t := self.layout.parse_member(i.key)) in self.keys)

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
        ref = ObjectRef(self.layout.payload(self.id, round_, sha), len(data), sha)
        await self.store.put(ref.key, data, timeout=self.t.transfer_s)
        manifest = Manifest(self.id, round_, ref, mode, sent, total, base_digest)
        try:
            await self._put_doc(self.layout.manifest(self.id, round_), manifest.to_body(), create_only=True)
        except ConditionFailed:
            stored = await self.read_manifest(self.id, round_)
            if stored is None:
                raise
            return stored, False
        return manifest, True

    async def read_manifest(self, tid: str, round_: int) -> Manifest | None:
        key = self.layout.manifest(tid, round_)
        body = await self._read(key, KIND_MANIFEST, signer=tid)
        return None if body is None else self._manifest(key, body, tid, round_)

    def _manifest(self, key: str, body: dict[str, Any], tid: str, round_: int) -> Manifest:
        m = Manifest(
            trainer=tid,
            round=_int(body, "round", key),
            payload=ObjectRef.parse(body.get("payload"), key),
            mode=_str(body, "mode", key, limit=64),
            sent=_int(body, "sent", key, limit=1 << 50),
            total=_int(body, "total", key, limit=1 << 50),
            base_digest=_str(body, "base_digest", key, limit=64),
        )
        if m.trainer != tid or m.round != round_ or not m.payload.key.startswith(self.layout.round_prefix(tid, round_)):
            raise ManifestError(f"{key}: manifest claims trainer {m.trainer!r} round {m.round} key {m.payload.key!r}")
        return m

    async def fetch(self, ref: ObjectRef) -> bytes:
        """The object a verified document names, never read past its size: SizeMismatch or
        VerificationError unless its size and SHA-256 match."""
        return await fetch_object(self.store, ref, timeout=self.t.transfer_s)

    # --- round records ------------------------------------------------------------------------

    async def read_record(self, round_: int) -> Record | None:
        key = self.layout.record(round_)
        body = await self._read(key, KIND_RECORD, signer=None)
        return None if body is None else self._record(key, body, round_)

    def _record(self, key: str, body: dict[str, Any], round_: int) -> Record:
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
            if not ref.key.startswith(self.layout.round_prefix(tid, round_)):
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
            "participants": {t: r.to_json() for t, r in record.participants.items()},
            "rejected": dict(record.rejected),
            "unavailable": dict(record.unavailable),
            "base_digest": record.base_digest,
        }
        try:
            await self._put_doc(self.layout.record(record.round), body, create_only=True)
            return record, True
        except ConditionFailed:
            winner = await self.read_record(record.round)
            if winner is None:  # 412 yet absent: only a store that lost an object could say this
                raise
            return winner, False

    async def latest_record_round(self, known: int = 0) -> tuple[int, int]:
        """How far the run has got: the newest round whose record verifies, at least ``known`` (a
        round whose record the caller has verified); and how many listed record names it ignored.

        A listing is a claim anyone with write access to the bucket can make (``rounds/99999999/
        record``), so it only narrows the search; the answer is a record that parses and verifies.
        Rounds are decided one after another and records are never deleted, so the run's records
        are the listed rounds contiguous from ``known`` up: names past a gap are ignored unread, and
        the newest of the contiguous ones that verifies is found by bisection (a few GETs however
        many names are planted). A name that is ignored or fails to verify is counted, never fatal.
        """
        infos = await self.store.list(self.layout.rounds, timeout=self.t.small_s)
        listed = {r for i in infos if (r := self.layout.parse_record(i.key)) is not None and r > known}
        lo = hi = known
        while hi + 1 in listed:
            hi += 1
        ignored = len(listed) - (hi - known)
        while lo < hi:  # invariant: lo's record verifies (or lo == known); none past hi does
            mid = (lo + hi + 1) // 2
            if await self._record_verifies(mid):
                lo = mid
            else:
                ignored += hi - mid + 1
                hi = mid - 1
        if ignored:
            log.warning("%s: ignored %d listed round-record names that do not verify or are out of sequence", self.id, ignored)
        return lo, ignored

    async def _record_verifies(self, round_: int) -> bool:
        try:
            return await self.read_record(round_) is not None
        except ManifestError as e:  # planted, foreign or malformed: not how far the run has got
            log.warning("%s: ignoring %s: %s", self.id, self.layout.record(round_), e)
            return False

    # --- digests ------------------------------------------------------------------------------

    async def publish_digest(self, round_: int, digest: str) -> str:
        """Publish our post-round digest (create-only); returns the one that stands in the store."""
        body = {"kind": KIND_DIGEST, "trainer": self.id, "round": round_, "digest": digest}
        try:
            await self._put_doc(self.layout.digest(self.id, round_), body, create_only=True)
            return digest
        except ConditionFailed:
            stored = await self.read_digest(self.id, round_)
            return stored if stored is not None else digest

    async def read_digest(self, tid: str, round_: int) -> str | None:
        key = self.layout.digest(tid, round_)
        body = await self._read(key, KIND_DIGEST, signer=tid)
        return None if body is None else self._digest(key, body, round_)

    def _digest(self, key: str, body: dict[str, Any], round_: int) -> str:
        if _int(body, "round", key) != round_:
            raise ManifestError(f"{key}: digest document is for round {body['round']}")
        digest = _str(body, "digest", key, limit=64)
        if not is_sha256(digest):
            raise ManifestError(f"{key}: {digest!r} is not a SHA-256 digest")
        return digest

    # --- global state -------------------------------------------------------------------------

    async def publish_state(self, state: GlobalState, digest: str) -> StateRef:
        """Upload the global state and its manifest (create-only); the first one for a round stands."""
        with tempfile.TemporaryDirectory(prefix="pulseloco-state-", dir=self.scratch_dir) as tmp:
            path = Path(tmp) / "state.safetensors"
            await asyncio.to_thread(state.save, path)
            sha = await asyncio.to_thread(file_sha256, path)
            size = path.stat().st_size
            ref = ObjectRef(self.layout.state(state.round, sha), size, sha)
            await self.store.put_file(ref.key, path, timeout=self.t.transfer_s)
        body = {
            "kind": KIND_STATE,
            "round": state.round,
            "state": ref.to_json(),
            "digest": digest,
            "writer": self.id,
        }
        try:
            await self._put_doc(self.layout.state_manifest(state.round), body, create_only=True)
        except ConditionFailed:
            stored = await self.read_state_ref(state.round)
            if stored is None:
                raise
            return stored
        return StateRef(state.round, ref, digest, self.id)

    async def read_state_ref(self, round_: int) -> StateRef | None:
        key = self.layout.state_manifest(round_)
        body = await self._read(key, KIND_STATE, signer=None)
        return None if body is None else self._state_ref(key, body, round_)

    def _state_ref(self, key: str, body: dict[str, Any], round_: int) -> StateRef:
        ref = StateRef(
            round=_int(body, "round", key),
            state=ObjectRef.parse(body.get("state"), key),
            digest=_str(body, "digest", key, limit=64),
            writer=_str(body, "writer", key),
        )
        if ref.round != round_ or not ref.state.key.startswith(self.layout.state_prefix(round_)):
            raise ManifestError(f"{key}: state manifest does not match its key")
        return ref

    async def state_rounds(self) -> list[int]:
        """Rounds that have a global state manifest, ascending."""
        infos = await self.store.list(self.layout.states, timeout=self.t.small_s)
        return sorted(r for i in infos if (r := self.layout.parse_state_manifest(i.key)) is not None)

    async def fetch_state(self, ref: StateRef, shapes: dict[str, tuple[int, ...]]) -> GlobalState:
        """Download, verify (size, SHA-256, shapes, round, digest) and load a global state. A signed
        size over what the model's state can take (``GlobalState.max_size``) is refused unread."""
        if ref.state.size > (limit := GlobalState.max_size(shapes)):
            raise VerificationError(f"{ref.state.key}: {ref.state.size} bytes claimed, over this model's state's {limit}")
        with tempfile.TemporaryDirectory(prefix="pulseloco-state-", dir=self.scratch_dir) as tmp:
            path = Path(tmp) / "state.safetensors"
            await fetch_file(self.store, ref.state, path, timeout=self.t.transfer_s)
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
        ref = ObjectRef(self.layout.checkpoint(self.id, round_, sha), path.stat().st_size, sha)
        await self.store.put_file(ref.key, path, timeout=self.t.transfer_s)
        body = {"kind": KIND_CHECKPOINT, "trainer": self.id, "round": round_, "checkpoint": ref.to_json()}
        await self._put_doc(self.layout.checkpoint_manifest(self.id, round_), body, create_only=False)

    async def latest_checkpoint(self) -> tuple[int, ObjectRef] | None:
        """Our newest verified checkpoint of the newest ``CHECKPOINT_READS`` names (planted ones: issue 38)."""
        infos = await self.store.list(self.layout.checkpoints(self.id), timeout=self.t.small_s)
        rounds = sorted(
            (r for i in infos if (r := self.layout.parse_checkpoint_manifest(self.id, i.key)) is not None), reverse=True
        )
        for r in rounds[:CHECKPOINT_READS]:
            key = self.layout.checkpoint_manifest(self.id, r)
            try:
                body = await self._read(key, KIND_CHECKPOINT, signer=self.id)
                if body is None:
                    continue
                ref = ObjectRef.parse(body.get("checkpoint"), key)
                if _int(body, "round", key) != r or not ref.key.startswith(self.layout.checkpoint_prefix(self.id, r)):
                    raise ManifestError(f"{key}: checkpoint manifest does not match its key")
            except ManifestError as e:  # planted, torn or oversized: an older one may do
                log.warning("%s: ignoring checkpoint manifest %s: %s", self.id, key, e)
                continue
            return r, ref
        return None

    async def fetch_checkpoint(self, ref: ObjectRef, path: Path) -> None:
        await fetch_file(self.store, ref, path, timeout=self.t.transfer_s)

    # --- retention ----------------------------------------------------------------------------

    async def delete_own_before(self, round_: int, reached: int) -> int:
        """Delete this trainer's round objects older than ``round_``, and its checkpoints older than
        both ``round_`` and its newest checkpoint (a resume point always survives). Returns the count.

        ``reached``: the round this trainer has reached. A listed checkpoint name above it is a
        claim this trainer cannot have written (planted): it never counts as the newest resume
        point, or one planted name would make retention delete the real one."""
        infos = await self.store.list(self.layout.trainer(self.id), timeout=self.t.small_s)
        owned = {i.key: parsed for i in infos if (parsed := self.layout.parse_own(self.id, i.key)) is not None}
        newest_ckpt = max((r for kind, r in owned.values() if kind == "checkpoint" and r <= reached), default=0)

        def is_old(key: str) -> bool:
            if key not in owned:
                return False
            kind, r = owned[key]
            return r < round_ if kind == "round" else r < min(round_, newest_ckpt)

        old = [i.key for i in infos if is_old(i.key)]
        await self.store.delete(old, timeout=self.t.small_s)
        return len(old)

    async def delete_states_before(self, round_: int) -> int:
        """Delete the shared global states of rounds 1..``round_``-1 (manifests first, so a reader
        never finds a manifest without its object). A state older than every trainer's retained
        payloads cannot be replayed forward, so recovery never needs it; genesis (round 0) stays as
        the run's anchor, and round records are never deleted: they are ~1 KB each and their
        create-only slots are what stops a returning trainer from re-deciding an old round alone."""
        infos = await self.store.list(self.layout.states, timeout=self.t.small_s)
        old = {r for i in infos if (r := self.layout.parse_state_manifest(i.key)) is not None and 0 < r < round_}
        prefixes = [self.layout.state_prefix(r) for r in sorted(old)]
        manifests = [self.layout.state_manifest(r) for r in sorted(old)]
        objects = [i.key for i in infos if i.key.startswith(tuple(prefixes)) and i.key not in manifests]
        await self.store.delete(manifests, timeout=self.t.small_s)
        await self.store.delete(objects, timeout=self.t.small_s)
        return len(manifests) + len(objects)
