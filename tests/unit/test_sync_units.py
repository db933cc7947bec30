"""PULSESync pieces on a local-directory store: layout, manifests, local state, publisher queueing,
resume, catch-up fallbacks and the payload cache. The S3 end-to-end runs are in test_sync.py."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import queue
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from pulsenet.checkpoint import save_state
from pulsenet.codec.digest import model_digest
from pulsenet.codec.patch import PatchEncoder, iter_apply, parse_patch
from pulsenet.errors import (
    ManifestError,
    ReplayError,
    SignatureError,
    StoreTimeout,
    StoreUnavailable,
    VerificationError,
)
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id, sign_document
from pulsenet.store import LocalStore
from pulsenet.sync import (
    Layout,
    Manifest,
    Publisher,
    PublisherConfig,
    Subscriber,
    SubscriberConfig,
    localstate,
)
from pulsenet.sync.arriving import ArrivingBytes, DownloadFailed
from pulsenet.sync.chain import PayloadCache
from pulsenet.sync.manifest import Head, sign_head, sign_manifest, verify_manifest
from tests.support.store import CountingStore
from tests.support.sync_support import keypair, perturbed_states, same_bits, train_states
from tests.support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    return train_states(6)


# --- layout and manifests --------------------------------------------------------------------------


def test_layout_keys_sort_and_parse() -> None:
    layout = Layout("runs/policy")
    keys = [layout.manifest(v) for v in (10, 2, 100)]
    assert sorted(keys) == [layout.manifest(v) for v in (2, 10, 100)]
    assert layout.parse_manifest(layout.manifest(42)) == 42
    p = layout.payload(7, "patch", "ab" * 32)
    assert p == "runs/policy/payloads/v000000000007-patch-abababababababab.pnp"
    assert layout.parse_payload(p)[0] == 7 and layout.parse_manifest(p) is None
    assert layout.parse_manifest("runs/policy/manifests/junk.json") is None
    with pytest.raises(ValueError):
        Layout("../escape")


def _manifest(key, version: int = 3, **changes) -> Manifest:
    sha = "0" * 64
    m = Manifest(
        version=version,
        kind="patch",
        model_digest="1" * 64,
        base_version=version - 1,
        base_digest="2" * 64,
        anchor=None,
        patch=ObjectRef(key=f"p/v{version}", size=10, sha256=sha),
        full_bytes=100,
        publisher=key_id(key.public_key()),
        created="2025-01-01T00:00:00+00:00",
    )
    return dataclasses.replace(m, **changes)


CTX = "pulsesync/policy"


def test_manifest_signing_and_every_rejection() -> None:
    key, trusted = keypair()
    other, _ = keypair()
    m = _manifest(key)
    data = sign_manifest(m, key, context=CTX)
    assert verify_manifest(data, trusted, context=CTX, key_version=3) == m
    assert verify_manifest(data, trusted, context=CTX, key_version=3, current=2) == m
    with pytest.raises(SignatureError):  # signed by a key we don't trust
        verify_manifest(sign_manifest(_manifest(other), other, context=CTX), trusted, context=CTX)
    env = json.loads(data)
    env["body"]["model_digest"] = "9" * 64
    with pytest.raises(SignatureError):  # body changed after signing
        verify_manifest(json.dumps(env).encode(), trusted, context=CTX)
    with pytest.raises(ManifestError, match="copied or misplaced"):  # right signature, wrong place
        verify_manifest(data, trusted, context=CTX, key_version=9)
    with pytest.raises(ReplayError):  # an old manifest presented as new
        verify_manifest(data, trusted, context=CTX, key_version=9, current=5)
    with pytest.raises(ReplayError):
        verify_manifest(data, trusted, context=CTX, key_version=3, current=3)
    body = m.to_body() | {"publisher": "someone-else"}
    with pytest.raises(ManifestError, match="claims publisher"):
        verify_manifest(sign_document(body, key, context=CTX), trusted, context=CTX)
    with pytest.raises(SignatureError, match="context"):  # signed for another channel
        verify_manifest(sign_manifest(m, key, context="pulsesync/staging"), trusted, context=CTX)
    for bad in (
        {"codec_version": 99},
        {"kind": "anchor"},
        {"base_version": None},
        {"version": -1},
        {"model_digest": "xyz"},
        {"payloads": []},
    ):
        with pytest.raises(ManifestError):
            verify_manifest(sign_document(m.to_body() | bad, key, context=CTX), trusted, context=CTX)


# --- local state ---------------------------------------------------------------------------------


def test_local_state_round_trip_and_refusals(tmp_path: Path, states: list[dict]) -> None:
    state = states[1]
    digest = model_digest(state)
    assert localstate.load(tmp_path) is None
    localstate.save(tmp_path, 7, digest, state, channel="policy")
    loaded = localstate.load(tmp_path)
    assert (
        loaded is not None
        and loaded.version == 7
        and loaded.digest == digest
        and same_bits(loaded.state, state)
    )
    assert json.loads((tmp_path / "version.json").read_text())["version"] == 7
    # Values that do not hash to the recorded digest are refused, whatever the header says.
    raw = bytearray((tmp_path / "model.safetensors").read_bytes())
    raw[-3] ^= 0x40
    (tmp_path / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(VerificationError):
        localstate.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(bytes(raw[:100]))  # truncated: unreadable, refused
    with pytest.raises(VerificationError):
        localstate.load(tmp_path)
    # A weights file without our metadata is not a resume point.
    save_state(tmp_path / "model.safetensors", state)
    assert localstate.load(tmp_path) is None
    (tmp_path / ".model.safetensors.abc123").write_bytes(b"partial")
    localstate.sweep(tmp_path)
    assert not (tmp_path / ".model.safetensors.abc123").exists()


# --- publisher ------------------------------------------------------------------------------------


class GatedStore(LocalStore):
    """A LocalStore whose puts wait for ``gate``: uploads 'fall behind' on demand."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        self.waiting += 1
        await self.gate.wait()
        self.waiting -= 1
        await super()._put(key, data, if_none_match)


