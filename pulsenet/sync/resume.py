"""A publisher's restart (``Publisher.resume``, publisher.py): the newest version a trusted key
signed, and its weights, taken from the caller if their digest matches or rebuilt from the store
(anchor + patches, verified).

Never a listed name alone: anyone who can write the bucket can plant ``v999999999999.json``. The
newest version is the newest manifest a trusted key signed."""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from pulsenet.codec.digest import model_digest
from pulsenet.errors import ManifestError, ObjectNotFound, VerificationError
from pulsenet.store.base import ObjectInfo, ObjectStore
from pulsenet.sync.chain import ChainPath, ManifestReader, PayloadCache, rebuild
from pulsenet.sync.manifest import Manifest

log = logging.getLogger(__name__)


async def newest_trusted(reader: ManifestReader, listing: Mapping[int, ObjectInfo]) -> Manifest | None:
    """The newest manifest of ``listing`` that verifies under the reader's trusted keys; names
    that do not (not ours, or deleted meanwhile) are skipped and logged (the first three each)."""
    ignored: list[int] = []
    newest: Manifest | None = None
    for v in sorted(listing, reverse=True):
        try:
            newest = await reader.get(v, info=listing[v])
            break
        except (ManifestError, ObjectNotFound) as e:  # not ours, or deleted meanwhile
            ignored.append(v)
            if len(ignored) <= 3:
                log.warning("resume: ignoring manifest v%d, not ours: %s", v, e)
    if len(ignored) > 3:
        log.warning("resume: ignored %d manifest names that are not ours in all", len(ignored))
    return newest


async def weights_of(
    newest: Manifest,
    paths: list[ChainPath],
    state: Mapping[str, torch.Tensor] | None,
    *,
    store: ObjectStore,
    threads: int,
    timeout_s: float | None,
) -> dict[str, torch.Tensor] | None:
    """The weights of ``newest``: ``state`` if the caller has them (checked by digest,
    ManifestError if they differ), else rebuilt from the store along the first of ``paths`` that
    verifies; None when none does (the chain is broken: the next version will be a plain anchor)."""
    if state is not None:
        digest = await asyncio.to_thread(model_digest, state, threads)
        if digest != newest.model_digest:
            raise ManifestError(
                f"the given state (digest {digest[:16]}…) is not the newest published v{newest.version} "
                f"({newest.model_digest[:16]}…): start without a state to rebuild it from the store"
            )
        return dict(state)
    try:
        return await _rebuild(store, paths, newest, threads=threads, timeout_s=timeout_s)
    except VerificationError as e:
        # The chain is broken (retired or corrupt): the next version will be a plain anchor.
        log.error("resume: %s; the next version will be an anchor without a patch", e)
        return None


async def _rebuild(
    store: ObjectStore, paths: list[ChainPath], newest: Manifest, *, threads: int, timeout_s: float | None
) -> dict[str, torch.Tensor]:
    bad: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="pulsenet-publisher-") as tmp:
        cache = PayloadCache(store, Path(tmp), timeout_s=timeout_s)
        errors = []
        for path in paths:
            try:
                return await rebuild(path, cache, None, threads=threads, bad=bad)
            except (VerificationError, ObjectNotFound) as e:
                errors.append(f"{path.describe()}: {e}")
    raise VerificationError(
        f"cannot rebuild the newest published v{newest.version} from the store: {'; '.join(errors) or 'no anchor'}"
    )
