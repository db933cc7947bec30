"""Retention that knows its consumers: signed status objects and the slowest live consumer.

Each inference node keeps one small signed object in its own store, ``status/{node}.json``
(version served, digest, time), rewritten every ``status_every_s``. A trainer reads them with the
rollout sources' read-only credentials and trusted keys, and tells its publisher how far back the
chain must stay (``Publisher.keep_from``): the version of the slowest *live* consumer, as long as it
is within ``bound`` versions of the head. A consumer further behind takes the newest anchor instead
(its chain would cost more than the anchor), and one whose object has not changed for ``ttl_s``
(by the trainer's own clock: no cross-site clock is trusted) is not live and holds nothing back.

The object is signed for ``status/{run}/{node}@{store url}`` (signing.py), so a status copied from
another node, bucket or run does not verify; a node's key signs only for its own slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.errors import ManifestError, ObjectNotFound, StoreError
from pulsenet.signing import sign_document, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)
FORMAT = "pulsenet.status"
MAX_STATUS = 4096
"""Largest status object a trainer fetches (real ones are ~300 bytes)."""


def status_key(node: str) -> str:
    return f"status/{node}.json"


def status_context(run: str, store_url: str, node: str) -> str:
    return f"status/{run}/{node}@{store_url.rstrip('/')}"


async def write_status(
    store: ObjectStore, key: Ed25519PrivateKey, *, run: str, node: str, version: int, digest: str
) -> None:
    """Overwrite ``node``'s signed status object in its own store (one PUT: readers see old or new)."""
    body = {
        "format": FORMAT,
        "node": node,
        "version": int(version),
        "digest": digest,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    await store.put(status_key(node), sign_document(body, key, context=status_context(run, store.url, node)))


async def read_status(
    store: ObjectStore, trusted: Mapping[str, Ed25519PublicKey], *, run: str, node: str
) -> dict[str, Any] | None:
    """``node``'s verified status body, None if it has none yet; ManifestError if it is not one."""
    try:
        data = await store.get(status_key(node), max_bytes=MAX_STATUS)
    except ObjectNotFound:  # the node has not reported yet
        return None
    body = verify_document(data, trusted, context=status_context(run, store.url, node)).body
    if body.get("format") != FORMAT or body.get("node") != node or not isinstance(body.get("version"), int):
        raise ManifestError(f"status object of {node} is malformed: {str(body)[:200]}")
    return body


@dataclass(slots=True)
class Consumer:
    node: str
    version: int
    digest: str
    changed: float
    """time.monotonic() when this trainer last saw the object change."""


class ConsumerTracker:
    """The consumers one publisher serves: who is live, and from which version retention must keep."""

    def __init__(self, *, bound: int, ttl_s: float) -> None:
        self.bound, self.ttl_s = bound, ttl_s
        self.consumers: dict[str, Consumer] = {}

    def observe(self, node: str, version: int, digest: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        old = self.consumers.get(node)
        if old is None or (old.version, old.digest) != (version, digest):
            self.consumers[node] = Consumer(node, version, digest, now)
        # An unchanged object (a node stuck at a version, or dead) ages: its ``changed`` stays.

    def touch(self, node: str, now: float | None = None) -> None:
        """The node rewrote its object (its time moved) at an unchanged version: it is alive."""
        if node in self.consumers:
            self.consumers[node].changed = time.monotonic() if now is None else now

    def live(self, now: float | None = None) -> list[Consumer]:
        now = time.monotonic() if now is None else now
        return [c for c in self.consumers.values() if now - c.changed <= self.ttl_s]

    def keep_from(self, head: int | None, now: float | None = None) -> int | None:
        """The oldest version a live consumer within ``bound`` of ``head`` holds; None: no constraint."""
        if head is None:
            return None
        held = [c.version for c in self.live(now) if 0 <= head - c.version <= self.bound]
        return min(held, default=None)

    def slowest(self, head: int | None, now: float | None = None) -> dict[str, Any] | None:
        """What ``/status`` shows: the live consumer furthest behind, and whether retention waits for it."""
        now = time.monotonic() if now is None else now
        live = self.live(now)
        if not live:
            return None
        c = min(live, key=lambda c: (c.version, c.node))
        behind = None if head is None else head - c.version
        return {
            "id": c.node,
            "version": c.version,
            "digest": c.digest,
            "behind": behind,
            "age_s": round(now - c.changed, 1),
            "kept": behind is not None and 0 <= behind <= self.bound,
        }


async def poll_consumers(
    tracker: ConsumerTracker, sources: Iterable[Any], *, run: str, times: dict[str, str]
) -> None:
    """Read every source's status object once (``sources``: RolloutSource-like: node, store, trusted).

    ``times``: the last ``time`` field seen per node, so a rewrite at the same version counts as alive.
    A missing, unreadable or forged object is skipped (logged), never fatal.
    """
    for src in sources:
        try:
            body = await read_status(src.store, src.trusted, run=run, node=src.node)
        except (StoreError, ManifestError) as e:
            log.warning("status of %s unreadable: %s: %s", src.node, type(e).__name__, e)
            continue
        if body is None:
            continue
        tracker.observe(src.node, body["version"], str(body.get("digest")))
        if times.get(src.node) != body.get("time"):
            times[src.node] = str(body.get("time"))
            tracker.touch(src.node)
