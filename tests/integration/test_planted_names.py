"""Issue 29 items 7, 8, 9, 11: an object name or a listing is a claim, never a fact.

Anyone who can put an object name in a bucket (a site writer, no key) plants names; a node may let
a listing narrow a search, but only what a trusted key signed decides, and every number in a name is
bounded by what the node knows before it steers anything. Each test plants what the hostile review
planted on main at 7876ec8 and checks the node neither dies, nor waits for good, nor fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.cli.export import export_version
from pulsenet.codec.digest import model_digest
from pulsenet.errors import ConfigError, ManifestError, ObjectNotFound, SignatureError
from pulsenet.nodes.build import compose_inference, compose_trainer
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import BYTE_PAD, bf16_state_dict, build_tiny_model, load_model
from pulsenet.rl.tasks import build_task
from pulsenet.rollouts import (
    Demand,
    RolloutLayout,
    RolloutSource,
    RolloutWriter,
    RolloutWriterConfig,
    batches_to_generate,
)
from pulsenet.rollouts.layout import BatchName
from pulsenet.rollouts.manifest import BatchManifest, now_iso, sign_batch_manifest
from pulsenet.signed import ObjectRef
from pulsenet.signing import generate_keypair, key_id, load_private_key, trusted_keys
from pulsenet.store import LocalStore
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync import Layout, Subscriber, SubscriberConfig
from pulsenet.sync.chain import ManifestReader, PayloadCache
from pulsenet.sync.manifest import Manifest
from pulsenet.sync.publisher import Publisher, PublisherConfig
from tests.support.rollouts import DIGESTS, Site, intake, make_rows, make_sites
from tests.support.store import CountingStore

pytestmark = pytest.mark.timeout(120)
LAYOUT = RolloutLayout()


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)


def _foreign_manifest(site: Site, seq: int, version: int = 1) -> bytes:
    """A well-formed manifest for ``site``'s slot at ``seq``, signed by a key that is not the node's."""
    other = Ed25519PrivateKey.generate()
    m = BatchManifest(
        node=site.node,
        seq=seq,
        version=version,
        model_digest=DIGESTS[version],
        payload=ObjectRef(LAYOUT.batch(version, site.node, seq, "a" * 64), 10, "a" * 64),
        rows=1,
        groups=1,
        tokens=2,
        publisher=key_id(other.public_key()),
        created=now_iso(),
    )
    return sign_batch_manifest(m, other, context=LAYOUT.context("test", site.own.url, site.node))


# --- item 7: the writer's resume point ------------------------------------------------------------


async def test_planted_names_never_set_the_writers_sequence(sites: list[Site]) -> None:
    """Was: ``rollouts/manifests/v000000000000-i0-99999999.json`` made ``start`` continue at 10**8,
    and the first write raised an untyped ValueError: the inference node died at every start."""
    a = sites[0]
    w = a.writer()
    for i in range(2):
        await w.write(make_rows(a.node, 1, seed=i))
    planted = {
        LAYOUT.manifest(0, a.node, 99_999_999): b"junk",  # the reviewer's name
        LAYOUT.manifest(1, a.node, 50): _foreign_manifest(a, 50),  # well formed, another key
        LAYOUT.manifest(1, a.node, 60): (await a.own.get(LAYOUT.manifest(1, a.node, 0), timeout=10)),  # a copy
        LAYOUT.batch(0, a.node, 99_999_999, "0" * 64): b"no manifest will ever name this",
    }
    for k, data in planted.items():
        await a.own.put(k, data, timeout=10)
    restarted = a.writer()
    await restarted.start()
    assert restarted.next_seq == 2
    assert restarted.stats.junk_names == 3
    assert [n.seq for n in restarted.produced] == [0, 1]
    assert (await restarted.write(make_rows(a.node, 1, seed=2))).seq == 2
    # without its head (deleted by a site writer) the node resumes from its verified manifests
    await a.own.delete([LAYOUT.head], timeout=10)
    again = a.writer()
    await again.start()
    assert again.next_seq == 3 and again.stats.junk_names == 3
    # the trainers still take exactly the node's three batches
    ti = intake(sites)
    assert await ti.poll(1) == 3


async def test_the_head_carries_the_sequence_past_retired_batches(sites: list[Site]) -> None:
    """The node's own signed head is a resume point: after retention deleted every batch, a restart
    does not reuse their numbers even though the listing is empty."""
    a = sites[0]
    w = a.writer()
    for i in range(3):
        await w.write(make_rows(a.node, 1, seed=i))
    await w.retain(10)
    assert not await a.own.list(LAYOUT.manifests, timeout=10)
    restarted = a.writer()
    await restarted.start()
    assert restarted.next_seq == 3 and restarted.stats.junk_names == 0


async def test_a_writer_checks_at_most_verify_at_start_names(sites: list[Site]) -> None:
    """A bucket full of planted names costs a bounded number of reads at start (newest first)."""
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 1, seed=0))
    for seq in range(1, 6):
        await a.own.put(LAYOUT.manifest(2, a.node, seq), b"junk", timeout=10)
    capped = RolloutWriter(a.own, a.key, a.node, RolloutWriterConfig(run="test", verify_at_start=3))
    await capped.start()
    assert capped.stats.junk_names == 6  # 3 read and refused, 3 never read
    assert capped.next_seq == 1  # the head still says where the node is


# --- item 8: demand pacing counts only the node's own batches -------------------------------------


def _demand(version: int = 10) -> Demand:
    return Demand(
        trainer="t0",
        version=version,
        max_staleness=2,
        participants=("t0",),
        grants={"inf-a": 32},
        taken={"inf-a": 0},
    )


def test_pacing_ignores_batches_above_the_served_version() -> None:
    """Was: four names at v999999999999 counted as outstanding batches; a grant of 4 batches was
    covered for good and the node waited for demand forever."""
    junk = [BatchName(999_999_999_999, "inf-a", 10**7 + i) for i in range(4)]
    pace = dict(node="inf-a", version=10, rows_per_batch=8)
    assert batches_to_generate([_demand()], produced=junk, **pace) == 4
    real = [BatchName(10, "inf-a", 0), BatchName(9, "inf-a", 1)]
    assert batches_to_generate([_demand()], produced=junk + real, **pace) == 2


async def test_planted_names_are_not_the_nodes_outstanding_batches(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 10, seed=0))
    for seq in range(4):
        await a.own.put(LAYOUT.manifest(999_999_999_999, a.node, 1000 + seq), b"junk", timeout=10)
        await a.own.put(LAYOUT.manifest(10, a.node, 2000 + seq), _foreign_manifest(a, 2000 + seq, 10), timeout=10)
    restarted = a.writer()
    await restarted.start()
    assert restarted.produced == [BatchName(10, a.node, 0)]
    assert restarted.stats.junk_names == 8
    d = _demand()
    assert batches_to_generate([d], node=a.node, version=10, produced=restarted.produced, rows_per_batch=8) == 3
    assert restarted.head is not None and restarted.head.newest_version == 10  # the head says no more either


# --- item 9: export --version latest ---------------------------------------------------------------


def _states(model: torch.nn.Module, n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` BF16 versions of ``model``'s weights, each a few entries away from the last."""
    states = [bf16_state_dict(model)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(n - 1):
        states.append({
            k: (t.float() + (torch.rand(t.shape, generator=gen) < 0.05) * 0.05).to(torch.bfloat16)
            for k, t in states[-1].items()
        })
    return states


async def _publish(store: LocalStore, key: Ed25519PrivateKey, states: list[dict], **kw: object) -> None:
    async with Publisher(store, key, PublisherConfig(anchor_every=10), **kw) as pub:  # type: ignore[arg-type]
        for s in states:
            await pub.publish_now(s)


async def test_export_latest_is_the_newest_version_that_verifies(tmp_path: Path) -> None:
    """Was: ``max(listed names)``; one planted ``v999999999999.json`` made export fail."""
    store = LocalStore(tmp_path / "store")
    key = Ed25519PrivateKey.generate()
    states = _states(build_tiny_model(0), 2)
    await _publish(store, key, states)
    layout = Layout()
    await store.put(layout.manifest(999_999_999_999), b"junk")
    await store.put(layout.manifest(7), await store.get(layout.manifest(0)))  # a genuine copy, misplaced
    trusted = {key_id(key.public_key()): key.public_key()}
    done = await export_version(store, trusted, out=tmp_path / "out", model="tiny")
    assert (done.version, done.digest) == (1, model_digest(states[1]))
    assert model_digest(bf16_state_dict(load_model(tmp_path / "out", dtype=torch.bfloat16))) == done.digest
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(SignatureError, match="4 refused"):  # under another key nothing verifies: said so
        await export_version(store, {key_id(other): other}, out=tmp_path / "x", model="tiny")
    await store.delete([layout.manifest(0), layout.manifest(1)])
    with pytest.raises(ManifestError, match="2 refused"):
        await export_version(store, trusted, out=tmp_path / "y", model="tiny")
    await store.delete([layout.manifest(7), layout.manifest(999_999_999_999)])
    with pytest.raises(ObjectNotFound, match="no published versions"):
        await export_version(store, trusted, out=tmp_path / "z", model="tiny")


# --- papercut: the channel carries its architecture ------------------------------------------------


async def test_export_rebuilds_the_channels_own_architecture_without_model(tmp_path: Path) -> None:
    """Was: without ``--model`` export assumed the tiny model ("model qwen2 (Qwen2Config) does not
    match v0 ..."). Anchors now carry the model's config.json, signed; a channel written before
    still exports with --model, and without it says to pass --model."""
    model = build_tiny_model(0, hidden_size=32, num_layers=1, max_positions=256)  # not the tiny model
    config = {k: v for k, v in json.loads(model.config.to_json_string(use_diff=False)).items() if not k.startswith("_")}
    states = _states(model, 2)
    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    carries = LocalStore(tmp_path / "new")
    await _publish(carries, key, states, model_config=config)
    done = await export_version(carries, trusted, out=tmp_path / "out")
    assert done.digest == model_digest(states[1])
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["hidden_size"], exported["num_hidden_layers"], exported["max_position_embeddings"]) == (32, 1, 256)
    assert model_digest(bf16_state_dict(load_model(tmp_path / "out", dtype=torch.bfloat16))) == done.digest
    assert json.loads((tmp_path / "out" / "pulsenet-export.json").read_text())["model"] == "qwen2 (from the channel)"
    old = LocalStore(tmp_path / "old")  # published before anchors carried the architecture
    await _publish(old, key, states)
    with pytest.raises(ConfigError, match=r"carries no architecture.*pass --model"):
        await export_version(old, trusted, out=tmp_path / "old-out")
    assert not (tmp_path / "old-out").exists()
    src = tmp_path / "src"
    model.save_pretrained(src)
    assert (await export_version(old, trusted, out=tmp_path / "with-model", model=str(src))).digest == done.digest


