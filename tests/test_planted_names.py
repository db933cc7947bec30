"""Issue 29 items 7, 8, 9, 11: an object name or a listing is a claim, never a fact.

Anyone who can put an object name in a bucket (a site writer, no key) plants names; a node may let
a listing narrow a search, but only what a trusted key signed decides, and every number in a name is
bounded by what the node knows before it steers anything. Each test plants what the hostile review
planted on main at 7876ec8 and checks the node neither dies, nor waits for good, nor fails.
"""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_rollouts import DIGESTS, Site, intake, make_rows, make_sites

from pulsenet.rollouts import Demand, RolloutLayout, RolloutWriter, RolloutWriterConfig, batches_to_generate
from pulsenet.rollouts.layout import BatchName
from pulsenet.rollouts.manifest import BatchManifest, now_iso, sign_batch_manifest
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id
from pulsenet.store.seaweed import SeaweedServer

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
