"""Rollout channel key layout, inside each inference node's own store (bucket/prefix)::

    {prefix}/batches/v{version:012d}-{node}-{seq:08d}-{sha256[:16]}.parquet   Parquet rows, create-only
    {prefix}/manifests/v{version:012d}-{node}-{seq:08d}.json                  signed manifest, create-only, last
    {prefix}/head.json                                                        signed head, overwritten after each batch
    {prefix}/key.pub                                                          the node's Ed25519 public key, raw 32 bytes

and inside each trainer's own store (the one its policy channel is in)::

    {prefix}/demand/{trainer}.json                                          signed demand record, overwritten

An inference node writes only under its own store, never a trainer's: trainers read it with
read-only credentials. ``seq`` counts the node's batches (never reused, continued from the listing
after a restart); ``version`` is the policy version that produced the rows, first so that a listing
sorts oldest first and retention can act on names alone. The manifest's signed body repeats
version, node and seq and names the payload's key, size and SHA-256; a manifest whose key
disagrees with its body is a copy and is rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pulsenet.errors import ConfigError

NODE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PREFIX = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
_MANIFEST = re.compile(r"v(\d{12})-([A-Za-z0-9._-]{1,64})-(\d{8})\.json")
_BATCH = re.compile(r"v(\d{12})-([A-Za-z0-9._-]{1,64})-(\d{8})-([0-9a-f]{16})\.parquet")
MAX_VERSION = 10**12 - 1
MAX_SEQ = 10**8 - 1


@dataclass(frozen=True, slots=True)
class BatchName:
    """What a key names: the batch's version, node and sequence number (unverified until signed)."""

    version: int
    node: str
    seq: int


@dataclass(frozen=True, slots=True)
class RolloutLayout:
    """Key names of the rollout channel under one node's store."""

    prefix: str = "rollouts"

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix) or any(p in (".", "..") for p in self.prefix.split("/")):
            raise ConfigError(f"rollout prefix {self.prefix!r} must be '/'-separated names of [A-Za-z0-9._-]")

    @property
    def manifests(self) -> str:
        return f"{self.prefix}/manifests/"

    @property
    def batches(self) -> str:
        return f"{self.prefix}/batches/"

    def context(self, run: str, store_url: str, node: str) -> str:
        """What a batch manifest of ``node`` is signed for: ``rollouts/{run}/{node}@{store_url}/{prefix}``.

        The run keeps a batch of one run out of another under the same keys; the node keeps one site
        key that signs for several nodes from passing one node's batch off as another's; the store URL
        and prefix keep a manifest copied into another bucket (or channel) from verifying there.
        """
        return f"rollouts/{run}/{node}@{store_url.rstrip('/')}/{self.prefix}"

    @property
    def head(self) -> str:
        """The node's signed head record (manifest.py): rewritten after each batch, so a trainer
        polls it with one conditional GET and lists the manifests only when it moved."""
        return f"{self.prefix}/head.json"

    @property
    def key(self) -> str:
        """The node's public key (raw 32 bytes), written by its writer at start: what a trainer
        with ``open_inference`` pins for a node it holds no key for (intake.py). A claim until
        pinned; an allowlisted node's key comes from the trainer's config, never from here."""
        return f"{self.prefix}/key.pub"

    def head_context(self, run: str, store_url: str, node: str) -> str:
        """What ``node``'s head is signed for (like ``context``, another kind of document)."""
        return f"rollout-head/{run}/{node}@{store_url.rstrip('/')}/{self.prefix}"

    def demand(self, trainer: str) -> str:
        """A trainer's demand record (demand.py), in the trainer's own store."""
        return f"{self.prefix}/demand/{check_node(trainer)}.json"

    def demand_context(self, run: str, store_url: str, trainer: str) -> str:
        """What ``trainer``'s demand record is signed for: like ``context``, for the trainer's slot,
        so a record copied to another trainer's store, another run or prefix does not verify."""
        return f"rollout-demand/{run}/{trainer}@{store_url.rstrip('/')}/{self.prefix}"

    def batch_id(self, node: str, name: BatchName) -> str:
        """``node/manifest key``: the name the partition hashes and the consumed record keeps."""
        return f"{node}/{self.manifest(name.version, name.node, name.seq)}"

    def manifest(self, version: int, node: str, seq: int) -> str:
        return f"{self.manifests}{_stem(version, node, seq)}.json"

    def batch(self, version: int, node: str, seq: int, sha256: str) -> str:
        return f"{self.batches}{_stem(version, node, seq)}-{sha256[:16]}.parquet"

    def parse_manifest(self, key: str) -> BatchName | None:
        """The batch a manifest key names, or None for any other key."""
        return _parse(key, self.manifests, _MANIFEST)

    def parse_batch(self, key: str) -> BatchName | None:
        """The batch a payload key names, or None for any other key."""
        return _parse(key, self.batches, _BATCH)


def check_node(node: str) -> str:
    if not isinstance(node, str) or not NODE.fullmatch(node):
        raise ConfigError(f"node id {node!r} must be 1-64 characters of [A-Za-z0-9._-]")
    return node


def _stem(version: int, node: str, seq: int) -> str:
    if not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise ValueError(f"version must be an int in 0..{MAX_VERSION}, got {version!r}")
    if not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise ValueError(f"seq must be an int in 0..{MAX_SEQ}, got {seq!r}")
    return f"v{version:012d}-{check_node(node)}-{seq:08d}"


def _parse(key: str, prefix: str, pattern: re.Pattern[str]) -> BatchName | None:
    if not key.startswith(prefix):
        return None
    m = pattern.fullmatch(key[len(prefix) :])
    return BatchName(int(m.group(1)), m.group(2), int(m.group(3))) if m else None
