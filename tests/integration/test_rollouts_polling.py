"""Issue 23 item 3: polls of the rollout channel cost nothing when nothing changed.

Counted inside the store layer (``ObjectStore.requests``) on the real SeaweedFS: an idle intake
poll is one conditional GET per source (a 304) and no LIST; the listing is read only when the
node's signed head moved, is missing, refused or went backwards, and those are counted; planted
manifests still never block a valid batch.
"""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.rollouts import RolloutLayout
from pulsenet.rollouts.manifest import RolloutHead, now_iso
from pulsenet.signing import key_id, sign_document
from pulsenet.store.base import RequestCounts
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import Site, intake, make_rows, make_sites

pytestmark = pytest.mark.timeout(120)
LAYOUT = RolloutLayout()


@pytest.fixture
async def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    """Both nodes started: each has written its head (a node without one is listed every poll)."""
    out = make_sites(s3_factory, seaweed)
    for s in out:
        await s.writer().start()
    return out


def counts(sites: list[Site]) -> list[RequestCounts]:
    return [s.read.requests.snapshot() for s in sites]


def delta(sites: list[Site], before: list[RequestCounts]) -> list[RequestCounts]:
    return [s.read.requests - b for s, b in zip(sites, before, strict=True)]


async def test_an_idle_poll_is_one_conditional_get_per_source(sites: list[Site]) -> None:
    a, b = sites
    wa, wb = a.writer(), b.writer()
    before = a.own.requests.snapshot()
    await wa.start()
    await wb.start()
    await wa.write(make_rows(a.node, 1, seed=1))
    await wb.write(make_rows(b.node, 1, seed=1))
    # a batch costs its node 3 PUTs (payload, manifest, head); start lists twice, writes the key and the head
    wrote = a.own.requests - before
    assert (wrote.put, wrote.list, wrote.delete) == (2 + 3, 2, 0)
    ti = intake(sites)
    assert await ti.poll(1) == 2
    for _ in range(3):
        before = counts(sites)
        assert await ti.poll(1) == 0
        for d in delta(sites, before):
            assert (d.get_not_modified, d.requests) == (1, 1), d
    assert ti.stats.head_not_modified == 6 and ti.stats.lists == 2
    # a new batch at node a: its head moved, a is listed and the batch fetched; b stays at one 304
    before = counts(sites)
    await wa.write(make_rows(a.node, 1, seed=2))
    assert await ti.poll(1) == 1
    da, db = delta(sites, before)
    assert (da.list, da.get, da.get_not_modified) == (1, 3, 0)  # head, manifest, payload
    assert (db.requests, db.get_not_modified) == (1, 1)
    # once the trainer moves on, a batch already listed but from a version it had not reached is
    # fetched without a new listing
    await wa.write(make_rows(a.node, 2, seed=3))
    assert await ti.poll(1) == 0  # v2 listed, not reached yet
    before = counts(sites)
    assert await ti.poll(2) == 1
    assert [d.list for d in delta(sites, before)] == [0, 0]


async def test_batches_over_a_budget_need_no_new_listing(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    for s in range(4):
        await w.write(make_rows(a.node, 1, seed=s))
    ti = intake(sites, max_queued=2)
    assert await ti.poll(1) == 2
    ti.take(1)
    before = counts(sites)
    assert await ti.poll(1) == 2
    assert delta(sites, before)[0].list == 0 and ti.stats.lists == 2


async def test_missing_backwards_and_forged_heads_are_detected_and_never_block(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 1, seed=1))
    ti = intake(sites)
    assert await ti.poll(1) == 1
    lists = ti.stats.lists

    # missing (deleted by a site writer): counted once, listed every poll, batches still flow
    await a.own.delete([LAYOUT.head], timeout=10)
    await ti.poll(1)
    await ti.poll(1)
    assert ti.stats.head_missing == 1 and ti.stats.lists == lists + 2
    await w.write(make_rows(a.node, 1, seed=2))  # the writer's next head
    assert await ti.poll(1) == 1
    lists = ti.stats.lists
    await ti.poll(1)
    assert ti.stats.lists == lists  # trusted again: idle polls do not list

    # backwards (an older signed head replayed): counted, listed until a newer head
    old = await a.own.get(LAYOUT.head, timeout=10)
    await w.write(make_rows(a.node, 1, seed=3))
    assert await ti.poll(1) == 1
    await a.own.put(LAYOUT.head, old, timeout=10)
    await ti.poll(1)
    await ti.poll(1)  # the same replayed object: a 304, still not trusted, still listed
    assert ti.stats.head_backwards == 1 and ti.stats.lists == lists + 3
    await w.write(make_rows(a.node, 1, seed=4))
    assert await ti.poll(1) == 1
    lists = ti.stats.lists
    await ti.poll(1)
    assert ti.stats.lists == lists

    # forged (a key not trusted for this node) or another node's: refused, listed, never trusted
    forged = RolloutHead(
        node=a.node, seq=w.head.seq + 10**9, next_seq=999, newest_version=999,
        publisher=key_id((k := Ed25519PrivateKey.generate()).public_key()), created=now_iso(),
    )  # fmt: skip
    ctx = LAYOUT.head_context("test", a.own.url, a.node)
    await a.own.put(LAYOUT.head, sign_document(forged.to_body(), k, context=ctx), timeout=10)
    await ti.poll(1)
    assert ti.stats.head_rejected == 1 and ti.stats.lists == lists + 1
    # a planted manifest (no head change) and a valid batch: found by the listing, the planted one
    # refused, the valid one accepted in the same poll
    await a.own.put(LAYOUT.manifest(1, a.node, 50), b"{}", timeout=10)
    await w.write(make_rows(a.node, 1, seed=5))
    assert await ti.poll(1) == 1
    assert ti.stats.rejected == {"malformed": 1}
    assert len(ti.take(1)) == 5  # seeds 1-5 and nothing else


async def test_a_head_unchanged_for_relist_after_s_is_listed_anyway(sites: list[Site]) -> None:
    """The safety net for a head write that failed: a batch whose head was not rewritten waits for
    the next head or for ``relist_after_s`` since the last listing (0 here: every poll lists)."""
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 1, seed=1))
    lazy, eager = intake(sites), intake(sites, relist_after_s=0.0)
    assert await lazy.poll(1) == 1 and await eager.poll(1) == 1
    head = await a.own.get(LAYOUT.head, timeout=10)
    await w.write(make_rows(a.node, 1, seed=2))
    await a.own.put(LAYOUT.head, head, timeout=10)  # the same bytes, the same ETag: as if not rewritten
    before = lazy.stats.lists
    assert await lazy.poll(1) == 0 and lazy.stats.lists == before  # a 304: nothing listed
    assert await eager.poll(1) == 1  # listed anyway
    await w.write(make_rows(a.node, 1, seed=3))  # the next head
    assert await lazy.poll(1) == 2
