"""``pulsenet trainer`` as a 2-rank FSDP2 site under real ``torchrun`` (CPU, gloo) against the
embedded SeaweedFS: rank 0 is the whole trainer node, rank 1 only takes its share of every GRPO
step and holds half of the model.

The rollouts are fixed batches signed with the rollouts writer, so the single-process reference
(``GRPOTrainer`` with ``DataParallel(reference_world=2)``: both half-batch gradients in rank order,
summed, the clipping norm taken chunk by chunk) steps on exactly what the site consumed; with 2
ranks the reduce-scatter is one commutative FP32 addition, so every published model digest must
equal the reference's to the bit.

Checked: the single-trainer mode (a version per data-parallel GRPO step), a SIGTERM to torchrun
(both ranks exit, none is left behind), a restart that resumes from rank 0's checkpoint (rank 1 gets
the optimizer state: the later versions still equal the reference), rank 0 finishing its steps
(exit 0); and the PULSELoCo mode (H data-parallel GRPO steps a round with micro-batches and a
binding clip, rank 1 loading the outer step's θ by broadcast, a SIGTERM in round 2 and a resume)
against ``LocoTrainer`` over the same reference site. Only CPU and gloo were run here (no GPU, no
NCCL).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.codec.rollout import Rollout
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.loco.persist import STATE_FILE
from pulsenet.loco.state import TrainerState
from pulsenet.nodes.common import initial_model, text_codec
from pulsenet.rl.distributed import GroupGRPOInner, RankGroup
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.models import BYTE_EOS
from pulsenet.rl.tasks import assign_problems, build_task, group_id
from pulsenet.rollouts import RolloutWriter, RolloutWriterConfig
from pulsenet.signing import generate_keypair, load_private_key, trusted_keys
from pulsenet.store import LocalStore, S3Store
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync.layout import Layout
from pulsenet.sync.manifest import verify_manifest

REPO = Path(__file__).resolve().parents[2]
BUCKET = "pulsenet-test"
RUN = "site"
WARMUP = 5
ROWS = 8
"""Rows per batch and per step (rows-per-step): 2 groups of 4 completions."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The reference runs in this process with the ranks' thread count (bits depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batches(n: int, seed: int = 3) -> list[list[dict[str, Any]]]:
    """``n`` fixed batches of completions; ``_rows`` makes them batch ``b``'s answers at a version
    (the trainer checks the whole batch, issue 38: group ids, prompts, G = 4 rows a group), each
    completion ended by EOS as an engine ends it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for b in range(n):
        rows = []
        for k in range(2):
            for i in range(4):
                length = 2 + (i + k + b) % 4  # at most the shipped max-new-tokens, 5
                ids = (*(int(x) for x in torch.randint(32, 127, (length - 1,), generator=g)), BYTE_EOS)
                logprobs = tuple(-0.25 * int(x) for x in torch.randint(2, 12, (length,), generator=g))
                rows.append(dict(batch=b, problem=k, completion_ids=ids, logprobs=logprobs,
                                 reward=float((i * 7 + k + b) % 3 == 0), seed=i))  # fmt: skip
        out.append(rows)
    return out


def _rows(batch: list[dict[str, Any]], version: int, digest: str) -> list[Rollout]:
    """``batch`` as node i0's answer of its batch number at ``version``: the assigned problems' prompts."""
    task = build_task("arith", seed=0)
    prompter = task.prompter(text_codec("tiny"))
    out = []
    for r in batch:
        b, k = r["batch"], r["problem"]
        problem = assign_problems(task, node="i0", version=version, seed=0, n=2, batch=b)[k]
        rest = {x: v for x, v in r.items() if x not in ("batch", "problem")}
        out.append(Rollout(**rest, group=group_id("i0", version, b, k), prompt_ids=tuple(prompter.ids(problem.prompt)),
                           version=version, model_digest=digest, node="i0"))  # fmt: skip
    task.close()
    return out


class Site2:
    """Keys, stores and the torchrun command of one test (its own key prefixes)."""

    def __init__(self, server: SeaweedServer, tmp: Path, **env: str) -> None:
        self.server, self.tmp = server, tmp
        self.prefix = f"site-{uuid.uuid4().hex[:8]}"
        (tmp / "keys").mkdir()
        for name in ("t0", "i0"):
            generate_keypair(tmp / "keys" / f"{name}.key")
        self.port = _free_port()
        self.extra = env
        self.log = tmp / "site.log"

    def url(self, name: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}-{name}"

    def store(self, name: str) -> S3Store:
        return S3Store(BUCKET, f"{self.prefix}-{name}", self.server.config("admin"))

    def env(self) -> dict[str, str]:
        ident = self.server.identities["admin"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))}
        return env | {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "AWS_ENDPOINT_URL": self.server.endpoint_url,
            "AWS_ACCESS_KEY_ID": ident.access_key,
            "AWS_SECRET_ACCESS_KEY": ident.secret_key,
            "AWS_REGION": self.server.region,
            "PULSENET_ID": "t0",
            "PULSENET_RUN": RUN,
            "PULSENET_STORE": self.url("t0"),
            "PULSENET_KEY": "keys/t0.key",
            "PULSENET_INFERENCE": f"i0={self.url('i0')}",
            "PULSENET_TRUST_INFERENCE": "i0=keys/i0.key.pub",
            "PULSENET_STATE_DIR": "state/t0",
            "PULSENET_STATUS_PORT": str(self.port),
            "PULSENET_CACHE_DIR": str(self.tmp / "cache"),
            # The batches are fixed rows written by hand (the reference step needs them fixed), not
            # the policy's draw: the replay check (rl/replay.py) would refuse them.
            "PULSENET_REPLAY__ENABLED": "false",
            "PYTHONFAULTHANDLER": "1",  # a rank that dies of a signal (a SIGSEGV seen once) leaves its stack
            "PULSENET_WARMUP_STEPS": str(WARMUP),
            "PULSENET_ROWS_PER_STEP": str(ROWS),
            "PULSENET_CONSUMER_POLL_S": "1",
            "PULSENET_LOCO_STORE": "",  # a lone site: the shipped config is t0 of a PULSELoCo pair
            "PULSENET_RESCORE": "false",  # the rows are the test's own, not drawn from the task: train on them as they are
            "PULSENET_PROMPTS_PER_BATCH": "2",  # what ``_batches`` answer: 2 problems of G = 4 rows
            "PULSENET_INTAKE__GROUP_SIZE": "4",
        } | self.extra

    def start(self) -> subprocess.Popen[bytes]:
        """``torchrun --nproc-per-node 2 -m pulsenet trainer --config configs/trainer.toml``."""
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
            "-m", "pulsenet", "-v", "--log-format", "json", "trainer", "--config", str(REPO / "configs" / "trainer.toml"),
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            return subprocess.Popen(cmd, cwd=self.tmp, env=self.env(), stdout=log, stderr=subprocess.STDOUT)

    async def sigterm_at(self, version: int) -> None:
        """Start the site, wait until it has published ``version``, SIGTERM torchrun (it passes the
        signal on: rank 0 stops cleanly and releases rank 1), and check that no rank is left."""
        proc = self.start()
        try:
            deadline = time.monotonic() + 120
            while self.version() < version:
                assert proc.poll() is None, self.tail()
                assert time.monotonic() < deadline, self.tail()
                await asyncio.sleep(0.3)
            ranks = _children(proc.pid)
            assert len(ranks) == 2, ranks
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            assert not [p for p in ranks if _alive(p)], f"left behind: {ranks}\n{self.tail()}"
        finally:
            if proc.poll() is None:
                proc.kill()

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def version(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=5) as r:
                v = json.loads(r.read())["version"]
        except OSError:
            return -1
        return -1 if v is None else int(v)

    async def write(self, batches: Sequence[list[Rollout]]) -> None:
        async with self.store("i0") as store:
            writer = RolloutWriter(store, load_private_key(self.tmp / "keys" / "i0.key"), "i0", RolloutWriterConfig(run=RUN))
            for rows in batches:
                await writer.write(rows)

    async def published(self) -> dict[int, str]:
        """version -> model digest of every manifest in t0's channel, verified."""
        trusted = trusted_keys([self.tmp / "keys" / "t0.key.pub"])
        async with self.store("t0") as store:
            layout = Layout(channel="policy", run=RUN, store_url=store.url)
            out = {}
            for info in await store.list(layout.manifests):
                m = verify_manifest(await store.get(info.key), trusted, context=layout.context)
                out[m.version] = m.model_digest
            return out


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _grpo(cache: Path, **grpo: Any) -> GRPOTrainer:
    """The trainer node's GRPOTrainer: the warmed-up tiny model (cached), configs/trainer.toml's lr."""
    model = initial_model("tiny", cache, seed=0, warmup_steps=WARMUP)
    return GRPOTrainer(model, GRPOConfig(lr=_shipped()["grpo"]["lr"], pad_id=text_codec("tiny").pad_id, **grpo))


