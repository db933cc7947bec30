"""The store layer: bytes in, objects out. See ``docs/store.md``.

``open_store("s3://bucket/prefix", S3Config(...))`` or ``open_store("file:///abs/path")`` gives an
:class:`ObjectStore`; everything above this layer talks only to that interface.
"""

from __future__ import annotations

import re
import urllib.parse

from pulsenet.errors import ConfigError
from pulsenet.store.base import (
    REQUEST_KINDS,
    ByteRange,
    Fetched,
    ObjectInfo,
    ObjectStore,
    RequestCounts,
    StoreHealth,
    backoff_delay,
    check_key,
)
from pulsenet.store.local import LocalStore
from pulsenet.store.ratelimit import RateLimiter
from pulsenet.store.s3 import S3Config, S3Store

__all__ = [
    "REQUEST_KINDS",
    "ByteRange",
    "Fetched",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "RateLimiter",
    "RequestCounts",
    "S3Config",
    "S3Store",
    "StoreHealth",
    "backoff_delay",
    "open_store",
]

# S3 bucket naming rules (lowercase letters, digits, dots, hyphens; 3-63 characters).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_USAGE = "use s3://bucket[/prefix] or file:///absolute/path"


def open_store(url: str, config: S3Config | None = None) -> ObjectStore:
    """Open the store a URL names. ``config`` supplies endpoint, credentials, timeouts and ``link_mbps``.

    For ``file://`` URLs only the timeouts and ``link_mbps`` of ``config`` apply. Environment variables
    are not read here: pass ``S3Config.from_env()`` from the CLI or node start-up if you want them.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.query or parts.fragment:
        raise ConfigError(f"store URL {url!r} must not have a query or fragment; {_USAGE}")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.fullmatch(bucket):
            raise ConfigError(f"store URL {url!r}: {bucket!r} is not a valid bucket name; {_USAGE}")
        prefix = urllib.parse.unquote(parts.path).strip("/")
        if prefix:
            _check_prefix(url, prefix)
        return S3Store(bucket, prefix, config)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"store URL {url!r} names host {parts.netloc!r}; file URLs must be local ({_USAGE})"
            )
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/"):
            raise ConfigError(f"store URL {url!r} needs an absolute path; {_USAGE}")
        if path.strip("/"):
            _check_prefix(url, path.strip("/"))
        config = config or S3Config()
        return LocalStore(
            path,
            link_mbps=config.link_mbps,
            default_timeout=config.timeout_s,
            transfer_timeout=config.transfer_timeout_s,
        )
    raise ConfigError(f"unsupported store URL {url!r}; {_USAGE}")


def _check_prefix(url: str, prefix: str) -> None:
    try:
        check_key(prefix)
    except ValueError as e:
        raise ConfigError(f"store URL {url!r}: bad path ({e})") from e
