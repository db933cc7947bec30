"""PULSESync publisher: each new BF16 state becomes the next version, as a patch against the last
published one, with a full anchor every K versions, uploaded in the background.

``publish(state)`` returns at once; a worker task encodes (in a thread) and uploads while the caller
keeps training. At most ``pending`` states wait: when uploads fall behind, the oldest waiting state
is dropped, never the one being uploaded. A patch is always encoded against the last *published*
state (the one subscribers can hold), so a dropped state leaves no hole in the chain. The queue,
the encoding and the upload are in outbox.py.

Per version: payloads first (content-addressed keys, see layout.py), then the signed manifest,
create-only. If the manifest write finds the version taken (another publisher, a forged or
replayed object), the publisher moves to the next free number and uploads again; subscribers follow
``base_version`` pointers, so a skipped number is no gap. Then retention: everything older than the
``keep_anchors``-th newest anchor goes (manifests first, so no manifest ever names a deleted payload),
and so do payloads no manifest will ever name (a crash between payload and manifest): retention.py.

Anchor versions carry two payloads: the anchor (for nodes that join late or fall behind) and the
patch from the previous version (so nodes that are following never download the full weights).

Restart: ``start()`` reads the newest manifest this publisher trusts and rebuilds its weights from
the store (anchor + patches, verified), or takes them from the caller if their digest matches
(resume.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec.mask import MAX_ZONES
from pulsenet.codec.patch import PATCH_ZSTD_LEVEL, PatchEncoder
from pulsenet.deadlines import SMALL_CALL_S, TRANSFER_S
from pulsenet.errors import (
    ConditionFailed,
    ConfigError,
    ManifestError,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from pulsenet.signed import ObjectRef, fetch_document
from pulsenet.signing import key_id
from pulsenet.store.base import ObjectStore, backoff_delay
from pulsenet.sync.chain import ManifestReader, candidate_paths
from pulsenet.sync.layout import DEFAULT_RUN, MAX_VERSION, Layout
from pulsenet.sync.manifest import (
    Head,
    Manifest,
    check_model_config,
    manifest_from,
    now_iso,
    sign_head,
    sign_manifest,
)
from pulsenet.sync.outbox import Encoded, Latest, Pending, StateDict, encode_payloads, upload_payloads
from pulsenet.sync.resume import newest_trusted, weights_of
from pulsenet.sync.retention import retain

log = logging.getLogger(__name__)

MiB = 1 << 20
_TAKEN_RETRIES = 8


@dataclass(kw_only=True, slots=True)
class PublisherConfig:
    channel: str = "policy"
    """Key prefix of this policy stream inside the store (see layout.py)."""
    run: str = DEFAULT_RUN
    """Run name, part of what every manifest is signed for (layout.py): subscribers must name the same."""
    anchor_every: int = 10
    """A full anchor at least every this many versions (1: every version is an anchor)."""
    keep_anchors: int | None = 2
    """Retention: keep the newest this many anchors and every version after the oldest of them;
    None keeps everything."""
    pending: int = 1
    """States waiting for upload; publishing into a full queue drops the oldest waiting one."""
    threads: int = 0
    """Codec threads (encode, and the rebuild on resume); 0: this node's share of its cores
    (``codec.threads.codec_threads``: its CPU affinity, capped by OMP_NUM_THREADS)."""
    zstd_level: int = PATCH_ZSTD_LEVEL
    """zstd level of the patch codec."""
    max_zones: int = MAX_ZONES
    """Context zones per tensor in patches (codec/mask.py). The default gives the smallest patches;
    1 skips the context model: ~2x the bytes for a codec barely faster end to end (docs/bench.md)."""
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (manifest put, get, list, delete)."""
    transfer_timeout_s: float | None = TRANSFER_S
    """Deadline of one payload upload or download."""
    spool_threshold: int = 64 * MiB
    """Payloads this large are written to a temporary file and uploaded with put_file (multipart)."""
    spool_dir: Path | None = None
    """Where spooled payloads go; None: the system temp dir."""
    retry_backoff_s: float = 0.5
    """Bound of the first wait after a failed upload (the store was unreachable); doubles per
    failure, each wait drawn uniformly below it (``store.backoff_delay``, full jitter)."""
    retry_backoff_cap_s: float = 10.0
    """Largest bound of a wait between upload attempts."""

    def __post_init__(self) -> None:
        if (
            self.anchor_every < 1
            or self.pending < 1
            or (self.keep_anchors is not None and self.keep_anchors < 1)
        ):
            raise ValueError("anchor_every and pending must be >= 1, keep_anchors >= 1 or None")


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishRecord:
    """What publishing one version cost."""

    version: int
    kind: str
    step: int | None
    digest: str
    payload_bytes: dict[str, int]
    """Role ("patch", "anchor") -> bytes uploaded."""
    full_bytes: int
    """Raw size of the weights: what a full checkpoint sync would move."""
    ratio: float
    """``full_bytes`` over what a following subscriber downloads (the patch, else the anchor)."""
    encode_s: float
    upload_s: float
    """Payloads and manifest, until the manifest is visible."""
    queued_s: float
    """From ``publish()`` until the worker took the state."""
    latency_s: float
    """From ``publish()`` until the manifest is visible."""
    superseded: int
    """Waiting states dropped since the previous published version."""
    deleted: int = 0
    """Objects retention removed after this version."""