async def test_full_queue_drops_oldest_and_next_patch_uses_published_base(
    tmp_path: Path, states: list[dict]
) -> None:
    store = GatedStore(tmp_path / "store")
    key, trusted = keypair()
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        await pub.publish_now(states[0])
        store.gate.clear()
        pub.publish(states[1], step=1)
        while store.waiting == 0:  # the worker took states[1] and is stuck uploading it
            await asyncio.sleep(0.01)
        pub.publish(states[2], step=2)
        pub.publish(states[3], step=3)  # the queue holds one: states[2] is dropped, never published
        assert pub.dropped == 1
        store.gate.set()
        await pub.flush(timeout=30)
    assert [(r.version, r.step, r.superseded) for r in pub.records] == [(0, None, 0), (1, 1, 0), (2, 3, 1)]
    async with Subscriber(store, trusted, SubscriberConfig()) as sub:
        m2 = await sub._reader.get(2)
        assert m2.base_version == 1 and m2.base_digest == model_digest(states[1])  # the published base
        assert await sub.sync_once() == 2
        assert sub.digest == model_digest(states[3]) and same_bits(sub.state, states[3])


async def test_publisher_resumes_and_yields_taken_versions(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    cfg = PublisherConfig(anchor_every=3, keep_anchors=None)
    first = Publisher(store, key, cfg)
    await first.start()
    for s in states[:4]:
        await first.publish_now(s)
    await first.close()
    # A restarted publisher rebuilds v3 from the store (anchor v3), or takes it from its caller.
    second = Publisher(store, key, cfg)
    await second.resume()
    assert (
        second.version == 3
        and second.digest == model_digest(states[3])
        and same_bits(second.state, states[3])
    )
    third = Publisher(store, key, cfg)
    with pytest.raises(ManifestError, match="not the newest"):
        await third.resume(states[2])
    await third.resume(states[3])
    # Both now publish "v4": the second one finds it taken and moves on, with its own base.
    await second.publish_now(states[4])
    rec = await third.publish_now(states[5])
    assert rec.version == 5
    async with Subscriber(store, trusted) as sub:
        assert await sub.sync_once() == 5
        assert sub.digest == model_digest(states[5])
        assert (await sub._reader.get(5)).base_version == 3


# --- subscriber ------------------------------------------------------------------------------------


async def test_missing_patch_falls_back_to_anchor_and_resume_skips_it(
    tmp_path: Path, states: list[dict]
) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    seen: list[tuple[int, str]] = []

    def on_update(version: int, state, digest: str) -> None:
        assert model_digest(state) == digest  # never anything unverified
        seen.append((version, digest))

    cfg = SubscriberConfig(state_dir=tmp_path / "sub", cache_dir=tmp_path / "cache")
    async with Publisher(store, key, PublisherConfig(anchor_every=2, keep_anchors=None)) as pub:
        for s in states[:2]:
            await pub.publish_now(s)
        async with Subscriber(store, trusted, cfg, on_update=on_update) as sub:
            assert await sub.sync_once() == 1
            rec2 = await pub.publish_now(states[2])  # anchor version: anchor + patch
            await pub.publish_now(states[3])
            m2 = await sub._reader.get(2)
            assert rec2.kind == "anchor" and m2.patch is not None and m2.anchor is not None
            await store.delete([m2.patch.key])
            assert await sub.sync_once() == 3  # v1 -> v2 patch is gone: anchor v2 + patch v3
            assert sub.stats.anchors_applied == 2 and sub.stats.payloads_rejected == 1
            assert same_bits(sub.state, states[3])
        # Restart: resumes from disk, announces it, then fetches only the next patch.
        seen.clear()
        async with Subscriber(store, trusted, cfg, on_update=on_update) as again:
            assert again.resumed_from == 3 and seen == [(3, model_digest(states[3]))]
            await pub.publish_now(states[4])
            assert await again.sync_once() == 4
            assert [k.split("/")[-1].split("-")[1] for k in again.cache.downloaded] == ["patch"]
            assert same_bits(again.state, states[4])
        # Damaged local weights are never served: the subscriber starts over from an anchor.
        weights = tmp_path / "sub" / "model.safetensors"
        raw = bytearray(weights.read_bytes())
        raw[-1] ^= 0x01
        weights.write_bytes(bytes(raw))
        seen.clear()
        async with Subscriber(store, trusted, cfg, on_update=on_update) as fresh:
            assert fresh.resumed_from is None and seen == []
            assert await fresh.sync_once() == 4 and fresh.stats.anchors_applied == 1


@pytest.mark.parametrize("in_place", [True, False])
async def test_rebuild_in_place_lets_each_old_tensor_go_as_its_new_one_lands(
    tmp_path: Path, states: list[dict], monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    """With its weights persisted, a subscriber rebuilds the next version into its state: each
    tensor the patch rewrites replaces the old one as soon as it is verified, so the old ones are
    gone before the last new one lands (one state plus the codec's window, not two; issue 37).
    Without it, every old tensor lives until the whole new state is verified."""
    from pulsenet.codec import patch as codec_patch
    from pulsenet.sync import chain

    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    cfg = SubscriberConfig(state_dir=tmp_path / "sub", cache_dir=tmp_path / "cache", rebuild_in_place=in_place)
    live: list[int] = []
    old: dict[str, weakref.ref] = {}  # the v1 tensors v2 rewrites, filled once v1 is served
    real = chain.iter_apply

    def counting(base, patch, **kw):
        for name, t in real(base, patch, **kw):
            live.append(sum(r() is not None for r in old.values()))  # before this tensor is placed
            yield name, t

    monkeypatch.setattr(chain, "iter_apply", counting)  # the rebuild in place
    monkeypatch.setattr(codec_patch, "iter_apply", counting)  # apply_patch, the whole-state rebuild
    async with Publisher(store, key) as pub, Subscriber(store, trusted, cfg) as sub:
        for s in states[:2]:
            await pub.publish_now(s)
        assert await sub.sync_once() == 1
        assert sub.state is not None
        old.update({n: weakref.ref(t) for n, t in sub.state.items() if not same_bits({n: t}, {n: states[2][n]})})
        live.clear()
        await pub.publish_now(states[2])
        assert await sub.sync_once() == 2 and same_bits(sub.state, states[2])
    assert len(old) >= 4 and live
    if in_place:  # the rewritten tensors go one by one
        assert live[0] == len(old) and live[-1] <= 1, live
    else:  # all of them held until the swap
        assert set(live) == {len(old)}, live
    assert sub.stats.state_reloads == 0


async def test_a_failed_rebuild_in_place_reloads_the_persisted_weights(tmp_path: Path, states: list[dict]) -> None:
    """A trusted key signs a patch whose last tensor does not decode (the payload matches its
    manifest, so only applying it finds out): the rebuild in place has replaced the tensors before
    it, so the subscriber reloads the persisted version (hashed), keeps serving it, and takes the
    next version by an anchor. Nothing unverified is ever handed out."""
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    seen: list[int] = []

    def on_update(version: int, state, digest: str) -> None:
        assert model_digest(state) == digest
        seen.append(version)

    cfg = SubscriberConfig(state_dir=tmp_path / "sub", cache_dir=tmp_path / "cache")
    async with (
        Publisher(store, key, PublisherConfig(anchor_every=3, keep_anchors=None)) as pub,
        Subscriber(store, trusted, cfg, on_update=on_update) as sub,
    ):
        for s in states[:2]:
            await pub.publish_now(s)
        assert await sub.sync_once() == 1
        await pub.publish_now(states[2])
        m2 = await pub._reader.get(2)
        assert m2.patch is not None and m2.anchor is None
        good = await store.get(m2.patch.key)
        bad = good[:-8] + bytes(b ^ 0x5A for b in good[-8:])  # the body's last section: the last tensor
        ref = ObjectRef(m2.patch.key.replace("-patch-", "-patch-bad-"), len(bad), hashlib.sha256(bad).hexdigest())
        await store.put(ref.key, bad)
        signed = sign_manifest(dataclasses.replace(m2, patch=ref), key, context=pub.layout.context)
        await store.put(pub.layout.manifest(2), signed)
        with pytest.raises(VerificationError):
            await sub.sync_once()
        assert sub.version == 1 and sub.stats.state_reloads == 1 and same_bits(sub.state, states[1])
        assert seen == [1]
        await pub.publish_now(states[3])  # v3 carries an anchor: the way past the bad patch
        assert await sub.sync_once() == 3 and same_bits(sub.state, states[3]) and seen == [1, 3]


def test_a_patch_decodes_as_its_bytes_land(states: list[dict]) -> None:
    """A streamed patch (``ArrivingBytes``): its first tensor is rebuilt and verified while the rest
    of the patch has not landed, and the whole comes out bit-exact once it has (issue 37)."""
    data = PatchEncoder().encode(states[0], states[1])
    first = next(e for e in parse_patch(data).tensors if e.op != "keep")
    cut = parse_patch(data).body_start + max(off + size for off, size, _ in first.sections.values())
    arriving, names = ArrivingBytes(len(data)), queue.Queue()
    arriving.feed(data[:cut])
    rebuilt: dict[str, torch.Tensor] = {}

    def decode() -> None:
        for name, t in iter_apply(states[0], parse_patch(arriving), threads=2):
            rebuilt[name] = t
            names.put(name)

    worker = threading.Thread(target=decode)
    worker.start()
    assert names.get(timeout=60) <= first.name  # (keep tensors before it come out too)
    assert arriving.filled == cut < len(data)
    arriving.feed(data[cut:])
    worker.join(60)
    assert same_bits(rebuilt, states[1])


def test_a_failed_download_frees_the_decoder_threads_waiting_for_it(states: list[dict]) -> None:
    data = PatchEncoder().encode(states[0], states[1])
    arriving = ArrivingBytes(len(data))
    arriving.feed(data[: len(data) // 2])
    errors: list[BaseException] = []

    def decode() -> None:
        try:
            dict(iter_apply(states[0], parse_patch(arriving), threads=2))
        except DownloadFailed as e:
            errors.append(e)

    worker = threading.Thread(target=decode)
    worker.start()
    time.sleep(0.2)
    arriving.fail(StoreUnavailable("the store went away"))
    worker.join(60)
    assert not worker.is_alive() and isinstance(errors[0].__cause__, StoreUnavailable)


async def test_a_download_cut_mid_patch_is_the_stores_fault_not_the_payloads(
    tmp_path: Path, states: list[dict]
) -> None:
    """The link gives out while a patch streams into a subscriber rebuilding in place: the store's
    error is raised (not the decoder's), the payload is not marked bad, and the next round reloads
    the persisted version and takes the same patch."""
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    cfg = SubscriberConfig(state_dir=tmp_path / "sub", cache_dir=tmp_path / "cache")
    async with Publisher(store, key) as pub, Subscriber(store, trusted, cfg) as sub:
        for s in states[:2]:
            await pub.publish_now(s)
        assert await sub.sync_once() == 1  # v1 persisted
        await pub.publish_now(states[2])
        patch = (await pub._reader.get(2)).patch
    assert patch is not None
    slow = LocalStore(tmp_path / "store", link_mbps=patch.size * 8 / 1e6)  # the patch takes ~1 s
    async with Subscriber(slow, trusted, dataclasses.replace(cfg, transfer_timeout_s=0.3)) as sub:
        await sub.start()
        assert sub.version == 1
        with pytest.raises(StoreTimeout):
            await sub.sync_once()
        assert sub._bad_payloads == set() and sub.version == 1
        sub.cache.timeout_s = 30.0
        assert await sub.sync_once() == 2 and same_bits(sub.state, states[2])
        assert sub.stats.state_reloads == 1 and sub.stats.payloads_rejected == 0


async def test_followers_take_the_patch_of_an_anchor_version(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    async with (
        Publisher(store, key, PublisherConfig(anchor_every=3)) as pub,
        Subscriber(store, trusted) as follower,
    ):
        for s in states[:3]:
            await pub.publish_now(s)
        assert await follower.sync_once() == 2
        rec = await pub.publish_now(states[3])
        assert rec.kind == "anchor" and set(rec.payload_bytes) == {"anchor", "patch"}
        follower.cache.downloaded.clear()
        assert await follower.sync_once() == 3
        assert len(follower.cache.downloaded) == 1 and "-patch-" in follower.cache.downloaded[0]
        async with Subscriber(store, trusted) as newcomer:  # a late joiner takes the anchor
            assert await newcomer.sync_once() == 3
            assert [k.split("-")[-2] for k in newcomer.cache.downloaded] == ["anchor"]
            assert same_bits(newcomer.state, follower.state)


async def test_corrupt_cached_payload_is_deleted_and_refetched(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, _ = keypair()
    async with Publisher(store, key) as pub:
        await pub.publish_now(states[0])
        ref = (await pub._reader.get(0)).anchor
    assert ref is not None
    cache = PayloadCache(store, tmp_path / "cache")
    cache.sweep()
    for bad in (b"garbage", (await store.get(ref.key))[:-1]):  # wrong bytes, truncated
        cache.path(ref).write_bytes(bad)
        data = await cache.read(ref)
        assert len(data) == ref.size
    assert cache.downloaded == [ref.key, ref.key]
    assert await cache.read(ref) == data and len(cache.downloaded) == 2  # a good cached copy is used
    await store.put(ref.key, data[:-1] + bytes([data[-1] ^ 1]))  # tampered at the source
    cache.path(ref).unlink()
    with pytest.raises(VerificationError):
        await cache.read(ref)
    assert not cache.path(ref).exists()


async def test_perturbed_states_round_trip(tmp_path: Path, states: list[dict]) -> None:
    """The synthetic states the retention test uses are valid, distinct versions."""
    chain = perturbed_states(states[0], 3)
    assert len({model_digest(s) for s in chain}) == 3


# --- hostile bucket writers (issue 12) --------------------------------------------------------------


def _hostile_manifests(key, layout: Layout, version: int) -> list[bytes]:
    """Objects a bucket writer (or a compromised key, for the signed ones) can put at a manifest key."""
    kid = key_id(key.public_key())
    ctx = json.dumps(layout.context)
    good = _manifest(key, version).to_body()
    envelope = '{"body": %s, "context": %s, "key_id": "%s", "sig": "AAAA"}'
    return [
        f'{{"body": {{}}, "key_id": "{kid}", "x": {"[" * 5000 + "]" * 5000}}}'.encode(),  # deep nesting
        (envelope % ('{"version": NaN}', ctx, kid)).encode(),
        (envelope % ('{"version": 1e400}', ctx, kid)).encode(),
        (envelope % ('{"name": "\\ud800"}', ctx, kid)).encode(),  # a lone surrogate
        (envelope % ('{"version": 1%s}' % ("0" * 5000), ctx, kid)).encode(),  # a 5000-digit int
        b"\xff\xfe not utf-8",
        b"[]",
        # Signed by the trusted key (a compromised one) but with fields of the wrong type or size:
        sign_document(good | {"payloads": "xx"}, key, context=layout.context),
        sign_document(good | {"payloads": [{"role": ["patch"]}]}, key, context=layout.context),
        sign_document(good | {"payloads": [good["payloads"][0] | {"size": "10"}]}, key, context=layout.context),
        sign_document(good | {"version": 10**30}, key, context=layout.context),
        sign_document(good | {"publisher": [kid]}, key, context=layout.context),
        sign_document(good | {"step": 2**70}, key, context=layout.context),
        sign_manifest(_manifest(key, version), key, context="pulsesync/default/elsewhere/policy"),
    ]


async def test_planted_manifests_never_block_a_valid_version(tmp_path: Path, states: list[dict]) -> None:
    store = CountingStore(tmp_path / "store")
    key, trusted = keypair()
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        for s in states[:3]:
            await pub.publish_now(s)
    layout = Layout("policy", store_url=store.url)
    hostile = _hostile_manifests(key, layout, 50)
    for i, data in enumerate(hostile):  # every one newer than the valid v2; one of them at the top
        await store.put(layout.manifest(10 + i), data)
    await store.put(layout.manifest(999_999_999_999), b"{" * 100_000)
    await store.delete([layout.head])  # no head to point at v2: the subscriber must find it alone
    async with Subscriber(store, trusted, SubscriberConfig(max_targets=1)) as sub:
        assert await sub.sync_once() == 2  # one round, though max_targets=1 and 15 junk objects sit above
        assert sub.digest == model_digest(states[2])
        assert sub.stats.manifests_rejected == len(hostile) + 1
        reads = dict(store.read_bytes)
        assert await sub.sync_once() is None  # refused objects are remembered, not fetched again
        assert store.read_bytes == reads and sub.stats.manifests_rejected == len(hostile) + 1
        await store.put(layout.manifest(10), b"changed")  # a changed object (new ETag) is looked at again
        with pytest.raises(ManifestError):
            await sub.sync_once()
        assert sub.stats.manifests_rejected == len(hostile) + 2 and sub.version == 2


def test_every_hostile_manifest_is_a_manifest_error() -> None:
    key, trusted = keypair()
    layout = Layout("policy", store_url="s3://bucket/prefix/")
    for data in _hostile_manifests(key, layout, 50):
        with pytest.raises(ManifestError) as e:
            verify_manifest(data, trusted, context=layout.context, key_version=50)
        assert len(str(e.value)) < 600  # hostile values are not echoed whole into logs


async def test_planted_version_names_never_stop_the_publisher(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    cfg = PublisherConfig(anchor_every=100)
    async with Publisher(store, key, cfg) as pub:
        await pub.publish_now(states[0])
        await store.put(layout.manifest(999_999_999_999), b"unsigned")  # the highest name there is
        await store.put(layout.manifest(1), b"unsigned")  # the number it would take next
        assert (await pub.publish_now(states[1])).version == 2  # a running publisher skips the taken v1
    async with Publisher(store, key, cfg) as again:  # a restarted one resumes from its own newest, v2
        assert again.version == 2 and again.digest == model_digest(states[1])
        other, _ = keypair()  # a key nobody trusts, and the next number taken with it
        await store.put(layout.manifest(3), sign_manifest(_manifest(other, 3), other, context=layout.context))
        assert (await again.publish_now(states[2])).version == 4
        assert (await again.publish_now(states[3])).version == 5
    async with Subscriber(store, trusted) as sub:
        assert await sub.sync_once() == 5 and sub.digest == model_digest(states[3])


async def test_oversized_objects_are_never_downloaded(tmp_path: Path, states: list[dict]) -> None:
    store = CountingStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        await pub.publish_now(states[0])
        await pub.publish_now(states[1])
        patch = (await pub._reader.get(1)).patch
    assert patch is not None and patch.size < 1 << 20
    big = b"x" * (4 << 20)
    await store.put(layout.manifest(7), big)  # a 4 MB "manifest", listed as such
    await store.put(patch.key, big)  # v1's 30 KB patch swapped for 4 MB
    cfg = SubscriberConfig(max_manifest_bytes=64 << 10)
    async with Subscriber(store, trusted, cfg) as sub:
        # v7 is refused from its listed size, v1 cannot be built: the subscriber settles for v0.
        assert await sub.sync_once() == 0
        assert layout.manifest(7) not in store.read_bytes  # never even requested
        assert store.read_bytes[patch.key] == 0  # refused from its size before a byte was written
        assert sub.stats.manifests_rejected == 1 and sub.stats.payloads_rejected == 1
        assert not any(p.stat().st_size > patch.size for p in sub.cache.dir.iterdir())
        # A fetch that does not know the listed size (a chain walk) is capped all the same.
        with pytest.raises(ManifestError, match="limit"):
            await sub._reader.get(7)
        assert store.read_bytes.get(layout.manifest(7), 0) <= (64 << 10) + 1


async def test_head_record_alarms_on_deleted_stale_and_replayed_heads(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        await pub.publish_now(states[0])
        head_v0 = await store.get(layout.head)
        for s in states[1:3]:
            await pub.publish_now(s)
        async with Subscriber(store, trusted, SubscriberConfig(head_max_age_s=0.5)) as sub:
            assert await sub.sync_once() == 2
            st = sub.stats
            assert (st.head_version, st.head_stale, st.head_missing_version, st.head_alarms) == (2, False, None, 0)
            await store.put(layout.head, head_v0)  # an old signed head copied back: a replay
            assert await sub.sync_once() is None
            assert st.heads_rejected == 1 and st.head_alarms == 1 and st.head_version == 2
            await asyncio.sleep(0.6)  # no new version, no head refresh: the head goes stale
            await sub.sync_once()
            assert st.head_stale and st.head_alarms >= 2
            await pub.write_head()  # the publisher refreshes it: fresh again
            await sub.sync_once()
            assert not sub.stats.head_stale
            await store.delete([layout.head])
            await sub.sync_once()  # a head seen before and now gone is an alarm too
            assert st.head_stale
    # Whoever can delete removes the two newest manifests: a subscriber with no state would settle
    # for v0 unnoticed. The head still names v2, whose manifest is gone: alarm, count, keep serving.
    await pub.write_head()
    await store.delete([layout.manifest(2), layout.manifest(1)])
    async with Subscriber(store, trusted) as late:
        assert await late.sync_once() == 0
        assert late.stats.head_missing_version == 2 and late.stats.head_alarms == 1


# --- conditional polling (issue 23), verified announcements (issue 21), changed tensors (issue 22) ----


def _requests(store: LocalStore, before) -> dict[str, int]:
    d = (store.requests - before).as_dict()
    return {k: v for k, v in d.items() if v and not k.startswith("bytes")}


async def test_idle_poll_is_one_conditional_get_and_no_list(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub, Subscriber(store, trusted) as sub:
        for s in states[:3]:
            await pub.publish_now(s)
        assert await sub.sync_once() == 2
        before = store.requests.snapshot()
        for _ in range(5):  # nothing changed: one 304 each, no listing, no byte downloaded
            assert await sub.sync_once() is None
        assert _requests(store, before) == {"get_not_modified": 5}
        assert (store.requests - before).bytes_down == 0
        assert (sub.stats.idle_polls, sub.stats.listings) == (5, 1)
        # One version: the head (changed), the listing, the manifest, the patch.
        await pub.publish_now(states[3])
        before = store.requests.snapshot()
        assert await sub.sync_once() == 3
        assert _requests(store, before) == {"get": 3, "list": 1}
        # A head refreshed without a new version is read (its ETag moved) but not followed by a listing.
        await pub.write_head()
        before = store.requests.snapshot()
        assert await sub.sync_once() is None
        assert _requests(store, before) == {"get": 1}


async def test_planted_and_stale_heads_are_still_caught_under_conditional_polling(
    tmp_path: Path, states: list[dict]
) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    kid = key_id(key.public_key())
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        for s in states[:3]:
            await pub.publish_now(s)
        # A head signed an hour ago for the current version: accepted (it is the publisher's), but stale.
        old = Head(version=2, model_digest=pub.digest, publisher=kid, time_ms=int(time.time() * 1000) - 3_600_000)
        await store.put(layout.head, sign_head(old, key, context=layout.context))
        async with Subscriber(store, trusted, SubscriberConfig(head_max_age_s=60)) as sub:
            assert await sub.sync_once() == 2 and sub.stats.head_stale and sub.stats.head_alarms == 1
            before = store.requests.snapshot()
            assert await sub.sync_once() is None  # unchanged (a 304), yet stale: alarm again, and list
            assert _requests(store, before) == {"get_not_modified": 1, "list": 1}
            assert sub.stats.head_alarms == 2 and sub.stats.idle_polls == 0
            await pub.write_head()  # fresh again: idle polls resume
            await sub.sync_once()
            before = store.requests.snapshot()
            assert await sub.sync_once() is None and not sub.stats.head_stale
            assert _requests(store, before) == {"get_not_modified": 1}
            alarms = sub.stats.head_alarms
            # Planted: an unsigned head, then one signed by another key. Refused on every poll (its ETag
            # is never kept as "unchanged"), each poll then lists; v2 keeps serving.
            for planted in (
                b'{"body": {}}',
                sign_head(
                    dataclasses.replace(old, publisher=key_id((other := keypair()[0]).public_key())), other,
                    context=layout.context,
                ),
            ):
                await store.put(layout.head, planted)
                for _ in range(2):
                    before = store.requests.snapshot()
                    assert await sub.sync_once() is None
                    assert _requests(store, before) == {"get": 1, "list": 1}
            assert sub.stats.heads_rejected == 4 and sub.stats.head_alarms == alarms + 4 and sub.version == 2
            # Planted manifest names cost an idle subscriber nothing and never block the next version.
            await pub.write_head()
            await sub.sync_once()
            await store.put(layout.manifest(999_999_999_999), b"{" * 1000)
            before = store.requests.snapshot()
            assert await sub.sync_once() is None and _requests(store, before) == {"get_not_modified": 1}
            await pub.publish_now(states[3])
            assert await sub.sync_once() == 3  # the head's version first, the planted name refused
            await store.delete([layout.manifest(999_999_999_999)])
            # Deleted head: alarm and list, every poll, until it is back.
            await store.delete([layout.head])
            for _ in range(2):
                before = store.requests.snapshot()
                await sub.sync_once()
                assert _requests(store, before) == {"get": 1, "list": 1} and sub.stats.head_stale
        # A head naming a version whose manifest was deleted is found although the head never changes.
        await pub.publish_now(states[4])
        await store.delete([layout.manifest(4)])
        async with Subscriber(store, trusted) as late:
            for _ in range(2):
                assert await late.sync_once() == 3 or late.version == 3
                assert late.stats.head_missing_version == 4
            assert late.stats.head_alarms == 2


async def test_announced_reports_only_versions_a_verified_manifest_backs(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    kid = key_id(key.public_key())
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        for s in states[:3]:
            await pub.publish_now(s)
    async with Subscriber(store, trusted) as sub:
        assert await sub.announced() == 2 and sub.stats.announced_version == 2 and sub.version is None
        before = store.requests.snapshot()
        assert await sub.announced() == 2 and _requests(store, before) == {"get_not_modified": 1}
        # The trusted trainer's key signs a head for v999999999999 without a manifest behind it.
        now = int(time.time() * 1000)
        huge = Head(version=999_999_999_999, model_digest=pub.digest, publisher=kid, time_ms=now)
        await store.put(layout.head, sign_head(huge, key, context=layout.context))
        assert await sub.announced() == 2
        assert sub.stats.announced_unverified == 1
        # ...then a manifest for it, but the head names another digest than the manifest: still not.
        m = dataclasses.replace(_manifest(key, 999_999_999_999), model_digest="1" * 64)
        await store.put(layout.manifest(999_999_999_999), sign_manifest(m, key, context=layout.context))
        assert await sub.announced() == 2 and sub.stats.announced_unverified == 2
        # A manifest signed by an untrusted key does not back it either.
        other, _ = keypair()
        await store.put(
            layout.manifest(999_999_999_999), sign_manifest(_manifest(other, 999_999_999_999), other, context=layout.context)
        )
        assert await sub.announced() == 2 and sub.stats.announced_unverified == 3
        # The head itself moves on in the polls (alarms), but what the subscriber serves is v2.
        assert await sub.sync_once() == 2
        assert sub.stats.head_version == 999_999_999_999 and sub.version == 2
        assert await sub.announced() == 2  # never below what it serves and verified


async def test_update_callback_gets_the_names_of_changed_tensors(tmp_path: Path, states: list[dict]) -> None:
    store = LocalStore(tmp_path / "store")
    key, trusted = keypair()
    base = states[0]
    names = sorted(base)
    one, two = names[0], names[-1]

    def bump(state: dict, name: str) -> dict:
        out = dict(state)
        out[name] = (state[name].view(torch.int16) + 1).view(torch.bfloat16)
        return out

    s1 = bump(base, one)
    s2 = bump(s1, two)
    s3 = bump(s2, one)
    seen: list[tuple[int, frozenset[str]]] = []

    async def on_update(version: int, state, digest: str, *, changed: frozenset[str]) -> None:
        assert model_digest(state) == digest
        seen.append((version, changed))

    cfg = SubscriberConfig(state_dir=tmp_path / "sub")
    async with Publisher(store, key, PublisherConfig(anchor_every=100)) as pub:
        await pub.publish_now(base)
        async with Subscriber(store, trusted, cfg, on_update=on_update) as sub:
            assert await sub.sync_once() == 0  # an anchor: every name
            await pub.publish_now(s1)
            assert await sub.sync_once() == 1
            await pub.publish_now(s2)
            await pub.publish_now(s3)
            assert await sub.sync_once() == 3  # two patches at once: the union
            assert sub.stats.last_changed == 2
        assert seen == [(0, frozenset(names)), (1, frozenset({one})), (3, frozenset({one, two}))]
        seen.clear()
        async with Subscriber(store, trusted, cfg, on_update=on_update):  # resumed from disk: every name
            assert seen == [(3, frozenset(names))]
    plain: list[int] = []
    async with Subscriber(store, trusted, on_update=lambda v, state, digest: plain.append(v)) as old_style:
        assert await old_style.sync_once() == 3 and plain == [3]  # a callback without ``changed``


async def test_publisher_rewrites_a_head_whose_write_failed(tmp_path: Path, states: list[dict]) -> None:
    store = FlakyHeadStore(tmp_path / "store")
    key, trusted = keypair()
    layout = Layout("policy", store_url=store.url)
    async with Publisher(store, key, PublisherConfig(anchor_every=100, retry_backoff_s=0.05)) as pub:
        await pub.publish_now(states[0])
        store.fail_head = 2
        await pub.publish_now(states[1])  # the manifest lands, its head write fails
        async with Subscriber(store, trusted) as sub:
            await wait_until(lambda: store.fail_head == 0, 10, "two failed head writes")
            await wait_until(lambda: not pub._head_due, 10, "the worker to rewrite the head")
            assert verify_head_version(await store.get(layout.head), trusted, layout) == 1
            assert await sub.sync_once() == 1


class FlakyHeadStore(LocalStore):
    """A LocalStore whose next ``fail_head`` writes of a head record fail as an outage would."""

    fail_head = 0

    async def _put(self, key: str, data: bytes, if_none_match: bool) -> None:
        if key.endswith("head.json") and self.fail_head > 0:
            self.fail_head -= 1
            raise StoreUnavailable("injected outage")
        await super()._put(key, data, if_none_match)


def verify_head_version(data: bytes, trusted, layout: Layout) -> int:
    from pulsenet.signing import verify_document
    from pulsenet.sync.manifest import head_from

    return head_from(verify_document(data, trusted, context=layout.context)).version


async def test_hostile_local_state_files_are_refused_not_fatal(tmp_path: Path, states: list[dict]) -> None:
    from safetensors.torch import save_file

    state, digest = states[1], model_digest(states[1])
    meta = {"pulsenet.format": localstate.META_FORMAT, "pulsenet.digest": digest}
    for version in ("-5", "1" + "0" * 5000, "٣", "3 "):  # negative, huge, a non-ASCII digit, padded
        check = localstate._check(version, digest)
        save_file(
            dict(state), str(tmp_path / localstate.WEIGHTS),
            metadata=meta | {"pulsenet.version": version, "pulsenet.check": check},
        )
        with pytest.raises(VerificationError):
            localstate.load(tmp_path)
    # A corrupted version number (7 -> 6, one bit) is caught by the header check, not resumed from.
    good = meta | {"pulsenet.version": "7", "pulsenet.check": localstate._check("7", digest)}
    save_file(dict(state), str(tmp_path / localstate.WEIGHTS), metadata=good)
    assert localstate.load(tmp_path).version == 7
    save_file(dict(state), str(tmp_path / localstate.WEIGHTS), metadata=good | {"pulsenet.version": "6"})
    with pytest.raises(VerificationError, match="check"):
        localstate.load(tmp_path)
    localstate.save(tmp_path, 7, digest, state, channel="policy")
    for bad in (b"[" * 100_000, b'{"version": 1' + b"0" * 5000 + b"}", b"\xff", b'{"version": "7"}', b"x" * 100_000):
        (tmp_path / localstate.INFO).write_bytes(bad)
        with pytest.raises(VerificationError):
            localstate.read_info(tmp_path)
    # A subscriber resuming from that directory rewrites the record instead of crashing.
    store = LocalStore(tmp_path / "store")
    _, trusted = keypair()
    async with Subscriber(store, trusted, SubscriberConfig(state_dir=tmp_path)) as sub:
        assert sub.resumed_from == 7
    assert localstate.read_info(tmp_path) == {
        "version": 7, "digest": digest, "channel": "policy", "updated": localstate.read_info(tmp_path)["updated"]
    }


def test_keygen_never_overwrites_a_key(tmp_path: Path) -> None:
    from pulsenet.errors import ConfigError
    from pulsenet.signing import generate_keypair

    kid = generate_keypair(tmp_path / "k")
    pub = (tmp_path / "k.pub").read_bytes()
    (tmp_path / "k").unlink()  # even with the private half gone, its public half is someone's trust root
    with pytest.raises(ConfigError, match="already exists"):
        generate_keypair(tmp_path / "k")
    assert (tmp_path / "k.pub").read_bytes() == pub and not (tmp_path / "k").exists() and kid


def test_spliced_documents_with_repeated_keys_never_verify() -> None:
    """Two signed documents spliced into one object with a repeated "body" key: JSON parsers keep
    the first or the last, so the splice would verify as one of them; it is refused outright."""
    key, trusted = keypair()
    layout = Layout("policy", store_url="s3://bucket/prefix/")
    old = sign_manifest(_manifest(key, 3), key, context=layout.context)
    new = sign_manifest(_manifest(key, 4), key, context=layout.context)
    spliced = new[:-1] + b',"body":' + json.dumps(json.loads(old)["body"]).encode() + b"}"
    with pytest.raises(ManifestError, match="repeated key"):
        verify_manifest(spliced, trusted, context=layout.context)
