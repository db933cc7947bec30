"""Trainer side of the rollout channel: poll the trusted inference nodes' stores, verify, queue.

A batch is accepted only if, in this order (the first failing check is the counted reason):

1. its manifest is at most ``signing.MAX_DOCUMENT`` bytes (listed size, then the read is capped)
   — ``too_large``;
2. it verifies under a key trusted *for the node whose store it is in*, signed for that node's
   context — ``wrong_node_key`` when a key trusted only for another node validly signed it,
   ``signature`` otherwise;
   malformed bodies and bodies that disagree with their key name — ``malformed``;
3. ``trainer_version - version <= max_staleness`` — else dropped as stale *in flight* (judged
   from the key name before any GET: a body must match its name anyway);
4. its model digest is the one published for its version (``digest_of``) — ``unknown_version``,
   ``wrong_digest``;
5. its declared size and rows are within limits — ``too_large``, refused before download;
6. the payload's size and SHA-256 equal the manifest's (``signed.fetch_object``: never read past the
   signed size) — ``size_mismatch``, ``hash_mismatch``;
7. the Parquet decodes under the limits — ``payload_malformed``;
8. every row's version, digest and node equal the manifest's, and the row, group and token
   counts match — ``row_mismatch``.

A refused manifest is remembered by key and ETag and never fetched again while unchanged, so it
never blocks or slows valid ones. Batches wait in a local queue; ``take()`` drops those that went
stale while queued (counted apart from those stale in flight). Several trainers share one pool by
a deterministic partition (partition.py): each fetches only the batches it owns.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet.codec.rollout import MAX_ROWS, MAX_TOKENS, Rollout, decode_batch
from pulsenet.deadlines import ROLLOUT_TRANSFER_S, SMALL_CALL_S
from pulsenet.errors import (
    DocumentTooLarge,
    ManifestError,
    ObjectNotFound,
    PulsenetError,
    RolloutError,
    SignatureError,
    SizeMismatch,
    StoreError,
    VerificationError,
)
from pulsenet.rollouts.layout import BatchName, RolloutLayout, check_node
from pulsenet.rollouts.manifest import BatchManifest, batch_manifest_from
from pulsenet.rollouts.partition import owner
from pulsenet.signed import fetch_document, fetch_object
from pulsenet.signing import MAX_DOCUMENT
from pulsenet.store.base import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

REASONS = (
    "too_large",
    "signature",
    "wrong_node_key",
    "malformed",
    "unknown_version",
    "wrong_digest",
    "size_mismatch",
    "hash_mismatch",
    "payload_malformed",
    "row_mismatch",
)


@dataclass(frozen=True, slots=True)
class RolloutSource:
    """One inference node's store, read with read-only credentials, and the keys it may sign with."""

    node: str
    store: ObjectStore
    trusted: Mapping[str, Ed25519PublicKey]
    """Key id -> public key of this node only: another node's key is refused here."""


@dataclass(kw_only=True, slots=True)
class RolloutIntakeConfig:
    run: str = "default"
    """Run id of the signing context (must equal the writers')."""
    prefix: str = "rollouts"
    """Key prefix of the channel inside each node's store."""
    max_staleness: int = 2
    """Largest ``trainer_version - rollout_version`` trained on."""
    max_batch_bytes: int = 256 << 20
    """Payloads declared larger are refused before download."""
    max_rows: int = MAX_ROWS
    max_tokens: int = MAX_TOKENS
    max_queued: int = 64
    """Batches held for ``take()``; a full queue leaves the rest in the store for later polls."""
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (list, manifest get)."""
    transfer_timeout_s: float | None = ROLLOUT_TRANSFER_S
    """Deadline of one payload download."""
    interval_s: float = 1.0
    """Time between polls in ``run()``."""
    round_timeout_s: float | None = 600.0
    """Deadline of one whole poll in ``run()``."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.max_queued < 1 or self.max_batch_bytes < 1:
            raise ValueError("max_staleness must be >= 0, max_queued and max_batch_bytes >= 1")