class Publisher:
    """Publishes versions of one channel; use as ``async with Publisher(...) as pub``."""

    def __init__(
        self,
        store: ObjectStore,
        key: Ed25519PrivateKey,
        config: PublisherConfig | None = None,
        *,
        on_record: Callable[[PublishRecord], None] | None = None,
        trusted: Mapping[str, Ed25519PublicKey] | None = None,
        model_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``trusted``: other keys whose manifests count when resuming (the own key always does).
        ``model_config``: the model's HF ``config.json`` contents, signed into every anchor manifest
        so that a reader (``pulsenet export``) rebuilds the architecture from the channel alone."""
        if model_config is not None:
            check_model_config(model_config, "publisher", ConfigError)
        self.model_config = model_config
        self.store = store
        self.config = config = config or PublisherConfig()
        self.layout = Layout(config.channel, run=config.run, store_url=store.url)
        self.key = key
        self.key_id = key_id(key.public_key())
        self.trusted = {**(trusted or {}), self.key_id: key.public_key()}
        self.on_record = on_record
        self.records: list[PublishRecord] = []
        """One record per published version, oldest first."""
        self.version: int | None = None
        """Last published version (None before the first)."""
        self.digest: str | None = None
        self.failures = 0
        """Upload attempts that failed (each is logged)."""
        self.dropped = 0
        """States dropped from the queue because newer ones arrived."""
        self.keep_from: int | None = None
        """Retention hint from the consumers' status objects (nodes/consumers.py): a live node holds
        this version, so nothing from it on is deleted (the owner bounds how old it may be)."""
        self._state: dict[str, torch.Tensor] | None = None
        self._anchor_version: int | None = None
        self._next = 0
        self._reader = ManifestReader(store, self.layout, self.trusted, config.timeout_s)
        self._encoder = PatchEncoder(
            level=config.zstd_level, threads=config.threads, max_zones=config.max_zones
        )
        self._queue = Latest(config.pending)
        self._lock = asyncio.Lock()  # one version at a time: the worker and publish_now share state
        self._idle = asyncio.Condition()
        self._busy = False
        self._error: BaseException | None = None
        self._worker: asyncio.Task[None] | None = None
        self._head_lock = asyncio.Lock()  # head writes in order: a late one never lands over a newer head
        self._head_due = False
        """The head does not name ``self.version`` yet (its write failed): ``_head_retry`` rewrites it."""
        self._head_retry: asyncio.Task[None] | None = None

    @property
    def state(self) -> dict[str, torch.Tensor] | None:
        """The last published weights (do not mutate)."""
        return self._state

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self, state: StateDict | None = None) -> None:
        """Resume from the store, then start the upload worker.

        ``state``: the weights of the newest published version if the caller has them (checked by
        digest, ManifestError if they differ); otherwise they are rebuilt from the store.
        """
        await self.resume(state)
        if self.version is not None:
            # A crash between a manifest and its head leaves the head behind, and following
            # subscribers look for new versions only when the head moves.
            await self.write_head()
        if self._worker is None:
            self._worker = asyncio.create_task(self._run(), name=f"pulsenet-publisher-{self.layout.channel}")

    async def close(self, *, flush_timeout: float | None = None) -> None:
        """Wait for pending uploads (up to ``flush_timeout``), then stop the worker."""
        try:
            if self._worker is not None and not self._worker.done():
                await self.flush(timeout=flush_timeout)
        finally:
            await self._stop_tasks()

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if et is None:
            await self.close()
        else:  # don't wait on uploads when the caller is failing or being cancelled
            await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        for task in (self._worker, self._head_retry):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._worker = self._head_retry = None

    async def resume(self, state: StateDict | None = None) -> None:
        """Load the newest trusted version from the store (see ``start``)."""
        listing = await self._reader.list_versions()
        if not listing:
            log.info("channel %s is empty: the first version will be v0", self.layout.channel)
            return
        newest = await newest_trusted(self._reader, listing)
        self._next = max(newest.version + 1 if newest is not None else 0, self._next)
        if newest is None:
            log.warning(
                "resume: no trusted manifest in %s; starting over with an anchor at v%d",
                self.layout.channel,
                self._next,
            )
            return
        paths = await candidate_paths(self._reader, newest, None, set(), max_anchors=1)
        self._anchor_version = paths[0].steps[0].manifest.version if paths else None
        self._state = await weights_of(
            newest,
            paths,
            state,
            store=self.store,
            threads=self.config.threads,
            timeout_s=self.config.transfer_timeout_s,
        )
        self.version, self.digest = newest.version, newest.model_digest
        log.info(
            "resumed at v%d (%s…), next version v%d", newest.version, newest.model_digest[:16], self._next
        )

    async def recent_digests(self, count: int) -> dict[int, str]:
        """``version -> model digest`` of the newest ``count`` versions up to ``self.version`` that
        are still in the store, from manifests verified with this publisher's key.

        What a restarted trainer needs to accept rollouts served by versions it published before
        the restart (their batches name the version and its digest)."""
        if self.version is None or count < 1:
            return {}
        out: dict[int, str] = {}
        for v in range(max(0, self.version - count + 1), self.version + 1):
            try:
                out[v] = (await self._reader.get(v)).model_digest
            except (ManifestError, ObjectNotFound) as e:  # retired, or not ours
                log.info("no verified manifest for v%d: %s", v, e)
        return out

    # --- publishing ----------------------------------------------------------------------------

    def publish(self, state: StateDict, *, step: int | None = None) -> None:
        """Queue ``state`` as the next version and return at once (call from the event loop thread).

        ``state`` is kept by reference until published and then as the next patch's base: don't
        mutate it (``LocalTrainer.bf16_state()`` returns fresh tensors).
        """
        if self._worker is None or self._worker.done():
            raise RuntimeError("Publisher is not running: call start() or use 'async with'")
        dropped = self._queue.put(Pending(state, step, time.perf_counter()))
        if dropped:
            self.dropped += dropped
            log.info("uploads are behind: dropped %d waiting state(s) for a newer one", dropped)

    async def publish_now(self, state: StateDict, *, step: int | None = None) -> PublishRecord:
        """Publish ``state`` in the caller's task and return its record (errors are raised)."""
        return await self._publish(Pending(state, step, time.perf_counter()))

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued state is published; re-raise the error of one that was given up."""
        async with asyncio.timeout(timeout), self._idle:
            await self._idle.wait_for(lambda: not self._queue and not self._busy)
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    async def _run(self) -> None:
        attempt = 0
        while True:
            item = await self._queue.get()
            self._busy = True
            try:
                await self._publish(item)
                attempt = 0
            except (StoreTimeout, StoreUnavailable) as e:
                # The store is unreachable: keep the state (unless a newer one waits) and retry.
                self.failures += 1
                delay = backoff_delay(attempt, self.config.retry_backoff_s, self.config.retry_backoff_cap_s)
                attempt += 1
                log.warning("publishing failed (%s: %s); retrying in %.1f s", type(e).__name__, e, delay)
                self._queue.put_back(item)
                await asyncio.sleep(delay)
            except Exception as e:  # the worker's top level: logged, counted, kept for flush()
                self.failures += 1
                self._error = e
                log.exception("publishing failed; this state is dropped")
            finally:
                self._busy = False
                async with self._idle:
                    self._idle.notify_all()

    async def _publish(self, item: Pending) -> PublishRecord:
        """One version: encode → claim → commit → write_head → retain → record, under the lock
        (versions go out one at a time, each a patch against the one before)."""
        async with self._lock:
            started = time.perf_counter()
            enc = await self._encode_item(item)
            encoded = time.perf_counter()
            manifest = await self._claim(item, enc)
            done = time.perf_counter()
            self._commit(item, manifest)
            await self.write_head()
            deleted = await self._retain_after(manifest)
        return self._record(item, manifest, enc, (started, encoded, done), deleted)

    async def _encode_item(self, item: Pending) -> Encoded:
        """The payloads (a patch against the last version, an anchor when one is due), in a thread."""
        anchor_due = (
            self.version is None
            or self._anchor_version is None
            or self._next - self._anchor_version >= self.config.anchor_every
        )
        return await asyncio.to_thread(encode_payloads, self._encoder, self._state, self.digest, item.state, anchor_due)

    async def _claim(self, item: Pending, enc: Encoded) -> Manifest:
        """Upload the payloads and put their signed manifest under the next free version number
        (create-only); a number someone else holds moves us on, at most ``_TAKEN_RETRIES`` times."""
        for attempt in range(_TAKEN_RETRIES):
            version = self._next
            refs = {
                role: ObjectRef(self.layout.payload(version, role, enc.hashes[role]), len(b), enc.hashes[role])
                for role, b in enc.blobs.items()
            }
            await upload_payloads(
                self.store,
                refs,
                enc.blobs,
                timeout=self.config.transfer_timeout_s,
                spool_threshold=self.config.spool_threshold,
                spool_dir=self.config.spool_dir,
            )
            manifest = self._manifest(version, item, enc, refs)
            if await self._put_manifest(manifest):
                return manifest
            self._next = await self._next_free(version)
            log.warning(
                "v%d is already taken in %s (attempt %d): moving to v%d",
                version,
                self.layout.channel,
                attempt + 1,
                self._next,
            )
        raise ConditionFailed(f"could not claim a version in {self.layout.channel} after {_TAKEN_RETRIES} tries")

    def _manifest(self, version: int, item: Pending, enc: Encoded, refs: dict[str, ObjectRef]) -> Manifest:
        """The manifest of ``version`` naming the uploaded payloads ``refs`` (unsigned)."""
        return Manifest(
            version=version,
            kind="anchor" if "anchor" in refs else "patch",
            model_digest=enc.digest,
            base_version=self.version if "patch" in refs else None,
            base_digest=self.digest if "patch" in refs else None,
            anchor=refs.get("anchor"),
            patch=refs.get("patch"),
            full_bytes=enc.full_bytes,
            publisher=self.key_id,
            created=now_iso(),
            step=item.step,
            model_config=self.model_config if "anchor" in refs else None,
        )

    async def _put_manifest(self, manifest: Manifest) -> bool:
        """Put the signed manifest if its version number is free; whether that version is now ours."""
        try:
            await self.store.put(
                self.layout.manifest(manifest.version),
                sign_manifest(manifest, self.key, context=self.layout.context),
                if_none_match=True,
                timeout=self.config.timeout_s,
            )
        except ConditionFailed:
            # An earlier attempt may have landed with its reply lost: then that version is this one.
            return await self._is_ours(manifest)
        return True

    async def _next_free(self, version: int) -> int:
        """The first version number above ``version`` that the listing does not show taken. Listed
        names only tell which numbers are taken, never which version is newest."""
        listing = await self._reader.list_versions()
        nxt = version + 1
        while nxt in listing:
            nxt += 1
        if nxt > MAX_VERSION:
            raise ConditionFailed(f"no free version number above v{version} in {self.layout.channel}")
        return nxt

    def _commit(self, item: Pending, manifest: Manifest) -> None:
        """The claimed version is now the last published one: the base of the next patch."""
        self._state, self.version, self.digest, self._next = (
            dict(item.state),
            manifest.version,
            manifest.model_digest,
            manifest.version + 1,
        )
        self._reader.remember(manifest)

    async def _retain_after(self, manifest: Manifest) -> int:
        """Retention after a version (retention.py); how many objects it deleted."""
        if manifest.kind == "anchor":
            self._anchor_version = manifest.version
        keep = self.config.keep_anchors
        if keep is None:
            if self._anchor_version is not None:
                self._reader.forget_below(self._anchor_version)  # keep the manifest cache small
            return 0
        return await retain(
            self.store,
            self.layout,
            self._reader,
            keep=keep,
            newest=self.version if self.version is not None else -1,  # ours: never a listed name
            keep_from=self.keep_from,
            timeout=self.config.timeout_s,
        )

    def _record(
        self, item: Pending, manifest: Manifest, enc: Encoded, times: tuple[float, float, float], deleted: int
    ) -> PublishRecord:
        """The version's :class:`PublishRecord`: kept, handed to ``on_record``, logged."""
        started, encoded, done = times
        sizes = {role: len(b) for role, b in enc.blobs.items()}
        record = PublishRecord(
            version=manifest.version,
            kind=manifest.kind,
            step=item.step,
            digest=enc.digest,
            payload_bytes=sizes,
            full_bytes=enc.full_bytes,
            ratio=enc.full_bytes / max(sizes.get("patch", sizes.get("anchor", 1)), 1),
            encode_s=encoded - started,
            upload_s=done - encoded,
            queued_s=started - item.submitted,
            latency_s=done - item.submitted,
            superseded=item.superseded,
            deleted=deleted,
        )
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        log.info(
            "published v%d (%s, %s bytes, %.0fx) in %.2f s",
            record.version,
            record.kind,
            sizes,
            record.ratio,
            record.latency_s,
        )
        return record

    async def write_head(self) -> bool:
        """Sign and overwrite the head record with the last published version and the time now.

        Call it periodically while no new version is due if subscribers set a freshness bound
        (``SubscriberConfig.head_max_age_s``). The manifest is what publishes a version; the head is
        what tells following subscribers to look (they list versions only when it moves) and lets
        them notice deleted or withheld ones. A failed write is logged, returns False, and is retried
        by the worker with backoff until it lands (or the next version writes a newer head).
        """
        async with self._head_lock:
            if self.version is None or self.digest is None:
                return True
            self._head_due = True
            head = Head(
                version=self.version, model_digest=self.digest, publisher=self.key_id, time_ms=int(time.time() * 1000)
            )
            try:
                await self.store.put(
                    self.layout.head, sign_head(head, self.key, context=self.layout.context), timeout=self.config.timeout_s
                )
            except StoreError as e:
                log.warning("head record for v%d not written (retried): %s: %s", head.version, type(e).__name__, e)
                if self._head_retry is None or self._head_retry.done():
                    self._head_retry = asyncio.create_task(self._rewrite_head(), name="pulsenet-publisher-head")
                return False
            self._head_due = head.version != self.version  # a newer version arrived meanwhile
            return True

    async def _rewrite_head(self) -> None:
        """Retry a failed head write with backoff until one lands (cancelled by ``close``)."""
        attempt = 0
        while self._head_due:
            await asyncio.sleep(backoff_delay(attempt, self.config.retry_backoff_s, self.config.retry_backoff_cap_s))
            attempt += 1
            if self._head_due:
                await self.write_head()

    async def _is_ours(self, manifest: Manifest) -> bool:
        """Whether the manifest already at ``manifest.version`` is this one, signed by us at another time."""
        try:
            signed = await fetch_document(
                self.store,
                self.layout.manifest(manifest.version),
                {self.key_id: self.key.public_key()},
                context=self.layout.context,
                max_bytes=self._reader.max_bytes,
                timeout=self.config.timeout_s,
            )
            there = manifest_from(signed, key_version=manifest.version)
        except (ManifestError, ObjectNotFound):
            return False
        return (there.model_digest, there.roles(), there.base_version) == (
            manifest.model_digest,
            manifest.roles(),
            manifest.base_version,
        )
