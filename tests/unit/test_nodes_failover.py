"""Losing a trainer never stalls inference: three trainers run PULSELoCo rounds with GRPO inner
loops and each publishes every version on its own channel; the inference node follows t0's channel
until t0 dies, then fails over to a channel whose signed head announces a newer version and keeps
serving verified versions to the end."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from pulsenet.loco import LocoConfig
from pulsenet.nodes.build import compose_inference, compose_trainer
from pulsenet.nodes.common import initial_model, text_codec
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.tasks import TaskConfig, build_task
from pulsenet.rollouts import RolloutSource
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import PublisherConfig
from pulsenet.sync.subscriber import SubscriberConfig
from tests.support.waiting import wait_until

TRAINERS = ("t0", "t1", "t2")
STEPS = 6


@pytest.mark.timeout(280)
async def test_inference_keeps_receiving_versions_when_the_followed_trainer_dies(tmp_path: Path) -> None:
    keys = {}
    for site in (*TRAINERS, "i0"):
        generate_keypair(tmp_path / "keys" / f"{site}.key")
        keys[site] = (load_private_key(tmp_path / "keys" / f"{site}.key"), load_public_key(tmp_path / "keys" / f"{site}.key.pub"))

    def store(site: str) -> LocalStore:
        return LocalStore(tmp_path / "s3" / site)

    text = text_codec("tiny")
    trainers = [
        compose_trainer(
            TrainerConfig(
                id=t,
                run="failover",
                steps=STEPS,
                rows_per_step=16,
                loco=LocoConfig(inner_steps=1, min_quorum=2, deadline_s=4.0),
                publish=PublisherConfig(anchor_every=100),
                state_dir=tmp_path / t,
                peers=[f"{p}={tmp_path / 'keys' / f'{p}.key.pub'}" for p in TRAINERS],
                grpo=GRPOConfig(lr=5e-4, pad_id=text.pad_id),
            ),
            store=store(t),
            key=keys[t][0],
            sources=[RolloutSource("i0", store("i0"), {key_id(keys["i0"][1]): keys["i0"][1]})],
            policy=GRPOInner(GRPOTrainer(
                initial_model("tiny", tmp_path / "cache", warmup_steps=20), GRPOConfig(lr=5e-4, pad_id=text.pad_id)
            )),
            task=build_task("arith", seed=0),
            text=text,
            loco_store=store("loco"),
        )
        for t in TRAINERS
    ]
    node = compose_inference(
        InferenceConfig(
            id="i0",
            run="failover",
            prompts=8,
            group_size=4,
            task=TaskConfig(max_new_tokens=4),
            batches_per_version=4,
            state_dir=tmp_path / "i0",
            subscribe=SubscriberConfig(interval_s=0.2),
            failover_s=2.0,
            status_every_s=1.0,
        ),
        store=store("i0"),
        policy_stores=[store(t) for t in TRAINERS],
        trusted={key_id(keys[t][1]): keys[t][1] for t in TRAINERS},
        key=keys["i0"][0],
        task=build_task("arith", seed=0),
        text=text,
    )
    stop_all, stop_inference = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(t.run(stop_all)) for t in trainers]
    inference = asyncio.create_task(node.run(stop_inference))
    try:
        async with asyncio.timeout(200):
            served = lambda v: node.engine is not None and (node.engine.version or 0) >= v  # noqa: E731
            await wait_until(lambda: served(2), 200, "the node serving v2", poll=0.2, task=inference)
            tasks[0].cancel()  # t0, the channel the node follows, dies mid-run
            with contextlib.suppress(asyncio.CancelledError):
                await tasks[0]
            await asyncio.gather(*tasks[1:])  # the survivors finish every round with a quorum of 2
            await wait_until(lambda: served(STEPS), 200, f"the node serving v{STEPS}", poll=0.2, task=inference)
    finally:
        stop_all.set()
        stop_inference.set()
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await inference

    survivors = {e.version: e.digest for e in trainers[1].events.events}
    assert survivors == {e.version: e.digest for e in trainers[2].events.events}  # bit-identical
    assert max(survivors) == STEPS
    versions = [v for v, _ in node.served]
    assert versions == sorted(versions) and versions[-1] == STEPS
    assert all(survivors[v] == d for v, d in node.served if v in survivors)  # only verified weights
    assert any(v > 2 for v in versions)  # it kept receiving after t0 died
    assert node.engine.weights_digest() == node.engine.digest == survivors[STEPS]
    # t0's channel stopped moving before the end: the last versions came through another channel.
    assert any(s.version == STEPS for s in node.subscribers[1:])


@pytest.mark.timeout(120)
async def test_a_channel_building_a_version_longer_than_failover_s_is_not_stalled(tmp_path: Path) -> None:
    """Building a version (its download, its rebuild, the engine taking it) may outlast
    ``failover_s``: an anchor over a slow link, a vLLM engine's start (~40 s for SmolLM2 on two busy
    cores), a large model's apply. The node must not take that for a stall and switch channels,
    which would abandon the build and start over on the other channel, forever. Here the engine
    takes 6x ``failover_s`` to start while the other channel announces the same version: the node
    serves it from the channel it follows and never follows the other."""
    from pulsenet.rl.models import BYTE_PAD, build_tiny_model
    from pulsenet.sync import Publisher
    from tests.support.peer import RUN, Site, stop_node

    net = Site(tmp_path, "t0", "t1", "i0")
    state = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, pad_id=BYTE_PAD)).bf16_state()
    for t in ("t0", "t1"):
        async with Publisher(net.store(t), net.keys[t], PublisherConfig(run=RUN)) as pub:
            await pub.publish_now(state, step=0)
    node = net.inference_node(InferenceConfig(
        id="i0", run=RUN, prompts=2, group_size=2, task=TaskConfig(max_new_tokens=2), state_dir=tmp_path / "i0",
        subscribe=SubscriberConfig(interval_s=0.1), failover_s=0.3, status_every_s=0.5,
    ))  # fmt: skip
    make, built = node._make_engine, []

    def slow_engine(**kw):
        built.append(kw["version"])
        import time

        time.sleep(1.8)  # in the engine's thread, as a vLLM start blocks it
        return make(**kw)

    node._make_engine = slow_engine
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    try:
        await wait_until(lambda: node.engine is not None and node.engine.version == 0, 60, "v0 served", task=task)
        await asyncio.sleep(1.0)  # failover_s x 3 with v0 served: no newer version anywhere, no switch either
    finally:
        await stop_node(stop, task)
    assert built == [0] and node._active == 0 and node.subscribers[1].stats.polls == 0


async def test_an_inference_nodes_downloads_go_through_its_state_dir_and_a_restart_sweeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel's payload cache defaults to ``state_dir/cache/policy-<k>``, not a temporary
    directory: a node killed mid-download (an anchor: the model's size) left the partial file in
    the system's /tmp, where nothing ever removed it. Now the next start sweeps it."""
    import tempfile

    from pulsenet.nodes.build import _subscriber
    from pulsenet.store.local import TMP_PREFIX
    from pulsenet.sync.publisher import Publisher
    from tests.support.sync_support import keypair, train_states

    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    key, trusted = keypair()
    store = LocalStore(tmp_path / "s3" / "t0")
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        published = [await pub.publish_now(s) for s in train_states(2)]
    leftover = tmp_path / "i0" / "cache" / "policy-0" / "pulsenet-payloads" / f"{TMP_PREFIX}0123456789abcdef"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"\0" * 1024)  # what a kill mid-download leaves
    c = InferenceConfig(id="i0", state_dir=tmp_path / "i0", subscribe=SubscriberConfig(interval_s=0.1, threads=1))
    async with _subscriber(c, [store], trusted, 0, lambda *a, **kw: None, lambda: None) as sub:
        assert sub.cache.dir == leftover.parent and not leftover.exists()
        await sub.sync_once()
        assert (sub.version, sub.digest) == (published[-1].version, published[-1].digest)
        assert sub.cache.downloaded  # the anchor went through this cache
    assert not list(system_tmp.iterdir())
