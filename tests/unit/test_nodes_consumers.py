"""Retention that knows its consumers: signed status objects, the slowest live consumer, and a
publisher that keeps the chain a live node still needs (within a bound)."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.errors import ManifestError, SignatureError
from pulsenet.nodes.consumers import ConsumerTracker, poll_consumers, read_status, status_key, write_status
from pulsenet.rollouts import RolloutSource
from pulsenet.signing import key_id
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import Subscriber, SubscriberConfig
from tests.support.sync_support import keypair, perturbed_states, same_bits, train_states

FAST = SubscriberConfig(interval_s=0.1, jitter=0.2, threads=1)


async def _manifest_versions(store, pub: Publisher) -> list[int]:
    return sorted(v for i in await store.list("") if (v := pub.layout.parse_manifest(i.key)) is not None)


async def test_slow_consumer_keeps_its_chain_until_the_bound(local_factory) -> None:
    """A consumer pinned at v2: with it live and within the bound, retention keeps every version from
    v2 and it catches up by patches alone; past the bound retention goes back to the newest anchor."""
    states = perturbed_states(train_states(1)[0], 14, fraction=0.005)
    key, trusted = keypair()
    store = local_factory()
    bound = 8
    tracker = ConsumerTracker(bound=bound, ttl_s=3600)
    cfg = PublisherConfig(anchor_every=2, keep_anchors=1)
    async with Publisher(store, key, cfg) as pub, Subscriber(store, trusted, FAST) as slow:
        for v in range(3):
            await pub.publish_now(states[v])
        assert await slow.sync_once() == 2
        tracker.observe("i0", 2, slow.digest)  # its status object says: v2
        for v in range(3, 10):
            pub.keep_from = tracker.keep_from(pub.version)
            await pub.publish_now(states[v])
            assert (await _manifest_versions(store, pub))[0] == 2, "the slow consumer's chain was cut"
        assert tracker.slowest(pub.version)["id"] == "i0" and tracker.slowest(pub.version)["kept"]
        # The whole patch chain v2 -> v9 is there (the subscriber may still pick an anchor when it
        # is cheaper: its choice, the chain is what retention owes it).
        objects = {i.key: i.size for i in await store.list("")}
        for v in range(3, 10):
            m = await pub._reader.get(v)
            assert m.patch is not None and m.base_version == v - 1 and objects[m.patch.key] == m.patch.size
        assert await slow.sync_once() == 9 and same_bits(slow.state, states[9])
        # Its status still says v2 (it never reported again): once the head is more than the bound
        # past it, it holds nothing back and will take the newest anchor.
        for v in range(10, 14):
            pub.keep_from = tracker.keep_from(pub.version)
            await pub.publish_now(states[v])
        assert pub.version - 2 > bound and tracker.keep_from(pub.version) is None
        assert tracker.slowest(pub.version)["kept"] is False
        pub.keep_from = None
        await pub.publish_now(perturbed_states(states[13], 2, seed=1)[1])
        assert (await _manifest_versions(store, pub))[0] >= 12  # back to the newest anchor


async def test_without_a_consumer_retention_cuts_at_the_newest_anchor(local_factory) -> None:
    """The control: the same run with no consumer deletes v2 as soon as an anchor passes it."""
    states = perturbed_states(train_states(1)[0], 8, fraction=0.005)
    key, _ = keypair()
    store = local_factory()
    async with Publisher(store, key, PublisherConfig(anchor_every=2, keep_anchors=1)) as pub:
        for s in states:
            await pub.publish_now(s)
        assert (await _manifest_versions(store, pub))[0] == 6


def test_consumer_liveness_is_by_the_trackers_own_clock() -> None:
    t = ConsumerTracker(bound=10, ttl_s=30)
    t.observe("i0", 5, "d0", now=100.0)
    t.observe("i1", 7, "d1", now=100.0)
    assert t.keep_from(9, now=110.0) == 5
    assert t.slowest(9, now=110.0) == {"id": "i0", "version": 5, "digest": "d0", "behind": 4, "age_s": 10.0, "kept": True}
    t.observe("i0", 5, "d0", now=125.0)  # the same object again: not news
    t.observe("i1", 8, "d1b", now=125.0)
    assert t.keep_from(9, now=131.0) == 8  # i0 unchanged for 31 s: not live, holds nothing
    t.touch("i0", now=131.0)  # rewritten (its time field moved) at the same version: alive
    assert t.keep_from(9, now=132.0) == 5
    assert t.keep_from(16, now=132.0) == 8  # i0 is 11 behind, past the bound: it takes an anchor
    assert t.keep_from(None) is None and ConsumerTracker(bound=1, ttl_s=1).slowest(3) is None


async def test_status_objects_are_signed_for_their_node_slot(local_factory) -> None:
    store = local_factory()
    k0, k1 = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    t0 = {key_id(k0.public_key()): k0.public_key()}
    await write_status(store, k0, run="r", node="i0", version=4, digest="ab" * 32)
    body = await read_status(store, t0, run="r", node="i0")
    assert (body["node"], body["version"], body["digest"]) == ("i0", 4, "ab" * 32)
    assert await read_status(store, t0, run="r", node="i1") is None  # not written yet
    with pytest.raises(ManifestError):  # signed for another run
        await read_status(store, t0, run="other", node="i0")
    # i1's key writing into i0's slot, or i0's status copied to i1's slot, does not verify.
    await write_status(store, k1, run="r", node="i0", version=9, digest="cd" * 32)
    with pytest.raises(SignatureError):
        await read_status(store, t0, run="r", node="i0")
    await write_status(store, k0, run="r", node="i0", version=4, digest="ab" * 32)
    await store.put(status_key("i1"), await store.get(status_key("i0")))
    with pytest.raises(ManifestError):
        await read_status(store, t0, run="r", node="i1")
    # The poller skips what does not verify and tracks what does.
    tracker = ConsumerTracker(bound=10, ttl_s=60)
    await poll_consumers(tracker, [RolloutSource("i0", store, t0), RolloutSource("i1", store, t0)], run="r", times={})
    assert set(tracker.consumers) == {"i0"} and tracker.consumers["i0"].version == 4