def _shipped() -> dict[str, Any]:
    """configs/trainer.toml's [trainer] table: what the site runs unless the test's env says otherwise."""
    return tomllib.loads((REPO / "configs" / "trainer.toml").read_text())["trainer"]


def _bf16_digest(grpo: GRPOTrainer) -> str:
    return model_digest(grpo.bf16_state())


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_torchrun_trainer_publishes_the_reference_versions_survives_sigterm_and_resumes(
    seaweed: SeaweedServer, tmp_path: Path, one_thread: None
) -> None:
    # max staleness 4: phase 1's batches (served by v0) are still fresh at v3, so only the record of
    # consumed batches in rank 0's checkpoint keeps the restarted site from training on them again
    site = Site2(seaweed, tmp_path, PULSENET_STEPS="5", PULSENET_INTAKE__MAX_STALENESS="4")
    batches = _batches(5)
    # The reference: one process, both ranks' half-batch gradients summed in rank order.
    ref = _grpo(tmp_path / "cache")  # also fills the warm-up cache the ranks load
    ref_site = RankGroup(grpo=ref, reference_world=2)
    want = [_bf16_digest(ref)]
    for rows in batches[:3]:
        ref_site.grpo_step(_rows(rows, 0, want[0]))
        want.append(_bf16_digest(ref))
    for rows in batches[3:]:  # phase 2's batches were served by v3
        ref_site.grpo_step(_rows(rows, 3, want[3]))
        want.append(_bf16_digest(ref))
    assert len(set(want)) == 6, "every step moved the weights"

    # Phase 1: three batches served by v0; the site publishes v1..v3, then waits for more.
    await site.write([_rows(b, 0, want[0]) for b in batches[:3]])
    t0 = time.monotonic()
    await site.sigterm_at(3)
    phase1_s = time.monotonic() - t0
    published = await site.published()
    assert {v: published[v] for v in range(4)} == dict(enumerate(want[:4])), site.tail()
    logs = site.log.read_text()
    assert "speaks for a rank group of 2 (gloo)" in logs and "rank 1 of 2 (gloo)" in logs
    assert "rank 1 released by rank 0" in logs, site.tail()  # not killed: told to stop

    # Phase 2: the same command resumes from rank 0's checkpoint (v3) and hands it to rank 1; two
    # more batches (served by v3) make v4 and v5, and the job ends with rank 0's last step.
    await site.write([_rows(b, 3, want[3]) for b in batches[3:]])
    proc = site.start()
    try:
        assert proc.wait(120) == 0, site.tail()
    finally:
        if proc.poll() is None:
            proc.kill()
    published = await site.published()
    assert published == dict(enumerate(want)), site.tail()
    # The BF16 digests above, and the FP32 master weights too: rank 0's last checkpoint.
    ckpt = torch.load(tmp_path / "state" / "t0" / "trainer.pt", weights_only=False)
    assert ckpt["version"] == 5 and ckpt["local"]["steps"] == 5
    assert model_digest(ckpt["local"]["weights"]) == model_digest(ref.local.state_fp32())
    print(f"phase 1 (3 steps, SIGTERM) {phase1_s:.1f} s; total {time.monotonic() - t0:.1f} s")


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_torchrun_trainer_runs_pulseloco_rounds_like_one_process(
    seaweed: SeaweedServer, tmp_path: Path, one_thread: None
) -> None:
    rounds, inner = 2, 2
    # micro-batches (each rank's 4 rows in 2 passes, one reduce-scatter) and a clipping norm that
    # binds: both must give the reference's bits under FSDP2
    clip, micro = 1e-3, 2
    site = Site2(seaweed, tmp_path, PULSENET_STEPS=str(rounds), PULSENET_LOCO__INNER_STEPS=str(inner),
                 PULSENET_PEERS="t0=keys/t0.key.pub", PULSENET_LOCO__DEADLINE_S="60",
                 PULSENET_GRPO__GRAD_CLIP=str(clip), PULSENET_GRPO__MICRO_BATCH_SIZE=str(micro))  # fmt: skip
    site.extra["PULSENET_LOCO_STORE"] = site.url("loco")
    batches = _batches(rounds * inner, seed=4)

    # The reference: LocoTrainer t0 over a LocalStore, its inner loop the 2-share reference site.
    ref = _grpo(tmp_path / "cache", grad_clip=clip, micro_batch_size=micro)
    v0 = _bf16_digest(ref)
    feed = iter([_rows(b, 0, v0) for b in batches])
    want = {0: v0}

    key = tmp_path / "keys" / "t0.key"
    outer = {"outer_lr": _shipped()["loco"]["outer-lr"], "outer_momentum": _shipped()["loco"]["outer-momentum"]}  # as the site
    config = LocoConfig(run=RUN, inner_steps=inner, workers_expected=1, min_quorum=None, deadline_s=60.0, **outer)
    policy = GroupGRPOInner(RankGroup(grpo=ref, reference_world=2))
    reference = LocoTrainer(
        "t0", LocalStore(tmp_path / "ref-store"), load_private_key(key), trainer_keys([f"t0={key}.pub"]),
        policy, config,
    )  # fmt: skip
    norms: list[float | None] = []

    async def inner_phase(r: int) -> list[float]:  # the node's loop: H steps on the batches it takes
        metrics = [policy.step(next(feed)) for _ in range(inner)]
        norms.extend(m.grad_norm for m in metrics)
        policy.end_phase()
        return [m.loss for m in metrics]

    async with reference.session():
        while reference.round < rounds:
            report = await reference.next_round(inner_phase)
            assert report is not None
            want[report.round] = _bf16_digest(ref)
    assert len(set(want.values())) == rounds + 1
    assert len(norms) == rounds * inner and all(n is not None and n > clip for n in norms), norms

    # Phase 1: round 1's batches only; once v1 is out the site waits in round 2's inner phase, and
    # a SIGTERM to torchrun abandons that round (both ranks exit).
    await site.write([_rows(b, 0, v0) for b in batches[:inner]])
    t0 = time.monotonic()
    await site.sigterm_at(1)
    assert await site.published() == {v: want[v] for v in range(2)}, site.tail()
    # Phase 2: the same command resumes from rank 0's PULSELoCo resume point (θ_1, the inner
    # optimizer and RNG, loaded into both ranks' shards) and redoes round 2 on its batches.
    await site.write([_rows(b, 0, v0) for b in batches[inner:]])
    proc = site.start()
    try:
        assert proc.wait(150) == 0, site.tail()  # rank 0 finished its rounds; rank 1 released
        assert "rank 1 released by rank 0" in site.log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert await site.published() == want, site.tail()
    # The agreed FP32 global state too (rank 0's resume point), not only its BF16 view.
    state = TrainerState.load(tmp_path / "state" / "t0" / "loco" / STATE_FILE)
    assert state.global_.round == rounds and state.global_.digest() == reference.digest
    print(f"site: {rounds} rounds of H={inner}, a SIGTERM and a restart in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("micro_batch_size", [None, 3])
def test_reference_shares_sum_to_the_plain_step(micro_batch_size: int | None, one_thread: None) -> None:
    """The share loop without torchrun: one share is the plain step to the bit (weights and
    metrics), and a share with no rows (a 1-row batch over 2 shares) adds nothing."""
    from pulsenet.rl import build_tiny_model
    from pulsenet.rl.parallel import DataParallel

    def step(rows: int, world: int | None) -> tuple[str, dict[str, Any]]:
        grpo = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, micro_batch_size=micro_batch_size))
        if world is not None:
            grpo.parallel = DataParallel(reference_world=world)
        m = grpo.step(_rows(_batches(1)[0][:rows], 0, "d"))
        return model_digest(grpo.local.state_fp32()), m.as_dict()

    assert step(ROWS, 1) == step(ROWS, None)
    assert step(1, 2) == step(1, None)
