"""``file:///path`` object store: one file per key, for single-machine runs and tests.

Durability and atomicity come from the filesystem: every object is written to a hidden temporary file
in the target directory, fsynced, then moved into place with ``os.replace`` (overwrite) or ``os.link``
(create-only: ``link`` fails if the name exists, so two racing creators cannot both win). Readers
therefore see either the old object or the new one, never a torn write. All file I/O runs in threads.
Create-only needs a filesystem with hard links (any local POSIX one; not some FUSE/SMB mounts, where
it fails with a StoreError rather than falling back to a racy check).

Limitation: a key cannot be both an object and a prefix of another key (``a`` and ``a/b``), since
``a`` would have to be a file and a directory. S3 allows it; pulsenet's key layouts never need it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import math
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.errors import ConditionFailed, ObjectNotFound, ObjectTooLarge, StoreError
from pulsenet.fsutil import fsync_path
from pulsenet.store.base import ByteRange, Fetched, ObjectInfo, ObjectStore, check_key, too_large
from pulsenet.store.ratelimit import RateLimiter, charge

T = TypeVar("T")

TMP_PREFIX = ".pulsenet-tmp-"
"""Temporary files start with this; listings skip them and keys may not use it."""
CHUNK = 8 * 1024 * 1024
"""File transfers move this much per thread hop (and per rate-limiter charge)."""


class LocalStore(ObjectStore):
    """Objects as files under ``root``; see the module docstring for the guarantees."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        link_mbps: float | None = None,
        default_timeout: float | None = SMALL_CALL_S,
        transfer_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.default_timeout = default_timeout
        self.transfer_timeout = transfer_timeout
        self._up = RateLimiter(link_mbps) if link_mbps else None
        self._down = RateLimiter(link_mbps) if link_mbps else None

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    # --- backend hooks ----------------------------------------------------------------------

    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        dest = self._path(key)
        self.requests.put += 1
        await charge(self._up, len(data))
        self.requests.bytes_up += len(data)
        await self._io("put", key, self._write_whole, dest, data, if_none_match)

    async def _put_file(self, key: str, path: str, if_none_match: bool) -> int:
        dest = self._path(key)
        fd = await asyncio.to_thread(os.open, path, os.O_RDONLY)  # a missing source is the caller's OSError
        self.requests.put += 1
        return await self._copy("put_file", key, fd, dest, False, if_none_match)

    async def _get(self, key: str, byte_range: ByteRange | None, max_bytes: int | None) -> bytes:
        self.requests.get += 1
        data = await self._io("get", key, _read, self._path(key), byte_range, max_bytes, reading=True)
        await self._received(len(data))
        return data

    async def _get_if_changed(self, key: str, etag: str | None, max_bytes: int | None) -> Fetched | None:
        try:
            got = await self._io("get", key, _read_if_changed, self._path(key), etag, max_bytes, reading=True)
        except BaseException:
            self.requests.get += 1  # answered with an error (a missing key) or not at all
            raise
        if got is None:
            self.requests.get_not_modified += 1
            return None
        self.requests.get += 1
        await self._received(len(got.data))
        return got

    async def _get_file(self, key: str, path: str, max_bytes: int | None) -> int:
        self.requests.get += 1
        fd = await self._io("get_file", key, _open_file, self._path(key), reading=True)
        try:
            too_large(key, os.fstat(fd).st_size, max_bytes, self.url)
        except ObjectTooLarge:
            os.close(fd)
            raise
        return await self._copy("get_file", key, fd, Path(path).absolute(), True, False, max_bytes)

    async def _head(self, key: str) -> ObjectInfo:
        self.requests.head += 1
        st = await self._io("head", key, os.stat, self._path(key), reading=True)
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(f"{key!r} not found in {self.url}")
        return _info(key, st)

    async def _list(self, prefix: str) -> list[ObjectInfo]:
        directory = prefix.rpartition("/")[0]
        if directory:
            check_key(directory)  # keeps ".." from walking out of the root
        self.requests.list += 1
        return await self._io("list", prefix, self._walk, self.root / directory, prefix)

    async def _delete(self, keys: list[str]) -> None:
        paths = [self._path(k) for k in keys]
        self.requests.delete += math.ceil(len(keys) / 1000)  # as S3's DeleteObjects batches
        await self._io("delete", f"{len(keys)} keys", _unlink_all, paths)

    # --- helpers ----------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        if key.rpartition("/")[2].startswith(TMP_PREFIX):
            raise ValueError(f"object key {key!r} uses the reserved name prefix {TMP_PREFIX!r}")
        return self.root.joinpath(*key.split("/"))

    async def _received(self, nbytes: int) -> None:
        await charge(self._down, nbytes)
        self.requests.bytes_down += nbytes

    async def _io(self, op: str, key: str, fn: Callable[..., T], *args: object, reading: bool = False) -> T:
        """Run blocking file I/O in a thread and turn OS errors into the store's typed errors.

        ``reading``: the call opens the object itself, so a missing path means a missing key.
        A missing key is an answer (health stays ok); any other OS error is a failure.
        """
        try:
            result = await asyncio.to_thread(fn, *args)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            if reading:
                self.health.ok()
                raise ObjectNotFound(f"{key!r} not found in {self.url}") from e
            err: StoreError = StoreError(f"{op} {key!r} in {self.url}: {e}")
            self.health.failed(err)
            raise err from e
        except StoreError:  # ConditionFailed, ObjectTooLarge: answers, not faults
            self.health.ok()
            raise
        except OSError as e:
            err = StoreError(f"{op} {key!r} in {self.url}: {e}")
            self.health.failed(err)
            raise err from e
        self.health.ok()
        return result

    @staticmethod
    def _write_whole(dest: Path, data: bytes, if_none_match: bool) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = new_tmp_file(dest.parent)
        try:
            write_at(tmp, 0, data)
            fsync_path(tmp)
            publish_file(tmp, dest, if_none_match)
        finally:
            unlink_quiet(tmp)

    async def _copy(
        self,
        op: str,
        key: str,
        fd: int,
        dest: Path,
        download: bool,
        if_none_match: bool,
        max_bytes: int | None = None,
    ) -> int:
        """Copy the open file ``fd`` to ``dest`` through a temporary file, one chunk per thread hop; closes ``fd``.

        The source is read through one descriptor (a concurrent replace of the source cannot mix two
        versions); the temporary file is reopened by path for each chunk, so a write still in flight
        in an abandoned thread after a cancel can never land in a reused descriptor.
        """
        tmp: Path | None = None
        try:
            await self._io(op, key, dest.parent.mkdir, 0o777, True, True)
            tmp = await self._io(op, key, new_tmp_file, dest.parent)
            offset = 0
            while chunk := await self._io(op, key, os.pread, fd, CHUNK, offset):
                if download:
                    await self._received(len(chunk))
                else:
                    await charge(self._up, len(chunk))
                    self.requests.bytes_up += len(chunk)
                await self._io(op, key, write_at, tmp, offset, chunk)
                offset += len(chunk)
                too_large(key, offset, max_bytes, self.url)  # the source grew after the check
            await self._io(op, key, fsync_path, tmp)
            await self._io(op, key, publish_file, tmp, dest, if_none_match)
            return offset
        finally:
            os.close(fd)
            if tmp is not None:
                await asyncio.shield(asyncio.to_thread(unlink_quiet, tmp))

    def _walk(self, top: Path, prefix: str) -> list[ObjectInfo]:
        infos = []
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                if name.startswith(TMP_PREFIX):
                    continue
                path = Path(dirpath, name)
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:  # deleted while we walked
                    continue
                if stat.S_ISREG(st.st_mode):
                    infos.append(_info(key, st))
        return infos


