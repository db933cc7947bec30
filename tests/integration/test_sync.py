"""PULSESync end to end against a real SeaweedFS S3 server.

- 30 versions from real AdamW steps reach three subscribers: one from the start, one joining late,
  one in its own process that is SIGKILLed mid-chain and restarted; all end bit-identical.
- A tampered payload, a manifest signed by an untrusted key and a replayed manifest are refused
  while the old weights keep serving; a corrupt link falls back to the next anchor.
- Retention keeps the object count bounded over 100 versions.
- Publisher and subscriber ride out a restart of the S3 server.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.codec.digest import model_digest
from pulsenet.codec.patch import PatchEncoder
from pulsenet.errors import ReplayError, SignatureError, VerificationError
from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
from pulsenet.rl.models import build_tiny_model
from pulsenet.rl.tasks import ArithmeticTask
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id
from pulsenet.store import S3Store
from pulsenet.store.seaweed import SeaweedServer
from pulsenet.sync import (
    Manifest,
    Publisher,
    PublisherConfig,
    Subscriber,
    SubscriberConfig,
    localstate,
)
from pulsenet.sync.chain import EMPTY_DIGEST
from pulsenet.sync.manifest import now_iso, sign_manifest
from tests.support.store import StoreFactory
from tests.support.sync_support import keypair, perturbed_states, same_bits, train_states
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

HELPER = Path(__file__).parents[1] / "support" / "sync_subscriber.py"
FAST = SubscriberConfig(interval_s=0.1, jitter=0.2, threads=1)


def write_public_key(key: Ed25519PrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


class Recorder:
    """An ``on_update`` that checks every state it is handed and remembers (version, digest)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []

    def __call__(self, version: int, state, digest: str) -> None:
        assert model_digest(state) == digest, "a subscriber exposed weights that do not match their digest"
        assert not self.seen or version > self.seen[-1][0], "versions must only move forward"
        self.seen.append((version, digest))


class HelperProcess:
    """``tests/support/sync_subscriber.py`` in its own process; its JSON events are collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict] = []
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls, store: S3Store, seaweed: SeaweedServer, trust: Path, state_dir: Path, until: int, log: Path
    ) -> HelperProcess:
        env = dict(os.environ)
        for line in seaweed.env_lines("reader"):  # read-only credentials: subscribers never write
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
        with open(log, "ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(HELPER),
                "--bucket",
                store.bucket,
                "--prefix",
                store.prefix.rstrip("/"),
                "--trust",
                str(trust),
                "--state-dir",
                str(state_dir),
                "--until",
                str(until),
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=env,
            )
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.events.append(json.loads(line))

    def saved(self) -> list[dict]:
        return [e for e in self.events if e["event"] == "saved"]

    def behind(self, version: int) -> int:
        """How many versions behind ``version`` the process is (0 once it has exited)."""
        if self.proc.returncode is not None:
            return 0
        saved = self.saved()
        return version - saved[-1]["version"] if saved else version + 1

    async def wait(self, pred, timeout: float, what: str) -> dict:
        """The first event matching ``pred``; ``timeout`` s without a new event of the process fail."""
        await wait_until(lambda: any(pred(e) for e in self.events), timeout, what, progress=lambda: len(self.events))
        return next(e for e in self.events if pred(e))

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


@contextlib.asynccontextmanager
async def running(*subs: Subscriber) -> AsyncIterator[asyncio.Event]:
    """Run subscribers' poll loops in a TaskGroup until the block exits."""
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        for s in subs:
            tg.create_task(s.run(stop))
        try:
            yield stop
        finally:
            stop.set()


# --- the main scenario ---------------------------------------------------------------------------


