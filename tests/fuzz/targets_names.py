"""Fuzz targets of planted object names (issue 29): a name or a listing is a claim, never a fact.

The input is not a document but a *listing*: one object key per line, each planted (with junk
bytes, or with a genuine signed document copied under another name when the line starts with
``@``) beside an honest channel in a real ``LocalStore``. Whatever is planted, the node must end
where the honest channel alone puts it; keys a store refuses, and the honest objects' own keys
(overwriting or deleting is not planting: availability is not something signatures give), are
skipped.

- ``names.rollout_writer`` (exact): ``RolloutWriter.start`` beside a node's own batches, then the
  demand pacing over what it counts as its own. Output: (produced, batches to generate, whether
  ``next_seq`` is the honest resume point or within ``taken_retries`` past it, where a payload name
  of the node's own may move it: what killed writers leave). Was: a planted
  ``v000000000000-inf-a-99999999.json`` killed the node, four names at v999999999999 stalled it.
- ``names.export`` (exact): ``pulsenet export``'s choice of the newest version
  (``cli.export.newest_verified``) beside a channel of two versions. Was: ``max(listed names)``.
- ``names.cache`` (exact): files planted in a payload cache's directory and beside it survive
  ``sweep`` and ``prune`` unless the cache wrote them. Was: ``--cache ~`` deleted ``.bashrc``.

Every case ends in the honest outcome, so these targets refuse nothing (``rejects``: False), and as
each case runs a node against a store, ``tests/fuzz/test_fuzz.py`` caps their cases (``max_cases``);
``python tests/fuzz/run.py --target names --cases N`` runs long. Shared interface: see
``tests/fuzz/harness.py``. Standard library and pulsenet only at module level.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import random
import shutil
import tempfile
from pathlib import Path

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import StoreError
from pulsenet.rollouts import Demand, RolloutLayout, RolloutWriter, RolloutWriterConfig, batches_to_generate
from pulsenet.store.base import check_key
from pulsenet.store.local import TMP_PREFIX, LocalStore
from pulsenet.sync.chain import CACHE_SUBDIR, ManifestReader, PayloadCache
from pulsenet.sync.layout import Layout

NODE = "inf-a"
RLAYOUT = RolloutLayout()
RETRIES = 8


@functools.cache
def _key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"pulsenet-fuzz:names").digest())


@functools.cache
def _dir() -> Path:
    """The run's scratch, removed when the fuzzer exits (each run's names left ~60 MB in /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="pulsenet-fuzz-names-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _plant(store: LocalStore, data: bytes, honest: set[str], genuine: bytes) -> list[str]:
    """Put every plantable key of ``data`` (one per line); returns the keys put."""
    planted = []
    for line in data.split(b"\n")[:64]:
        copy = line.startswith(b"@")
        key = line[1:].decode("utf-8", "replace") if copy else line.decode("utf-8", "replace")
        try:
            check_key(key)
            if key in honest or key.rpartition("/")[2].startswith(TMP_PREFIX) or len(key.encode()) > 200:
                continue
            asyncio.run(store.put(key, genuine if copy else b"junk"))
        except (ValueError, OSError, StoreError):  # a key no store takes (nor an attacker's put)
            continue
        planted.append(key)
    return planted


# --- names.rollout_writer -------------------------------------------------------------------------


def _rows(version: int, seed: int) -> list[Rollout]:
    return [
        Rollout(group=f"g{seed}", prompt_ids=(1, 2), completion_ids=(3,), logprobs=(-0.5,), reward=1.0, version=version,
                model_digest="3f" * 32, node=NODE, seed=seed)
    ]  # fmt: skip


@functools.cache
def _rollout_channel() -> tuple[LocalStore, frozenset[str], bytes, tuple]:
    """A node's own store with three batches (v5, v5, v6): the store, its keys, a genuine manifest, and
    the honest outcome."""
    store = LocalStore(_dir() / "rollouts")

    async def go() -> RolloutWriter:
        w = _writer(store)
        for i, v in enumerate((5, 5, 6)):
            await w.write(_rows(v, i))
        return w

    w = asyncio.run(go())
    honest = frozenset(i.key for i in asyncio.run(store.list("")))
    genuine = asyncio.run(store.get(RLAYOUT.manifest(5, NODE, 0)))
    return store, honest, genuine, _rollout_outcome(w)