# --- blocking primitives (run in threads; S3Store.get_file uses them too) ---------------------------------------------------


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(
        key=key,
        size=st.st_size,
        # inode changes on every replace, mtime+size catch in-place edits made outside pulsenet.
        etag=f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}",
        last_modified=dt.datetime.fromtimestamp(st.st_mtime_ns / 1e9, tz=dt.UTC),
    )


def _open_file(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IsADirectoryError(errno.EISDIR, "not an object", str(path))
    return fd


def _read(path: Path, byte_range: ByteRange | None, max_bytes: int | None) -> bytes:
    with open(path, "rb") as f:
        start, end = byte_range or (0, None)
        size = os.fstat(f.fileno()).st_size
        length = max(0, min(size if end is None else end, size) - start)
        too_large(str(path), length, max_bytes, "a local store")
        if byte_range is None and max_bytes is None:
            return f.read()
        return os.pread(f.fileno(), length if max_bytes is None else min(length, max_bytes + 1), start)


def _read_if_changed(path: Path, etag: str | None, max_bytes: int | None) -> Fetched | None:
    """The file and its ETag (from the same open descriptor, so they match), or None if unchanged."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "not an object", str(path))
        tag = _info("", st).etag
        if tag == etag:
            return None
        too_large(str(path), st.st_size, max_bytes, "a local store")
        return Fetched(f.read(st.st_size if max_bytes is None else min(st.st_size, max_bytes + 1)), tag)


def new_tmp_file(directory: Path) -> Path:
    path = directory / f"{TMP_PREFIX}{secrets.token_hex(8)}"
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    return path


def write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)  # no O_CREAT: if the temp file was cleaned up, fail instead
    try:
        view = memoryview(data)
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n
    finally:
        os.close(fd)


def publish_file(tmp: Path, dest: Path, if_none_match: bool) -> None:
    if if_none_match:
        try:
            os.link(tmp, dest)  # atomic create-only: fails with EEXIST if anything has the name
        except FileExistsError as e:
            raise ConditionFailed(f"{dest} already exists (create-only put)") from e
    else:
        os.replace(tmp, dest)
    fsync_path(dest.parent)  # make the new directory entry durable, not just the data


def unlink_quiet(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError as e:
            # Missing keys are not an error; a directory at that name means no object there either.
            if e.errno not in (errno.ENOENT, errno.EISDIR, errno.ENOTDIR):
                raise