@pytest.mark.timeout(1200)  # the waits below fail on a stall, not on a slow (loaded) machine
async def test_thirty_versions_reach_three_subscribers(
    s3_factory: StoreFactory, seaweed: SeaweedServer, tmp_path: Path
) -> None:
    key, trusted = keypair()
    trust = write_public_key(key, tmp_path / "publisher.pub")
    store = s3_factory()
    trainer = LocalTrainer(build_tiny_model(0), LocalTrainerConfig(lr=1e-4))
    task = ArithmeticTask(0)
    states: list[dict[str, torch.Tensor]] = []
    pub = Publisher(store, key, PublisherConfig(anchor_every=5, keep_anchors=None, pending=64))
    early, late = Recorder(), Recorder()
    sub_a = Subscriber(
        s3_factory(identity="reader"),
        trusted,
        dataclasses.replace(FAST, state_dir=tmp_path / "a"),
        on_update=early,
    )
    sub_b = Subscriber(s3_factory(identity="reader"), trusted, FAST, on_update=late)

    async def train_and_publish(upto: int, pace: HelperProcess | None = None) -> None:
        while len(states) < upto:
            if states:
                await asyncio.to_thread(trainer.train_step, task)  # the caller keeps computing...
            states.append(trainer.bf16_state())
            pub.publish(states[-1], step=len(states) - 1)  # ...while uploads run in the background
            if pace is not None:  # keep the process at most two versions behind, so it follows the chain
                await wait_until(
                    lambda p=pace: p.behind(len(states) - 1) <= 2,
                    60,
                    "the process to keep up",
                    progress=lambda p=pace: len(p.events),
                )

    helper = await HelperProcess.start(store, seaweed, trust, tmp_path / "c", 29, tmp_path / "c.log")
    restarted: HelperProcess | None = None
    try:
        async with pub, running(sub_a) as _:
            await helper.wait(lambda e: e["event"] == "started", 180, "the subscriber process to start")
            # Phase 1: v0..v13; the process is SIGKILLed as it starts building a version after v9,
            # i.e. in the middle of fetching and applying a chain.
            trainer_task = asyncio.create_task(train_and_publish(14, pace=helper))
            building = await helper.wait(
                lambda e: e["event"] == "building" and (e["current"] or 0) >= 9, 90, "a chain after v9"
            )
            helper.proc.send_signal(signal.SIGKILL)
            await helper.close()
            await trainer_task
            await pub.flush(timeout=180)
            assert len(helper.saved()) > 1  # it was following, not one jump
            # Restart: it resumes from its local weights and fetches patches only (no anchor).
            restarted = await HelperProcess.start(
                store, seaweed, trust, tmp_path / "c", 29, tmp_path / "c.log"
            )
            started = await restarted.wait(lambda e: e["event"] == "started", 180, "the restarted process")
            assert started["resumed"] is not None and started["resumed"] >= building["current"]
            # On a loaded machine the SIGKILL can land after the process saved v13 (the chain it was
            # building reached it): it then resumes at v13 and has nothing to fetch until phase 2.
            if started["resumed"] < 13:
                await restarted.wait(
                    lambda e: e["event"] == "saved" and e["version"] == 13, 60, "v13 after the restart"
                )
                after = [k for e in restarted.saved() for k in e["downloaded"]]
                # Patches only (none at all when the killed process had already cached every payload
                # it needed: the cache survives the kill, a race with SIGKILL's timing).
                assert restarted.saved() and not any("-anchor-" in k for k in after), after
            # Phase 2: v14..v29, with a late joiner once v20 (an anchor version) is out.
            trainer_task = asyncio.create_task(train_and_publish(30))
            await wait_until(
                # v20's record: appended once its head is written (``pub.version`` moves before the
                # head does, and a subscriber started between the two would begin at v19)
                lambda: len(pub.records) >= 21, 90, "v20 published with its head", progress=lambda: (len(states), pub.version)
            )
            async with sub_b, running(sub_b):
                await trainer_task
                await pub.flush(timeout=180)
                await wait_until(
                    lambda: sub_a.version == 29 and sub_b.version == 29,
                    60,
                    "v29 everywhere",
                    progress=lambda: (sub_a.version, sub_b.version),
                )
                late_downloads = list(sub_b.cache.downloaded)
            done = await restarted.wait(lambda e: e["event"] == "done", 60, "the process to finish")
            assert await restarted.proc.wait() == 0
    finally:
        await helper.close()
        if restarted is not None:
            await restarted.close()

    assert pub.version == 29 and len(pub.records) == 30 and pub.dropped == 0
    final = states[-1]
    assert pub.digest == model_digest(final)
    assert sub_a.digest == sub_b.digest == done["digest"] == pub.digest
    on_disk = localstate.load(tmp_path / "c")
    assert on_disk is not None and on_disk.version == 29
    for state in (sub_a.state, sub_b.state, on_disk.state, localstate.load(tmp_path / "a").state):
        assert same_bits(state, final)
    published = {r.version: r.digest for r in pub.records}
    assert all(published[v] == d for v, d in early.seen + late.seen)
    # The late joiner started from an anchor at or after v20, then followed with patches. (A poll
    # that lags several versions on a loaded machine may take the v25 anchor when it is cheaper
    # than the patches in between: the subscriber picks the cheapest verified path.)
    assert sub_b.stats.anchors_applied >= 1 and late.seen[0][0] >= 20, late.seen
    anchors = [int(k.split("/v")[-1][:12]) for k in late_downloads if "-anchor-" in k]
    patches = [int(k.split("/v")[-1][:12]) for k in late_downloads if "-patch-" in k]
    assert anchors and anchors[0] >= 20 and patches and min(patches) > anchors[0], late_downloads
    assert len(anchors) == sub_b.stats.anchors_applied, late_downloads
    assert {r.kind for r in pub.records if r.version % 5 == 0} == {"anchor"}
    assert all(r.ratio > 1 for r in pub.records[1:]) and all(r.latency_s > 0 for r in pub.records)


