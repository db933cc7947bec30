"""A 2-rank site on CPU (gloo): data-parallel inner steps and a PULSELoCo round spoken for by rank 0,
bit-equal to the single-process reference (``GroupInner(reference_world=2)``, see pulsenet/rl/distributed.py).

The ranks are this file run by ``torchrun`` (``torchrun --nproc-per-node 2 tests/integration/test_distributed.py
MODE OUT``), the launch path of a real site. Only CPU and gloo were tested here (no GPU, no NCCL).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.rl import ArithmeticTask, LocalTrainer, LocalTrainerConfig, build_tiny_model, sharding
from pulsenet.rl.distributed import BatchOf, GroupInner, serve_rank
from pulsenet.signing import generate_keypair, load_private_key
from pulsenet.store import LocalStore

WORLD = 2
STEPS = 3
ROUNDS = 2



def task_batches(task: Any, batch_size: int, seq_len: int) -> BatchOf:
    """The supervised data stream of the rank group: ``task.batch`` at the step counter."""
    return lambda step: task.batch(batch_size, seq_len, step=step)

def _local() -> tuple[LocalTrainer, object]:
    # grad_clip small enough to bind at every step: the clipping norm must be the same bits too
    config = LocalTrainerConfig(lr=1e-3, batch_size=4, seq_len=32, forward="bf16-weights", seed=5, grad_clip=1e-3)
    local = LocalTrainer(build_tiny_model(0), config)
    return local, task_batches(ArithmeticTask(11), config.batch_size, config.seq_len)


def _loco_config() -> LocoConfig:
    return LocoConfig(
        inner_steps=2, workers_expected=1, min_quorum=1, poll_s=0.05, join_wait_s=5.0,
        deadline_s=5.0, digest_wait_s=1.0, state_every=100, checkpoint_every=0,
    )  # fmt: skip


def _digests(local: LocalTrainer) -> dict[str, str]:
    return {"fp32": model_digest(local.state_fp32()), "bf16": model_digest(local.bf16_state())}


def _run_round(inner: GroupInner, out: Path) -> str:
    """One site ("site") over a LocalStore under ``out``: ROUNDS rounds; the agreed global digest."""
    key = out / "keys" / "site"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True)
        generate_keypair(key)
    store = LocalStore(out / "store")
    trainer = LocoTrainer(
        "site", store, load_private_key(key), trainer_keys([f"{key}.pub"]), inner, _loco_config()
    )
    asyncio.run(trainer.run(ROUNDS))
    return trainer.digest


def _rank_main(mode: str, out: Path) -> None:
    """One rank of the site (run by the test as a subprocess)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local, batch_of = _local()
    result: dict[str, object] = {"total_elements": sum(p.numel() for p in local.model.parameters())}
    try:
        if rank != 0:
            serve_rank(local, batch_of)  # type: ignore[arg-type]
        else:
            inner = GroupInner(local, batch_of)  # type: ignore[arg-type]
            try:
                if mode == "steps":
                    # a read of the whole sharded model that bypasses the site raises (alone, rank 0
                    # would wait forever for rank 1, which waits for a command)
                    try:
                        local.state_fp32()
                    except RuntimeError as e:
                        result["guard"] = str(e)
                    # STEPS steps, with a detour: a restart's restore must reach every rank
                    # (optimizer, step counter), or rank 1 would train on the wrong rows after it
                    losses = inner.train(STEPS - 1)
                    saved, weights = inner.checkpoint(), inner.state_fp32()
                    inner.train(1)
                    inner.restore(saved)
                    inner.load_state_fp32(weights)
                    result["losses"] = losses + inner.train(1)
                else:
                    result["global"] = _run_round(inner, out)
            finally:
                inner.stop()
        # what this rank holds of the trained model: its FSDP2 chunks only
        result["sharded"] = local.sharded
        result["shard_elements"] = sum(sharding.local(p).numel() for p in local.model.parameters())
        result.update(_digests(local))  # a gather: both ranks take part
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _why_ranks_failed(log: str) -> str:
    """What a failed site says about its cause, first (a long traceback would push it out of CI's tail):
    torchrun's root-cause block (a rank's exit code; -9 is a kill) and each rank's last error line."""
    lines = log.splitlines()
    cause = [i for i, line in enumerate(lines) if "Root Cause" in line]
    errors = {}
    for line in lines:
        rank, _, text = line.partition("]: ")
        if rank.startswith("[rank") and text[:1].isalpha() and not text.startswith(("Traceback", "File ")):
            errors[rank + "]"] = text  # the last such line of each rank: its exception
    summary = lines[cause[0] : cause[0] + 12] if cause else lines[-12:]
    return "\n".join([*summary, *(f"{r}: {t}" for r, t in errors.items())])


def _run_site(mode: str, out: Path) -> list[dict[str, object]]:
    """The site as a real one starts: ``torchrun`` (static rendezvous on 127.0.0.1) and WORLD ranks."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), __file__, mode, str(out),
    ]  # fmt: skip
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, timeout=120, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"torchrun exited {done.returncode}:\n{_why_ranks_failed(done.stdout + done.stderr)}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """The reference runs in this process with the ranks' thread count (bits depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(120)
def test_two_rank_steps_equal_the_single_process_reference(tmp_path: Path, one_thread: None) -> None:
    ranks = _run_site("steps", tmp_path)
    local, batch_of = _local()
    losses = GroupInner(local, batch_of, reference_world=WORLD).train(STEPS)  # type: ignore[arg-type]
    want = _digests(local)
    assert ranks[0]["losses"] == losses
    for r in ranks:
        assert {"fp32": r["fp32"], "bf16": r["bf16"]} == want
    assert want != _digests(_local()[0])  # the steps moved the weights
    assert "through its rl.distributed.RankGroup" in str(ranks[0].get("guard"))
    # FSDP2: each rank held its chunk of every parameter, not the whole model
    assert all(r["sharded"] for r in ranks)
    assert sum(r["shard_elements"] for r in ranks) == ranks[0]["total_elements"]  # type: ignore[misc]
    assert max(r["shard_elements"] for r in ranks) < 0.6 * ranks[0]["total_elements"]  # type: ignore[operator]


@pytest.mark.timeout(120)
def test_two_rank_site_runs_pulseloco_rounds_like_one_process(tmp_path: Path, one_thread: None) -> None:
    ranks = _run_site("loco", tmp_path / "site")
    local, batch_of = _local()
    inner = GroupInner(local, batch_of, reference_world=WORLD)  # type: ignore[arg-type]
    assert ranks[0]["global"] == _run_round(inner, tmp_path / "reference")
    want = _digests(local)
    for r in ranks:  # rank 1 got the outer step's θ by broadcast
        assert {"fp32": r["fp32"], "bf16": r["bf16"]} == want


if __name__ == "__main__":
    from pulsenet.rl.distributed import exit_rank

    _rank_main(sys.argv[1], Path(sys.argv[2]))
    exit_rank(0)  # as pulsenet's own ranks end: no interpreter finalization with gloo threads alive
