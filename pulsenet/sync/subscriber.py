"""PULSESync subscriber: poll a channel, rebuild the newest version off to the side, verify it,
then swap it in.

Each round whose head moved lists the manifests and takes the newest version above the current one
whose manifest a trusted key signed. It fetches payloads through a local cache, applies them in
threads, and checks every payload's size and SHA-256 against the manifest, every rebuilt tensor's
SHA-256 and the model digest of the result. Only then does it swap in the new weights:
``on_update(version, state, digest, changed=...)``, ``changed`` naming the tensors the verified
patches rewrote. Nothing unverified is ever handed out; a failure leaves the current weights serving.
``announced()`` says which version the channel announces *and* a verified manifest backs (what a
node may act on: failover), never a bare head's number.

- **Catch-up** (chain.py): the cheapest verified path: patches from the current version, or the
  newest anchor plus the patches after it (joined late, fell far behind, chain retired). A missing
  or corrupt object marks that payload bad and the next path is tried.
- **Replay**: a manifest that is not newer than the current version (a copied old manifest, a
  store rolled back) is a ReplayError: logged once, ignored.
- **Hostile objects**: anything in the bucket may be planted. A manifest object that is too big
  (listed size), malformed, unsigned or signed for another context is rejected, remembered by key
  and ETag (not fetched again until it changes) and never stops an older valid version from being
  taken in the same round.
- **Polls that cost nothing when nothing changed**: each round starts with one conditional GET of
  the signed head (``{channel}/head.json``, ``If-None-Match`` on the ETag of the last head accepted:
  a 304 with no body while it is unchanged). The version listing is read only when the head moved
  past the version serving, is missing, refused, moving backwards, stale, unreadable, or none was
  ever accepted; otherwise the round ends there (``stats.idle_polls``). A head naming a version
  whose manifest is missing, older than ``head_max_age_s``, or moving backwards is an alarm
  (logged, counted in the stats), never a reason to stop serving.
- **Persistence** (``state_dir``): after each swap the weights are written atomically with their
  version (localstate.py), so a restarted, even SIGKILLed, subscriber resumes from disk and
  fetches only the patches it missed.
- **Lifetimes**: ``run()`` polls until ``stop`` is set or it is cancelled; each round runs under
  ``asyncio.timeout``, every store call has its own deadline, cancellation is never retried.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet import runtime
from pulsenet.codec.buffers import BufferPool
from pulsenet.deadlines import SMALL_CALL_S, TRANSFER_S
from pulsenet.errors import (
    ManifestError,
    ObjectNotFound,
    PulsenetError,
    ReplayError,
    StoreError,
    VerificationError,
)
from pulsenet.store.base import ObjectStore
from pulsenet.sync import localstate
from pulsenet.sync.chain import (
    ManifestReader,
    PayloadCache,
    candidate_paths,
    check_cache_dir,
    rebuild,
)
from pulsenet.sync.layout import DEFAULT_RUN, Layout
from pulsenet.sync.manifest import MAX_MANIFEST, Head, Manifest

log = logging.getLogger(__name__)

OnUpdate = Callable[..., Awaitable[None] | None]
"""``on_update(version, state, digest, *, changed)``, sync or async (see ``Subscriber.__init__``)."""


@dataclass(kw_only=True, slots=True)
class SubscriberConfig:
    channel: str = "policy"
    """Key prefix of the policy stream (see layout.py)."""
    run: str = DEFAULT_RUN
    """Run name the publisher signed for (layout.py): manifests of another run do not verify."""
    interval_s: float = 2.0
    """Time between polls."""
    jitter: float = 0.2
    """Each wait is ``interval_s`` times a random factor in [1 - jitter, 1 + jitter], so many
    subscribers don't poll in lockstep."""
    state_dir: Path | None = None
    """Persist the verified weights here and resume from them; None keeps them in memory only."""
    cache_dir: Path | None = None
    """Payload cache, owned by this subscriber alone; None: a temporary directory removed on close."""
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (list, manifest get)."""
    transfer_timeout_s: float | None = TRANSFER_S
    """Deadline of one payload download."""
    round_timeout_s: float | None = 1800.0
    """Deadline of one whole poll-and-update round."""
    threads: int = 0
    """Codec threads for applying and verifying; 0: this node's share of its cores
    (``codec.threads.codec_threads``: its CPU affinity, capped by OMP_NUM_THREADS)."""
    parallel_downloads: int = 4
    """Payloads fetched at once when catching up (a streamed patch is one GET)."""
    rebuild_in_place: bool = True
    """Rebuild into the persisted current state, tensor by tensor (``chain.apply_payloads``'s
    ``consume``): one BF16 state held, not two; a failed rebuild reloads it from ``state_dir``."""
    max_targets: int = 3
    """Versions whose payloads are tried per round, newest first, when the newest cannot be built
    (rejected manifests do not count: they cost one small fetch each, once)."""
    max_manifest_bytes: int = MAX_MANIFEST
    """Manifest objects listed (or found) larger than this are rejected unread."""
    head_max_age_s: float | None = None
    """Alarm when the head record is older than this (or missing); None: no freshness bound. The
    publisher must then rewrite its head more often (``Publisher.write_head``)."""


@dataclass(slots=True)
class SubscriberStats:
    polls: int = 0
    updates: int = 0
    rounds_failed: int = 0
    """Rounds that ended in an error (logged); the current weights kept serving."""
    manifests_rejected: int = 0
    """Manifests refused: bad signature, untrusted key, malformed."""
    replays: int = 0
    """Manifests refused as not newer than the current version."""
    payloads_rejected: int = 0
    """Payloads missing or failing verification."""
    anchors_applied: int = 0
    patches_applied: int = 0
    last_update_s: float | None = None
    """``time.time()`` of the last swap."""
    bytes_downloaded: int = 0
    """Payload bytes fetched from the store."""
    last_download_s: float = 0.0
    """Fetching the payloads of the last update (a streamed patch: until its last byte landed)."""
    last_apply_s: float = 0.0
    """Decoding and verifying the last update, after its download (a streamed patch decodes during it)."""
    state_reloads: int = 0  # failed rebuilds in place after which the persisted weights were reloaded
    last_changed: int | None = None
    """Tensors the last update changed (``changed`` handed to ``on_update``)."""
    errors: list[str] = field(default_factory=list)
    """The last few round errors, newest last."""
    head_version: int | None = None
    """Version the newest verified head record names: the publisher's word, not verified weights
    (a trusted key can sign any number). Alarms only; act on :meth:`Subscriber.announced`."""
    announced_version: int | None = None
    """The newest version :meth:`Subscriber.announced` vouched for: its signed manifest verified."""
    announced_unverified: int = 0
    """Heads ``announced()`` did not vouch for: their version's manifest missing, unverifiable, or
    of another model digest than the head's (a head running ahead of every manifest)."""
    head_age_s: float | None = None
    """Age of that head record at the last poll."""
    head_stale: bool = False
    """The head is older than ``head_max_age_s``, or missing where one is expected."""
    head_missing_version: int | None = None
    """The head names this version but its manifest is not listed (deleted or withheld)."""
    head_alarms: int = 0
    """Head alarms raised, one per condition per poll: stale or missing head, missing version,
    refused or replayed head."""
    heads_rejected: int = 0
    """Head records refused: malformed, untrusted, other context, or moving backwards."""
    idle_polls: int = 0
    """Polls that ended at the head: unchanged (a 304) or naming no version above the current one."""
    listings: int = 0
    """Polls that read the version listing (the head moved, or could not be trusted to say it did not)."""


