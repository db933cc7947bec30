"""``pulsenet export`` against real SeaweedFS: a verified version becomes a Hugging Face directory that
``from_pretrained`` loads with the published digest; a wrong key or a tampered payload writes nothing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pulsenet.cli.export import export_version
from pulsenet.codec.digest import model_digest
from pulsenet.errors import ConfigError, SignatureError
from pulsenet.rl.models import bf16_state_dict, load_model
from pulsenet.signing import generate_keypair, load_private_key, trusted_keys
from pulsenet.store import S3Store
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync import Layout
from pulsenet.sync.publisher import Publisher, PublisherConfig
from tests.support.model_dirs import llama_dir
from tests.support.store import TEST_BUCKET, unique_prefix

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _env(seaweed: SeaweedServer, identity: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for line in seaweed.env_lines(identity):
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = value
    return env


def _export(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pulsenet", "export", *args], env=env, capture_output=True, text=True, timeout=180, check=False
    )


def test_export_writes_a_loadable_verified_directory(
    seaweed: SeaweedServer, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    src = llama_dir(tmp_path / "src")
    states = [bf16_state_dict(load_model(src))]
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # two RL-sized steps: a few entries of every tensor move
        states.append({
            n: (t.float() + (torch.rand(t.shape, generator=gen) < 0.05) * 0.05).to(torch.bfloat16)
            for n, t in states[-1].items()
        })
    digests = [model_digest(s) for s in states]
    key = tmp_path / "t0.key"
    generate_keypair(key)
    other = tmp_path / "other.key"
    generate_keypair(other)
    prefix = unique_prefix(request)
    url = f"s3://{TEST_BUCKET}/{prefix}"

    async def publish() -> None:
        async with S3Store(TEST_BUCKET, prefix, seaweed.config("admin")) as store:
            pub = Publisher(store, load_private_key(key), PublisherConfig(anchor_every=10))
            await pub.resume()
            for s in states:
                await pub.publish_now(s)

    asyncio.run(publish())
    env = _env(seaweed, "reader")
    base = ["--store", url, "--trust", f"{key}.pub", "--model", str(src)]

    out = tmp_path / "exported"
    r = _export([*base, "--out", str(out)], env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["v2", digests[2], str(out)]
    loaded = load_model(out, dtype=torch.bfloat16)
    assert model_digest(bf16_state_dict(loaded)) == digests[2]  # tied lm_head re-tied by from_pretrained
    assert {"config.json", "model.safetensors", "tokenizer.json", "pulsenet-export.json"} <= {p.name for p in out.iterdir()}
    assert loaded(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == loaded.config.vocab_size

    async def export(out: Path, *, trust: Path = key, **kw: object) -> object:  # the command's own function
        async with S3Store(TEST_BUCKET, prefix, seaweed.config("reader")) as store:
            return await export_version(store, trusted_keys([f"{trust}.pub"]), out=out, **{"model": str(src), **kw})  # type: ignore[arg-type]

    done = asyncio.run(export(tmp_path / "v1", version=1))
    assert (done.version, done.digest) == (1, digests[1])  # type: ignore[attr-defined]
    assert model_digest(bf16_state_dict(load_model(tmp_path / "v1", dtype=torch.bfloat16))) == digests[1]
    with pytest.raises(ConfigError, match="not an empty directory"):  # never over an existing directory
        asyncio.run(export(out))
    with pytest.raises(SignatureError):
        asyncio.run(export(tmp_path / "wrong", trust=other))
    assert not (tmp_path / "wrong").exists()
    with pytest.raises(ConfigError, match="does not match v0"):
        asyncio.run(export(tmp_path / "t", model="tiny", version=0))
    assert not (tmp_path / "t").exists()

    _tamper_newest_patch(seaweed, prefix)
    r = _export([*base, "--out", str(tmp_path / "tampered")], env)
    assert r.returncode != 0 and "VerificationError" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if "tampered" in p.name) == []  # no temp left either


def _tamper_newest_patch(seaweed: SeaweedServer, prefix: str) -> None:
    async def go() -> None:
        async with S3Store(TEST_BUCKET, prefix, seaweed.config("admin")) as store:
            keys = [i.key for i in await store.list(Layout().payloads) if "-patch-" in i.key]
            newest = max(keys)
            data = bytearray(await store.get(newest))
            data[-10] ^= 0xFF
            await store.put(newest, bytes(data))

    asyncio.run(go())
