"""Helpers for the PULSELoCo tests: keys, tiny in-process trainers, trainer processes, reading the store."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import StoreUnavailable
from pulsenet.loco import LocoConfig, LocoTrainer, RoundStore
from pulsenet.loco.documents import Manifest, trainer_keys
from pulsenet.loco.layout import LocoLayout
from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig, build_tiny_model
from pulsenet.rl.inner import SupervisedInner, data_seed
from pulsenet.signing import generate_keypair, load_private_key
from pulsenet.store.base import ByteRange, Fetched, ObjectInfo, ObjectStore

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "loco_worker.py"


def make_keys(directory: Path, ids: Sequence[str]) -> tuple[dict[str, Path], list[Path]]:
    """``(id -> private key path, public key paths)``; every trainer trusts every key."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = {}
    for tid in ids:
        keys[tid] = directory / tid
        if not keys[tid].exists():
            generate_keypair(keys[tid])
    return keys, [Path(f"{p}.pub") for p in keys.values()]


def tiny_trainer(
    tid: str,
    store: ObjectStore,
    keys: dict[str, Path],
    pubs: list[Path],
    config: LocoConfig,
    *,
    seed: int = 0,
    lr: float = 1e-3,
    cls: type[LocoTrainer] = LocoTrainer,
    **kwargs: Any,
) -> LocoTrainer:
    """A trainer on the tiny byte-level Qwen2, same init for every id, its own data stream."""
    local = LocalTrainer(
        build_tiny_model(seed),
        LocalTrainerConfig(lr=lr, batch_size=4, seq_len=32, seed=data_seed(seed, tid)),
    )
    task = ArithmeticTask(data_seed(seed, tid))
    return cls(
        tid,
        store,
        load_private_key(keys[tid]),
        trainer_keys(pubs),
        SupervisedInner(local, task),
        config,
        **kwargs,
    )


def forge_payloads(trainer: LocoTrainer, mutate: Callable[[wire.Payload], wire.Payload | None]) -> None:
    """A compromised trainer: the payload it publishes in a round is ``mutate(decoded payload)``
    (unless that returns None), encoded as raw FP32 bits (relative coding needs in-range indices,
    and a forger need not use it anyway). Done at its store, under its own key, so the
    trainer itself then judges the stored bytes exactly as its peers do (``fresh=False``: the
    stored payload stands, as for a restarted trainer whose earlier payload differed)."""
    publish = trainer.rs.publish_payload

    async def forged(round_: int, data: bytes, **kw: Any) -> tuple[Manifest, bool]:
        state = trainer.state
        assert state is not None
        payload = wire.decode(data, state.shapes(), state.theta if trainer.config.sparse else None)
        bad = mutate(payload)
        if bad is None:
            return await publish(round_, data, **kw)
        manifest, _ = await publish(round_, wire.encode(bad), **kw)
        return manifest, False

    trainer.rs.publish_payload = forged  # type: ignore[method-assign]


def eval_loss(trainer: LocoTrainer, batches: int = 4) -> float:
    """Loss of the trainer's global weights on held-out batches (a data seed no trainer uses).

    BF16 autocast, like the trainers' forward: PULSELoCo withholds exactly the updates a BF16
    forward cannot see, so that is the view in which it must match DiLoCo.
    """
    from pulsenet.rl.local import causal_lm_loss

    model = trainer.inner.local.model  # type: ignore[attr-defined]
    held_out = ArithmeticTask(10_007)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.inner.load_state_fp32(trainer.state.theta)  # type: ignore[union-attr]
    total = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for step in range(batches):
            ids, labels = held_out.batch(16, 32, step=step)
            total += float(causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels))
    trainer.inner.load_state_fp32(saved)
    return total / batches


