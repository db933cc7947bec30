"""PULSELoCo key layout: where a run's documents and objects live, relative to its store URL.

::

    members/<id>                                     signed: this trainer takes part in the run
    trainers/<id>/<round:08d>/<sha16>.payload        payload bytes (content-addressed, written first)
    trainers/<id>/<round:08d>/manifest               signed: key, size, SHA-256 of the payload (create-only)
    trainers/<id>/<round:08d>/digest                 signed: SHA-256 digest of (θ, m) after the round (create-only)
    trainers/<id>/<round:08d>/joining                signed: back after missing a round, training this one
    trainers/<id>/checkpoint/<round:08d>/<sha16>.pt  the trainer's own resume point (every few rounds)
    trainers/<id>/checkpoint/<round:08d>/manifest    signed: its key, size, SHA-256
    rounds/<round:08d>/record                        signed: the round's participant set (create-only: first writer wins)
    state/<round:08d>/<sha16>.safetensors            agreed global state after the round (genesis = 0)
    state/<round:08d>/manifest                       signed: its key, size, SHA-256 and global digest (create-only)

Rounds are zero-padded so a listing sorts them. Each trainer writes only under ``trainers/<id>/``,
plus the two shared create-only kinds (``rounds/``, ``state/``), which can never be overwritten
once they exist. Every document of the run is signed for :attr:`LocoLayout.context` (the run and
the store location): a document copied from another run or store does not verify.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pulsenet.errors import ConfigError

TRAINER_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PROTOCOL = "pulseloco"
MAX_ROUND = 10**8 - 1
"""Rounds are 8 digits in keys."""
_TID = r"([a-z0-9][a-z0-9_-]{0,62})"
_PAYLOAD = re.compile(rf"trainers/{_TID}/(\d{{8}})/[0-9a-f]{{16}}\.payload")
_RECORD = re.compile(r"rounds/(\d{8})/record")
_STATE_MANIFEST = re.compile(r"state/(\d{8})/manifest")


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


@dataclass(frozen=True, slots=True)
class LocoLayout:
    """Key names of one PULSELoCo run under its store, and what its documents are signed for."""

    run: str = "default"
    store_url: str = ""
    """``ObjectStore.url`` (endpoint-free, so readers through other endpoints agree on it)."""

    def __post_init__(self) -> None:
        check_run_id(self.run)
        if not isinstance(self.store_url, str) or any(c in self.store_url for c in "\n\r"):
            raise ConfigError(f"store URL {self.store_url!r} must be one line")

    @property
    def context(self) -> str:
        """What every document of the run is signed for (signing.py)."""
        return f"{PROTOCOL}/{self.run}/{self.store_url.rstrip('/')}"

    # --- listing prefixes -----------------------------------------------------------------------

    members = "members/"
    rounds = "rounds/"
    states = "state/"

    def trainer(self, tid: str) -> str:
        """Everything trainer ``tid`` writes (its rounds and checkpoints)."""
        return f"trainers/{check_trainer_id(tid)}/"

    def round_prefix(self, tid: str, round_: int) -> str:
        """Trainer ``tid``'s objects of one round: a payload named for that round lives here."""
        return f"{self.trainer(tid)}{_r(round_)}/"

    def checkpoints(self, tid: str) -> str:
        return f"{self.trainer(tid)}checkpoint/"

    def checkpoint_prefix(self, tid: str, round_: int) -> str:
        """Trainer ``tid``'s checkpoint of one round: the object its manifest names lives here."""
        return f"{self.checkpoints(tid)}{_r(round_)}/"

    def state_prefix(self, round_: int) -> str:
        """The global state of one round: the object its manifest names lives here."""
        return f"{self.states}{_r(round_)}/"

    # --- keys -----------------------------------------------------------------------------------

    def member(self, tid: str) -> str:
        return f"{self.members}{check_trainer_id(tid)}"

    def manifest(self, tid: str, round_: int) -> str:
        return self.round_prefix(tid, round_) + "manifest"

    def payload(self, tid: str, round_: int, sha256: str) -> str:
        return self.round_prefix(tid, round_) + f"{sha256[:16]}.payload"

    def digest(self, tid: str, round_: int) -> str:
        return self.round_prefix(tid, round_) + "digest"

    def joining(self, tid: str, round_: int) -> str:
        return self.round_prefix(tid, round_) + "joining"

    def record(self, round_: int) -> str:
        return f"{self.rounds}{_r(round_)}/record"

    def state(self, round_: int, sha256: str) -> str:
        return f"{self.state_prefix(round_)}{sha256[:16]}.safetensors"

    def state_manifest(self, round_: int) -> str:
        return f"{self.state_prefix(round_)}manifest"

    def checkpoint(self, tid: str, round_: int, sha256: str) -> str:
        return f"{self.checkpoint_prefix(tid, round_)}{sha256[:16]}.pt"

    def checkpoint_manifest(self, tid: str, round_: int) -> str:
        return f"{self.checkpoint_prefix(tid, round_)}manifest"

    # --- parsing keys (None: any other key) -----------------------------------------------------

    def parse_member(self, key: str) -> str | None:
        """The trainer a member key names."""
        tid = key.removeprefix(self.members)
        return tid if key.startswith(self.members) and TRAINER_ID.fullmatch(tid) else None

    def parse_payload(self, key: str) -> tuple[str, int] | None:
        """``(trainer, round)`` of a payload key."""
        m = _PAYLOAD.fullmatch(key)
        return (m.group(1), int(m.group(2))) if m else None

    def parse_record(self, key: str) -> int | None:
        """The round a record key names."""
        m = _RECORD.fullmatch(key)
        return int(m.group(1)) if m else None

    def parse_state_manifest(self, key: str) -> int | None:
        """The round a state manifest key names."""
        m = _STATE_MANIFEST.fullmatch(key)
        return int(m.group(1)) if m else None

    def parse_checkpoint_manifest(self, tid: str, key: str) -> int | None:
        """The round of trainer ``tid``'s checkpoint manifest key."""
        m = re.fullmatch(re.escape(self.checkpoints(tid)) + r"(\d{8})/manifest", key)
        return int(m.group(1)) if m else None

    def parse_own(self, tid: str, key: str) -> tuple[str, int] | None:
        """``("round" | "checkpoint", round)`` of any object trainer ``tid`` wrote (retention)."""
        m = re.match(re.escape(self.trainer(tid)) + r"(?:(checkpoint)/)?(\d{8})/", key)
        return ("checkpoint" if m.group(1) else "round", int(m.group(2))) if m else None


def _r(round_: int) -> str:
    if not 0 <= round_ <= MAX_ROUND:
        raise ValueError(f"round must be an int in 0..{MAX_ROUND}, got {round_!r}")
    return f"{round_:08d}"
