"""Inference side of the rollout channel: upload batches to the node's own store, then sign them.

``start()`` also publishes the node's public key (``layout.key``), for trainers that accept open
nodes (intake.py). Per batch: Parquet encode and SHA-256 in a thread, the payload put create-only under its
content-tagged key, then the signed manifest create-only (layout.py), then the signed head
overwritten (manifest.py: trainers poll it with one conditional GET and list only when it moved;
a failed head write is logged, counted and redone with the next batch, never fails the batch). Nothing is ever overwritten:
if either key is taken (a restarted node racing its old self, a planted object) the batch moves to
the next sequence number. ``start()`` continues the sequence after what the node's own key signed
(its head and the manifests that verify under its key), so a restarted node neither reuses a number
nor overwrites a batch, and a planted name never sets the number (issue 29).

Orphans: a payload whose manifest was never written (the writer killed between the two puts) is
this node's to remove: ``start`` and ``retain`` delete it once it is older than
``orphan_grace_s`` (or below the retention floor), so nothing half-written stays behind.

Retention (``retain``): trainers cannot write here (each site writes only its own bucket), so the
owner cannot learn which batches were consumed; it deletes what nobody may train on any more,
batches whose version is below ``newest_policy_version - max_staleness``, manifests first so no
manifest ever names a missing payload. Storage stays bounded by ``max_staleness + 1`` versions of
batches.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec.rollout import ZSTD_LEVEL, Rollout, encode_batch
from pulsenet.deadlines import ROLLOUT_TRANSFER_S, SMALL_CALL_S
from pulsenet.errors import (
    ConditionFailed,
    DocumentTooLarge,
    ManifestError,
    ObjectNotFound,
    RolloutError,
    StoreError,
)
from pulsenet.rollouts.layout import MAX_SEQ, BatchName, RolloutLayout, check_node
from pulsenet.rollouts.manifest import (
    MAX_HEAD,
    MAX_MANIFEST,
    BatchManifest,
    RolloutHead,
    batch_manifest_from,
    head_from,
    now_iso,
    sign_batch_manifest,
)
from pulsenet.signed import ObjectRef, fetch_document
from pulsenet.signing import key_id, sign_document
from pulsenet.store.base import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class RolloutWriterConfig:
    run: str = "default"
    """Run id: part of the signing context, so batches never cross runs."""
    prefix: str = "rollouts"
    """Key prefix of the channel inside the node's store (layout.py)."""
    max_staleness: int = 2
    """Versions a trainer may lag its rollouts; ``retain`` deletes what is older than that."""
    zstd_level: int = ZSTD_LEVEL
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (manifest put, list, delete)."""
    transfer_timeout_s: float | None = ROLLOUT_TRANSFER_S
    """Deadline of one payload upload."""
    taken_retries: int = 8
    """Sequence numbers tried per batch when keys are already taken."""
    orphan_grace_s: float = 120.0
    """A payload no manifest names (its writer died between the two puts) is deleted at ``start``
    and by ``retain`` once this old: longer than a manifest put may take (a racing instance)."""
    verify_at_start: int = 1024
    """Most of this node's listed manifests ``start`` fetches and verifies (newest first; retention
    keeps ``max_staleness + 1`` versions of batches, so an honest channel holds far fewer): names
    planted past it cost nothing but a line in the listing."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.taken_retries < 1 or self.orphan_grace_s < 0 or self.verify_at_start < 1:
            raise ValueError("max_staleness and orphan_grace_s must be >= 0, taken_retries and verify_at_start >= 1")


@dataclass(slots=True)
class WriterStats:
    batches: int = 0
    rows: int = 0
    bytes_uploaded: int = 0
    seq_taken: int = 0
    """Sequence numbers skipped because a key already existed."""
    deleted: int = 0
    """Objects removed by retention."""
    head_writes: int = 0
    head_errors: int = 0
    """Head writes that failed (logged; the head is rewritten with the next batch)."""
    orphans_deleted: int = 0
    """Payloads deleted because no manifest named them (also counted in ``deleted``)."""
    junk_names: int = 0
    """Manifest names of this node found at ``start`` that did not verify under its key (planted,
    malformed, another key's), or were past ``verify_at_start``: ignored, never a resume point."""


