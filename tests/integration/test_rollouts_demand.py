"""Issue 23: generation paced by the trainers' signed demand records (pulsenet/rollouts/demand.py).

The pacing function is pure and tested alone; the records are written and read over the real
SeaweedFS, each trainer in its own bucket with its own credentials, the nodes reading with the
read-only identity; a paced network of one trainer and two nodes then trains on every batch it
generates but the last step's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.errors import ManifestError
from pulsenet.rollouts import (
    Demand,
    DemandConfig,
    DemandReader,
    DemandSource,
    DemandWriter,
    RolloutLayout,
    batches_to_generate,
    owner,
)
from pulsenet.rollouts.layout import BatchName
from pulsenet.signing import key_id
from pulsenet.store import ObjectStore
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import DIGESTS, Site, intake, make_rows, make_sites

pytestmark = pytest.mark.timeout(120)
LAYOUT = RolloutLayout()


def demand(trainer: str = "t0", version: int = 10, **kw: object) -> Demand:
    fields = dict(
        trainer=trainer,
        version=version,
        max_staleness=2,
        participants=(trainer,),
        grants={"inf-a": 32, "inf-b": 32},
        taken={"inf-a": 0, "inf-b": 0},
    )
    fields.update(kw)
    return Demand(**fields)


def names(node: str, versions: list[int]) -> list[BatchName]:
    return [BatchName(v, node, seq) for seq, v in enumerate(versions)]


# --- pacing, pure --------------------------------------------------------------------------------


def test_pacing_generates_the_shortfall_and_waits_when_covered() -> None:
    pace = dict(node="inf-a", version=10, rows_per_batch=8)
    assert batches_to_generate([], produced=[], **pace) is None  # no trainer paces: unpaced
    assert batches_to_generate([demand(grants={"inf-b": 32})], produced=[], **pace) is None
    d = demand()
    assert batches_to_generate([d], produced=[], **pace) == 4  # 32 rows / 8
    assert batches_to_generate([d], produced=names("inf-a", [10, 9]), **pace) == 2
    assert batches_to_generate([d], produced=names("inf-a", [10, 10, 9, 8]), **pace) == 0  # covered: wait
    # taken batches are not outstanding; those older than the trainer accepts are not either
    taken = demand(taken={"inf-a": 3})
    assert batches_to_generate([taken], produced=names("inf-a", [10, 10, 9, 8]), **pace) == 3
    assert batches_to_generate([d], produced=names("inf-a", [7, 7, 6, 5]), **pace) == 4
    # a grant in rows that is not a whole number of batches rounds up
    assert batches_to_generate([demand(grants={"inf-a": 20})], produced=names("inf-a", [10]), **pace) == 2
    # grant 0 (a node the trainer thinks dead) or a served version too old for the trainer: wait
    assert batches_to_generate([demand(grants={"inf-a": 0})], produced=[], **pace) == 0
    assert batches_to_generate([demand(version=13)], produced=[], **pace) == 0  # v10 < 13 - 2
    with pytest.raises(ValueError):
        batches_to_generate([d], produced=[], node="inf-a", version=10, rows_per_batch=0)


def test_pacing_counts_each_trainers_own_batches() -> None:
    """Two trainers share the pool by the partition: a batch counts as outstanding only for the
    trainer that owns it, and the node makes the sum of both shortfalls."""
    parts = ("t0", "t1")
    made = names("inf-a", [10] * 12)
    owners = [owner(LAYOUT.batch_id("inf-a", b), parts) for b in made]
    n0, n1 = owners.count("t0"), owners.count("t1")
    assert n0 and n1
    t0 = demand("t0", participants=parts, grants={"inf-a": 8 * (n0 + 2)})
    t1 = demand("t1", participants=parts, grants={"inf-a": 8 * n1}, taken={"inf-a": 1})
    assert batches_to_generate([t0, t1], node="inf-a", version=10, produced=made, rows_per_batch=8) == 2 + 1


# --- the record over the real store --------------------------------------------------------------


@dataclasses.dataclass
class Trainer:
    id: str
    key: Ed25519PrivateKey
    own: ObjectStore
    read: ObjectStore

    def source(self) -> DemandSource:
        return DemandSource(self.id, self.read, {key_id(self.key.public_key()): self.key.public_key()})

    def writer(self, **cfg: object) -> DemandWriter:
        return DemandWriter(self.own, self.key, self.id, DemandConfig(run="test", **cfg))


@pytest.fixture
def trainers(s3_factory, seaweed: SeaweedServer) -> list[Trainer]:
    """Trainers t0 and t1, each writing its own bucket (site a, site b) under its own prefix."""
    out = []
    for t, site in (("t0", "a"), ("t1", "b")):
        prefix = f"demand-{t}-{uuid.uuid4().hex[:8]}"
        bucket = seaweed.bucket(site)
        out.append(
            Trainer(
                t,
                Ed25519PrivateKey.generate(),
                s3_factory(identity=seaweed.writer(site), bucket=bucket, prefix=prefix),
                s3_factory(identity="reader", bucket=bucket, prefix=prefix),
            )
        )
    return out


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)


async def test_records_are_signed_per_trainer_and_never_go_back(trainers: list[Trainer]) -> None:
    t0, t1 = trainers
    w = t0.writer()
    await w.start()
    first = await w.write(demand("t0", version=3))
    reader = DemandReader([t0.source(), t1.source()], DemandConfig(run="test"))
    assert await reader.poll() == [first]
    assert reader.stats.missing == 1  # t1 has written nothing yet
    old_bytes = await t0.own.get(LAYOUT.demand("t0"), timeout=10)
    second = await w.write(demand("t0", version=4, taken={"inf-a": 2}))
    assert second.seq > first.seq and await reader.poll() == [second]
    # a site writer of t0's bucket replays the older signed record: seen, counted, ignored
    await t0.own.put(LAYOUT.demand("t0"), old_bytes, timeout=10)
    assert await reader.poll() == [second] and reader.stats.backwards == 1
    # t0's record copied into t1's slot (another bucket, another trainer) does not verify there,
    # nor does one t1 writes with a key not trusted for it
    await t1.own.put(LAYOUT.demand("t1"), old_bytes, timeout=10)
    await reader.poll()
    forged = DemandWriter(t1.own, Ed25519PrivateKey.generate(), "t1", DemandConfig(run="test"))
    await forged.write(demand("t1", version=99))
    await reader.poll()
    assert reader.stats.rejected == {"t1": 2} and reader.live() == [second]
    # deleted: counted missing; the last good record stays live until ttl_s (reader's clock)
    await t0.own.delete([LAYOUT.demand("t0")], timeout=10)
    missing = reader.stats.missing
    assert await reader.poll() == [second] and reader.stats.missing == missing + 1
    assert reader.live(now=asyncio.get_running_loop().time() + 10**6) == []
    # the trainers' stores are read-only to a node
    with pytest.raises(Exception, match=r"[Aa]ccess|[Dd]enied|403"):
        await t0.read.put(LAYOUT.demand("t0"), old_bytes, timeout=10)
    # a restarted writer continues after its own record, even if it was planted over
    await w.write(demand("t0", version=5))
    again = t0.writer()
    await again.start()
    assert (await again.write(demand("t0", version=5))).seq > w.last.seq


async def test_writer_rewrites_on_change_and_heartbeat(trainers: list[Trainer]) -> None:
    t0 = trainers[0]
    stop = asyncio.Event()
    versions = iter([1, 1, 1, 2, 2])

    def snapshot() -> Demand:
        try:
            return demand("t0", version=next(versions))
        except StopIteration:
            stop.set()
            return demand("t0", version=2)

    w = t0.writer(interval_s=0.001, heartbeat_s=3600, ttl_s=7200)
    await w.run(snapshot, stop)
    assert w.stats.writes == 2 and w.last is not None and w.last.version == 2
    w = t0.writer(interval_s=0.001, heartbeat_s=1e-9)  # every check is a heartbeat
    versions = iter([7, 7, 7])
    await w.run(snapshot, stop := asyncio.Event())
    assert w.stats.writes == 4


def test_records_refuse_malformed_bodies() -> None:
    good = dataclasses.replace(demand(), seq=5, publisher="ab" * 8, created="x").to_body()
    assert Demand.from_body(good).grants == {"inf-a": 32, "inf-b": 32}
    for change in (
        {"format": "other"},
        {"seq": -1},
        {"version": True},
        {"participants": []},
        {"participants": ["t1"]},  # without the trainer
        {"participants": ["t1", "t0"]},  # unsorted
        {"grants": {"../x": 1}},
        {"grants": {"inf-a": 1.5}},
        {"taken": {"inf-a": 1 << 41}},
        {"extra": 1},
    ):
        with pytest.raises(ManifestError):
            Demand.from_body({**good, **change})


# --- a paced network ----------------------------------------------------------------------------


async def test_a_paced_network_trains_on_what_it_generates(sites: list[Site], trainers: list[Trainer]) -> None:
    """One trainer, two nodes, 20 versions. Per step, as on a real network: the trainer takes a
    step's rows (newest first) and says so in its record; the nodes, serving the trainer's current
    version, read the records and generate what they ask while the trainer trains; the trainer
    publishes the next version. Everything generated is trained on but the last step's rows in
    flight: nothing goes stale, the trained fraction is >= 95% (issue 23's target), each step finds
    its rows (the engines never over- or under-produce), and the lag is 1."""
    t0 = trainers[0]
    rows_per_step, rows_per_batch, steps = 32, 8, 20
    ti = intake(sites, max_staleness=2)
    dw = t0.writer()
    await dw.start()
    reader = DemandReader([t0.source()], DemandConfig(run="test"))
    writers = [s.writer() for s in sites]
    for w in writers:
        await w.start()
    version, generated, trained, short = 0, 0, 0, 0

    async def generate() -> None:
        nonlocal generated
        live = await reader.poll()
        for w in writers:
            n = batches_to_generate(live, node=w.node, version=version, produced=w.produced, rows_per_batch=rows_per_batch)
            assert n is not None
            for _ in range(n):
                await w.write(make_rows(w.node, version, groups=2, g=4, seed=generated))
                generated += 1

    await dw.write(ti.demand(version, rows_per_step))
    await generate()
    for _ in range(steps):
        await ti.poll(version)
        rows = []
        while len(rows) < rows_per_step and (got := ti.take(version, max_batches=1)):
            rows += got[0].rows
        short += len(rows) < rows_per_step
        trained += len(rows) // rows_per_batch
        await dw.write(ti.demand(version, rows_per_step))
        await generate()  # while the trainer trains
        version += 1  # the step's new version, published
        await dw.write(ti.demand(version, rows_per_step))
        for w in writers:
            await w.retain(version)
    assert short == 0
    assert ti.stats.stale_in_flight == ti.stats.stale_queued == 0 and ti.stats.rejected == {}
    assert generated - trained == rows_per_step // rows_per_batch  # the last step's, in flight
    assert trained / generated >= 0.95
    assert ti.stats.staleness == {0: 4, 1: trained - 4}  # the first step's rows, then one version behind
    assert version == steps and DIGESTS[version]


async def test_an_idle_demand_poll_is_one_conditional_get_per_trainer(trainers: list[Trainer]) -> None:
    for t in trainers:
        w = t.writer()
        await w.write(demand(t.id, participants=(t.id,)))
    reader = DemandReader([t.source() for t in trainers], DemandConfig(run="test"))
    assert len(await reader.poll()) == 2
    before = [t.read.requests.snapshot() for t in trainers]
    assert len(await reader.poll()) == 2
    for t, b in zip(trainers, before, strict=True):
        d = t.read.requests - b
        assert (d.requests, d.get_not_modified) == (1, 1)
    assert reader.stats.not_modified == 2 and reader.stats.reads == 2