class Subscriber:
    """Follows one channel; ``run()`` polls, ``sync_once()`` does one round."""

    def __init__(
        self,
        store: ObjectStore,
        trusted: Mapping[str, Ed25519PublicKey],
        config: SubscriberConfig | None = None,
        *,
        on_update: OnUpdate | None = None,
        on_saved: Callable[[int, str], None] | None = None,
        on_consume: Callable[[], object] | None = None,
    ) -> None:
        """``on_update(version, state, digest, *, changed)``, sync or async, receives only verified
        weights, as soon as they are verified. ``changed`` (a frozenset of tensor names) names the
        tensors that may differ from the previous ``state`` handed over: those the verified patches
        rewrote, every name after an anchor or a resume from disk; the others are the previous
        tensors themselves (shared: treat them as read-only), so an engine updates only ``changed``
        (``InferenceEngine.update(..., changed=...)`` takes the same keyword). A callback without a
        ``changed`` parameter (or ``**kwargs``) is called with the first three only.
        ``on_saved(version, digest)`` runs once they are persisted in ``state_dir``. ``on_consume()``,
        sync or async, runs before a rebuild in place takes the last state handed over apart: a holder
        of its tensors drops them there, or they stay resident beside the rebuilt ones."""
        if not trusted:
            raise ManifestError("a subscriber needs at least one trusted publisher key")
        self.store = store
        self.config = config = config or SubscriberConfig()
        self.layout = Layout(config.channel, run=config.run, store_url=store.url)
        self.on_update = on_update
        self._pass_changed = on_update is not None and _takes_keyword(on_update, "changed")
        self.on_saved = on_saved
        self.on_consume = on_consume
        self.stats = SubscriberStats()
        self.version: int | None = None
        """Version of the weights serving now (None before the first)."""
        self.digest: str | None = None
        self.state: Mapping[str, torch.Tensor] | None = None
        """``version``'s weights; None before it, or given up to a rebuild in place until reloaded."""
        self._persisted: tuple[int, str | None] | None = None  # (version, digest) in ``state_dir``
        self.resumed_from: int | None = None
        """Version loaded from ``state_dir`` at start, if any."""
        self.building: int | None = None
        """The version a round is building now (download, rebuild, hand-over to ``on_update``), else None."""
        self._reader = ManifestReader(store, self.layout, trusted, config.timeout_s, config.max_manifest_bytes)
        self._head: Head | None = None
        self._head_etag: str | None = None
        """ETag of the object ``_head`` came from: the next poll asks the store "changed since?"."""
        self._head_trusted = False
        """This poll's head read gave an accepted head (new or unchanged): it may end the poll."""
        self._head_gone = False
        self._bad_payloads: set[str] = set()
        self._rejected: dict[str, str] = {}  # manifest key -> etag of a copy we refused
        self._tmp_cache: tempfile.TemporaryDirectory[str] | None = None
        self._cache: PayloadCache | None = None
        self._rng = random.Random()
        self._started = False
        self._buffers = BufferPool()  # an old version's tensor memory goes to the next one's (codec/buffers.py)

    @property
    def cache(self) -> PayloadCache:
        if self._cache is None:
            raise RuntimeError("Subscriber is not started: call start() or use 'async with'")
        return self._cache

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the cache and resume from ``state_dir`` (calls ``on_update`` with what it loaded)."""
        if self._started:
            return
        cache_dir = self.config.cache_dir
        if cache_dir is not None and self.config.state_dir is not None:  # a model directory is not a cache's to clean
            check_cache_dir(cache_dir, self.config.state_dir, cache_flag="cache_dir", other_flag="state_dir")
        if cache_dir is None:
            self._tmp_cache = tempfile.TemporaryDirectory(prefix="pulsenet-sub-cache-")
            cache_dir = Path(self._tmp_cache.name)
        self._cache = PayloadCache(self.store, cache_dir, timeout_s=self.config.transfer_timeout_s)
        await asyncio.to_thread(self._cache.sweep)
        self._started = True
        if self.config.state_dir is None:
            return
        state_dir = Path(self.config.state_dir)
        await asyncio.to_thread(state_dir.mkdir, parents=True, exist_ok=True)
        await asyncio.to_thread(localstate.sweep, state_dir)
        try:
            local = await asyncio.to_thread(localstate.load, state_dir, threads=self.config.threads, buffers=self._buffers)
        except (PulsenetError, OSError, ValueError) as e:
            log.error("local state in %s is unusable (%s): starting from an anchor", state_dir, e)
            return
        if local is None:
            return
        await asyncio.to_thread(
            localstate.write_info, state_dir, local.version, local.digest, channel=self.layout.channel
        )
        self.resumed_from, self._persisted = local.version, (local.version, local.digest)
        log.info("resumed v%d (%s…) from %s", local.version, local.digest[:16], state_dir)
        await self._swap(local.version, local.state, local.digest, persist=False, changed=frozenset(local.state))

    async def close(self) -> None:
        if self._tmp_cache is not None:
            await asyncio.to_thread(self._tmp_cache.cleanup)
            self._tmp_cache = None
        self._cache = None
        self._started = False

    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Poll until ``stop`` is set (or the task is cancelled). Round errors are logged and counted."""
        await self.start()
        await runtime.every(
            self.config.interval_s, stop or asyncio.Event(), self.sync_once, jitter=self.config.jitter,
            timeout=self.config.round_timeout_s, on_error=self._round_failed, rng=self._rng,
        )  # fmt: skip

    def _round_failed(self, e: Exception) -> None:
        """A failed sync round (``run``): counted and logged; the current weights keep serving."""
        self._count_failure(e)
        if isinstance(e, (PulsenetError, TimeoutError)):
            log.warning("sync round failed, still serving v%s: %s: %s", self.version, type(e).__name__, e)
        else:
            log.error("unexpected error in a sync round, still serving v%s", self.version, exc_info=e)

    # --- one round -----------------------------------------------------------------------------

    async def sync_once(self) -> int | None:
        """Move to the newest verifiable version; returns it, or None if nothing newer was usable.

        Raises the reason when newer versions exist but none could be verified (ReplayError,
        SignatureError, ManifestError, VerificationError, ObjectNotFound) and store errors as they
        are; the current weights stay in place either way.
        """
        await self.start()
        self.stats.polls += 1
        head = await self._read_head()  # before the listing: a version it names is listed by then
        stale = self._check_head_age(head)
        if self._head_trusted and not stale and head is not None and self.version is not None and head.version <= self.version:
            self.stats.idle_polls += 1  # the publisher's word: nothing newer to look for
            self.stats.head_missing_version = None
            return None
        self.stats.listings += 1
        listing = await self._reader.list_versions()
        self._check_head_listed(head, listing)
        keys = {self.layout.manifest(v) for v in listing}
        self._rejected = {k: e for k, e in self._rejected.items() if k in keys}
        newer = sorted((v for v in listing if self.version is None or v > self.version), reverse=True)
        if head is not None and head.version in newer:  # the publisher's word first: planted names wait
            newer.remove(head.version)
            newer.insert(0, head.version)
        errors: list[Exception] = []
        tried = 0
        for v in newer:
            key = self.layout.manifest(v)
            if self._rejected.get(key) == listing[v].etag:
                continue  # refused before, unchanged since: don't fetch or log it again
            if tried >= self.config.max_targets:
                break
            try:
                target = await self._reader.get(v, current=self.version, info=listing[v])
            except ReplayError as e:
                self._reject(key, listing[v].etag, e)
                self.stats.replays += 1
                errors.append(e)
                continue
            except ManifestError as e:  # includes SignatureError
                self._reject(key, listing[v].etag, e)
                self.stats.manifests_rejected += 1
                errors.append(e)
                continue
            except ObjectNotFound as e:  # retired between the listing and the get
                errors.append(e)
                continue
            tried += 1
            try:
                self.building = target.version
                await self._update_to(target)
                return target.version
            except (VerificationError, ObjectNotFound) as e:
                log.warning("cannot build v%d: %s", v, e)
                errors.append(e)
            finally:
                self.building = None
        if errors:
            raise errors[0]
        return None

    async def _update_to(self, target: Manifest) -> None:
        if self.state is None and self.version is not None:  # a rebuild in place failed: reload
            await self._reload_persisted()
        known = self.version is not None and self.digest is not None and self.state is not None
        current = (self.version, self.digest) if known else None
        paths = await candidate_paths(self._reader, target, current, self._bad_payloads)
        if not paths:
            raise VerificationError(f"no usable path to v{target.version}: every anchor or link to it is missing or bad")
        failures: list[str] = []
        for path in paths:
            if any(s.payload.key in self._bad_payloads for s in path.steps):
                continue
            log.info("building %s", path.describe())
            before = len(self._bad_payloads)
            changed: set[str] = set()
            if path.start is not None and self.state is None:
                continue  # the weights it would patch were lost with a failed rebuild: anchors only
            fetched, timings = self.cache.bytes_downloaded, {}
            base, consume = self.state, self._may_consume()
            if consume:  # given up to the rebuild, which replaces its tensors one by one (an anchor's at once)
                if self.on_consume is not None and inspect.isawaitable(result := self.on_consume()):
                    await result
                self.state, base = None, base if path.start is not None else None
            try:  # (any other error leaves ``state`` None: the next _update_to reloads it first)
                state = await rebuild(path, self.cache, base, threads=self.config.threads, bad=self._bad_payloads,
                                      parallel=self.config.parallel_downloads, timings=timings, changed=changed,
                                      consume=consume, buffers=self._buffers)  # fmt: skip
            except (VerificationError, ObjectNotFound) as e:
                if consume:  # ``base`` holds a mix of two versions: freed before the persisted copy is read
                    base = None
                    await self._reload_persisted()
                self.stats.payloads_rejected += len(self._bad_payloads) - before
                log.warning("path %s failed: %s; trying the next", path.describe(), e)
                failures.append(f"{path.describe()}: {e}")
                continue
            del base
            self.stats.bytes_downloaded += self.cache.bytes_downloaded - fetched
            self.stats.last_download_s, self.stats.last_apply_s = timings["download_s"], timings["apply_s"]
            self.stats.anchors_applied += sum(s.role == "anchor" for s in path.steps)
            self.stats.patches_applied += sum(s.role == "patch" for s in path.steps)
            await self._swap(target.version, state, target.model_digest, persist=True, changed=frozenset(changed))
            await asyncio.to_thread(self.cache.prune, set())  # all applied: nothing left to resume
            self._reader.forget_below(target.version)
            return
        raise VerificationError(
            f"v{target.version} could not be verified: {'; '.join(failures) or 'no usable path'}"
        )

    def _may_consume(self) -> bool:
        """Whether the next rebuild may take the state apart: only while its exact copy is persisted."""
        here = (self.version, self.digest)
        return self.config.rebuild_in_place and self.state is not None and self._persisted == here

    async def _reload_persisted(self) -> None:
        """The weights a failed rebuild in place took apart, from ``state_dir`` (hashed), or, if they
        cannot be had, ``state`` stays None: no patch path is offered, the next version is an anchor."""
        where = self.config.state_dir  # set whenever a rebuild in place ran (``_persisted``)
        try:
            load = functools.partial(localstate.load, threads=self.config.threads, buffers=self._buffers)
            local = await asyncio.to_thread(load, Path(where)) if where else None
        except (PulsenetError, OSError, ValueError) as e:
            local = None
            log.error("reloading v%s from %s failed: %s", self.version, where, e)
        if local is not None and (local.version, local.digest) == (self.version, self.digest):
            self.state, self.stats.state_reloads = local.state, self.stats.state_reloads + 1
            log.info("reloaded v%d from %s after a failed rebuild", local.version, where)
            return
        self._persisted = None
        log.error("could not reload v%s from %s: the next version comes from an anchor", self.version, where)

    async def _swap(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        digest: str,
        *,
        persist: bool,
        changed: frozenset[str],
    ) -> None:
        """Make verified weights current: callback first (serving), then disk (resume point)."""
        self.state, self.version, self.digest = state, version, digest
        if persist:
            self.stats.updates += 1
        self.stats.last_update_s = time.time()
        self.stats.last_changed = len(changed)
        if self.on_update is not None:
            extra = {"changed": changed} if self._pass_changed else {}
            # a dict of its own: the next rebuild in place replaces entries of ``self.state``
            result = self.on_update(version, dict(state), digest, **extra)
            if inspect.isawaitable(result):
                await result
        if persist and self.config.state_dir is not None:
            await asyncio.to_thread(
                localstate.save,
                Path(self.config.state_dir),
                version,
                digest,
                state,
                channel=self.layout.channel,
            )
            self._persisted = (version, digest)
            if self.on_saved is not None:
                self.on_saved(version, digest)
        log.info("now at v%d (%s…)", version, digest[:16])

    # --- head record -----------------------------------------------------------------------------

    async def announced(self) -> int | None:
        """The newest version this channel announces *and* backs with a verified signed manifest:
        how a node that follows several channels tells which one moves (failover), and what it may
        act on (retention). None if none yet.

        One conditional GET of the head (a 304 while it is unchanged); when the head names a version
        above the last one vouched for, that version's manifest is fetched and verified (not cached)
        and must carry the head's model digest. A head running ahead of every verifiable manifest (a
        trusted key signing "v999999999999", a manifest deleted or withheld) is counted in
        ``stats.announced_unverified`` and logged, and the last vouched-for version (or the one
        serving, if newer) is returned instead. Store errors are logged, not raised.
        """
        floor = max((v for v in (self.stats.announced_version, self.version) if v is not None), default=None)
        head = await self._read_head()
        if head is None or (floor is not None and head.version <= floor):
            return floor
        try:
            m = await self._reader.get(head.version, cache=False)
            if m.model_digest != head.model_digest:
                raise ManifestError(
                    f"its manifest's digest {m.model_digest[:16]}… is not the head's {head.model_digest[:16]}…"
                )
        except (ManifestError, ObjectNotFound) as e:
            self.stats.announced_unverified += 1
            log.warning(
                "%s announces v%d, which no verified manifest backs (%s: %s): still v%s",
                self.layout.head,
                head.version,
                type(e).__name__,
                e,
                floor,
            )
            return floor
        except StoreError as e:
            log.warning("announced: manifest v%d not read: %s: %s", head.version, type(e).__name__, e)
            return floor
        self.stats.announced_version = m.version
        return m.version

    async def _read_head(self) -> Head | None:
        """The newest verified head record seen (this one, or an earlier one if this is refused).

        One conditional GET. Only an accepted head's ETag is kept: a refused, replayed or missing
        one is fetched (and alarmed on) again at the next poll, never taken for "unchanged".
        ``_head_trusted`` tells the round whether this read may end it without a listing."""
        self._head_gone = self._head_trusted = False
        try:
            got = await self._reader.head_if_changed(self._head_etag)
        except ObjectNotFound:
            self._head_etag = None
            if self._head is not None or self.config.head_max_age_s is not None:
                self._alarm("head record %s is missing", self.layout.head)
                self._head_gone = self.stats.head_stale = True
            return self._head
        except ManifestError as e:
            self._head_etag = None
            self.stats.heads_rejected += 1
            self._alarm("head record %s refused: %s: %s", self.layout.head, type(e).__name__, e)
            return self._head
        except StoreError as e:  # transient: the listing will tell whether the store is reachable
            log.warning("head record %s not read: %s: %s", self.layout.head, type(e).__name__, e)
            return self._head
        if got is None:  # 304: the head we accepted last time is still there
            self._head_trusted = self._head is not None
            return self._head
        head, etag = got
        old = self._head
        if old is not None and (head.version, head.time_ms) < (old.version, old.time_ms):
            self._head_etag = None
            self.stats.heads_rejected += 1
            self._alarm(
                "head record moved backwards (v%d at %d ms after v%d at %d ms): replay ignored",
                head.version,
                head.time_ms,
                old.version,
                old.time_ms,
            )
            return old
        self._head, self._head_etag, self._head_trusted = head, etag, True
        return head

    def _check_head_age(self, head: Head | None) -> bool:
        """Record the head's version and age; alarm and return True when it is stale or gone."""
        st = self.stats
        if head is None:
            return self._head_gone
        st.head_version = head.version
        st.head_age_s = time.time() - head.time_ms / 1000
        max_age = self.config.head_max_age_s
        too_old = max_age is not None and st.head_age_s > max_age
        st.head_stale = too_old or self._head_gone
        if too_old:
            self._alarm("head record v%d is %.1f s old, over the %g s bound", head.version, st.head_age_s, max_age)
        return st.head_stale

    def _check_head_listed(self, head: Head | None, listing: Mapping[int, object]) -> None:
        """Alarm on a head naming a version whose manifest is not listed."""
        st = self.stats
        if head is None:
            return
        missing = head.version not in listing and (self.version is None or head.version > self.version)
        st.head_missing_version = head.version if missing else None
        if missing:
            self._alarm(
                "head record names v%d but its manifest is not in the store (deleted or withheld); serving v%s",
                head.version,
                self.version,
            )

    def _alarm(self, msg: str, *args: object) -> None:
        self.stats.head_alarms += 1
        log.error(msg, *args)

    def _reject(self, key: str, etag: str, e: Exception) -> None:
        self._rejected[key] = etag
        log.warning("rejected %s: %s: %s", key, type(e).__name__, e)

    def _count_failure(self, e: BaseException) -> None:
        self.stats.rounds_failed += 1
        self.stats.errors = [*self.stats.errors[-9:], f"{type(e).__name__}: {e}"]


def _takes_keyword(fn: Callable[..., object], name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: call it the plain way
        return False
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in named) for p in params)