class RolloutWriter:
    """Publishes one inference node's rollout batches; ``await start()`` before ``write``."""

    def __init__(
        self,
        store: ObjectStore,
        key: Ed25519PrivateKey,
        node: str,
        config: RolloutWriterConfig | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.key_id = key_id(key.public_key())
        self.node = check_node(node)
        self.config = config = config or RolloutWriterConfig()
        self.layout = RolloutLayout(config.prefix)
        self.context = self.layout.context(config.run, store.url, node)
        self.stats = WriterStats()
        self.next_seq: int | None = None
        """Sequence number of the next batch (None before ``start``)."""
        self._produced: dict[int, BatchName] = {}  # seq -> this node's batches whose manifest is in the store
        self.head: RolloutHead | None = None
        """The head written last (or found at ``start``)."""
        self._retained_floor: int | None = None

    @property
    def produced(self) -> list[BatchName]:
        """This node's batches in its store (manifest written, not yet deleted by ``retain``), as
        of ``start`` plus what this writer did since: what demand pacing counts as outstanding."""
        return [self._produced[s] for s in sorted(self._produced)]

    async def start(self) -> None:
        """Continue the sequence after this node's own batches, and delete its orphans: payloads
        whose manifest was never written (a writer killed between the two puts), older than
        ``orphan_grace_s``.

        A listed name is a claim anyone who can write the bucket can make: the resume point and
        ``produced`` come only from what this node's key signed, its head (``next_seq``) and the
        manifests that verify under its key for this channel (at most ``verify_at_start``, newest
        first). A name that does not verify is ignored and counted (``stats.junk_names``); the
        payload names of orphans move the sequence on only within ``taken_retries`` of that signed
        resume point (what killed writers may have left), so no name pins the node to a number."""
        listings = {
            prefix: await self.store.list(prefix, timeout=self.config.timeout_s)
            for prefix in (self.layout.manifests, self.layout.batches)
        }
        try:  # our own head: its seq goes on from there, whatever this machine's clock says
            signed = await fetch_document(
                self.store,
                self.layout.head,
                self._own_key,
                context=self.layout.head_context(self.config.run, self.store.url, self.node),
                max_bytes=MAX_HEAD,
                timeout=self.config.timeout_s,
            )
            self.head = head_from(signed, self.node)
        except ObjectNotFound:
            pass
        except (ManifestError, DocumentTooLarge) as e:  # planted or of another key: overwritten below
            log.warning("rollout head in %s is not %s's: %s", self.store.url, self.node, e)
        mine = [
            (name, info)
            for info in listings[self.layout.manifests]
            if (name := self.layout.parse_manifest(info.key)) is not None and name.node == self.node
        ]
        for name in await self._verified(mine):
            self._produced[name.seq] = name
        if self.stats.junk_names:
            log.warning("rollout writer %s: %d listed names of its own did not verify: ignored", self.node, self.stats.junk_names)
        resume = max([self.head.next_seq if self.head else 0, *(s + 1 for s in self._produced)])
        orphans = [
            name.seq
            for info in listings[self.layout.batches]
            if (name := self.layout.parse_batch(info.key)) is not None and name.node == self.node
        ]
        # past the orphans too (a sequence number is never reused), as far as killed writers reach
        self.next_seq = max([resume, *(s + 1 for s in orphans if resume <= s < resume + self.config.taken_retries)])
        self.stats.deleted += await self._delete_orphans(
            listings[self.layout.manifests], listings[self.layout.batches], floor=None
        )
        await self.write_key()
        await self.write_head()
        log.info("rollout writer %s continues at seq %d", self.node, self.next_seq)

    @property
    def _own_key(self) -> dict[str, Ed25519PublicKey]:
        return {self.key_id: self.key.public_key()}

    async def _verified(self, listed: list[tuple[BatchName, ObjectInfo]]) -> list[BatchName]:
        """The names among ``listed`` whose manifest this node's key signed for this channel and
        whose body names that very batch; the rest are counted in ``stats.junk_names``. Checks at
        most ``verify_at_start`` names (newest first), a few at a time."""
        listed = sorted(listed, key=lambda x: (x[0].version, x[0].seq), reverse=True)
        skipped = listed[self.config.verify_at_start :]
        if skipped:
            self.stats.junk_names += len(skipped)
            log.warning(
                "rollout writer %s: %d listed manifests past the newest %d not checked",
                self.node, len(skipped), self.config.verify_at_start,
            )
        gate = asyncio.Semaphore(8)

        async def check(name: BatchName, info: ObjectInfo) -> BatchName | None:
            async with gate:
                try:
                    signed = await fetch_document(
                        self.store,
                        info.key,
                        self._own_key,
                        context=self.context,
                        max_bytes=MAX_MANIFEST,
                        timeout=self.config.timeout_s,
                        listed_size=info.size,
                    )
                    return batch_manifest_from(signed, layout=self.layout, name=name).name
                except ObjectNotFound:
                    return None  # deleted since the listing (a racing instance's retention)
                except ManifestError as e:  # planted, another key's, malformed: never steers anything
                    self.stats.junk_names += 1
                    if self.stats.junk_names <= 3:  # counted all; a bucket full of names is not a log full of lines
                        log.warning("rollout writer %s: ignoring %s: %s", self.node, info.key, e)
                    return None

        found = await asyncio.gather(*(check(n, i) for n, i in listed[: self.config.verify_at_start]), return_exceptions=True)
        for r in found:  # every check has ended: a store error or timeout fails the start as a listing's would
            if isinstance(r, BaseException):
                raise r
        return [n for n in found if isinstance(n, BatchName)]

    async def write(self, rows: Sequence[Rollout], *, dropped: Sequence[int] = ()) -> BatchManifest:
        """Upload one batch (rows of one policy version and digest, sampled by this node);
        ``dropped``: the problem numbers of its assignment the node's prompter left out, declared in
        the manifest (the trainer checks every other one is answered)."""
        if self.next_seq is None:
            await self.start()
        if not rows:
            raise RolloutError("a rollout batch needs at least one row")
        version, digest = rows[0].version, rows[0].model_digest
        for r in rows:
            if r.node != self.node or r.version != version or r.model_digest != digest:
                raise RolloutError(
                    f"every row of a batch must be node {self.node!r}, v{version}, digest {digest[:16]}…; "
                    f"got node {r.node!r}, v{r.version}"
                )
        data = await asyncio.to_thread(encode_batch, rows, zstd_level=self.config.zstd_level)
        sha = await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
        for _ in range(self.config.taken_retries):
            seq = self.next_seq or 0
            if seq > MAX_SEQ:  # 10**8 batches of one node: a new node id (or run) goes on from here
                raise RolloutError(f"node {self.node} has used every sequence number up to {MAX_SEQ} in {self.store.url}")
            self.next_seq = seq + 1
            key = self.layout.batch(version, self.node, seq, sha)
            try:
                await self.store.put(key, data, if_none_match=True, timeout=self.config.transfer_timeout_s)
            except ConditionFailed:
                self.stats.seq_taken += 1
                log.warning("batch key %s exists; moving to the next sequence number", key)
                continue
            manifest = BatchManifest(
                node=self.node,
                seq=seq,
                version=version,
                model_digest=digest,
                payload=ObjectRef(key, len(data), sha),
                rows=len(rows),
                groups=len({r.group for r in rows}),
                tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows),
                dropped=tuple(sorted(set(dropped))),
                publisher=self.key_id,
                created=now_iso(),
            )
            signed = sign_batch_manifest(manifest, self.key, context=self.context)
            mkey = self.layout.manifest(version, self.node, seq)
            try:
                await self.store.put(mkey, signed, if_none_match=True, timeout=self.config.timeout_s)
            except ConditionFailed:
                # Our payload put succeeded, so that key was free and is ours alone: remove it.
                self.stats.seq_taken += 1
                await self.store.delete([key], timeout=self.config.timeout_s)
                # Manifest keys are predictable (the head says next_seq): names planted ahead of us
                # would eat every retry one by one. The listing tells which numbers are taken (never
                # which batches exist): go past all of them at once.
                self.next_seq = await self._first_free(version, seq + 1)
                log.warning("manifest %s exists; moving to sequence number %d", mkey, self.next_seq)
                continue
            self._produced[seq] = manifest.name
            self.stats.batches += 1
            self.stats.rows += len(rows)
            self.stats.bytes_uploaded += len(data) + len(signed)
            await self.write_head()
            return manifest
        raise ConditionFailed(
            f"{self.config.taken_retries} sequence numbers in a row were taken in {self.store.url}"
        )

    async def _first_free(self, version: int, seq: int) -> int:
        """The first sequence number from ``seq`` that no listed manifest key of this node at
        ``version`` holds."""
        listing = await self.store.list(self.layout.manifests, timeout=self.config.timeout_s)
        taken = {
            n.seq
            for i in listing
            if (n := self.layout.parse_manifest(i.key)) is not None and n.node == self.node and n.version == version
        }
        while seq in taken:
            seq += 1
        return seq

    async def write_key(self) -> None:
        """Publish this node's public key (``layout.key``, raw 32 bytes): a trainer that accepts
        open nodes pins it on first read. Rewritten at every start (the same bytes: trainers'
        conditional GETs then answer 304); a store error fails the start."""
        raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        await self.store.put(self.layout.key, raw, timeout=self.config.timeout_s)

    async def write_head(self) -> bool:
        """Overwrite the signed head with what this node has written; False (logged, counted) if
        the put failed: the next batch writes it again, and trainers list anyway now and then."""
        seq = max(time.time_ns() // 1000, self.head.seq + 1 if self.head else 0)
        head = RolloutHead(
            node=self.node,
            seq=seq,
            next_seq=self.next_seq or 0,
            newest_version=max((n.version for n in self._produced.values()), default=0),
            publisher=self.key_id,
            created=now_iso(),
        )
        data = sign_document(
            head.to_body(), self.key, context=self.layout.head_context(self.config.run, self.store.url, self.node)
        )
        try:
            await self.store.put(self.layout.head, data, timeout=self.config.timeout_s)
        except (StoreError, TimeoutError) as e:
            self.stats.head_errors += 1
            log.warning("rollout head of %s not written: %s: %s", self.node, type(e).__name__, e)
            return False
        self.head = head
        self.stats.head_writes += 1
        return True

    async def retain(self, newest_version: int) -> int:
        """Delete this node's batches no trainer may accept any more (version below
        ``newest_version - max_staleness``), and its orphans (payloads without a manifest) older
        than ``orphan_grace_s`` or below that floor; returns how many objects went.

        Lists the channel only when the floor moved since the last call (once per version, however
        often it is called)."""
        floor = newest_version - self.config.max_staleness
        if floor == self._retained_floor:
            return 0
        manifests = await self.store.list(self.layout.manifests, timeout=self.config.timeout_s)
        batches = await self.store.list(self.layout.batches, timeout=self.config.timeout_s)
        doomed = [
            info.key
            for info in manifests
            if (name := self.layout.parse_manifest(info.key)) is not None and name.node == self.node and name.version < floor
        ]
        await self.store.delete(doomed, timeout=self.config.timeout_s)  # manifests first: none names a missing payload
        gone = set(doomed)
        n = len(doomed) + await self._delete_orphans([i for i in manifests if i.key not in gone], batches, floor=floor)
        self._retained_floor = floor
        self._produced = {s: n for s, n in self._produced.items() if n.version >= floor}
        self.stats.deleted += n
        if n:
            log.info("retention: deleted %d rollout objects of %s below v%d", n, self.node, floor)
        return n

    async def _delete_orphans(self, manifests: list[ObjectInfo], batches: list[ObjectInfo], *, floor: int | None) -> int:
        """Delete this node's payloads that no listed manifest names: below ``floor`` (nobody may
        take them) or older than ``orphan_grace_s`` by the store's clock. The grace keeps the
        payload of a racing instance of this node (a restart racing its old self) whose manifest
        put is still on its way."""
        named = {
            (n.version, n.seq)
            for i in manifests
            if (n := self.layout.parse_manifest(i.key)) is not None and n.node == self.node
        }
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self.config.orphan_grace_s)
        orphans = [
            i.key
            for i in batches
            if (n := self.layout.parse_batch(i.key)) is not None
            and n.node == self.node
            and (n.version, n.seq) not in named
            and ((floor is not None and n.version < floor) or i.last_modified <= cutoff)
        ]
        if orphans:
            await self.store.delete(orphans, timeout=self.config.timeout_s)
            self.stats.orphans_deleted += len(orphans)
            log.info("deleted %d rollout payloads of %s that no manifest names", len(orphans), self.node)
        return len(orphans)