async def test_a_trainer_node_signs_its_models_architecture_into_its_anchors(tmp_path: Path) -> None:
    """What the trainer node publishes is what ``export`` needs: a non-tiny model's channel exports
    without ``--model``, and no path of the trainer's machine (``_name_or_path``) goes out."""
    model = build_tiny_model(0, hidden_size=32, num_layers=1)
    model.config._name_or_path = "/home/someone/models/secret"
    store = LocalStore(tmp_path / "store")
    key = Ed25519PrivateKey.generate()
    task = build_task("arith", seed=0)
    try:
        node = compose_trainer(
            TrainerConfig(id="t0", state_dir=tmp_path / "t0"),
            store=store,
            key=key,
            sources=[RolloutSource("i0", LocalStore(tmp_path / "i0"), {key_id(key.public_key()): key.public_key()})],
            policy=GRPOInner(GRPOTrainer(model, GRPOConfig(pad_id=BYTE_PAD))),
            task=task,
            text=text_codec("tiny"),
        )
        async with node.publisher as pub:
            await pub.publish_now(bf16_state_dict(model))
    finally:
        task.close()
    signed = (await ManifestReader(store, Layout(store_url=store.url), {key_id(key.public_key()): key.public_key()}).get(0))
    assert signed.model_config is not None and signed.model_config["hidden_size"] == 32
    assert "secret" not in json.dumps(signed.model_config)
    done = await export_version(store, {key_id(key.public_key()): key.public_key()}, out=tmp_path / "out")
    assert done.digest == model_digest(bf16_state_dict(model))


