"""The object-store contract: bytes in, objects out. Knows nothing of tensors or protocols.

Every public method takes ``timeout`` (seconds for the whole call, retries included; ``None`` means the
store's default). The public methods here validate arguments and apply the deadline once; backends
implement the underscored methods and never deal with deadlines themselves.

Keys are ``/``-separated, relative to the store URL's prefix, and never contain empty, ``.`` or ``..``
segments, so the same key names the same object on S3 and in a local directory.

Every store counts what it sends (``requests``: :class:`RequestCounts`, by billing class) and how
reachable the server is (``health``: :class:`StoreHealth`); both are plain dataclasses a node reads
for ``/metrics`` and ``/healthz``.
"""

from __future__ import annotations

import abc
import asyncio
import builtins
import contextlib
import dataclasses
import datetime as dt
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Self

from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.errors import ObjectNotFound, ObjectTooLarge, StoreTimeout

ByteRange = tuple[int, int]
STREAM_CHUNK = 1 << 18  # what get_stream hands over at a time: 21 ms of a 100 Mbit/s link (a decoder waits for whole chunks)


@dataclasses.dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a listing or a HEAD tells about one object."""

    key: str
    """Relative to the store's prefix."""
    size: int
    etag: str
    """Opaque change marker, without quotes. On S3 the server's ETag; locally mtime and size."""
    last_modified: dt.datetime
    """Timezone-aware (UTC)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Fetched:
    """An object's bytes and the ETag they came with (``get_if_changed``)."""

    data: bytes
    etag: str
    """Without quotes; pass it back to ``get_if_changed`` to ask "has it changed since?"."""


@dataclasses.dataclass(slots=True)
class RequestCounts:
    """Requests a store sent, by the class an object store bills them in, and the bytes moved.

    S3: one count per HTTP request, so every retry, listing page, multipart part and ``get_file``
    range counts (what the bill and the per-prefix rate limits see). ``file://``: one per call (a
    delete of more than 1000 keys counts one per 1000, as on S3). Mutated in place by the store on
    its event loop; read it with :meth:`snapshot` / :meth:`as_dict`, subtract snapshots for a delta.
    """

    get: int = 0
    """GETs that returned a body (whole objects, ranges, conditional GETs that found a change)."""
    get_not_modified: int = 0
    """Conditional GETs answered 304 Not Modified: no body (``get_if_changed`` on an unchanged ETag)."""
    head: int = 0
    list: int = 0
    """ListObjectsV2 pages."""
    put: int = 0
    """PutObject, and each CreateMultipartUpload, UploadPart and CompleteMultipartUpload."""
    delete: int = 0
    """DeleteObjects requests (up to 1000 keys each)."""
    bytes_down: int = 0
    """Body bytes received (the store's egress, what S3 bills per GB out)."""
    bytes_up: int = 0
    """Body bytes sent (retries included)."""

    def snapshot(self) -> RequestCounts:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def requests(self) -> int:
        """All requests, of every kind."""
        return self.get + self.get_not_modified + self.head + self.list + self.put + self.delete

    def __sub__(self, other: RequestCounts) -> RequestCounts:
        return RequestCounts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)})


REQUEST_KINDS = ("get", "get_not_modified", "head", "list", "put", "delete")
"""The request kinds of :class:`RequestCounts`, in the order ``/metrics`` lists them."""


