"""What the rollout intake reads of each source before listing it: the source (its store and the
keys it may sign with), its signed head (``layout.head``, manifest.py) and an open node's key.

Polling costs one request when nothing changed: a node rewrites its head after every batch, and
one conditional GET of it per poll decides whether to list the source's manifests (a 304 while
unchanged: no listing, unless that head was never verified or ``relist_after_s`` passed since the
last listing, a safety net for a head write that failed). A head that is missing, refused or older
than one already verified (replayed) is counted, and the source is listed every poll until a good
one appears. A head only says *when* to list: batches are accepted on their own signed manifests
(checks.py), never on a head's word. An open node's key (``layout.key``) is read the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet.errors import ManifestError, ObjectNotFound, ObjectTooLarge
from pulsenet.rollouts.intake_types import IntakeStats, Refusal, RolloutIntakeConfig
from pulsenet.rollouts.layout import RolloutLayout
from pulsenet.rollouts.manifest import MAX_HEAD, head_from
from pulsenet.signing import key_id, verify_document
from pulsenet.store.base import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RolloutSource:
    """One inference node's store, read with read-only credentials, and the keys it may sign with."""

    node: str
    store: ObjectStore
    trusted: Mapping[str, Ed25519PublicKey]
    """Key id -> public key of this node only: another node's key is refused here."""


@dataclass(slots=True)
class SourceHead:
    """What the intake knows of one source's head (and of an open node's key)."""

    etag: str | None = None
    """ETag of the head object read last (accepted or not): a 304 on it means "the same object"."""
    seq: int = -1
    """Highest head seq verified."""
    trusted: bool = False
    """The object behind ``etag`` is a verified head not older than ``seq``: its 304 means no change."""
    missing: bool = False
    listed: float = -math.inf
    """time.monotonic() of the last listing."""
    key_etag: str | None = None
    """Open node: ETag of the key object read last ("": found missing, said once)."""


async def head_moved(
    source: RolloutSource,
    st: SourceHead,
    keys: Mapping[str, Ed25519PublicKey],
    *,
    layout: RolloutLayout,
    config: RolloutIntakeConfig,
    stats: IntakeStats,
) -> bool:
    """Whether to list ``source`` now: one conditional GET of its head decides (module docstring).
    ``keys``: the ones the source's documents verify under. Updates ``st`` and counts in ``stats``;
    store errors other than a missing or oversized head propagate."""
    cfg = config
    try:
        got = await source.store.get_if_changed(layout.head, st.etag, max_bytes=MAX_HEAD, timeout=cfg.timeout_s)
    except ObjectNotFound:
        if not st.missing:
            stats.head_missing += 1
            log.warning("rollout source %s has no head: listing it every poll", source.node)
        st.etag, st.trusted, st.missing = None, False, True
        return True
    except ObjectTooLarge as e:
        stats.head_rejected += 1
        st.etag, st.trusted = None, False
        log.warning("rollout head of %s refused: %s", source.node, e)
        return True
    st.missing = False
    if got is None:  # 304: the same object as last time
        stats.head_not_modified += 1
        stale = cfg.relist_after_s is not None and time.monotonic() - st.listed >= cfg.relist_after_s
        return not st.trusted or stale
    st.etag = got.etag
    context = layout.head_context(cfg.run, source.store.url, source.node)
    try:
        signed = await asyncio.to_thread(verify_document, got.data, keys, context=context)
        head = head_from(signed, source.node)
    except ManifestError as e:  # SignatureError included
        stats.head_rejected += 1
        st.trusted = False
        log.warning("rollout head of %s refused: %s: %s", source.node, type(e).__name__, e)
        return True
    if head.seq < st.seq:
        stats.head_backwards += 1
        st.trusted = False
        log.warning("rollout head of %s went back from seq %d to %d", source.node, st.seq, head.seq)
        return True
    st.seq, st.trusted = head.seq, True
    return True


async def read_open_key(
    source: RolloutSource, st: SourceHead, *, layout: RolloutLayout, timeout: float | None, have_key: bool
) -> Ed25519PublicKey | Refusal | None:
    """An open source's public key (``layout.key``: raw 32 bytes in its own store) if it changed
    since the last read (one conditional GET per poll: a 304 while unchanged); None: unchanged, or
    missing (said once while the intake holds no key of it: ``have_key``); a Refusal: the object
    is no key. Store errors other than a missing or oversized object propagate."""
    try:
        got = await source.store.get_if_changed(layout.key, st.key_etag or None, max_bytes=64, timeout=timeout)
    except ObjectNotFound:
        # Pinned before (perhaps before a restart): the intake goes on with the key it has.
        if not have_key and st.key_etag is None:
            st.key_etag = ""  # said once
            log.warning("open rollout node %s has no %s yet: nothing of it can be verified", source.node, layout.key)
        return None
    except ObjectTooLarge:
        return Refusal("malformed", "a public key object over 64 bytes")
    if got is None:
        return None
    st.key_etag = got.etag
    try:
        return Ed25519PublicKey.from_public_bytes(got.data)
    except ValueError as e:
        return Refusal("malformed", f"not a raw Ed25519 public key: {e}")


async def proves_key(
    source: RolloutSource, key: Ed25519PublicKey, *, layout: RolloutLayout, config: RolloutIntakeConfig
) -> bool | Refusal:
    """Whether open ``source`` holds the private half of the ``key`` it publishes: its head, signed
    for its own context (run, store, node), verifies under it. A public key is public: without this
    a node could publish an honest open node's key as its own, have it pinned first, and make the
    honest node's every document a ``wrong_node_key`` (issue 38). False: no head yet (not pinned;
    asked again next poll); a Refusal: a head that does not verify under it. Store errors other
    than a missing or oversized head propagate."""
    try:
        data = await source.store.get(layout.head, max_bytes=MAX_HEAD, timeout=config.timeout_s)
    except ObjectNotFound:
        return False
    except ObjectTooLarge as e:
        return Refusal("too_large", f"head: {e}")
    context = layout.head_context(config.run, source.store.url, source.node)
    try:
        signed = await asyncio.to_thread(verify_document, data, {key_id(key): key}, context=context)
        head_from(signed, source.node)
    except ManifestError as e:  # SignatureError included
        return Refusal("wrong_node_key", f"its head does not verify under the key it publishes: {e}")
    return True
