"""S3-compatible object store on boto3 (AWS S3, SeaweedFS, MinIO, R2).

boto3 is synchronous, so every call runs in this store's own thread pool (sized to its transfer
concurrency, unlike the loop's default executor) and the event loop never blocks. botocore's own
retries are off: one retry loop here, with exponential backoff and full jitter, retries transient
failures (5xx, throttling, dropped connections, timeouts) and never a 4xx that means "no" or a
cancellation (``s3_errors.py`` says which is which, and which typed error each becomes); when they
are exhausted the call raises StoreUnavailable or StoreTimeout. The whole call, backoff included,
sits under one ``asyncio.timeout`` (see ``ObjectStore``). Every request is counted (``requests``)
and its outcome recorded (``health``), so a node sees an outage as it happens, not only when a call
gives up.

Multipart uploads and ranged parallel downloads are done here rather than by boto3's TransferManager:
s3transfer cannot send ``If-None-Match`` with CompleteMultipartUpload, and its worker threads ignore
asyncio cancellation, deadlines and the link rate limiter. The thresholds and concurrency still come
from :class:`S3Config`.

A call abandoned by its deadline may still finish in its thread (boto3 calls cannot be interrupted);
each request is bounded by the connect/read timeouts, and a put that lands late is harmless because
readers only trust objects a manifest names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import functools
import hashlib
import logging
import math
import os
import re
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bex
from botocore.config import Config as BotoConfig

from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.errors import (
    AccessDenied,
    ConditionFailed,
    ConfigError,
    ObjectNotFound,
    StoreError,
)
from pulsenet.runtime import all_of, settled
from pulsenet.store.base import ByteRange, Fetched, ObjectInfo, ObjectStore, backoff_delay, too_large
from pulsenet.store.local import fsync_path, new_tmp_file, unlink_quiet, write_at
from pulsenet.store.ratelimit import RateLimiter, charge
from pulsenet.store.s3_errors import http_status, is_transient, typed_error

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1024 * 1024
DELETE_BATCH = 1000
"""DeleteObjects takes at most 1000 keys per request."""
MAX_PARTS = 10_000
"""S3's limit on parts per multipart upload; the part size grows to stay under it."""

@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class S3Config:
    """How to reach an S3-compatible endpoint. Environment variables apply only via :meth:`with_env`."""

    endpoint_url: str | None = None
    """E.g. ``http://127.0.0.1:8333``; None means AWS for ``region``."""
    access_key_id: str | None = None
    """None (with ``secret_access_key``) falls back to boto's credential chain (instance roles, ~/.aws)."""
    secret_access_key: str | None = None
    region: str = "us-east-1"
    timeout_s: float | None = SMALL_CALL_S
    """Default deadline for one small call (put, get, head, list, delete), retries included."""
    transfer_timeout_s: float | None = None
    """Default deadline for put_file/get_file; None bounds each request only (sizes vary by 1000x)."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    """Per request: how long a socket may stay silent."""
    max_retries: int = 8
    """Retries after the first attempt; with the default backoff they wait 8 s on average (16 s at
    most) before StoreUnavailable, and the call's deadline (``timeout_s``) caps them anyway."""
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 5.0
    multipart_threshold: int = 16 * MiB
    """put_file uses multipart at or above this size."""
    multipart_chunk: int = 8 * MiB
    """Part size for uploads and range size for get_file (S3 needs parts of at least 5 MiB)."""
    max_concurrency: int = 8
    """Parts or ranges in flight per transfer."""
    list_page_size: int = 1000
    """MaxKeys per ListObjectsV2 page (1000 is the S3 maximum)."""
    link_mbps: float | None = None
    """Emulate a link of this many Mbit/s each way (tests, benchmarks); None: no cap."""

    def __post_init__(self) -> None:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ConfigError("set both access_key_id and secret_access_key, or neither")
        if self.multipart_chunk < 5 * MiB:
            raise ConfigError(
                f"multipart_chunk must be at least 5 MiB (S3 minimum part size), got {self.multipart_chunk}"
            )
        if self.multipart_threshold < 1 or self.max_concurrency < 1 or self.max_retries < 0:
            raise ConfigError("multipart_threshold and max_concurrency must be >= 1, max_retries >= 0")
        if not 1 <= self.list_page_size <= 1000:
            raise ConfigError(f"list_page_size must be in 1..1000, got {self.list_page_size}")
        if self.link_mbps is not None and self.link_mbps <= 0:
            raise ConfigError(f"link_mbps must be > 0 or None, got {self.link_mbps}")

    def with_env(self, environ: Mapping[str, str] | None = None) -> S3Config:
        """A copy with the standard AWS variables that are set applied on top (call at the edge only)."""
        env = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for var, field in (
            ("AWS_ENDPOINT_URL", "endpoint_url"),
            ("AWS_ACCESS_KEY_ID", "access_key_id"),
            ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
            ("AWS_DEFAULT_REGION", "region"),
            ("AWS_REGION", "region"),  # the newer name wins when both are set
        ):
            if env.get(var):
                changes[field] = env[var]
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields: Any) -> S3Config:
        """``S3Config(**fields)`` with the AWS environment variables applied on top."""
        return cls(**fields).with_env(environ)