# --- refusals --------------------------------------------------------------------------------------


async def test_tampered_untrusted_and_replayed_are_refused(s3_factory: StoreFactory) -> None:
    states = train_states(10)
    key, trusted = keypair()
    store = s3_factory()
    rec = Recorder()
    async with (
        Publisher(store, key, PublisherConfig(anchor_every=4, keep_anchors=None)) as pub,
        Subscriber(s3_factory(identity="reader"), trusted, FAST, on_update=rec) as sub,
    ):
        for s in states[:6]:
            await pub.publish_now(s)
        assert await sub.sync_once() == 5

        # 1. One flipped byte in the next patch: refused, v5 keeps serving.
        await pub.publish_now(states[6])
        m6 = await pub._reader.get(6)
        assert m6.patch is not None
        data = bytearray(await store.get(m6.patch.key))
        data[len(data) // 2] ^= 0x01
        await store.put(m6.patch.key, bytes(data))
        with pytest.raises(VerificationError, match="v6"):
            await sub.sync_once()
        assert sub.version == 5 and same_bits(sub.state, states[5]) and rec.seen[-1][0] == 5
        # The broken link is skipped once the next anchor (v8) exists: fall back to it.
        await pub.publish_now(states[7])
        await pub.publish_now(states[8])
        assert await sub.sync_once() == 8
        assert same_bits(sub.state, states[8]) and sub.stats.payloads_rejected >= 1

        # 2. A well-formed manifest + payload signed by a key nobody trusts.
        forger = Ed25519PrivateKey.generate()
        evil = dict(states[8])
        name = next(iter(evil))
        evil[name] = torch.zeros_like(evil[name])
        blob = PatchEncoder().encode({}, evil, base_digest=EMPTY_DIGEST)
        sha = hashlib.sha256(blob).hexdigest()
        ref = ObjectRef(key=pub.layout.payload(9, "anchor", sha), size=len(blob), sha256=sha)
        await store.put(ref.key, blob)
        forged = Manifest(
            version=9,
            kind="anchor",
            model_digest=model_digest(evil),
            base_version=None,
            base_digest=None,
            anchor=ref,
            patch=None,
            full_bytes=1,
            publisher=key_id(forger.public_key()),
            created=now_iso(),
        )
        await store.put(pub.layout.manifest(9), sign_manifest(forged, forger, context=pub.layout.context), if_none_match=True)
        # A following subscriber does not even list while the signed head still names its v8.
        assert await sub.sync_once() is None and sub.stats.manifests_rejected == 0
        # One that lists (here: the head is gone, an alarm) refuses the forgery.
        await store.delete([pub.layout.head])
        with pytest.raises(SignatureError):
            await sub.sync_once()
        assert sub.version == 8 and sub.stats.manifests_rejected == 1
        assert await sub.sync_once() is None  # refused once, not fetched or reported again
        # The honest publisher finds v9 taken and publishes v10 on top of its own v8.
        rec10 = await pub.publish_now(states[9])
        assert rec10.version == 10
        assert await sub.sync_once() == 10 and same_bits(sub.state, states[9])

        # 3. A replay: v3's genuine signed manifest copied to a newer version number (and the head
        # deleted, so that the subscriber lists at every poll).
        await store.delete([pub.layout.head])
        old = await store.get(pub.layout.manifest(3))
        await store.put(pub.layout.manifest(11), old, if_none_match=True)
        with pytest.raises(ReplayError):
            await sub.sync_once()
        assert sub.version == 10 and sub.stats.replays == 1

        # The same in a poll loop: logged and counted, never fatal; weights untouched.
        old2 = await store.get(pub.layout.manifest(2))
        await store.put(pub.layout.manifest(12), old2, if_none_match=True)
        async with running(sub):
            await wait_until(lambda: sub.stats.replays == 2, 10, "the replay to be seen")
        assert sub.version == 10 and sub.stats.rounds_failed >= 1
    assert [v for v, _ in rec.seen] == [5, 8, 10]


async def test_versions_do_not_verify_in_another_channel_run_or_store(
    s3_factory: StoreFactory, seaweed: SeaweedServer
) -> None:
    """Issue 12 item 2: a copy of a channel, byte for byte, is refused anywhere but where it was signed."""
    states = perturbed_states(train_states(1)[0], 2)
    key, trusted = keypair()
    prefix = f"ctx-{os.urandom(4).hex()}"
    store = s3_factory(prefix=f"{prefix}/a")
    async with Publisher(store, key, PublisherConfig(channel="staging", run="r1")) as pub:
        for s in states:
            await pub.publish_now(s)
    objects = {i.key: await store.get(i.key) for i in await store.list("staging/")}

    async def copy_to(dest, channel: str) -> None:
        for k, data in objects.items():
            await dest.put(channel + k[len("staging") :], data)

    async def refused(dest, channel: str, run: str) -> None:
        cfg = dataclasses.replace(FAST, channel=channel, run=run)
        async with Subscriber(dest, trusted, cfg) as sub:
            with pytest.raises(SignatureError, match="signed for context"):
                await sub.sync_once()
            assert sub.version is None and sub.stats.manifests_rejected == 2 and sub.stats.heads_rejected == 1

    # Where it was signed, through other credentials too, it verifies.
    reader = s3_factory(identity="reader", prefix=f"{prefix}/a")
    async with Subscriber(reader, trusted, dataclasses.replace(FAST, channel="staging", run="r1")) as sub:
        assert await sub.sync_once() == 1 and sub.digest == model_digest(states[1])
    await refused(store, "staging", "r2")  # same objects, another run
    await copy_to(store, "prod")
    await refused(store, "prod", "r1")  # another channel in the same store
    other_prefix = s3_factory(prefix=f"{prefix}/b")
    await copy_to(other_prefix, "staging")
    await refused(other_prefix, "staging", "r1")  # another prefix of the same bucket
    other_bucket = s3_factory(bucket=seaweed.bucket("a"), prefix=prefix)
    await copy_to(other_bucket, "staging")
    await refused(other_bucket, "staging", "r1")  # another bucket


# --- retention -------------------------------------------------------------------------------------


async def test_retention_bounds_objects_over_100_versions(s3_factory: StoreFactory) -> None:
    k, keep = 5, 2
    states = perturbed_states(train_states(1)[0], 100, fraction=0.005)
    key, trusted = keypair()
    store = s3_factory()
    # Per version a manifest and a patch, plus an anchor every k: at most keep*k versions are live;
    # plus the head record.
    bound = 2 * keep * k + keep + 1
    counts = []
    async with Publisher(store, key, PublisherConfig(anchor_every=k, keep_anchors=keep)) as pub:
        for i, s in enumerate(states):
            if i == 50:  # an orphan payload (a crashed upload) is cleaned up too
                await store.put(pub.layout.payload(3, "patch", "f" * 64), b"orphan")
            await pub.publish_now(s)
            counts.append(len(await store.list("")))
        assert max(counts) <= bound, counts
        assert counts[-1] >= k + 1  # it is not deleting what the chain needs
        objects = [i.key for i in await store.list("")]
        assert not any("/v000000000003-" in o for o in objects)
        # A fresh subscriber still rebuilds the newest version from what is left.
        async with Subscriber(s3_factory(identity="reader"), trusted, FAST) as sub:
            assert await sub.sync_once() == 99
            assert same_bits(sub.state, states[-1])


# --- S3 server restart -----------------------------------------------------------------------------


async def test_publisher_and_subscriber_survive_s3_restart(tmp_path: Path) -> None:
    states = train_states(12)
    key, trusted = keypair()
    with SeaweedServer(tmp_path / "weed") as server:
        server.create_buckets("restart")
        quick = {
            "max_retries": 3,
            "backoff_base_s": 0.05,
            "backoff_cap_s": 0.5,
            "timeout_s": 5.0,
            "connect_timeout_s": 1.0,
            "read_timeout_s": 5.0,
        }
        pub_store = S3Store("restart", "sync", server.config(**quick))
        sub_store = S3Store("restart", "sync", server.config("reader", **quick))
        cfg = PublisherConfig(anchor_every=4, retry_backoff_s=0.2, retry_backoff_cap_s=1.0, timeout_s=5.0)
        sub = Subscriber(sub_store, trusted, dataclasses.replace(FAST, timeout_s=5.0, round_timeout_s=20.0))
        async with pub_store, sub_store, Publisher(pub_store, key, cfg) as pub, running(sub):
            for s in states[:4]:
                pub.publish(s)
                await pub.flush(timeout=30)
            await wait_until(lambda: sub.version == 3, 30, "v3 before the restart")
            await asyncio.to_thread(server.stop)
            t0 = time.monotonic()
            for s in states[4:8]:  # published while the server is down: queued, retried
                pub.publish(s)
                await asyncio.sleep(0.3)
            # down until both have seen it (asserted below), not for a fixed 1.2 s a loaded machine may not act in
            await wait_until(lambda: pub.failures >= 1 and sub.stats.rounds_failed >= 1, 60, "both to see the outage")
            await asyncio.to_thread(server.start)
            for s in states[8:]:
                pub.publish(s)
                await asyncio.sleep(0.1)
            await pub.flush(timeout=90)
            await wait_until(lambda: sub.version == pub.version, 60, "the subscriber to catch up")
            assert time.monotonic() - t0 > 1
        assert pub.failures >= 1 and sub.stats.rounds_failed >= 1  # both saw the outage
        assert pub.digest == model_digest(states[-1]) and same_bits(sub.state, states[-1])


# --- soak (slow) -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_soak_random_sigkills_with_retention(
    s3_factory: StoreFactory, seaweed: SeaweedServer, tmp_path: Path
) -> None:
    """60 versions with retention on, the subscriber process SIGKILLed at random moments 5 times."""
    import random

    rng = random.Random(7)
    key, _ = keypair()
    trust = write_public_key(key, tmp_path / "publisher.pub")
    store = s3_factory()
    states = perturbed_states(train_states(1)[0], 60, fraction=0.003, seed=1)
    last = len(states) - 1
    procs: list[HelperProcess] = []
    try:
        async with Publisher(store, key, PublisherConfig(anchor_every=5, keep_anchors=2, pending=64)) as pub:
            procs.append(
                await HelperProcess.start(store, seaweed, trust, tmp_path / "c", last, tmp_path / "c.log")
            )
            kills = 0
            for s in states:
                pub.publish(s)
                await asyncio.sleep(0.3)
                running = any(e["event"] == "started" for e in procs[-1].events)
                if kills < 5 and running and rng.random() < 0.25:
                    await procs[-1].close()  # SIGKILL, wherever it is
                    kills += 1
                    procs.append(
                        await HelperProcess.start(
                            store, seaweed, trust, tmp_path / "c", last, tmp_path / "c.log"
                        )
                    )
            await pub.flush(timeout=180)
            done = await procs[-1].wait(lambda e: e["event"] == "done", 120, "the last process to finish")
    finally:
        for p in procs:
            await p.close()
    assert kills >= 1
    on_disk = localstate.load(tmp_path / "c")
    assert on_disk is not None and on_disk.version == last and done["digest"] == pub.digest
    assert same_bits(on_disk.state, states[-1])
    resumed = [e["resumed"] for p in procs[1:] for e in p.events if e["event"] == "started"]
    assert any(r is not None for r in resumed)
