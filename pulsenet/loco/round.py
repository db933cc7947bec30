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
(``rounds/``, ``state/``), which can never be overwritten once they exist. A document is used only
if it verifies against a trusted key and its body names the trainer and round its key says; an
object a document points to is used only if its size and SHA-256 match. Every store call runs
under a timeout; hashing and other CPU work runs in threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.errors import (
    ConditionFailed,
    ConfigError,
    ManifestError,
    ObjectNotFound,
    VerificationError,
)
from pulsenet.loco.state import GlobalState, file_sha256
from pulsenet.signing import sign_document, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)

TRAINER_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
CONTEXT = "pulseloco"
"""What every round document is signed for (signing.py); the run and trainer bind into it next."""
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
        try:
            ref = cls(key=str(d["key"]), size=int(d["size"]), sha256=str(d["sha256"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: bad object reference {d!r}: {e}") from None
        if ref.size < 0 or not re.fullmatch(r"[0-9a-f]{64}", ref.sha256):
            raise ManifestError(f"{where}: bad size or SHA-256 in {d!r}")
        return ref


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

    small_s: float = 30.0
    """Documents, listings, deletes."""
    transfer_s: float = 600.0
    """Payloads, states and checkpoints (size varies by 1000x between tiny and real models)."""


class RoundStore:
    """One trainer's view of a PULSELoCo run in an object store: it signs what it writes, verifies what it reads."""

    def __init__(
        self,
        store: ObjectStore,
        trainer_id: str,
        key: Ed25519PrivateKey,
        trusted: Mapping[str, Ed25519PublicKey],
        timeouts: Timeouts | None = None,
    ) -> None:
        self.store = store
        self.id = check_trainer_id(trainer_id)
        self.key = key
        self.trusted = dict(trusted)
        self.t = timeouts or Timeouts()

    # --- signed documents ---------------------------------------------------------------------

    async def _put_doc(self, key: str, body: dict[str, Any], *, create_only: bool) -> None:
        await self.store.put(
            key, sign_document(body, self.key, context=CONTEXT), if_none_match=create_only, timeout=self.t.small_s
        )

    async def _get_doc(self, key: str, kind: str) -> dict[str, Any] | None:
        """The verified body at ``key``, or None if there is no object there yet."""
        try:
            data = await self.store.get(key, timeout=self.t.small_s)
        except ObjectNotFound:
            return None
        body = verify_document(data, self.trusted, context=CONTEXT).body
        if body.get("kind") != kind:
            raise ManifestError(f"{key}: expected a {kind} document, got kind {body.get('kind')!r}")
        return body

    # --- membership ---------------------------------------------------------------------------

    async def join(self) -> None:
        await self._put_doc(member_key(self.id), {"kind": KIND_MEMBER, "trainer": self.id}, create_only=False)

    async def members(self) -> list[str]:
        """Trainer ids that announced themselves (ids only; their documents are verified when used)."""
        infos = await self.store.list("members/", timeout=self.t.small_s)
        ids = [i.key.removeprefix("members/") for i in infos]
        return sorted(t for t in ids if TRAINER_ID.fullmatch(t))

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
        key = manifest_key(tid, round_)
        body = await self._get_doc(key, KIND_MANIFEST)
        if body is None:
            return None
        try:
            m = Manifest(
                trainer=str(body["trainer"]),
                round=int(body["round"]),
                payload=ObjectRef.parse(body["payload"], key),
                mode=str(body["mode"]),
                sent=int(body["sent"]),
                total=int(body["total"]),
                base_digest=str(body["base_digest"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{key}: malformed manifest: {e}") from None
        if m.trainer != tid or m.round != round_ or not m.payload.key.startswith(round_prefix(tid, round_)):
            raise ManifestError(
                f"{key}: manifest claims trainer {m.trainer!r} round {m.round} key {m.payload.key!r}"
            )
        return m

    async def fetch(self, ref: ObjectRef) -> bytes:
        """Download an object a verified document names and check its size and SHA-256."""
        data = await self.store.get(ref.key, timeout=self.t.transfer_s)
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
        key = record_key(round_)
        body = await self._get_doc(key, KIND_RECORD)
        if body is None:
            return None
        try:
            rec = Record(
                round=int(body["round"]),
                writer=str(body["writer"]),
                participants={str(t): ObjectRef.parse(r, key) for t, r in dict(body["participants"]).items()},
                rejected={str(t): str(v) for t, v in dict(body["rejected"]).items()},
                unavailable={str(t): str(v) for t, v in dict(body.get("unavailable", {})).items()},
                base_digest=str(body["base_digest"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{key}: malformed round record: {e}") from None
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
        key = digest_key(tid, round_)
        body = await self._get_doc(key, KIND_DIGEST)
        if body is None:
            return None
        if (
            body.get("trainer") != tid
            or body.get("round") != round_
            or not isinstance(body.get("digest"), str)
        ):
            raise ManifestError(f"{key}: digest document does not match its key: {body}")
        return body["digest"]

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
        key = state_manifest_key(round_)
        body = await self._get_doc(key, KIND_STATE)
        if body is None:
            return None
        try:
            ref = StateRef(
                round=int(body["round"]),
                state=ObjectRef.parse(body["state"], key),
                digest=str(body["digest"]),
                writer=str(body["writer"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{key}: malformed state manifest: {e}") from None
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
            await self.store.get_file(ref.state.key, path, timeout=self.t.transfer_s)
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
            body = await self._get_doc(key, KIND_CHECKPOINT)
            if body is None or body.get("trainer") != self.id or body.get("round") != r:
                continue
            return r, ObjectRef.parse(body["checkpoint"], key)
        return None

    async def fetch_checkpoint(self, ref: ObjectRef, path: Path) -> None:
        await self.store.get_file(ref.key, path, timeout=self.t.transfer_s)
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

    async def delete_states_before(self, round_: int) -> None:
        infos = await self.store.list("state/", timeout=self.t.small_s)
        old = [i.key for i in infos if (m := re.match(r"state/(\d{8})/", i.key)) and int(m.group(1)) < round_]
        await self.store.delete(old, timeout=self.t.small_s)