@dataclass(frozen=True, slots=True)
class RolloutBatch:
    """An accepted batch: its verified manifest and rows."""

    manifest: BatchManifest
    rows: list[Rollout]

    @property
    def version(self) -> int:
        return self.manifest.version


@dataclass(slots=True)
class IntakeStats:
    polls: int = 0
    accepted: int = 0
    rows_accepted: int = 0
    taken: int = 0
    """Batches handed to the trainer by ``take()``."""
    bytes_downloaded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """Reason (REASONS) -> batches refused for it."""
    stale_in_flight: int = 0
    """Batches already too old when first seen in the store."""
    stale_queued: int = 0
    """Accepted batches that went too old in the local queue before ``take()``."""
    other_trainer: int = 0
    """Batches left to another participant by the partition."""
    staleness: dict[int, int] = field(default_factory=dict)
    """``trainer_version - version`` -> batches taken at that lag."""
    errors: int = 0
    """Store errors and failed polls (logged); the sources are retried next poll."""


class RolloutIntake:
    """Collects verified rollout batches from the trusted inference nodes for one trainer."""

    def __init__(
        self,
        sources: Sequence[RolloutSource],
        digest_of: Callable[[int], str | None],
        config: RolloutIntakeConfig | None = None,
        *,
        trainer_id: str = "t0",
        participants: Sequence[str] | Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        """``digest_of(version)``: the model digest published for a policy version, None if unknown.
        ``participants``: the trainer ids sharing the pool (per version, or fixed); default just us."""
        nodes = [check_node(s.node) for s in sources]
        if len(set(nodes)) != len(nodes) or not sources:
            raise ValueError(f"rollout sources need distinct node ids, got {nodes}")
        self.sources = list(sources)
        self._any_node = {kid: k for s in sources for kid, k in s.trusted.items()}
        """Every node's keys: a document one of them signed verifies, and its signer is then checked
        against the keys of the node whose store it is in (``wrong_node_key`` otherwise)."""
        self.digest_of = digest_of
        self.config = config = config or RolloutIntakeConfig()
        self.layout = RolloutLayout(config.prefix)
        self.trainer_id = trainer_id
        fixed = tuple(participants) if participants is not None and not callable(participants) else None
        if fixed is not None and trainer_id not in fixed:
            raise ValueError(f"trainer {trainer_id!r} is not among the participants {fixed}")
        self._participants = participants if callable(participants) else (lambda _v: fixed or (trainer_id,))
        self.stats = IntakeStats()
        self._seen: dict[str, dict[str, str]] = {s.node: {} for s in sources}  # node -> key -> etag decided
        self._accepted: dict[str, int] = {}  # batch id -> version: never queued twice
        self._taken: dict[str, int] = {}  # batch id -> version: handed to the trainer (``consumed``)
        self._queue: collections.deque[RolloutBatch] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    def batch_id(self, node: str, name: BatchName) -> str:
        return f"{node}/{self.layout.manifest(name.version, name.node, name.seq)}"

    # --- trainer API -------------------------------------------------------------------------

    def take(self, trainer_version: int, max_batches: int | None = None) -> list[RolloutBatch]:
        """Queued batches still fresh enough for ``trainer_version``, oldest first; stale ones are
        dropped and counted (``stale_queued``)."""
        out: list[RolloutBatch] = []
        while self._queue and (max_batches is None or len(out) < max_batches):
            b = self._queue.popleft()
            lag = trainer_version - b.version
            if lag > self.config.max_staleness:
                self.stats.stale_queued += 1
                log.info(
                    "dropped queued batch %s/v%d seq %d: %d versions stale",
                    b.manifest.node,
                    b.version,
                    b.manifest.seq,
                    lag,
                )
                continue
            self.stats.taken += 1
            self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + 1
            m = b.manifest  # accepted only from its own node's store, under its own name
            self._taken[self.batch_id(m.node, BatchName(m.version, m.node, m.seq))] = b.version
            out.append(b)
        return out

    def consumed(self) -> dict[str, int]:
        """``batch id -> version`` of the batches ``take`` handed out that are still within the
        staleness window: part of a trainer's resume state, so that a restarted trainer does not
        train on a batch twice (``skip_consumed``)."""
        return dict(self._taken)

    def skip_consumed(self, consumed: Mapping[str, int]) -> None:
        """Never queue these batches (what ``consumed`` returned before a restart)."""
        self._taken.update(consumed)
        self._accepted.update(consumed)

    async def run(self, trainer_version: Callable[[], int], stop: asyncio.Event | None = None) -> None:
        """Poll until ``stop`` is set or the task is cancelled; failed polls are logged and counted."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                async with asyncio.timeout(self.config.round_timeout_s):
                    await self.poll(trainer_version())
            except (PulsenetError, TimeoutError) as e:
                self.stats.errors += 1
                log.warning("rollout poll failed: %s: %s", type(e).__name__, e)
            except Exception:  # the task's top level: logged and counted, polling goes on
                self.stats.errors += 1
                log.exception("unexpected error in a rollout poll")
            try:
                async with asyncio.timeout(self.config.interval_s):
                    await stop.wait()
            except TimeoutError:
                pass

    async def poll(self, trainer_version: int) -> int:
        """One pass over every source; returns how many batches were accepted into the queue."""
        self.stats.polls += 1
        floor = trainer_version - self.config.max_staleness
        self._accepted = {b: v for b, v in self._accepted.items() if v >= floor}
        self._taken = {b: v for b, v in self._taken.items() if v >= floor}
        accepted = 0
        for source in self.sources:
            try:
                accepted += await self._poll_source(source, trainer_version)
            except (StoreError, TimeoutError) as e:
                self.stats.errors += 1
                log.warning(
                    "rollout source %s (%s) failed: %s: %s",
                    source.node,
                    source.store.url,
                    type(e).__name__,
                    e,
                )
        return accepted

    # --- one source --------------------------------------------------------------------------

    async def _poll_source(self, source: RolloutSource, trainer_version: int) -> int:
        listing = await source.store.list(self.layout.manifests, timeout=self.config.timeout_s)
        seen = self._seen[source.node]
        listed = {i.key for i in listing}
        for k in [k for k in seen if k not in listed]:
            del seen[k]  # memory stays bounded by the listing
        accepted = 0
        for info in listing:
            name = self.layout.parse_manifest(info.key)
            if name is None or seen.get(info.key) == info.etag:
                continue
            if name.version > trainer_version:
                continue  # from a version this trainer has not reached: look again later
            if trainer_version - name.version > self.config.max_staleness:
                # Stale by its name: dropped without a GET. Nothing valid is lost, since a body
                # must name the batch its key names to be accepted at all.
                self.stats.stale_in_flight += 1
                seen[info.key] = info.etag
                continue
            bid = self.batch_id(source.node, name)
            if owner(bid, self._participants(name.version)) != self.trainer_id:
                self.stats.other_trainer += 1
                seen[info.key] = info.etag
                continue
            if len(self._queue) >= self.config.max_queued:
                break
            batch = await self._consider(source, info, name, trainer_version)
            seen[info.key] = info.etag  # decided: accepted, rejected or stale, never fetched again
            if batch is not None and bid not in self._accepted:
                self._accepted[bid] = batch.version
                self._queue.append(batch)
                self.stats.accepted += 1
                self.stats.rows_accepted += len(batch.rows)
                accepted += 1
        return accepted

    async def _consider(
        self, source: RolloutSource, info: ObjectInfo, name: BatchName, trainer_version: int
    ) -> RolloutBatch | None:
        """The batch if it passes every check, else None with the reason counted and logged.

        Store errors other than a missing or oversized object propagate (nothing is remembered)."""
        cfg = self.config
        ctx = self.layout.context(cfg.run, source.store.url, source.node)
        try:  # verified under every node's keys, so that another node's signature is told apart
            signed = await fetch_document(
                source.store,
                info.key,
                self._any_node,
                context=ctx,
                max_bytes=MAX_DOCUMENT,
                timeout=cfg.timeout_s,
                listed_size=info.size,
            )
            if signed.signer not in source.trusted:
                return self._reject(info.key, "wrong_node_key", f"signed by {signed.signer}, a key of another node")
            m = batch_manifest_from(signed, layout=self.layout, name=name)
        except ObjectNotFound:
            return None  # deleted by its owner's retention since the listing
        except DocumentTooLarge as e:
            return self._reject(info.key, "too_large", str(e))
        except SignatureError as e:
            return self._reject(info.key, "signature", str(e))
        except ManifestError as e:
            return self._reject(info.key, "malformed", str(e))
        if m.node != source.node:
            return self._reject(info.key, "malformed", f"node {m.node!r} in the store of {source.node!r}")
        lag = trainer_version - m.version
        if lag > cfg.max_staleness:
            self.stats.stale_in_flight += 1
            log.info("dropped batch %s: %d versions stale in flight", info.key, lag)
            return None
        published = self.digest_of(m.version)
        if published is None:
            return self._reject(info.key, "unknown_version", f"no published digest for v{m.version}")
        if published != m.model_digest:
            return self._reject(
                info.key, "wrong_digest", f"served {m.model_digest[:16]}…, v{m.version} is {published[:16]}…"
            )
        if m.payload.size > cfg.max_batch_bytes or m.rows > cfg.max_rows or m.tokens > cfg.max_tokens:
            return self._reject(
                info.key, "too_large", f"{m.payload.size} bytes, {m.rows} rows, {m.tokens} tokens declared"
            )
        try:
            payload = await fetch_object(source.store, m.payload, timeout=cfg.transfer_timeout_s)
        except ObjectNotFound:
            return self._reject(info.key, "size_mismatch", f"payload {m.payload.key} is missing")
        except SizeMismatch as e:
            return self._reject(info.key, "size_mismatch", str(e))
        except VerificationError as e:
            self.stats.bytes_downloaded += m.payload.size
            return self._reject(info.key, "hash_mismatch", str(e))
        self.stats.bytes_downloaded += len(payload)
        try:
            rows, problem = await asyncio.to_thread(_decode_and_match, m, payload)
        except RolloutError as e:
            return self._reject(info.key, "payload_malformed", str(e))
        if problem:
            return self._reject(info.key, "row_mismatch", problem)
        return RolloutBatch(m, rows)

    def _reject(self, key: str, reason: str, why: str) -> None:
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + 1
        log.warning("rejected rollout batch %s (%s): %s", key, reason, why)
        return None


def _decode_and_match(m: BatchManifest, payload: bytes) -> tuple[list[Rollout], str | None]:
    """The rows (decoded under the manifest's counts) and what disagrees with the manifest, if anything."""
    rows = decode_batch(payload, max_rows=m.rows, max_tokens=m.tokens)
    return rows, _row_mismatch(m, rows)


def _row_mismatch(m: BatchManifest, rows: list[Rollout]) -> str | None:
    for r in rows:
        if r.version != m.version or r.model_digest != m.model_digest or r.node != m.node:
            return f"a row says node {r.node!r} v{r.version}; the manifest says {m.node!r} v{m.version}"
    if len(rows) != m.rows or len({r.group for r in rows}) != m.groups:
        return (
            f"{len(rows)} rows in {len({r.group for r in rows})} groups; manifest says {m.rows} in {m.groups}"
        )
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    if tokens != m.tokens:
        return f"{tokens} tokens; manifest says {m.tokens}"
    return None