@functools.cache
def _honest_head() -> bytes:
    return asyncio.run(_rollout_channel()[0].get(RLAYOUT.head))


def _writer(store: LocalStore) -> RolloutWriter:
    cfg = RolloutWriterConfig(run="fuzz", taken_retries=RETRIES, orphan_grace_s=1e9, verify_at_start=64)
    return RolloutWriter(store, _key(), NODE, cfg)


def _rollout_outcome(w: RolloutWriter) -> tuple:
    demand = Demand(trainer="t0", version=6, max_staleness=2, participants=("t0",), grants={NODE: 8}, taken={})
    wanted = batches_to_generate([demand], node=NODE, version=6, produced=w.produced, rows_per_batch=1)
    return tuple(w.produced), wanted, 3 <= (w.next_seq or 0) <= 3 + RETRIES


def _rollout_writer(data: bytes) -> tuple:
    store, honest, genuine, _ = _rollout_channel()
    planted = _plant(store, data, set(honest), genuine)
    try:
        w = _writer(store)
        asyncio.run(w.start())
        return _rollout_outcome(w)
    finally:
        asyncio.run(store.delete(planted))
        asyncio.run(store.put(RLAYOUT.head, _honest_head()))  # start rewrote it: the next case starts honest


def _rollout_seeds() -> list[bytes]:
    m, b = RLAYOUT.manifest, RLAYOUT.batch
    return [
        m(0, NODE, 99_999_999).encode(),
        "\n".join(m(999_999_999_999, NODE, 1000 + i) for i in range(4)).encode(),
        "\n".join(["@" + m(5, NODE, 50), "@" + m(6, NODE, 3), b(0, NODE, 99_999_999, "0" * 64), m(6, "inf-b", 9)]).encode(),
    ]


def _mutate_rollout_names(data: bytes, rng: random.Random) -> bytes:
    """Add a name a bucket writer would pick: this node's or another's, extreme numbers, a copy."""
    version = rng.choice([0, 4, 5, 6, 7, 10**12 - 1, rng.randrange(10**12)])
    seq = rng.choice([0, 1, 2, 3, 4, 10, 10**8 - 1, rng.randrange(10**8)])
    node = rng.choice([NODE, NODE, "inf-b", "inf-a.", "x"])
    name = (
        RLAYOUT.manifest(version, node, seq)
        if rng.random() < 0.6
        else RLAYOUT.batch(version, node, seq, rng.randbytes(32).hex())
    )
    return data + b"\n" + (b"@" if rng.random() < 0.3 else b"") + name.encode()


# --- names.export ----------------------------------------------------------------------------------


@functools.cache
def _sync_channel() -> tuple[LocalStore, frozenset[str], bytes, int]:
    """A PULSESync channel of two versions (tiny states): the store, its keys, v0's manifest, the newest."""
    import torch

    from pulsenet.sync.publisher import Publisher, PublisherConfig

    store = LocalStore(_dir() / "sync")

    async def go() -> None:
        async with Publisher(store, _key(), PublisherConfig(anchor_every=10)) as pub:
            for i in range(2):
                await pub.publish_now({"w": torch.full((4, 4), float(i), dtype=torch.bfloat16)})

    asyncio.run(go())
    honest = frozenset(i.key for i in asyncio.run(store.list("")))
    return store, honest, asyncio.run(store.get(Layout().manifest(0))), 1


def _export(data: bytes) -> int:
    from pulsenet.cli.export import newest_verified
    from pulsenet.signing import key_id

    store, honest, genuine, _ = _sync_channel()
    planted = _plant(store, data, set(honest), genuine)
    try:
        reader = ManifestReader(store, Layout(store_url=store.url), {key_id(_key().public_key()): _key().public_key()})
        return asyncio.run(newest_verified(reader)).version
    finally:
        asyncio.run(store.delete(planted))