def test_the_architecture_is_optional_and_bounded_in_the_manifest() -> None:
    """Only anchors of a publisher that knows its model carry it: a manifest without it has the
    exact body it had before (the golden vector stays), and a malformed one is refused."""
    golden = json.loads((Path(__file__).parents[1] / "golden" / "sync-manifest.json").read_text())["body"]
    m = Manifest.from_body(golden)
    assert m.model_config is None and m.to_body() == golden
    body = {**golden, "model_config": {"model_type": "qwen2", "hidden_size": 32}}
    assert Manifest.from_body(body).to_body() == body
    for bad in ([1], {"hidden_size": 32}, {"model_type": "x", "pad": "y" * (64 << 10)}):
        with pytest.raises(ManifestError, match="model_config"):
            Manifest.from_body({**golden, "model_config": bad})
    with pytest.raises(ConfigError, match="model_config"):
        Publisher(LocalStore(Path("/nonexistent-never-created")), Ed25519PrivateKey.generate(), model_config={"no": "type"})


# --- item 11: the payload cache deletes only what it wrote -----------------------------------------


async def test_the_payload_cache_deletes_only_what_it_wrote(tmp_path: Path) -> None:
    """Was: ``sweep`` deleted every dotfile and ``prune`` every file of the directory it was given:
    ``--cache ~`` deleted ``.bashrc`` and ``notes.txt``."""
    store = LocalStore(tmp_path / "store")
    key = Ed25519PrivateKey.generate()
    await _publish(store, key, _states(build_tiny_model(0), 1))
    trusted = {key_id(key.public_key()): key.public_key()}
    ref = (await ManifestReader(store, Layout(store_url=store.url), trusted).get(0)).anchor
    assert ref is not None
    home = tmp_path / "home"
    home.mkdir()
    mine = {".bashrc": b"alias ll='ls -l'", "notes.txt": b"notes", ".pulsenet-tmp-0123456789abcdef": b"not the cache's",
            ref.key.replace("/", "__"): b"a file that only looks cached"}  # fmt: skip
    for name, data in mine.items():
        (home / name).write_bytes(data)
    cache = PayloadCache(store, home)
    cache.sweep()
    assert len(await cache.read(ref)) == ref.size
    cache.prune(set())
    assert {n: (home / n).read_bytes() for n in mine} == mine
    assert not cache.path(ref).exists() and cache.path(ref).parent == home / "pulsenet-payloads"
    (home / "dir").mkdir()  # was: IsADirectoryError from prune
    (cache.dir / "dir").mkdir()
    (cache.dir / ".pulsenet-tmp-fedcba9876543210").write_bytes(b"a killed download")
    (cache.dir / ".keep").write_bytes(b"a dotfile the cache did not write")
    cache.sweep()
    cache.prune(set())
    assert sorted(p.name for p in cache.dir.iterdir()) == [".keep", "dir"]
    assert {n: (home / n).read_bytes() for n in mine} == mine and (home / "dir").is_dir()