class S3Store(ObjectStore):
    """Objects under ``s3://bucket/prefix``; keys are relative to the prefix."""

    def __init__(self, bucket: str, prefix: str = "", config: S3Config | None = None) -> None:
        super().__init__()
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.config = config = config or S3Config()
        self.default_timeout = config.timeout_s
        self.transfer_timeout = config.transfer_timeout_s
        self._up = RateLimiter(config.link_mbps) if config.link_mbps else None
        self._down = RateLimiter(config.link_mbps) if config.link_mbps else None
        workers = config.max_concurrency + 4  # room for small calls beside a full transfer
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pulsenet-s3")
        session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            region_name=config.region,
        )
        self._client = session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=BotoConfig(
                s3={"addressing_style": "path"},
                signature_version="s3v4",
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                retries={"total_max_attempts": 1, "mode": "standard"},  # we retry, botocore must not
                max_pool_connections=workers,
                tcp_keepalive=True,
                ignore_configured_endpoint_urls=True,  # AWS_ENDPOINT_URL only via S3Config.with_env
            ),
        )
        self._closed = False

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.config.endpoint_url!r})"

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Don't wait for abandoned requests (each is bounded by the read timeout anyway).
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    # --- backend hooks ----------------------------------------------------------------------

    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        extra = {"IfNoneMatch": "*"} if if_none_match else {}
        attempts = 0

        async def once() -> None:
            nonlocal attempts
            attempts += 1
            await self._sent(len(data))
            await self._run(
                self._client.put_object, Bucket=self.bucket, Key=self._full(key), Body=data, **extra
            )

        try:
            await self._call("put", key, once, kind="put", conditional=if_none_match)
        except ConditionFailed:
            if attempts > 1 and await self._is_ours(
                key, hashlib.md5(data, usedforsecurity=False).hexdigest()
            ):
                return
            raise

    async def _put_file(self, key: str, path: str, if_none_match: bool) -> int:
        size = await asyncio.to_thread(os.path.getsize, path)  # a missing source is the caller's OSError
        if size < self.config.multipart_threshold:
            data = await asyncio.to_thread(Path(path).read_bytes)
            await self._put(key, data, if_none_match)
            return len(data)
        return await self._put_multipart(key, path, size, if_none_match)

    async def _get(self, key: str, byte_range: ByteRange | None, max_bytes: int | None) -> bytes:
        async def once() -> bytes:
            got = await self._run(self._get_body, self._full(key), byte_range, max_bytes=max_bytes)
            assert got is not None  # only a conditional GET answers 304
            await self._received(len(got.data))
            return got.data

        return await self._call("get", key, once, kind="get")

    async def _get_if_changed(self, key: str, etag: str | None, max_bytes: int | None) -> Fetched | None:
        async def once() -> Fetched | None:
            try:
                got = await self._run(self._get_body, self._full(key), None, max_bytes=max_bytes, if_none_match=etag)
            except BaseException:
                self.requests.get += 1  # sent, answered with an error or not at all
                raise
            if got is None:
                self.requests.get_not_modified += 1
                return None
            self.requests.get += 1
            await self._received(len(got.data))
            return got

        return await self._call("get", key, once)

    async def _get_file(self, key: str, path: str, max_bytes: int | None) -> int:
        info = await self._head(key)
        too_large(key, info.size, max_bytes, self.url)
        dest = Path(path).absolute()
        await asyncio.to_thread(dest.parent.mkdir, parents=True, exist_ok=True)
        tmp = await asyncio.to_thread(new_tmp_file, dest.parent)
        try:
            chunk = self.config.multipart_chunk
            ranges = [(start, min(start + chunk, info.size)) for start in range(0, info.size, chunk)]
            gate = asyncio.Semaphore(self.config.max_concurrency)

            async def fetch(byte_range: ByteRange) -> None:
                async with gate:
                    # If-Match pins every range to the version we HEADed: a concurrent overwrite fails
                    # the download (ConditionFailed) instead of stitching two versions together.
                    async def once() -> bytes:
                        got = await self._run(self._get_body, self._full(key), byte_range, if_match=info.etag or None)
                        assert got is not None
                        await self._received(len(got.data))
                        return got.data

                    data = await self._call("get_file", key, once, kind="get")
                    if len(data) != byte_range[1] - byte_range[0]:
                        raise StoreError(f"get_file {key!r}: range {byte_range} returned {len(data)} bytes")
                    # By path, not a shared descriptor: see LocalStore._copy for why.
                    await asyncio.to_thread(write_at, tmp, byte_range[0], data)

            await all_of(fetch(r) for r in ranges)
            await asyncio.to_thread(fsync_path, tmp)
            await asyncio.to_thread(os.replace, tmp, dest)
            await asyncio.to_thread(fsync_path, dest.parent)
            return info.size
        finally:
            await asyncio.shield(asyncio.to_thread(unlink_quiet, tmp))

    async def _get_stream(self, key: str, sink: Callable[[bytes], object], max_bytes: int, chunk: int) -> int:
        """One GET, its body read ``chunk`` bytes at a time in a worker thread, each chunk through the
        link limiter and ``sink`` on the event loop before the next is read. A transient failure
        resumes at the bytes handed over (``Range``, ``If-Match`` on the first answer's ETag)."""
        loop, got, etag, stop = asyncio.get_running_loop(), 0, "", threading.Event()

        async def deliver(data: bytes) -> None:
            nonlocal got
            too_large(key, got + len(data), max_bytes, f"bucket {self.bucket}")
            await self._received(len(data))
            got += len(data)
            sink(data)

        def read() -> None:  # in the worker thread
            nonlocal etag
            resume = {"Range": f"bytes={got}-"} | ({"IfMatch": f'"{etag}"'} if etag else {}) if got else {}
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key), **resume)
            etag = etag or str(resp.get("ETag", "")).strip('"')
            too_large(key, got + int(resp.get("ContentLength") or 0), max_bytes, f"bucket {self.bucket}")
            with resp["Body"] as body:
                while not stop.is_set() and (data := body.read(min(chunk, max_bytes + 1 - got))):
                    handed = asyncio.run_coroutine_threadsafe(deliver(data), loop)
                    while not settled(handed, 1.0):  # a cancelled call or a closed store frees the thread
                        if stop.is_set() or self._closed:
                            handed.cancel()
                            return

        async def once() -> None:
            try:
                await self._run(read)
            except bex.ClientError as e:
                if not (got and http_status(e) == 416):  # 416: resumed at the very end, nothing left
                    raise

        try:
            await self._call("get_stream", key, once, kind="get")
        finally:
            stop.set()  # a cancelled call's thread stops at its next chunk
        return got

    async def _head(self, key: str) -> ObjectInfo:
        async def once() -> dict[str, Any]:
            return await self._run(self._client.head_object, Bucket=self.bucket, Key=self._full(key))

        resp = await self._call("head", key, once, kind="head")
        return ObjectInfo(
            key=key,
            size=resp["ContentLength"],
            etag=resp["ETag"].strip('"'),
            last_modified=resp["LastModified"].astimezone(dt.UTC),
        )

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        infos: list[ObjectInfo] = []
        kwargs: dict[str, Any] = {
            "Bucket": self.bucket,
            "Prefix": self.prefix + prefix,
            "MaxKeys": self.config.list_page_size,
        }
        while True:

            async def once(kwargs: dict[str, Any] = kwargs) -> dict[str, Any]:
                return await self._run(self._client.list_objects_v2, **kwargs)

            page = await self._call("list", prefix, once, kind="list")
            for obj in page.get("Contents", []):
                infos.append(
                    ObjectInfo(
                        key=obj["Key"][len(self.prefix) :],
                        size=obj["Size"],
                        etag=obj.get("ETag", "").strip('"'),
                        last_modified=obj["LastModified"].astimezone(dt.UTC),
                    )
                )
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return infos
            kwargs = {**kwargs, "ContinuationToken": token}

    async def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self._full(k)} for k in keys[i : i + DELETE_BATCH]]

            async def once(batch: list[dict[str, str]] = batch) -> dict[str, Any]:
                return await self._run(
                    self._client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )

            resp = await self._call("delete", f"{len(batch)} keys", once, kind="delete")
            # DeleteObjects answers 200 even when keys fail; missing keys are not failures.
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                kind = AccessDenied if all(e.get("Code") == "AccessDenied" for e in errors) else StoreError
                raise kind(
                    f"delete in {self.url}: {len(errors)} of {len(batch)} keys failed, "
                    f"first {first.get('Key')!r}: {first.get('Code')}: {first.get('Message')}"
                )

    # --- multipart --------------------------------------------------------------------------

    async def _put_multipart(self, key: str, path: str, size: int, if_none_match: bool) -> int:
        full = self._full(key)
        chunk = max(self.config.multipart_chunk, math.ceil(size / MAX_PARTS))
        n_parts = math.ceil(size / chunk)

        async def create() -> dict[str, Any]:
            return await self._run(
                self._client.create_multipart_upload, Bucket=self.bucket, Key=full, ChecksumAlgorithm="CRC32"
            )

        upload_id = (await self._call("put_file", key, create, kind="put"))["UploadId"]
        parts: list[dict[str, str | int]] = [{} for _ in range(n_parts)]
        gate = asyncio.Semaphore(self.config.max_concurrency)
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)
        try:

            async def upload(i: int) -> None:
                async with gate:
                    data = await asyncio.to_thread(os.pread, fd, chunk, i * chunk)

                    async def once() -> dict[str, Any]:
                        await self._sent(len(data))
                        return await self._run(
                            self._client.upload_part,
                            Bucket=self.bucket,
                            Key=full,
                            UploadId=upload_id,
                            PartNumber=i + 1,
                            Body=data,
                            ChecksumAlgorithm="CRC32",
                        )

                    resp = await self._call("put_file", key, once, kind="put")
                    parts[i] = {"PartNumber": i + 1, "ETag": resp["ETag"]}
                    if "ChecksumCRC32" in resp:
                        parts[i]["ChecksumCRC32"] = resp["ChecksumCRC32"]

            await all_of(upload(i) for i in range(n_parts))

            extra = {"IfNoneMatch": "*"} if if_none_match else {}
            attempts = 0

            async def complete() -> None:
                nonlocal attempts
                attempts += 1
                await self._run(
                    self._client.complete_multipart_upload,
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    **extra,
                )

            try:
                await self._call("put_file", key, complete, kind="put", conditional=if_none_match)
            except (ConditionFailed, ObjectNotFound):
                # A completion that landed but whose response was lost is retried, and the retry is
                # told NoSuchUpload (404: the upload id was consumed) or, create-only, that the key
                # exists. Only a retry can see that; the object then tells whether it was ours.
                etag = _multipart_etag(parts)
                if not (attempts > 1 and await self._completed(key, size, etag, if_none_match)):
                    raise
        except BaseException:
            self._abort_soon(full, upload_id)
            raise
        finally:
            os.close(fd)
        return size

    def _abort_soon(self, full_key: str, upload_id: str) -> None:
        """Drop the parts of a failed upload, in the background: we may be inside a cancellation."""

        def abort() -> None:
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=full_key, UploadId=upload_id)
            except (bex.ClientError, bex.BotoCoreError) as e:
                log.warning(
                    "could not abort multipart upload of %s/%s (parts stay until a lifecycle rule "
                    "removes them): %s",
                    self.bucket,
                    full_key,
                    e,
                )

        if not self._closed:
            self._executor.submit(abort)

    # --- plumbing ---------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        return self.prefix + key

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._closed:
            raise StoreError(f"{self.url} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def _get_body(
        self,
        full_key: str,
        byte_range: ByteRange | None,
        *,
        if_match: str | None = None,
        if_none_match: str | None = None,
        max_bytes: int | None = None,
    ) -> Fetched | None:
        """GET and read the body in the worker thread (reading is blocking I/O too).

        ``if_match`` pins the object's ETag (412 otherwise); ``if_none_match`` makes an unchanged
        object answer 304, returned as None. With ``max_bytes`` an over-long body is refused from its
        Content-Length and never read past ``max_bytes + 1`` bytes (a server may lie about the length)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": full_key}
        if byte_range is not None:
            kwargs["Range"] = f"bytes={byte_range[0]}-{byte_range[1] - 1}"
        if if_match is not None:
            kwargs["IfMatch"] = f'"{if_match}"'
        if if_none_match is not None:
            kwargs["IfNoneMatch"] = f'"{if_none_match}"'
        try:
            resp = self._client.get_object(**kwargs)
        except bex.ClientError as e:
            if if_none_match is not None and http_status(e) == 304:
                return None  # botocore raises on 304 Not Modified: the object is unchanged
            if byte_range is not None and http_status(e) == 416:
                return Fetched(b"", "")  # start at or past the end: slice semantics, like LocalStore
            raise
        etag = str(resp.get("ETag", "")).strip('"')
        with resp["Body"] as body:
            if max_bytes is None:
                return Fetched(body.read(), etag)
            too_large(full_key, int(resp.get("ContentLength") or 0), max_bytes, f"bucket {self.bucket}")
            return Fetched(body.read(max_bytes + 1), etag)

    async def _sent(self, nbytes: int) -> None:
        await charge(self._up, nbytes)
        self.requests.bytes_up += nbytes

    async def _received(self, nbytes: int) -> None:
        await charge(self._down, nbytes)
        self.requests.bytes_down += nbytes

    async def _call(
        self,
        op: str,
        key: str,
        once: Callable[[], Awaitable[T]],
        *,
        kind: str | None = None,
        conditional: bool = False,
    ) -> T:
        """Run ``once`` until it succeeds, retrying transient failures with backoff and jitter.

        Each attempt is one request: counted under ``kind`` (None: ``once`` counts itself) and
        recorded in ``health`` (any answer from the server is ok, a transient failure is not)."""
        attempt = 0
        while True:
            if kind is not None:
                setattr(self.requests, kind, getattr(self.requests, kind) + 1)
            try:
                result = await once()
            except (bex.ClientError, bex.BotoCoreError) as e:
                transient = is_transient(e)
                if transient:
                    self.health.failed(e, answered=isinstance(e, bex.ClientError))  # a 5xx: there, but failing
                else:
                    self.health.ok()  # a 4xx is an answer
                if not transient or attempt >= self.config.max_retries:
                    raise typed_error(
                        e,
                        where=f"{op} {key!r} in {self.url} ({self.config.endpoint_url or 'AWS'})",
                        op=op,
                        bucket=self.bucket,
                        conditional=conditional,
                        attempts=attempt + 1,
                        read_timeout_s=self.config.read_timeout_s,
                    ) from e
                # "Full jitter" (AWS Architecture Blog, "Exponential Backoff And Jitter"): a uniform
                # draw below the exponential bound, so a thousand nodes that lost the store at the
                # same moment do not come back in lockstep. The bound doubles to backoff_cap_s.
                delay = backoff_delay(attempt, self.config.backoff_base_s, self.config.backoff_cap_s)
                log.debug("%s %s: %s; retry %d in %.2f s", op, key, e, attempt + 1, delay)
            else:
                self.health.ok()
                return result
            await asyncio.sleep(delay)
            attempt += 1

    async def _is_ours(self, key: str, etag: str) -> bool:
        """After a retried create-only write failed its condition: did our own first attempt land?

        A lost response to a successful conditional write makes the retry see "already exists".
        Comparing the stored ETag with the one our bytes produce tells the two cases apart (S3-style
        MD5 ETags; a server that computes them differently just gets the conservative answer). A racer
        that wrote the very same bytes also counts as ours: create-only of equal content is idempotent.
        """
        try:
            return (await self._head(key)).etag == etag
        except ObjectNotFound:
            return False


    async def _completed(self, key: str, size: int, etag: str, create_only: bool) -> bool:
        """After a retried multipart completion failed: is the object at ``key`` the one we completed?

        Its ETag must be the multipart ETag of our parts. A server that computes ETags otherwise
        (no ``-<parts>`` suffix) gets a size check for a plain put, where a racing writer would win
        anyway, and the conservative answer for a create-only one.
        """
        try:
            info = await self._head(key)
        except ObjectNotFound:
            return False
        if info.etag == etag:
            return True
        return not create_only and info.size == size and not re.fullmatch(r"[0-9a-f]{32}-\d+", info.etag)


def _multipart_etag(parts: list[dict[str, str | int]]) -> str:
    """The ETag S3 gives a multipart object: MD5 of the parts' binary MD5s, then ``-<count>``."""
    digests = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in parts)
    return f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"

