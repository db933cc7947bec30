"""Reading a PULSESync channel: verified manifests, the cheapest path to a version, checked payloads.

Shared by the subscriber (catch-up), the publisher (resume after a restart) and ``pulsenet ls``.

A *path* to version T is the list of payloads to apply in order: either the patches
``current+1 .. T`` (following each manifest's ``base_version``), or an anchor at A <= T followed by
the patches ``A+1 .. T``. Manifest sizes give each path's cost before anything is downloaded, so
a reader takes the cheapest one: a node slightly behind replays patches; one that joined late, fell
far behind (the patches would cost more than an anchor) or whose chain was retired takes an anchor.
A path that fails (missing object, wrong bytes, failed digest) marks its payload bad and the next
path is tried, so a broken link falls back to an anchor.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet.codec.buffers import BufferPool
from pulsenet.codec.digest import model_digest
from pulsenet.codec.patch import apply_patch, iter_apply, parse_patch
from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.errors import (
    ConfigError,
    ManifestError,
    ObjectNotFound,
    PatchError,
    ReplayError,
    VerificationError,
)
from pulsenet.runtime import all_of
from pulsenet.signed import (
    ObjectRef,
    check_bytes,
    fetch_document,
    fetch_document_if_changed,
    fetch_file,
    fetch_streamed,
    fetch_unverified,
)
from pulsenet.store.base import ObjectInfo, ObjectStore
from pulsenet.store.local import TMP_PREFIX
from pulsenet.sync.arriving import ArrivingBytes
from pulsenet.sync.layout import Layout
from pulsenet.sync.manifest import MAX_HEAD, MAX_MANIFEST, Head, Manifest, head_from, manifest_from

log = logging.getLogger(__name__)

EMPTY_DIGEST = model_digest({})
"""Model digest of the empty model: the base of every anchor."""

StateDict = Mapping[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Step:
    """Apply ``payload`` (``manifest``'s ``role`` payload) to reach ``manifest.version``."""

    manifest: Manifest
    role: str
    """"anchor" or "patch"."""
    payload: ObjectRef


@dataclass(frozen=True, slots=True)
class ChainPath:
    """Payloads that rebuild ``target`` from ``start`` (None: from the empty model via an anchor)."""

    start: int | None
    steps: tuple[Step, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.payload.size for s in self.steps)

    @property
    def target(self) -> Manifest:
        return self.steps[-1].manifest

    def describe(self) -> str:
        first = self.steps[0]
        origin = f"anchor v{first.manifest.version}" if self.start is None else f"v{self.start}"
        return f"{origin} -> v{self.target.version} ({len(self.steps)} payloads, {self.nbytes:,} bytes)"


@dataclass(slots=True)
class ManifestReader:
    """Lists a channel's manifests and fetches them verified (``signed.fetch_document``), caching
    what verified; also reads the head record. The one reader of a channel: subscriber, publisher
    (resume, retention) and ``pulsenet ls``."""

    store: ObjectStore
    layout: Layout
    trusted: Mapping[str, Ed25519PublicKey]
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (list, get)."""
    max_bytes: int = MAX_MANIFEST
    """Largest manifest object fetched: a bigger one is refused from its listed size, and every
    fetch is capped at it (a planted 10 GB "manifest" costs nothing)."""
    _cache: dict[int, Manifest] = field(default_factory=dict)

    async def list_versions(self) -> dict[int, ObjectInfo]:
        """``version -> listing entry`` for every manifest key in the channel (unverified)."""
        infos = await self.store.list(self.layout.manifests, timeout=self.timeout_s)
        out: dict[int, ObjectInfo] = {}
        for info in infos:
            v = self.layout.parse_manifest(info.key)
            if v is not None:
                out[v] = info
        return out

    async def get(
        self, version: int, *, current: int | None = None, info: ObjectInfo | None = None, cache: bool = True
    ) -> Manifest:
        """The verified manifest at ``version``: ObjectNotFound, ManifestError, SignatureError, or
        ReplayError when ``current`` is given and the manifest is not newer than it.

        ``info``: the listing entry; an object listed over ``max_bytes`` is refused unread.
        ``cache=False``: don't keep it (a look-ahead that must not grow the cache).
        """
        m = self._cache.get(version)
        if m is None:
            signed = await fetch_document(
                self.store,
                self.layout.manifest(version),
                self.trusted,
                context=self.layout.context,
                max_bytes=self.max_bytes,
                timeout=self.timeout_s,
                listed_size=info.size if info is not None else None,
            )
            m = manifest_from(signed, key_version=version, current=current)
            if cache:
                self._cache[version] = m
        if current is not None and m.version <= current:
            raise ReplayError(
                f"manifest v{m.version} is not newer than the current v{current}: replay ignored"
            )
        return m

    async def head(self) -> Head:
        """The verified head record: ObjectNotFound, ManifestError or SignatureError."""
        signed = await fetch_document(
            self.store,
            self.layout.head,
            self.trusted,
            context=self.layout.context,
            max_bytes=MAX_HEAD,
            timeout=self.timeout_s,
        )
        return head_from(signed)

    async def head_if_changed(self, etag: str | None) -> tuple[Head, str] | None:
        """The verified head record and its ETag, or None while its ETag is still ``etag`` (one
        conditional GET: a 304 with no body). Errors as :meth:`head`."""
        got = await fetch_document_if_changed(
            self.store,
            self.layout.head,
            self.trusted,
            etag=etag,
            context=self.layout.context,
            max_bytes=MAX_HEAD,
            timeout=self.timeout_s,
        )
        return None if got is None else (head_from(got.signed), got.etag)

    async def peek(self, version: int, *, info: ObjectInfo | None = None) -> Manifest:
        """The manifest at ``version`` parsed but NOT verified (``pulsenet ls`` without keys): never
        trust it. Same size limits as :meth:`get`; not cached."""
        body = await fetch_unverified(
            self.store,
            self.layout.manifest(version),
            max_bytes=self.max_bytes,
            timeout=self.timeout_s,
            listed_size=info.size if info is not None else None,
        )
        return Manifest.from_body(body)

    async def peek_head(self) -> Head:
        """The head record parsed but NOT verified: never trust it."""
        body = await fetch_unverified(self.store, self.layout.head, max_bytes=MAX_HEAD, timeout=self.timeout_s)
        return Head.from_body(body)

    def remember(self, manifest: Manifest) -> None:
        """Cache a manifest this process wrote (it signed it, so it is verified)."""
        self._cache[manifest.version] = manifest

    def forget_below(self, version: int) -> None:
        """Drop cached manifests older than ``version`` (they are retired or no longer needed)."""
        for v in [v for v in self._cache if v < version]:
            del self._cache[v]


async def candidate_paths(
    reader: ManifestReader,
    target: Manifest,
    current: tuple[int, str] | None,
    bad: set[str],
    *,
    max_anchors: int = 2,
) -> list[ChainPath]:
    """Paths to ``target``, cheapest first, avoiding payloads in ``bad``.

    Walks back from ``target`` along ``base_version``: each anchor met gives a path (anchor + the
    patches after it); reaching ``current`` (version, digest) gives the patch-only path. The walk
    stops at a missing or unverifiable manifest, a bad payload, ``max_anchors`` anchors, or once the
    patches behind it already cost more than the best anchor path (no path through them can win).
    """
    paths: list[ChainPath] = []
    tail: list[Step] = []  # patches from the walk position up to target, newest first
    tail_bytes = 0
    m = target
    while True:
        if m.anchor is not None and m.anchor.key not in bad:
            paths.append(ChainPath(None, (Step(m, "anchor", m.anchor), *reversed(tail))))
        anchors = [p for p in paths if p.start is None]
        if m.patch is None or m.patch.key in bad or m.base_version is None:
            break
        tail.append(Step(m, "patch", m.patch))
        tail_bytes += m.patch.size
        if current is not None and m.base_version == current[0]:
            if m.base_digest == current[1]:
                paths.append(ChainPath(current[0], tuple(reversed(tail))))
            else:
                log.warning(
                    "v%d's patch applies to a v%d with another digest than ours: not using it",
                    m.version,
                    current[0],
                )
            break
        reachable = current is not None and m.base_version > current[0]
        if anchors and (
            not reachable or len(anchors) >= max_anchors or tail_bytes >= min(p.nbytes for p in anchors)
        ):
            break
        try:
            m = await reader.get(m.base_version)
        except (ObjectNotFound, ManifestError) as e:
            log.info("chain walk from v%d stops at v%d: %s", target.version, m.base_version, e)
            break
    return sorted(paths, key=lambda p: (p.nbytes, len(p.steps)))


CACHE_SUBDIR = "pulsenet-payloads"
"""The one directory a payload cache writes in, inside the directory it is given: it deletes only
there, so a cache pointed at ``~`` or at a model directory never touches the files beside it."""
_CACHED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
"""Names the cache gives its files: a payload key with ``/`` as ``__``, or ``x-<sha256 of the key>``
when that is not such a name. Only files so named are ever pruned."""
_TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"[0-9a-f]{16}")
"""Temporary files ``ObjectStore.get_file`` writes beside their target: all ``sweep`` removes."""


def check_cache_dir(cache: Path, other: Path, *, cache_flag: str, other_flag: str, inside: bool = True) -> None:
    """ConfigError naming both settings when the payload cache ``cache`` is ``other`` (a model or
    output directory) or contains it, or (``inside=False``) lies inside it: a cache is a directory
    of its own, and a model directory is never a cache's to clean."""
    c, o = Path(cache).expanduser().resolve(), Path(other).expanduser().resolve()
    if c == o or c in o.parents or (not inside and o in c.parents):
        how = "is" if c == o else ("contains" if c in o.parents else "is inside")
        raise ConfigError(
            f"{cache_flag} {cache} {how} {other_flag} {other}: give the payload cache a directory of its own "
            f"(e.g. {cache_flag} {o.parent / (o.name + '-cache')})"
        )


class PayloadCache:
    """Payloads on local disk, checked against their manifest entry on every read.

    Downloads go through ``signed.fetch_file`` (never past the signed size; size and SHA-256
    checked; temporary file + rename), so the cache never holds a partial or unchecked object; a
    cached file whose size or SHA-256 is wrong (disk corruption, an older crash) is deleted and
    fetched again.

    The cache owns only what it wrote: files named by ``_CACHED_NAME`` (and the temporary files of
    its downloads) in ``root/pulsenet-payloads`` (``CACHE_SUBDIR``). ``sweep`` and ``prune`` never
    delete anything else, whatever ``root`` is (was, issue 29: ``--cache ~`` deleted ``.bashrc``, and
    ``pull --out D --cache D`` the verified model in D).
    """

    def __init__(self, store: ObjectStore, root: Path, *, timeout_s: float | None = None) -> None:
        self.store = store
        self.root = Path(root)
        self.dir = self.root / CACHE_SUBDIR
        """Where the cached payloads live (created by ``sweep`` or the first download)."""
        self.timeout_s = timeout_s
        """Deadline of one download (None: the store's transfer default)."""
        self.downloaded: list[str] = []
        """Keys fetched from the store, in order (tests and metrics)."""
        self.bytes_downloaded = 0

    def path(self, ref: ObjectRef) -> Path:
        return self.dir / _cache_name(ref.key)

    async def read(self, ref: ObjectRef) -> bytes:
        """The payload's bytes, verified: ObjectNotFound if it is gone, VerificationError (SizeMismatch
        for another size) if it is wrong."""
        path = self.path(ref)
        data = await asyncio.to_thread(_read_checked, path, ref)
        if data is not None:
            return data
        await asyncio.to_thread(self.dir.mkdir, parents=True, exist_ok=True)
        await fetch_file(self.store, ref, path, timeout=self.timeout_s)
        self.downloaded.append(ref.key)
        self.bytes_downloaded += ref.size
        return await asyncio.to_thread(_read_fetched, path, ref)

    async def stream(self, ref: ObjectRef, into: ArrivingBytes) -> float:
        """Download the payload into ``into`` as it lands, for a decoder reading it meanwhile (not
        kept on disk), then check it whole: ObjectNotFound, SizeMismatch or VerificationError as
        :meth:`read`. Any failure fails ``into`` first, so the decoder's waiting threads stop.
        Returns when the last byte landed."""
        try:
            await fetch_streamed(self.store, ref, into.feed, timeout=self.timeout_s)
            landed = time.perf_counter()
            await asyncio.to_thread(check_bytes, ref, into.whole())
        except BaseException as e:
            into.fail(e)
            raise
        self.downloaded.append(ref.key)
        self.bytes_downloaded += ref.size
        return landed

    def sweep(self) -> None:
        """Remove temporary files a killed download left behind (blocking: call in a thread)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self._own(_TMP_NAME):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def prune(self, keep: set[str]) -> None:
        """Delete cached payloads whose keys are not in ``keep`` (blocking: call in a thread)."""
        wanted = {_cache_name(k) for k in keep}
        for p in self._own(_CACHED_NAME):
            if p.name not in wanted:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def _own(self, pattern: re.Pattern[str]) -> list[Path]:
        """Regular files (not links, not directories) in the cache's directory named by ``pattern``."""
        try:
            entries = list(self.dir.iterdir())
        except FileNotFoundError:
            return []
        out = []
        for p in entries:
            with contextlib.suppress(FileNotFoundError):
                if pattern.fullmatch(p.name) and stat.S_ISREG(p.lstat().st_mode):
                    out.append(p)
        return out


def _cache_name(key: str) -> str:
    """The cache's file name for a payload key (``_CACHED_NAME``)."""
    name = key.replace("/", "__")
    return name if _CACHED_NAME.fullmatch(name) else f"x-{hashlib.sha256(key.encode()).hexdigest()}"


def _read_checked(path: Path, ref: ObjectRef) -> bytes | None:
    """The cached file's bytes if they match ``ref``; None (and the file deleted) if absent or wrong."""
    try:
        with path.open("rb") as f:
            data = f.read(ref.size + 1)  # never more than the manifest allows, whatever is on disk
    except FileNotFoundError:
        return None
    if len(data) == ref.size and hashlib.sha256(data).hexdigest() == ref.sha256:
        return data
    log.warning(
        "cached payload %s is corrupt (size %d, manifest says %d): deleting it",
        path.name,
        len(data),
        ref.size,
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return None


def _read_fetched(path: Path, ref: ObjectRef) -> bytes:
    """The bytes ``fetch_file`` just checked (read back without hashing them again)."""
    with path.open("rb") as f:
        data = f.read(ref.size + 1)
    if len(data) != ref.size:  # changed on disk since the check: the digest checks catch the rest
        raise VerificationError(f"payload {ref.key} changed on local disk right after its download")
    return data


async def rebuild(
    path: ChainPath,
    cache: PayloadCache,
    base: StateDict | None,
    *,
    threads: int = 2,
    parallel: int = 4,
    bad: set[str] | None = None,
    timings: dict[str, float] | None = None,
    changed: set[str] | None = None,
    consume: bool = False,
    buffers: BufferPool | None = None,
) -> dict[str, torch.Tensor]:
    """Apply ``path``'s payloads to ``base`` (None for an anchor path) and return verified weights
    (:func:`apply_payloads` says what is checked, raised and ``consume``d).

    A path of one patch not yet cached streams (:func:`_stream_patch`): its tensors are rebuilt as
    its bytes land, so the link and the decode overlap (issue 37: a version's latency is the link's
    time plus the last tensor's). Other paths are fetched whole (:func:`fetch_payloads`), then
    applied. ``timings`` receives ``download_s`` (until the last byte landed) and ``apply_s`` (the
    rebuild's time after that)."""
    bad = bad if bad is not None else set()
    t0 = time.perf_counter()
    one_patch = len(path.steps) == 1 and path.steps[0].role == "patch"
    if one_patch and not await asyncio.to_thread(cache.path(path.steps[0].payload).exists):
        state, t1 = await _stream_patch(path, cache, base, threads=threads, bad=bad, changed=changed, consume=consume,
                                        buffers=buffers)
    else:
        payloads = await fetch_payloads(path, cache, parallel=parallel, bad=bad)
        t1 = time.perf_counter()
        state = await apply_payloads(path, payloads, base, threads=threads, bad=bad, changed=changed, consume=consume,
                                     buffers=buffers)
    if timings is not None:
        timings.update(download_s=t1 - t0, apply_s=time.perf_counter() - t1)
    return state


async def _stream_patch(
    path: ChainPath, cache: PayloadCache, base: StateDict | None, *, bad: set[str], **apply_kw
) -> tuple[dict[str, torch.Tensor], float]:
    """:func:`rebuild` of a one-patch path while the patch downloads; returns the weights and when
    its last byte landed.

    The bytes are decoded before the payload's SHA-256 is known, which is safe: the table's tensor
    hashes must make the signed model digest before any tensor is decoded, and every tensor must
    match its hash (``iter_apply``); the payload's SHA-256 is still checked once it has landed, and
    a mismatch fails the rebuild as it always did. The patch is not cached (a retry downloads it
    again). A failed download fails the decode, and its error (not the decoder's) is raised: a
    store outage is not the payload's fault.
    """
    ref = path.steps[0].payload
    arriving = ArrivingBytes(ref.size)

    async def download() -> float:
        try:
            return await cache.stream(ref, arriving)
        except (ObjectNotFound, VerificationError):
            bad.add(ref.key)
            raise

    task = asyncio.create_task(download())
    try:
        state = await apply_payloads(path, [arriving], base, bad=bad, **apply_kw)
    except BaseException as e:
        task.cancel()
        await asyncio.wait([task])
        failed = None if task.cancelled() else task.exception()
        if failed is not None and not isinstance(e, asyncio.CancelledError):
            raise failed from None  # the download's error, not the decoder's DownloadFailed
        raise
    return state, await task


async def fetch_payloads(path: ChainPath, cache: PayloadCache, *, parallel: int = 4, bad: set[str]) -> list[bytes]:
    """``path``'s payloads, downloaded in parallel (at most ``parallel`` at once), each checked
    against its manifest on read. A payload found missing or wrong is added to ``bad`` and the error
    raised: ObjectNotFound or VerificationError. Transient store errors propagate as they are (the
    payload is not to blame)."""
    gate = asyncio.Semaphore(max(1, parallel))

    async def fetch(step: Step) -> bytes:
        async with gate:
            try:
                return await cache.read(step.payload)
            except (ObjectNotFound, VerificationError):
                bad.add(step.payload.key)
                raise

    return await all_of(fetch(s) for s in path.steps)


async def apply_payloads(
    path: ChainPath,
    payloads: list[bytes] | list[ArrivingBytes],
    base: StateDict | None,
    *,
    threads: int = 2,
    bad: set[str],
    changed: set[str] | None = None,
    consume: bool = False,
    buffers: BufferPool | None = None,
) -> dict[str, torch.Tensor]:
    """Apply ``path``'s fetched payloads to ``base`` (None for an anchor path), in threads.

    Every rebuilt tensor is checked against its SHA-256 and each version's weights against the
    manifest's model digest; a payload that fails is added to ``bad`` and VerificationError raised.
    ``changed`` receives the names of the tensors the path may have changed relative to ``base``:
    every name for an anchor path, else those the patches rewrite (op ``full`` or ``sparse``), add
    or remove; a patch's ``keep`` tensors are the base's own.

    ``consume``: ``base`` is a dict the caller gives up. A patch path rebuilds into it: each
    verified tensor replaces its entry as soon as it is rebuilt (tensors are never written to, only
    entries replaced), so the tensor it replaces is freed unless someone else holds it, and a node
    holds one state and the codec's window instead of two states (issue 37). After a failure it
    holds a mix of versions and must be discarded (the subscriber reloads its persisted state).
    Without ``consume`` the base is only read. ``buffers``: the caller's pool for the rebuilt
    tensors' memory (``iter_apply``).
    """
    state: StateDict = {} if path.start is None else (base if base is not None else {})
    into = consume and path.start is not None and isinstance(state, dict)
    digest = EMPTY_DIGEST if path.start is None else path.steps[0].manifest.base_digest
    for step, payload in zip(path.steps, payloads, strict=True):
        m = step.manifest
        try:
            state = await asyncio.to_thread(_apply, state, digest, step, payload, threads, changed, into, buffers)
        except (PatchError, VerificationError) as e:
            bad.add(step.payload.key)
            raise VerificationError(f"v{m.version} {step.role} payload {step.payload.key}: {e}") from e
        digest = m.model_digest
    return dict(state)


def _apply(
    state: StateDict,
    digest: str | None,
    step: Step,
    data: bytes | ArrivingBytes,
    threads: int,
    changed: set[str] | None = None,
    into: bool = False,
    buffers: BufferPool | None = None,
) -> dict:
    """One payload onto ``state`` (whose verified digest is ``digest``), checked against the manifest;
    adds the names it rewrites to ``changed``. ``into``: replace ``state``'s entries (a dict) as the
    tensors are verified, and return it (``apply_payloads``'s ``consume``)."""
    m = step.manifest
    expect_base = EMPTY_DIGEST if step.role == "anchor" else m.base_digest
    patch = parse_patch(data)
    if changed is not None:
        changed.update(e.name for e in patch.tensors if e.op != "keep" or e.name not in state)
        changed.update(patch.removed)
    if digest != expect_base or patch.base_digest != expect_base:
        raise VerificationError(
            f"base mismatch: we hold {str(digest)[:16]}…, the manifest expects {str(expect_base)[:16]}…, "
            f"the patch {patch.base_digest[:16]}…"
        )
    if patch.target_digest != m.model_digest:
        raise VerificationError(
            f"patch target {patch.target_digest[:16]}… is not the manifest's {m.model_digest[:16]}…"
        )
    # An anchor rebuilds from nothing, so the codec's default cap (relative to the base) would refuse
    # a model over 1 GiB; the size a trusted key signed is the exact bound instead.
    kw: dict = {"max_output_bytes": m.full_bytes} if step.role == "anchor" else {}
    if not into:
        return apply_patch(state, patch, base_digest=digest, threads=threads, buffers=buffers, **kw)
    assert isinstance(state, dict)
    for name, tensor in iter_apply(state, patch, base_digest=digest, threads=threads, buffers=buffers, **kw):
        state[name] = tensor  # the replaced tensor goes now, not after the whole model is rebuilt
    for name in patch.removed:  # iter_apply finished: every tensor and the model digest verified
        del state[name]
    return state