def test_pull_refuses_a_cache_that_is_or_holds_its_output(tmp_path: Path) -> None:
    """Was: ``pull --out D --cache D`` exited 0 with the verified model deleted from D."""
    store = tmp_path / "store"
    key = tmp_path / "t0.key"
    generate_keypair(key)
    asyncio.run(_publish(LocalStore(store), load_private_key(key), _states(build_tiny_model(0), 1)))
    out = tmp_path / "model"
    base = ["pull", "--store", f"file://{store}", "--trust", f"{key}.pub", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    r = subprocess.run(
        [sys.executable, "-m", "pulsenet", *base], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert r.returncode == 0, r.stderr
    before = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in before
    for cache in (out, tmp_path):  # the output directory itself, a directory that holds it
        r = subprocess.run([sys.executable, "-m", "pulsenet", *base, "--cache", str(cache)], env=env, capture_output=True,
                           text=True, timeout=180, check=False)  # fmt: skip
        assert r.returncode != 0 and "ConfigError" in r.stderr and "--cache" in r.stderr and "--out" in r.stderr, r.stderr
        assert sorted(p.name for p in out.iterdir()) == before
    with pytest.raises(ConfigError, match=r"--cache .* is --out"):
        asyncio.run(export_version(
            LocalStore(store), trusted_keys([f"{key}.pub"]), out=tmp_path / "e", model="tiny", cache_dir=tmp_path / "e"
        ))
    with pytest.raises(ConfigError, match=r"cache_dir .* contains state_dir"):
        asyncio.run(Subscriber(
            LocalStore(store), trusted_keys([f"{key}.pub"]), SubscriberConfig(state_dir=out, cache_dir=tmp_path)
        ).start())


# --- other names that steered: PULSESync retention --------------------------------------------------


async def test_publisher_retention_never_fetches_names_above_its_own_version(tmp_path: Path) -> None:
    """Retention looked for anchors among every listed name: a planted manifest + anchor name pair
    above the publisher's own version was fetched (and refused) at every publish. Only versions the
    publisher itself reached are candidates now."""
    store = CountingStore(tmp_path / "store")
    key = Ed25519PrivateKey.generate()
    states = _states(build_tiny_model(0), 4)
    layout = Layout(store_url=store.url)
    async with Publisher(store, key, PublisherConfig(anchor_every=1, keep_anchors=1)) as pub:
        await pub.publish_now(states[0])
        planted = layout.manifest(500_000)
        await store.put(planted, b"junk")
        await store.put(layout.payload(500_000, "anchor", "0" * 64), b"junk")
        for s in states[1:]:
            await pub.publish_now(s)
    assert planted not in store.read_bytes
    assert sorted(
        v for i in await store.list(layout.manifests) if (v := layout.parse_manifest(i.key)) is not None
    ) == [3, 500_000]


def test_publish_cli_carries_a_model_directorys_architecture(tmp_path: Path) -> None:
    """``pulsenet publish DIR`` signs DIR's config.json into the anchor; ``pulsenet export`` then
    needs no ``--model``."""
    model = build_tiny_model(0, hidden_size=32, num_layers=1)
    model.save_pretrained(tmp_path / "m")
    generate_keypair(tmp_path / "k")
    store = f"file://{tmp_path / 'store'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pulsenet", *args], env=env, capture_output=True, text=True, timeout=180, check=False
        )

    r = cli("publish", str(tmp_path / "m"), "--store", store, "--key", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    r = cli("export", "--store", store, "--trust", str(tmp_path / "k.pub"), "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[1] == model_digest(bf16_state_dict(model))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["hidden_size"] == 32


async def test_names_planted_ahead_of_the_writer_cost_one_listing(sites: list[Site]) -> None:
    """The head says the next sequence number, so manifest keys are predictable: names planted at
    the next numbers used to eat one retry each, and nine of them failed every batch (was:
    ``ConditionFailed`` after ``taken_retries``). The writer now goes past every listed name at once."""
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 1, seed=0))
    for seq in range(1, 41):
        await a.own.put(LAYOUT.manifest(1, a.node, seq), b"junk", timeout=10)
    m = await w.write(make_rows(a.node, 1, seed=1))
    assert m.seq == 41 and w.stats.seq_taken == 1
    assert [n.seq for n in w.produced] == [0, 41]
    ti = intake(sites)
    assert await ti.poll(1) == 2


async def test_an_inference_node_counts_planted_names_in_status(tmp_path: Path) -> None:
    """The names a node's writer refused at start show in ``/status`` and ``/metrics``."""
    key = Ed25519PrivateKey.generate()
    store = LocalStore(tmp_path / "i0")
    for seq in (5, 99_999_999):
        await store.put(LAYOUT.manifest(0, "i0", seq), b"junk")
    task = build_task("arith", seed=0)
    try:
        node = compose_inference(
            InferenceConfig(id="i0", run="test", state_dir=tmp_path / "state"),
            store=store,
            policy_stores=[LocalStore(tmp_path / "t0")],
            trusted={key_id(key.public_key()): key.public_key()},
            key=key,
            task=task,
            text=text_codec("tiny"),
        )
        await node._start_writer()
    finally:
        task.close()
    assert node.writer.next_seq == 0
    assert node.state.to_json()["rejected"] == {"i0": {"planted_name": 2}}
