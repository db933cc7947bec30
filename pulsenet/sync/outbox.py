"""A version on its way out of the publisher (publisher.py): the states waiting to be published
(``Latest``, a bounded queue that keeps the newest), one version's payloads encoded in a thread
(``encode_payloads``: a patch against the last published state, an anchor when one is due) and
uploaded (``upload_payloads``: large ones spooled to a file for a multipart upload)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from pulsenet.codec.patch import PatchEncoder, parse_patch
from pulsenet.runtime import all_of
from pulsenet.signed import ObjectRef
from pulsenet.store.base import ObjectStore
from pulsenet.sync.chain import EMPTY_DIGEST

StateDict = Mapping[str, torch.Tensor]


@dataclass(slots=True)
class Pending:
    """A state handed to ``Publisher.publish``, waiting to become a version."""

    state: StateDict
    step: int | None
    submitted: float
    """time.perf_counter() at ``publish()``."""
    superseded: int = 0
    """Waiting states it replaced (``Latest.put``)."""


class Latest:
    """A bounded FIFO that keeps the newest items: putting into a full one drops the oldest."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[Pending] = collections.deque()
        self._size = size
        self._ready = asyncio.Event()

    def put(self, item: Pending) -> int:
        """Add ``item``; returns how many older items were dropped to make room."""
        dropped = 0
        while len(self._items) >= self._size:
            item.superseded += self._items.popleft().superseded + 1
            dropped += 1
        self._items.append(item)
        self._ready.set()
        return dropped

    def put_back(self, item: Pending) -> None:
        """Return a failed item to the front, unless something newer is already waiting."""
        if not self._items:
            self._items.append(item)
            self._ready.set()

    async def get(self) -> Pending:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True)
class Encoded:
    """One version's payloads as encoded (``encode_payloads``)."""

    blobs: dict[str, bytes]
    """Payload bytes by role (``patch``, ``anchor``)."""
    hashes: dict[str, str]
    """Their SHA-256 by role."""
    digest: str
    """The model digest the payloads rebuild."""
    full_bytes: int
    """The state's size in memory (for the compression ratio)."""


def encode_payloads(
    encoder: PatchEncoder, base: StateDict | None, base_digest: str | None, state: StateDict, anchor: bool
) -> Encoded:
    """``state``'s payloads: a patch against ``base`` (the last published state, digest
    ``base_digest``; none without one) and an anchor if ``anchor`` or there is no base; blocking,
    run it in a thread."""
    blobs: dict[str, bytes] = {}
    if base is not None:
        blobs["patch"] = encoder.encode(base, state, base_digest=base_digest)
    if anchor or base is None:
        blobs["anchor"] = encoder.encode({}, state, base_digest=EMPTY_DIGEST)
    hashes = {role: hashlib.sha256(b).hexdigest() for role, b in blobs.items()}
    digest = parse_patch(next(iter(blobs.values()))).target_digest
    return Encoded(blobs, hashes, digest, sum(t.numel() * t.element_size() for t in state.values()))


async def upload_payloads(
    store: ObjectStore,
    refs: Mapping[str, ObjectRef],
    blobs: Mapping[str, bytes],
    *,
    timeout: float | None,
    spool_threshold: int,
    spool_dir: Path | None,
) -> None:
    """Upload each role's bytes to its ref's key, concurrently; payloads of ``spool_threshold``
    bytes or more go through a temporary file in ``spool_dir`` (``put_file``, multipart)."""
    await all_of(_upload(store, ref.key, blobs[role], timeout, spool_threshold, spool_dir) for role, ref in refs.items())


async def _upload(
    store: ObjectStore, key: str, data: bytes, timeout: float | None, spool_threshold: int, spool_dir: Path | None
) -> None:
    if len(data) < spool_threshold:
        await store.put(key, data, timeout=timeout)
        return
    fd, tmp = tempfile.mkstemp(prefix="pulsenet-payload-", dir=spool_dir)
    try:
        await asyncio.to_thread(_write_fd, fd, data)
        await store.put_file(key, tmp, timeout=timeout)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _write_fd(fd: int, data: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        f.write(data)
