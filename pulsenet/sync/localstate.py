"""A subscriber's verified weights on local disk, so a restart (even after SIGKILL) resumes from them.

Layout of the state directory::

    model.safetensors   the weights; its header metadata holds the version and model digest
    version.json        {"version", "digest", "channel", "updated"}: for people and tools

The weights and the version they are commit together, in one atomic rename of
``model.safetensors`` (written beside it, fsynced, renamed: ``checkpoint.write_safetensors``). A
crash leaves the old file or the new one, never a mix. ``version.json`` is written right after and
may lag by one version after a crash; it is rewritten from the weights file on the next start.

On load the metadata is never trusted on its own: the values are hashed and must give the recorded
digest, and the version must match the header's check value (a SHA-256 over format, version and
digest: it catches a corrupted version number, which no digest covers), or the state is refused
(VerificationError) and the subscriber starts from an anchor. Any malformed file (either one) ends
in a VerificationError, never another exception.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from pulsenet.checkpoint import write_safetensors
from pulsenet.codec.buffers import BufferPool, pooled_copy
from pulsenet.codec.digest import model_digest
from pulsenet.codec.dtypes import dtype_name
from pulsenet.errors import VerificationError
from pulsenet.fsutil import atomic_write_bytes
from pulsenet.sync.layout import MAX_VERSION
from pulsenet.sync.manifest import now_iso

WEIGHTS = "model.safetensors"
INFO = "version.json"
META_FORMAT = "pulsenet-sync-state/1"
MAX_INFO = 64 << 10
"""Largest ``version.json`` read (a real one is about 150 bytes)."""
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class LocalState:
    version: int
    digest: str
    state: dict[str, torch.Tensor]


def read_version(directory: Path) -> tuple[int, str] | None:
    """(version, digest) recorded in the weights file's header, unverified; None if there is none."""
    path = Path(directory) / WEIGHTS
    if not path.is_file():
        return None
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("pulsenet.format") != META_FORMAT:
            return None
        version, digest, check = meta["pulsenet.version"], meta["pulsenet.digest"], meta["pulsenet.check"]
    except (SafetensorError, KeyError, ValueError, OSError) as e:
        raise VerificationError(f"{path} is unreadable: {type(e).__name__}: {str(e)[:200]}") from None
    if not (isinstance(version, str) and re.fullmatch(r"[0-9]{1,12}", version)) or not (
        isinstance(digest, str) and _HEX64.fullmatch(digest)
    ):
        raise VerificationError(f"{path} has a malformed version or digest in its header")
    if check != _check(version, digest):
        raise VerificationError(f"{path}: the header's version and digest do not match its check value")
    return int(version), digest


def _check(version: str, digest: str) -> str:
    return hashlib.sha256(f"{META_FORMAT}\n{version}\n{digest}".encode()).hexdigest()[:32]


def load(directory: Path, *, threads: int = 2, buffers: BufferPool | None = None) -> LocalState | None:
    """The persisted state, verified by hashing its values; None if the directory holds none.
    ``buffers``: the tensors are copied, one at a time, into memory lent by this pool (the
    subscriber's, whose next rebuild in place then reuses it; codec/buffers.py).

    A weights file that is not ours (no pulsenet metadata) counts as none. One whose values do not
    hash to the recorded digest raises VerificationError.
    """
    directory = Path(directory)
    recorded = read_version(directory)
    if recorded is None:
        return None
    version, digest = recorded
    try:
        with safe_open(directory / WEIGHTS, framework="pt") as f:
            names = list(f.keys())
            state = {n: f.get_tensor(n) if buffers is None else pooled_copy(buffers, f.get_tensor(n)) for n in names}
    except (SafetensorError, ValueError, TypeError, RuntimeError, OSError) as e:
        raise VerificationError(f"{directory / WEIGHTS} is unreadable: {type(e).__name__}: {str(e)[:200]}") from None
    actual = model_digest(state, threads)
    if actual != digest:
        raise VerificationError(
            f"{directory / WEIGHTS} claims v{version} digest {digest[:16]}… but its values hash to {actual[:16]}…"
        )
    return LocalState(version, digest, state)


def save(
    directory: Path, version: int, digest: str, state: Mapping[str, torch.Tensor], *, channel: str = ""
) -> None:
    """Persist verified weights atomically (blocking: call in a thread)."""
    directory = Path(directory)
    names = sorted(state, key=lambda n: n.encode("utf-8"))
    meta = {n: (dtype_name(state[n].dtype), tuple(state[n].shape)) for n in names}
    metadata = {
        "pulsenet.format": META_FORMAT,
        "pulsenet.version": str(version),
        "pulsenet.digest": digest,
        "pulsenet.check": _check(str(version), digest),
    }
    write_safetensors(directory / WEIGHTS, meta, ((n, state[n]) for n in names), metadata=metadata)
    write_info(directory, version, digest, channel=channel)


def read_info(directory: Path) -> dict | None:
    """``version.json`` as written by ``write_info`` (informational, never a resume point); None if
    absent, VerificationError if malformed."""
    path = Path(directory) / INFO
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_INFO + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise VerificationError(f"{path} is unreadable: {e}") from None
    if len(raw) > MAX_INFO:
        raise VerificationError(f"{path} is over {MAX_INFO} bytes")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 / JSON, 4300+ digit ints, deep nesting
        raise VerificationError(f"{path} is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not (
        isinstance(doc, dict)
        and isinstance(doc.get("version"), int)
        and not isinstance(doc["version"], bool)
        and 0 <= doc["version"] <= MAX_VERSION
        and isinstance(doc.get("digest"), str)
        and _HEX64.fullmatch(doc["digest"])
        and isinstance(doc.get("channel"), str)
        and isinstance(doc.get("updated"), str)
    ):
        raise VerificationError(f"{path} is not a pulsenet version record")
    return {k: doc[k] for k in ("version", "digest", "channel", "updated")}


def write_info(directory: Path, version: int, digest: str, *, channel: str = "") -> None:
    """Write ``version.json`` atomically, unless it already says this version and digest."""
    try:
        old = read_info(directory)
        if old is not None and (old["version"], old["digest"], old["channel"]) == (version, digest, channel):
            return
    except VerificationError:
        pass  # rewritten below
    doc = {"version": version, "digest": digest, "channel": channel, "updated": now_iso()}
    atomic_write_bytes(directory / INFO, json.dumps(doc, indent=1).encode())


def sweep(directory: Path) -> None:
    """Remove temporary files a killed writer left in ``directory`` (blocking)."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if p.name.startswith((f".{WEIGHTS}.", f".{INFO}.")):
            p.unlink(missing_ok=True)