@dataclasses.dataclass(slots=True)
class StoreHealth:
    """Whether the server answers: updated by the store after every request, read by the node.

    A request *answered* is any response from the server, a 404 or 403 included; a *failure* is one
    that got no usable answer (connection refused or reset, timeout, 5xx, throttling) or a call whose
    deadline passed. Times are ``time.time()``.
    """

    last_ok: float | None = None
    """When the server last answered."""
    last_failure: float | None = None
    consecutive_failures: int = 0
    """Failed requests since the last answer (0: reachable)."""
    failures: int = 0
    """Failed requests in all."""
    last_error: str | None = None
    """The last failure, ``Type: message`` (bounded)."""
    last_failure_answered: bool = False
    """The last failure was the server's own answer (a 5xx, throttling): it is reachable but
    failing, say out of disk ("No writable volumes"), not gone."""

    def ok(self) -> None:
        self.last_ok = time.time()
        self.consecutive_failures = 0

    def failed(self, e: BaseException, *, answered: bool = False) -> None:
        self.last_failure = time.time()
        self.consecutive_failures += 1
        self.failures += 1
        self.last_error = f"{type(e).__name__}: {e}"[:500]
        self.last_failure_answered = answered

    def degraded(self, now: float | None = None) -> str | None:
        """None while the last request was answered, else why (for ``/healthz``)."""
        if self.consecutive_failures == 0:
            return None
        now = time.time() if now is None else now
        since = f"{now - self.last_ok:.1f} s ago" if self.last_ok is not None else "never"
        what, last = ("store failing", "last good answer") if self.last_failure_answered else ("store unreachable", "last answer")
        return f"{what}: {self.consecutive_failures} failed requests in a row, {last} {since}; last error {self.last_error}"

    def snapshot(self) -> StoreHealth:
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt + 1`` (0-based): "full jitter", uniform in
    ``[0, min(cap_s, base_s * 2**attempt)]`` (AWS Architecture Blog, "Exponential Backoff And
    Jitter"), so clients that lost the store at the same moment do not come back in lockstep. The one
    backoff rule of the store and of the retry loops above it."""
    bound = min(cap_s, base_s * 2 ** min(attempt, 62))
    return (rng or random).uniform(0, bound)


def check_key(key: str) -> str:
    """Reject keys that would not mean the same object on every backend (or would escape a directory)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"object key must be a non-empty str, got {key!r}")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in key or "\x00" in key:
        raise ValueError(
            f"invalid object key {key!r}: use '/'-separated names without empty, '.' or '..' parts"
        )
    return key


def _check_limit(max_bytes: int | None) -> int | None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
    return max_bytes


def too_large(key: str, size: int, max_bytes: int | None, where: str) -> None:
    """Raise ObjectTooLarge if ``size`` exceeds ``max_bytes`` (a listed, HEAD or Content-Length size)."""
    if max_bytes is not None and size > max_bytes:
        raise ObjectTooLarge(f"{key!r} in {where} is {size} bytes, over the {max_bytes}-byte limit")


def check_range(byte_range: ByteRange | None) -> ByteRange | None:
    if byte_range is None:
        return None
    start, end = byte_range
    if not (0 <= start < end):
        raise ValueError(
            f"byte_range must be (start, end) with 0 <= start < end (end exclusive), got {byte_range}"
        )
    return start, end