async def published_digests(rs: RoundStore, ids: Sequence[str], rounds: range) -> dict[int, dict[str, str]]:
    """``round -> {trainer: digest}`` for every digest document present in the store."""
    out: dict[int, dict[str, str]] = {}
    for r in rounds:
        out[r] = {}
        for tid in ids:
            if await rs.store.exists(LocoLayout().digest(tid, r)):
                d = await rs.read_digest(tid, r)
                assert d is not None
                out[r][tid] = d
    return out


def trainer_args(
    store_url: str,
    tid: str,
    keys: dict[str, Path],
    pubs: list[Path],
    state_dir: Path,
    *,
    workers: int,
    rounds: int,
    report: Path,
    extra: Sequence[str] = (),
) -> list[str]:
    """``pulsenet loco train`` arguments for a fast tiny-model run (the worker script takes the same)."""
    return [
        "--store", store_url, "--id", tid, "--key", str(keys[tid]), "--trust", *map(str, pubs),
        "--workers-expected", str(workers), "--min-quorum", "2", "--H", "4", "--rounds", str(rounds),
        "--model", "tiny", "--batch", "4", "--seq", "32", "--threads", "1",
        "--state-dir", str(state_dir), "--poll", "0.1", "--digest-wait", "4", "--state-every", "3",
        "--checkpoint-every", "2", "--join-wait", "60", "--store-timeout", "20",
        "--transfer-timeout", "60", "--report", str(report), *extra,
    ]  # fmt: skip


def spawn(
    argv: Sequence[str], env: dict[str, str], log: Path, *, worker: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``pulsenet -v loco train ARGV`` (or the fault-injecting worker script) with output to ``log``."""
    cmd = (
        [sys.executable, str(WORKER), *argv]
        if worker
        else [sys.executable, "-m", "pulsenet", "-v", "loco", "train", *argv]
    )
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, cwd=REPO, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )


class FlakyStore(ObjectStore):
    """A real store (LocalStore or S3Store) seen through a link that fails on demand: while
    ``fail(op, key)`` is true a call raises StoreUnavailable (what the S3 client raises once a
    refused or reset connection has used up its retries), without reaching the store. Same URL as
    the store it wraps, so documents signed through it verify through the store itself."""

    def __init__(self, inner: ObjectStore, fail: Callable[[str, str], bool] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.fail: Callable[[str, str], bool] = fail or (lambda op, key: False)
        self.failed = 0
        """Calls refused so far."""

    @property
    def url(self) -> str:
        return self.inner.url

    def _check(self, op: str, key: str) -> None:
        if self.fail(op, key):
            self.failed += 1
            e = StoreUnavailable(f"injected: {op} {key!r}: connection refused")
            self.health.failed(e)
            raise e

    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        self._check("put", key)
        await self.inner.put(key, data, if_none_match=if_none_match)

    async def _put_file(self, key: str, path: str, if_none_match: bool) -> int:
        self._check("put", key)
        return await self.inner.put_file(key, path, if_none_match=if_none_match)

    async def _get(self, key: str, byte_range: ByteRange | None, max_bytes: int | None) -> bytes:
        self._check("get", key)
        return await self.inner.get(key, byte_range=byte_range, max_bytes=max_bytes)

    async def _get_if_changed(self, key: str, etag: str | None, max_bytes: int | None) -> Fetched | None:
        self._check("get", key)
        return await self.inner.get_if_changed(key, etag, max_bytes=max_bytes)

    async def _get_file(self, key: str, path: str, max_bytes: int | None) -> int:
        self._check("get", key)
        return await self.inner.get_file(key, path, max_bytes=max_bytes)

    async def _head(self, key: str) -> ObjectInfo:
        self._check("head", key)
        return await self.inner.head(key)

    async def _list(self, prefix: str) -> builtins.list[ObjectInfo]:
        self._check("list", prefix)
        return await self.inner.list(prefix)

    async def _delete(self, keys: builtins.list[str]) -> None:
        self._check("delete", keys[0])
        await self.inner.delete(keys)
