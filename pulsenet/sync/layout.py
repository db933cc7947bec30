"""PULSESync key layout: where manifests and payloads of a channel live in the store.

::

    {channel}/manifests/v{version:012d}.json                       signed manifest, create-only, written last
    {channel}/payloads/v{version:012d}-{role}-{sha256[:16]}.pnp    patch bytes; role = "anchor" | "patch"
    {channel}/head.json                                            signed head record, overwritten per version

Versions are zero-padded so a listing sorts them. A payload key carries the first 16 hex digits of
its own SHA-256: two publishers racing for one version can never overwrite each other's payloads
(only one manifest wins the create-only write, and it names its own bytes).

Every document of a channel is signed for ``context``: the run, the store location and the channel.
A manifest copied into another channel, another bucket or prefix, or another run does not verify.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pulsenet.errors import ConfigError

ROLES = ("anchor", "patch")
_MANIFEST = re.compile(r"v(\d{12})\.json")
_PAYLOAD = re.compile(r"v(\d{12})-(anchor|patch)-([0-9a-f]{16})\.pnp")
_CHANNEL = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
_RUN = re.compile(r"[A-Za-z0-9._-]{1,128}")
DEFAULT_RUN = "default"
MAX_VERSION = 10**12 - 1


@dataclass(frozen=True, slots=True)
class Layout:
    """Key names for one channel (a policy stream) under a store, and what its documents are signed for."""

    channel: str = "policy"
    run: str = DEFAULT_RUN
    """Name of the training run: two runs sharing a store, channel name and key stay apart."""
    store_url: str = ""
    """``ObjectStore.url`` (S3: ``s3://bucket/prefix/``, no endpoint, so readers going through other
    endpoints or credentials agree on it)."""

    def __post_init__(self) -> None:
        if not _CHANNEL.fullmatch(self.channel) or any(p in (".", "..") for p in self.channel.split("/")):
            raise ConfigError(f"channel {self.channel!r} must be '/'-separated names of [A-Za-z0-9._-]")
        if not isinstance(self.run, str) or not _RUN.fullmatch(self.run):
            raise ConfigError(f"run {self.run!r} must be 1-128 characters of [A-Za-z0-9._-]")
        if not isinstance(self.store_url, str) or any(c in self.store_url for c in "\n\r"):
            raise ConfigError(f"store URL {self.store_url!r} must be one line")

    @property
    def context(self) -> str:
        """What every document of this channel is signed for (signing.py): one signed for another
        run, store location or channel does not verify here."""
        return f"pulsesync/{self.run}/{self.store_url}/{self.channel}"

    @property
    def head(self) -> str:
        """The signed head record: the newest version, overwritten after each manifest."""
        return f"{self.channel}/head.json"

    @property
    def manifests(self) -> str:
        """Listing prefix of the manifests."""
        return f"{self.channel}/manifests/"

    @property
    def payloads(self) -> str:
        """Listing prefix of the payloads."""
        return f"{self.channel}/payloads/"

    def manifest(self, version: int) -> str:
        return f"{self.manifests}v{_check_version(version):012d}.json"

    def payload(self, version: int, role: str, sha256: str) -> str:
        if role not in ROLES:
            raise ValueError(f"payload role must be one of {ROLES}, got {role!r}")
        return f"{self.payloads}v{_check_version(version):012d}-{role}-{sha256[:16]}.pnp"

    def parse_manifest(self, key: str) -> int | None:
        """The version a manifest key names, or None for any other key."""
        if not key.startswith(self.manifests):
            return None
        m = _MANIFEST.fullmatch(key[len(self.manifests) :])
        return int(m.group(1)) if m else None

    def parse_payload(self, key: str) -> tuple[int, str] | None:
        """``(version, role)`` of a payload key, or None for any other key."""
        if not key.startswith(self.payloads):
            return None
        m = _PAYLOAD.fullmatch(key[len(self.payloads) :])
        return (int(m.group(1)), m.group(2)) if m else None


def _check_version(version: int) -> int:
    if not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an int in 0..{MAX_VERSION}, got {version!r}")
    return version
