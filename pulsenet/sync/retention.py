"""A publisher's retention (publisher.py): after each version, everything older than the
``keep_anchors``-th newest anchor goes, manifests first (so no manifest ever names a deleted
payload), and so do payloads no manifest will ever name (a crash between payload and manifest).

Only the publisher's own verified manifests decide what is an anchor: a listed name above its own
version is planted and never even fetched, and a live consumer's hint (``keep_from``) holds the
chain from the version it follows."""

from __future__ import annotations

import contextlib
import logging

from pulsenet.errors import ManifestError, ObjectNotFound, StoreError
from pulsenet.store.base import ObjectStore
from pulsenet.sync.chain import ManifestReader
from pulsenet.sync.layout import Layout

log = logging.getLogger(__name__)


async def retain(
    store: ObjectStore,
    layout: Layout,
    reader: ManifestReader,
    *,
    keep: int,
    newest: int,
    keep_from: int | None,
    timeout: float | None,
) -> int:
    """Delete what no kept chain needs: ``keep`` anchors back from ``newest`` (the publisher's own
    last version, -1 before the first), never from ``keep_from`` on; returns how many objects went.
    Failures are logged only (retention runs again after the next version)."""
    try:
        return await _retain_once(store, layout, reader, keep, newest, keep_from, timeout)
    except (StoreError, ManifestError) as e:
        log.warning("retention skipped this time: %s: %s", type(e).__name__, e)
        return 0


async def _retain_once(
    store: ObjectStore,
    layout: Layout,
    reader: ManifestReader,
    keep: int,
    newest: int,
    keep_from: int | None,
    timeout: float | None,
) -> int:
    infos = await store.list(f"{layout.channel}/", timeout=timeout)
    manifests: dict[int, str] = {}
    payloads: list[tuple[int, str]] = []
    anchor_keys: set[str] = set()
    for info in infos:
        if (v := layout.parse_manifest(info.key)) is not None:
            manifests[v] = info.key
        elif (parsed := layout.parse_payload(info.key)) is not None:
            payloads.append((parsed[0], info.key))
            if parsed[1] == "anchor":
                anchor_keys.add(info.key)
    if not manifests:
        return 0
    anchor_keys = {key for v, key in payloads if key in anchor_keys and v in manifests}
    anchors = []
    # A name above our own version is no anchor of ours (planted): not even fetched.
    for v in sorted({v for v, key in payloads if key in anchor_keys and v <= newest}, reverse=True):
        if len(anchors) >= keep:
            break
        with contextlib.suppress(ManifestError, ObjectNotFound):  # untrusted or vanished: not a chain we keep
            m = await reader.get(v)
            if m.anchor is not None and m.anchor.key in anchor_keys:
                anchors.append(v)
    cutoff = anchors[-1] if len(anchors) >= keep else 0
    if keep_from is not None:  # a live consumer still follows the chain from there
        cutoff = max(0, min(cutoff, keep_from))
    old_manifests = [key for v, key in manifests.items() if v < cutoff]
    old_payloads = [key for v, key in payloads if v < cutoff or (v not in manifests and v < newest)]
    # Manifests first: a manifest must never name a deleted payload.
    await store.delete(old_manifests, timeout=timeout)
    await store.delete(old_payloads, timeout=timeout)
    reader.forget_below(cutoff)
    if old_manifests or old_payloads:
        log.info(
            "retention: kept v%d.. (anchors %s), deleted %d objects",
            cutoff,
            anchors,
            len(old_manifests) + len(old_payloads),
        )
    return len(old_manifests) + len(old_payloads)
