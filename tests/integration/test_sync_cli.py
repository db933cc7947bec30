"""``pulsenet publish|pull|ls`` against real SeaweedFS, each command in its own process.

Publish from one process, pull from others: a one-shot pull, a ``--follow`` that picks up a new
version, and a pull that meets a tampered payload, exits non-zero and leaves its directory as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pulsenet.checkpoint import Checkpoint, save_state
from pulsenet.codec.digest import model_digest
from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
from pulsenet.rl.models import bf16_state_dict, build_tiny_model, save_model
from pulsenet.rl.tasks import ArithmeticTask
from pulsenet.signing import generate_keypair
from pulsenet.store import S3Store
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync import Layout
from pulsenet.sync.localstate import read_version
from tests.support.store import TEST_BUCKET, unique_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _env(seaweed: SeaweedServer, identity: str, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for line in seaweed.env_lines(identity):
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    env["XDG_CACHE_HOME"] = str(tmp / "xdg")
    return env


def _cli(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsenet", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_publish_pull_follow_and_refuse(
    seaweed: SeaweedServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model = build_tiny_model(0)
    trainer = LocalTrainer(model, LocalTrainerConfig(lr=1e-4))
    task = ArithmeticTask(0)
    save_model(model, tmp_path / "m0")  # an HF directory (FP32: published as BF16)
    digests = [model_digest(bf16_state_dict(model))]
    for k in (1, 2):
        trainer.train_step(task)
        save_state(tmp_path / f"m{k}.safetensors", bf16_state_dict(model))
        digests.append(model_digest(bf16_state_dict(model)))
    key = tmp_path / "publisher.key"
    generate_keypair(key)
    url = f"s3://{TEST_BUCKET}/{unique_prefix(request)}"
    writer, reader = _env(seaweed, "admin", tmp_path), _env(seaweed, "reader", tmp_path)
    pull = ["pull", "--store", url, "--trust", f"{key}.pub"]

    r = _cli(
        ["publish", str(tmp_path / "m0"), "--store", url, "--key", str(key), "--anchor-every", "5"], writer
    )
    assert r.returncode == 0, r.stderr
    assert f"v0 {digests[0]}" in r.stdout

    out = tmp_path / "out"
    r = _cli([*pull, "--out", str(out)], reader)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["v0", digests[0]]
    assert model_digest(Checkpoint(out / "model.safetensors")) == digests[0]

    # The same store and key under another run name (--run, or PULSENET_RUN) verifies nothing.
    r = _cli([*pull, "--out", str(tmp_path / "other-run")], reader | {"PULSENET_RUN": "other"})
    assert r.returncode != 0 and "signed for context" in r.stderr, r.stderr
    assert not (tmp_path / "other-run" / "model.safetensors").exists()

    # --follow picks up a version published by another process, then stops cleanly on SIGTERM.
    followed = tmp_path / "followed"
    follow = subprocess.Popen(
        [sys.executable, "-m", "pulsenet", *pull, "--out", str(followed), "--follow", "--interval", "0.2"],
        env=reader,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline().split() == ["v0", digests[0]]
        r = _cli(["publish", str(tmp_path / "m1.safetensors"), "--store", url, "--key", str(key)], writer)
        assert r.returncode == 0, r.stderr
        line = follow.stdout.readline()  # printed once v1 is on disk (the test timeout bounds the wait)
        assert line.split() == ["v1", digests[1]], line
        assert read_version(followed) == (1, digests[1])
        assert model_digest(Checkpoint(followed / "model.safetensors")) == digests[1]
        assert json.loads((followed / "version.json").read_text())["version"] == 1
        follow.send_signal(signal.SIGTERM)
        assert follow.wait(30) == 0
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()

    # A tampered payload: the pull fails loudly and the directory keeps its v0 weights untouched.
    r = _cli(["publish", str(tmp_path / "m2.safetensors"), "--store", url, "--key", str(key)], writer)
    assert r.returncode == 0, r.stderr
    before = _snapshot(out)
    _tamper_newest_patch(seaweed, url)
    r = _cli([*pull, "--out", str(out)], reader)
    assert r.returncode != 0
    assert "VerificationError" in r.stderr and "v2" in r.stderr, r.stderr
    assert _snapshot(out) == before


def _tamper_newest_patch(seaweed: SeaweedServer, url: str) -> None:
    import asyncio

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    layout = Layout()

    async def go() -> None:
        async with S3Store(bucket, prefix, seaweed.config("admin")) as store:
            keys = [i.key for i in await store.list(layout.payloads) if "-patch-" in i.key]
            newest = max(keys)
            data = bytearray(await store.get(newest))
            data[-10] ^= 0xFF
            await store.put(newest, bytes(data))

    asyncio.run(go())


def test_ls_prints_versions(
    seaweed: SeaweedServer,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ls`` in-process on a channel published in-process (cheap): JSON and the rich table."""
    from pulsenet.cli import main

    key = tmp_path / "k"
    generate_keypair(key)
    model = build_tiny_model(0)
    save_state(tmp_path / "a.safetensors", bf16_state_dict(model))
    save_state(tmp_path / "b.safetensors", bf16_state_dict(build_tiny_model(1)))
    url = f"s3://{TEST_BUCKET}/{unique_prefix(request)}"
    for name, value in (
        line.removeprefix("export ").partition("=")[::2] for line in seaweed.env_lines("admin")
    ):
        monkeypatch.setenv(name, value)
    for f in ("a", "b"):
        assert main(["publish", str(tmp_path / f"{f}.safetensors"), "--store", url, "--key", str(key)]) == 0
    capsys.readouterr()
    assert main(["ls", "--store", url, "--trust", f"{key}.pub", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(v["version"], v["kind"], v["verified"]) for v in doc["versions"]] == [
        (0, "anchor", True),
        (1, "patch", True),
    ]
    assert doc["objects"] == 5 and doc["versions"][1]["ratio"] > 0  # 2 manifests, 2 payloads, the head
    assert doc["head"] == {"version": 1, "time_ms": doc["head"]["time_ms"], "verified": True}
    assert main(["ls", "--store", url]) == 0
    table = capsys.readouterr().out
    assert "anchor" in table and "not checked" in table
