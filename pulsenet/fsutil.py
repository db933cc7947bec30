"""Atomic, durable local file writes: the one way pulsenet puts a file in place.

A temporary file in the same directory, fsynced, then ``os.replace``d over the target and the
directory fsynced: a crash at any point leaves either the old file or the new one, never a torn
one, and a failure removes the temporary.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int = 0o644) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; when the block succeeds, make it ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        yield tmp
        os.chmod(tmp, mode)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    with atomic_path(path, mode) as tmp:
        tmp.write_bytes(data)


def fresh_scratch(directory: str | os.PathLike[str]) -> Path:
    """``directory``, created, and emptied of what a killed run left there: a node's own temporary
    files (a spooled payload, a global state on its way up) die with it at any line, and would pile
    up, a model's size each, over days of restarts. Only for a directory the node owns alone."""
    directory = Path(directory)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def private_scratch(parent: str | os.PathLike[str] | None, prefix: str) -> Path:
    """A new private directory (``mkdtemp``: 0700) named ``<prefix><pid namespace>.<pid>-…`` in
    ``parent`` (None: the temporary directory), made after removing the ones of the same prefix,
    owner and PID namespace whose process is gone. For a shared parent (``fresh_scratch`` is for a
    directory owned alone): a killed process cleans nothing up, and in /dev/shm what it left holds
    memory until a reboot. A directory whose pid is alive (reused or not), or that another PID
    namespace made (containers sharing a /dev/shm), is left alone."""
    root = Path(parent if parent is not None else tempfile.gettempdir())
    ns = _pid_namespace()
    with contextlib.suppress(FileNotFoundError):
        for d in root.iterdir():
            owner, dash, _ = d.name.removeprefix(prefix).partition("-")
            d_ns, dot, pid = owner.partition(".")
            if not (d.name.startswith(prefix) and dash and dot and pid.isdigit() and d_ns == str(ns)) or _alive(int(pid)):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = d.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                    shutil.rmtree(d, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{ns}.{os.getpid()}-", dir=root))


def _pid_namespace() -> int:
    """This process's PID namespace (its inode; 0 where there is no /proc): a pid names the same
    process only inside one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True