class ObjectStore(abc.ABC):
    """Async object store. Subclasses: :class:`~pulsenet.store.s3.S3Store`, :class:`~pulsenet.store.local.LocalStore`."""

    default_timeout: float | None = SMALL_CALL_S
    """Deadline for small calls (put, get, head, list, delete) when ``timeout`` is None."""
    transfer_timeout: float | None = None
    """Deadline for ``put_file``/``get_file`` when ``timeout`` is None; None: bounded per request only."""

    def __init__(self) -> None:
        self.requests = RequestCounts()
        """What this store sent, by kind (see :class:`RequestCounts`)."""
        self.health = StoreHealth()
        """Whether its server answers (see :class:`StoreHealth`)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL this store was opened with (for logs and errors)."""

    # --- public API: validation + deadline, then the backend ------------------------------

    async def put(
        self, key: str, data: bytes, *, if_none_match: bool = False, timeout: float | None = None
    ) -> None:
        """Write ``data`` at ``key``.

        ``if_none_match=True`` makes it create-only, atomically: if the key exists the call raises
        :class:`~pulsenet.errors.ConditionFailed` and the object is left as it was. Manifests use this
        so a published version can never be overwritten.
        """
        check_key(key)
        async with self._deadline("put", key, timeout):
            await self._put(key, bytes(data) if not isinstance(data, bytes) else data, if_none_match)

    async def put_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        if_none_match: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Upload a local file (multipart on S3 above the threshold). Returns its size.

        ``if_none_match`` is atomic on both backends: on S3 it is sent with the single PutObject or with
        CompleteMultipartUpload (AWS S3 and SeaweedFS honour both; a server that ignores it on the
        multipart path would silently overwrite, which is why protocols write payloads plainly and keep
        create-only for small manifests). We never emulate it with a HEAD then PUT, which races.
        """
        check_key(key)
        async with self._deadline("put_file", key, timeout, transfer=True):
            return await self._put_file(key, os.fspath(path), if_none_match)

    async def get(
        self,
        key: str,
        *,
        byte_range: ByteRange | None = None,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> bytes:
        """Read an object, or the half-open slice ``[start, end)`` of it.

        Ranges follow Python slice semantics: an ``end`` past the object is clipped and a ``start`` at or
        past the end gives ``b""``. A missing key raises :class:`~pulsenet.errors.ObjectNotFound`.
        ``max_bytes``: an object (or slice) larger than this raises
        :class:`~pulsenet.errors.ObjectTooLarge` having read at most ``max_bytes + 1`` bytes of it, so
        a planted multi-GB object costs a reader nothing. Every read of untrusted objects passes it.
        """
        check_key(key)
        byte_range = check_range(byte_range)
        limit = _check_limit(max_bytes)
        async with self._deadline("get", key, timeout):
            data = await self._get(key, byte_range, limit)
        if limit is not None and len(data) > limit:  # the backends stop early; this is the contract
            raise ObjectTooLarge(f"{key!r} in {self.url} is over the {limit}-byte limit")
        return data

    async def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None, timeout: float | None = None
    ) -> Fetched | None:
        """The object and its ETag, or None if its ETag still equals ``etag`` (nothing is read).

        On S3 this is one GET with ``If-None-Match``: an unchanged object costs a 304 with no body
        (counted as ``get_not_modified``). ``etag=None`` is a plain GET that also returns the ETag.
        A missing key raises :class:`~pulsenet.errors.ObjectNotFound`; ``max_bytes`` as in :meth:`get`.
        This is how pollers watch one small object (a signed head) for the price of a 304.
        """
        check_key(key)
        limit = _check_limit(max_bytes)
        async with self._deadline("get", key, timeout):
            got = await self._get_if_changed(key, etag.strip('"') if etag else None, limit)
        if got is not None and limit is not None and len(got.data) > limit:
            raise ObjectTooLarge(f"{key!r} in {self.url} is over the {limit}-byte limit")
        return got

    async def get_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        *,
        timeout: float | None = None,
        max_bytes: int | None = None,
    ) -> int:
        """Download an object to ``path`` (ranged and parallel on S3). Returns its size.

        The bytes go to a temporary file next to ``path`` that is renamed into place only once complete,
        so ``path`` is either absent/unchanged or whole, even if the call fails or is cancelled.
        ``max_bytes``: a larger object raises :class:`~pulsenet.errors.ObjectTooLarge` before any
        byte is written (and the object cannot grow past it mid-download: reads stop there).
        """
        check_key(key)
        limit = _check_limit(max_bytes)
        async with self._deadline("get_file", key, timeout, transfer=True):
            return await self._get_file(key, os.fspath(path), limit)

    async def get_stream(
        self,
        key: str,
        sink: Callable[[bytes], object],
        *,
        max_bytes: int,
        chunk: int = STREAM_CHUNK,
        timeout: float | None = None,
    ) -> int:
        """Read an object front to back, handing it to ``sink`` (called on the event loop: keep it
        cheap) ``chunk`` bytes at a time, in order, as the bytes land: a reader decodes an object's
        front while its back is still on the wire. Returns the object's size.

        On S3 this is one GET whose body is read as it arrives (a transient failure resumes from
        the bytes already handed over, pinned to the object's ETag). An object larger than
        ``max_bytes`` raises :class:`~pulsenet.errors.ObjectTooLarge` before its excess reaches
        ``sink``; what reached ``sink`` is unchecked: callers check the whole, as a payload's
        SHA-256 is checked (``signed.fetch_streamed``).
        """
        check_key(key)
        limit = _check_limit(max_bytes)
        assert limit is not None and chunk > 0
        async with self._deadline("get_stream", key, timeout, transfer=True):
            return await self._get_stream(key, sink, limit, chunk)

    async def head(self, key: str, *, timeout: float | None = None) -> ObjectInfo:
        """Size, ETag and modification time; :class:`~pulsenet.errors.ObjectNotFound` if missing."""
        check_key(key)
        async with self._deadline("head", key, timeout):
            return await self._head(key)

    async def exists(self, key: str, *, timeout: float | None = None) -> bool:
        try:
            await self.head(key, timeout=timeout)
        except ObjectNotFound:
            return False
        return True

    async def list(self, prefix: str = "", *, timeout: float | None = None) -> list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (a string prefix, not a directory), sorted by key."""
        if not isinstance(prefix, str) or "\\" in prefix:
            raise ValueError(f"invalid prefix {prefix!r}")
        async with self._deadline("list", prefix, timeout):
            infos = await self._list(prefix)
        return sorted(infos, key=lambda i: i.key)

    async def delete(self, keys: Iterable[str], *, timeout: float | None = None) -> None:
        """Delete keys in batches; keys that do not exist are not an error."""
        if isinstance(keys, str):
            raise ValueError(f"delete takes an iterable of keys, got the single string {keys!r}")
        keys = [check_key(k) for k in keys]
        if not keys:
            return
        async with self._deadline("delete", f"{len(keys)} keys", timeout):
            await self._delete(keys)

    async def close(self) -> None:  # noqa: B027 (optional hook: a LocalStore holds nothing to release)
        """Release clients and threads. Idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # --- backend hooks ----------------------------------------------------------------------

    @abc.abstractmethod
    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None: ...

    @abc.abstractmethod
    async def _put_file(self, key: str, path: str, if_none_match: bool) -> int: ...

    @abc.abstractmethod
    async def _get(self, key: str, byte_range: ByteRange | None, max_bytes: int | None) -> bytes:
        """May return up to ``max_bytes + 1`` bytes (the caller raises) or raise ObjectTooLarge itself."""

    @abc.abstractmethod
    async def _get_if_changed(self, key: str, etag: str | None, max_bytes: int | None) -> Fetched | None:
        """None when the object's ETag is ``etag``; may return ``max_bytes + 1`` bytes, like ``_get``."""

    @abc.abstractmethod
    async def _get_file(self, key: str, path: str, max_bytes: int | None) -> int:
        """Must raise ObjectTooLarge before writing ``path`` when the object exceeds ``max_bytes``."""

    async def _get_stream(self, key: str, sink: Callable[[bytes], object], max_bytes: int, chunk: int) -> int:
        """Ranged reads in order, one at a time (backends that can stream one request override it)."""
        size = 0
        while True:
            data = await self._get(key, (size, size + chunk), None)
            if size + len(data) > max_bytes:
                raise ObjectTooLarge(f"{key!r} in {self.url} is over the {max_bytes}-byte limit")
            size += len(data)
            if data:
                sink(data)
            if len(data) < chunk:
                return size

    @abc.abstractmethod
    async def _head(self, key: str) -> ObjectInfo: ...

    @abc.abstractmethod
    async def _list(self, prefix: str) -> builtins.list[ObjectInfo]: ...

    @abc.abstractmethod
    async def _delete(self, keys: builtins.list[str]) -> None: ...

    # --- helpers ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _deadline(
        self, op: str, key: str, timeout: float | None, *, transfer: bool = False
    ) -> AsyncIterator[None]:
        """One deadline for the whole call, retries and backoff included, surfaced as StoreTimeout."""
        if timeout is None:
            timeout = self.transfer_timeout if transfer else self.default_timeout
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                yield
        except TimeoutError as e:
            if not deadline.expired() or isinstance(e, StoreTimeout):
                raise
            err = StoreTimeout(f"{op} {key!r} on {self.url} did not finish within {timeout:g} s")
            self.health.failed(err)  # a hung server answers nothing: no request of ours records it
            raise err from e