def _export_seeds() -> list[bytes]:
    layout = Layout()
    return [
        layout.manifest(999_999_999_999).encode(),
        f"@{layout.manifest(7)}\n{layout.manifest(2)}\n{layout.payload(2, 'anchor', '0' * 64)}".encode(),
        b"policy/manifests/v1.json\npolicy/head.json.x",
    ]


def _mutate_export_names(data: bytes, rng: random.Random) -> bytes:
    v = rng.choice([2, 3, 10, 10**12 - 1, rng.randrange(10**12)])
    return data + b"\n" + (b"@" if rng.random() < 0.4 else b"") + Layout().manifest(v).encode()


# --- names.cache ----------------------------------------------------------------------------------


def _cache(data: bytes) -> bool:
    """Plant files (one name per line; ``@name``: inside the cache's own directory) beside a payload
    cache and in it, sweep and prune: every planted file the cache did not write survives."""
    root = Path(tempfile.mkdtemp(dir=_dir(), prefix="cache-"))
    cache = PayloadCache(None, root)  # type: ignore[arg-type]  (no download: sweep and prune only)
    cache.dir.mkdir()
    planted: dict[Path, bytes] = {}
    for line in data.split(b"\n")[:32]:
        inside = line.startswith(b"@")
        name = (line[1:] if inside else line).decode("utf-8", "replace")
        if not name or "/" in name or "\x00" in name or name in (".", "..", CACHE_SUBDIR) or len(name.encode()) > 200:
            continue
        path = (cache.dir if inside else root) / name
        try:
            path.write_bytes(b"mine")
        except OSError:
            continue
        planted[path] = b"mine"
    cache.sweep()
    cache.prune(set())
    for path in planted:
        kept = path.exists()
        owned = path.parent == cache.dir and (
            (path.name.startswith(TMP_PREFIX) and len(path.name) == len(TMP_PREFIX) + 16
            and all(c in "0123456789abcdef" for c in path.name[len(TMP_PREFIX):]))
            or (path.name[:1].isascii() and path.name[:1].isalnum()
                and all(c.isascii() and (c.isalnum() or c in "._-") for c in path.name))
        )  # fmt: skip
        if kept == owned:
            raise AssertionError(f"{path.name!r} in {path.parent.name}: {'kept' if kept else 'deleted'}")
    return True


def _cache_seeds() -> list[bytes]:
    return [
        b".bashrc\nnotes.txt\nmodel.safetensors\nversion.json",
        b"@.pulsenet-tmp-0123456789abcdef\n@policy__payloads__v000000000000-anchor-0000000000000000.pnp\n@.keep",
        b".pulsenet-tmp-0123456789abcdef\npolicy__payloads__v000000000001-patch-1111111111111111.pnp",
    ]


def _mutate_cache_names(data: bytes, rng: random.Random) -> bytes:
    name = rng.choice(
        [".profile", TMP_PREFIX + rng.randbytes(8).hex(), TMP_PREFIX + "x", "x-" + rng.randbytes(32).hex(), "a" * 250,
         "\u00e9t\u00e9", "-rf", "..x", " "]
    )  # fmt: skip
    return data + b"\n" + (b"@" if rng.random() < 0.5 else b"") + name.encode()


TARGETS: list[dict] = [
    {
        "name": "names.rollout_writer",
        "seeds": _rollout_seeds,
        "decode": _rollout_writer,
        "exact": True,
        "rejects": False,
        "max_cases": 300,
        "equal": lambda out, _seed: out == _rollout_channel()[3],
        "mutators": [_mutate_rollout_names],
    },
    {
        "name": "names.export",
        "seeds": _export_seeds,
        "decode": _export,
        "exact": True,
        "rejects": False,
        "max_cases": 600,
        "equal": lambda out, _seed: out == _sync_channel()[3],
        "mutators": [_mutate_export_names],
    },
    {
        "name": "names.cache",
        "seeds": _cache_seeds,
        "decode": _cache,
        "exact": True,
        "rejects": False,
        "mutators": [_mutate_cache_names],
    },
]
