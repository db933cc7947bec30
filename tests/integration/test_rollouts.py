"""The rollout channel: Parquet batch format, signed batches in each inference node's own bucket,
and the trainer's intake (trust per node, digest per version, staleness, partition, retention).

Inference node ``inf-a`` writes to site bucket ``pulsenet-a`` with its own write-only-there
identity, ``inf-b`` to ``pulsenet-b``; the trainer reads both with the read-only identity. Tampering
tests write with a site's own credentials: what a compromised or buggy site could do.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.codec.rollout import Rollout, decode_batch, encode_batch
from pulsenet.errors import RolloutError
from pulsenet.rollouts import (
    RolloutIntake,
    RolloutIntakeConfig,
    RolloutLayout,
    RolloutWriter,
    RolloutWriterConfig,
    owner,
)
from pulsenet.rollouts.manifest import BatchManifest, now_iso, sign_batch_manifest
from pulsenet.signed import ObjectRef
from pulsenet.signing import MAX_DOCUMENT, key_id
from pulsenet.store.seaweed import SeaweedServer
from tests.support.rollouts import DIGESTS, Site, intake, make_rows, make_sites

pytestmark = pytest.mark.timeout(120)



# --- format ------------------------------------------------------------------------------------


def test_format_round_trip_is_exact() -> None:
    rows = make_rows("inf-a", 7, groups=3, g=4)
    rows.append(dataclasses.replace(rows[0], completion_ids=(), logprobs=(), seed=-3, reward=-1e300))
    data = encode_batch(rows)
    assert decode_batch(data) == rows
    kv = pq.ParquetFile(pa.BufferReader(data)).metadata.metadata
    assert kv[b"pulsenet.format"] == b"pulsenet-rollouts" and kv[b"pulsenet.schema"] == b"1"
    assert pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0).column(1).compression == "ZSTD"


def test_encoder_refuses_rows_that_cannot_travel() -> None:
    row = make_rows("inf-a", 1)[1]
    for bad in (
        dataclasses.replace(row, logprobs=(*row.logprobs, -1.0)),
        dataclasses.replace(row, reward=float("nan")),
        dataclasses.replace(
            row, logprobs=(float("-inf"),) * len(row.completion_ids), completion_ids=row.completion_ids
        )
        if row.completion_ids
        else dataclasses.replace(row, completion_ids=(1,), logprobs=(float("-inf"),)),
        dataclasses.replace(row, prompt_ids=(-1,)),
        dataclasses.replace(row, prompt_ids=(1 << 31,)),
        dataclasses.replace(row, model_digest="xyz"),
        dataclasses.replace(row, node="a/b"),
    ):
        with pytest.raises(RolloutError):
            encode_batch([bad])
    with pytest.raises(RolloutError):
        encode_batch([])


def _table_bytes(columns: dict, metadata: dict | None = None) -> bytes:
    """A Parquet file written the way encode_batch writes one, from arbitrary columns."""
    table = pa.table(columns)
    sink = io.BytesIO()
    with pq.ParquetWriter(
        sink, table.schema, compression="zstd", store_schema=False, write_statistics=False
    ) as w:
        w.write_table(table)
        w.add_key_value_metadata(
            {b"pulsenet.format": b"pulsenet-rollouts", b"pulsenet.schema": b"1"}
            if metadata is None
            else metadata
        )
    return sink.getvalue()


def _arrow_default(columns: dict) -> bytes:
    """pyarrow's default file (with ARROW:schema): this format refuses metadata it does not define."""
    sink = io.BytesIO()
    table = pa.table(columns).replace_schema_metadata(
        {b"pulsenet.format": b"pulsenet-rollouts", b"pulsenet.schema": b"1"}
    )
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def _columns(rows: list[Rollout]) -> dict:
    return {
        "group": pa.array([r.group for r in rows], pa.string()),
        "prompt_ids": pa.array([list(r.prompt_ids) for r in rows], pa.list_(pa.int32())),
        "completion_ids": pa.array([list(r.completion_ids) for r in rows], pa.list_(pa.int32())),
        "logprobs": pa.array([list(r.logprobs) for r in rows], pa.list_(pa.float32())),
        "reward": pa.array([r.reward for r in rows], pa.float64()),
        "version": pa.array([r.version for r in rows], pa.int64()),
        "model_digest": pa.array([r.model_digest for r in rows], pa.string()),
        "node": pa.array([r.node for r in rows], pa.string()),
        "seed": pa.array([r.seed for r in rows], pa.int64()),
    }


def test_decoder_refuses_hostile_batches() -> None:
    rows = [r for r in make_rows("inf-a", 3) if r.completion_ids][:4]
    good = encode_batch(rows)
    assert _table_bytes(_columns(rows)) and decode_batch(_table_bytes(_columns(rows))) == rows
    cols = _columns(rows)

    def with_(**changes: pa.Array) -> bytes:
        return _table_bytes({**cols, **changes})

    n = len(rows)
    hostile = {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "footer cut": good[:-9],
        "not parquet": b"PAR1" + b"\x00" * 64 + b"PAR1",
        "corrupted pages": good[:8] + bytes(b ^ 0x5A for b in good[8:200]) + good[200:],
        "no format metadata": _table_bytes(cols, metadata={}),
        "arrow schema metadata": _arrow_default(cols),
        "other schema version": _table_bytes(
            cols, metadata={b"pulsenet.format": b"pulsenet-rollouts", b"pulsenet.schema": b"2"}
        ),
        "missing column": _table_bytes({k: v for k, v in cols.items() if k != "seed"}),
        "extra column": with_(extra=pa.array([1] * n)),
        "wrong type int64 ids": with_(
            prompt_ids=pa.array([list(r.prompt_ids) for r in rows], pa.list_(pa.int64()))
        ),
        "wrong type reward str": with_(reward=pa.array(["1"] * n)),
        "null reward": with_(reward=pa.array([None] + [1.0] * (n - 1), pa.float64())),
        "null token": with_(
            completion_ids=pa.array([[None, *r.completion_ids[1:]] for r in rows], pa.list_(pa.int32()))
        ),
        "null list": with_(
            logprobs=pa.array([None] + [list(r.logprobs) for r in rows[1:]], pa.list_(pa.float32()))
        ),
        "length mismatch": with_(
            logprobs=pa.array([[*r.logprobs, -1.0] for r in rows], pa.list_(pa.float32()))
        ),
        "nan reward": with_(reward=pa.array([float("nan")] * n, pa.float64())),
        "inf logprob": with_(
            logprobs=pa.array([[float("-inf")] * len(r.logprobs) for r in rows], pa.list_(pa.float32()))
        ),
        "negative token": with_(prompt_ids=pa.array([[-5] for _ in rows], pa.list_(pa.int32()))),
        "bad digest": with_(model_digest=pa.array(["00"] * n)),
        "bad node": with_(node=pa.array(["../etc"] * n)),
        "empty group": with_(group=pa.array([""] * n)),
        "negative version": with_(version=pa.array([-1] * n, pa.int64())),
    }
    for what, data in hostile.items():
        with pytest.raises(RolloutError):
            decode_batch(data)
            pytest.fail(f"{what}: decoded")
    with pytest.raises(RolloutError, match="rows"):
        decode_batch(good, max_rows=n - 1)
    tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    with pytest.raises(RolloutError, match=r"decoded bytes|tokens"):
        decode_batch(good, max_tokens=tokens - 1)
    big = encode_batch(
        [dataclasses.replace(rows[0], completion_ids=(7,) * 100_000, logprobs=(-0.5,) * 100_000)]
    )
    assert len(big) < 4096  # a tiny payload that decodes to ~1 MB: refused from its page headers

    # a footer that understates a column's values (pages declare more) is refused too
    def varint(v: int) -> bytes:
        out = b""
        while True:
            out += bytes([(v & 0x7F) | (0x80 if v > 0x7F else 0)])
            v >>= 7
            if not v:
                return out

    honest = b"\x16" + varint(2 * 100_000)  # ColumnMetaData.num_values (field 5, i64, zigzag)
    assert big.count(honest) == 2  # completion_ids and logprobs
    with pytest.raises(RolloutError, match="pages hold 100000 values, the footer says 20000"):
        decode_batch(big.replace(honest, b"\x16" + varint(2 * 20_000)))
    with pytest.raises(RolloutError, match="over 1000 tokens"):
        decode_batch(big, max_tokens=1000, max_rows=1)


# --- the channel over the real store -------------------------------------------------------------


@pytest.fixture
def sites(s3_factory, seaweed: SeaweedServer) -> list[Site]:
    return make_sites(s3_factory, seaweed)


async def test_valid_batches_flow_from_two_nodes(sites: list[Site]) -> None:
    wa, wb = sites[0].writer(), sites[1].writer()
    await wa.start()
    await wb.start()
    sent = {}
    for v in (4, 5):
        for w in (wa, wb):
            m = await w.write(make_rows(w.node, v))
            sent[(w.node, m.seq)] = make_rows(w.node, v)
            assert m.rows == 6 and m.groups == 2 and m.version == v
    ti = intake(sites)
    assert await ti.poll(5) == 4
    assert await ti.poll(5) == 0  # nothing new, nothing fetched twice
    got = ti.take(5)
    assert {(b.manifest.node, b.manifest.seq): b.columns.to_rows() for b in got} == sent
    assert ti.stats.rejected == {} and ti.stats.taken == 4 and ti.stats.staleness == {1: 2, 0: 2}
    # the trainer's credentials cannot write into a node's bucket
    with pytest.raises(Exception, match=r"[Aa]ccess|[Dd]enied|403"):
        await sites[0].read.put("rollouts/manifests/x", b"x", timeout=10)


async def test_a_restarted_intake_skips_the_batches_its_trainer_consumed(sites: list[Site]) -> None:
    """``consumed`` is part of a trainer's resume state: a new intake given it (``skip_consumed``)
    queues only the batches the trainer had not taken, though all are still fresh and valid."""
    w = sites[0].writer()
    await w.start()
    for v in (4, 4, 5):
        await w.write(make_rows(w.node, v))
    before = intake(sites)
    assert await before.poll(5) == 3
    taken = before.take(5, max_batches=2)  # newest version first (in order within one): one v4 stays
    consumed = before.consumed()
    assert sorted(consumed.values()) == [4, 5] and len(consumed) == 2

    after = intake(sites)  # the restart: a fresh intake over the same stores
    after.skip_consumed(consumed)
    assert await after.poll(5) == 1
    assert [b.manifest.seq for b in taken] == [2, 0]
    assert [b.manifest.seq for b in after.take(5)] == [1]
    # a fresh intake without the record would train on all three again
    assert await intake(sites).poll(5) == 3
    # the record forgets what is past the staleness window (max_staleness 2: at v7 only v5 is kept)
    await after.poll(7)
    assert list(after.consumed().values()) == [5]


async def _plant(
    site: Site,
    batch: list[Rollout],
    seq: int,
    *,
    key: Ed25519PrivateKey | None = None,
    run: str = "test",
    **overrides: object,
) -> BatchManifest:
    """Upload a batch by hand (payload + manifest) the way a writer would, with any fields changed."""
    key = key or site.key
    layout = RolloutLayout()
    data = encode_batch(batch)
    sha = hashlib.sha256(data).hexdigest()
    version = batch[0].version
    fields = dict(
        node=site.node,
        seq=seq,
        version=version,
        model_digest=batch[0].model_digest,
        payload=ObjectRef(key=layout.batch(version, site.node, seq, sha), size=len(data), sha256=sha),
        rows=len(batch),
        groups=len({r.group for r in batch}),
        tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in batch),
        publisher=key_id(key.public_key()),
        created=now_iso(),
    )
    fields.update(overrides)
    m = BatchManifest(**fields)
    await site.own.put(m.payload.key, data, timeout=10)
    signed = sign_batch_manifest(m, key, context=RolloutLayout().context(run, site.read.url, site.node))
    await site.own.put(layout.manifest(version, site.node, seq), signed, timeout=10)
    return m


async def test_forged_batch_is_rejected(sites: list[Site]) -> None:
    a = sites[0]
    await _plant(a, make_rows(a.node, 3, seed=1), 0, key=Ed25519PrivateKey.generate())
    await _plant(a, make_rows(a.node, 3, seed=2), 1, run="other-run")  # right key, other context
    await a.writer().write(make_rows(a.node, 3, seed=3))
    ti = intake(sites)
    assert await ti.poll(3) == 1
    assert ti.stats.rejected == {"signature": 2}
    assert [b.columns.to_rows() for b in ti.take(3)] == [make_rows(a.node, 3, seed=3)]


async def test_tampered_payload_is_rejected(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    m1 = await w.write(make_rows(a.node, 2, seed=1))
    m2 = await w.write(make_rows(a.node, 2, seed=2))
    await w.write(make_rows(a.node, 2, seed=3))
    data = bytearray(await a.own.get(m1.payload.key, timeout=10))
    data[len(data) // 2] ^= 1
    await a.own.put(m1.payload.key, bytes(data), timeout=10)  # same size, other bytes
    await a.own.put(m2.payload.key, bytes(data) + b"!", timeout=10)  # longer than signed
    ti = intake(sites)
    assert await ti.poll(2) == 1
    assert ti.stats.rejected == {"hash_mismatch": 1, "size_mismatch": 1}
    assert ti.take(2)[0].columns.to_rows() == make_rows(a.node, 2, seed=3)


async def test_stale_batches_are_dropped_in_flight_and_in_queue(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    for v in (1, 2, 3, 5):
        await w.write(make_rows(a.node, v))
    ti = intake(sites, max_staleness=2)
    assert await ti.poll(4) == 2  # v1 is 3 behind trainer v4: stale in flight; v5 is not reached yet
    assert ti.stats.stale_in_flight == 1 and ti.stats.rejected == {}
    assert await ti.poll(5) == 1  # now v5; v1 is never fetched again
    assert ti.stats.stale_in_flight == 1
    got = ti.take(5)  # trainer moved to v5 while v2 waited: dropped as stale in the queue
    assert [b.version for b in got] == [5, 3]  # newest first
    assert ti.stats.stale_queued == 1 and ti.stats.staleness == {2: 1, 0: 1}


async def test_wrong_digest_is_rejected(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    await w.write(make_rows(a.node, 6, digest=DIGESTS[5]))  # served v5's weights but labelled v6
    await w.write(make_rows(a.node, 6))
    ti = RolloutIntake(
        [a.source()], lambda v: DIGESTS[v] if v != 7 else None, RolloutIntakeConfig(run="test")
    )
    await w.write(make_rows(a.node, 7))  # nothing published for v7 (as far as this trainer knows)
    assert await ti.poll(7) == 1
    assert ti.stats.rejected == {"wrong_digest": 1, "unknown_version": 1}


async def test_other_nodes_key_is_rejected_in_this_nodes_slot(sites: list[Site]) -> None:
    a, b = sites
    # node b's (trusted) key signs a batch in node a's bucket, claiming to be node a
    impostor = RolloutWriter(a.own, b.key, a.node, RolloutWriterConfig(run="test"))
    await impostor.write(make_rows(a.node, 1))
    await a.writer().write(make_rows(a.node, 1, seed=9))
    ti = intake(sites)
    assert await ti.poll(1) == 1
    assert ti.stats.rejected == {"wrong_node_key": 1}
    assert ti.take(1)[0].manifest.publisher == key_id(a.key.public_key())


async def test_rows_must_match_their_manifest(sites: list[Site]) -> None:
    a = sites[0]
    await _plant(a, make_rows("inf-b", 2), 0, node=a.node)  # rows of another node under a's manifest
    await _plant(a, make_rows(a.node, 2), 1, rows=5)  # row count lies
    ti = intake(sites)
    assert await ti.poll(2) == 0
    assert ti.stats.rejected == {"row_mismatch": 1, "payload_malformed": 1}  # 6 rows > declared 5


async def test_oversized_batch_is_refused_before_download(sites: list[Site]) -> None:
    a = sites[0]
    m = await a.writer().write(make_rows(a.node, 1, groups=8, g=8))
    ti = intake(sites, max_batch_bytes=m.payload.size - 1)
    assert await ti.poll(1) == 0
    assert ti.stats.rejected == {"too_large": 1} and ti.stats.bytes_downloaded == 0
    ti = intake(sites, max_rows=m.rows - 1)
    assert await ti.poll(1) == 0
    assert ti.stats.rejected == {"too_large": 1} and ti.stats.bytes_downloaded == 0
    # a manifest over the document limit is refused by its listed size, and a payload larger than
    # its manifest says is cut off at the signed size
    await a.own.put(RolloutLayout().manifest(1, a.node, 5), b" " * (MAX_DOCUMENT + 1), timeout=30)
    m2 = await a.writer().write(make_rows(a.node, 1, seed=4))
    await a.own.put(m2.payload.key, b"x" * (10 * m2.payload.size), timeout=10)
    ti = intake(sites)
    assert await ti.poll(1) == 1
    assert ti.stats.rejected == {"too_large": 1, "size_mismatch": 1}
    assert ti.stats.bytes_downloaded == m.payload.size


async def test_planted_malformed_manifest_does_not_block_valid_batches(sites: list[Site]) -> None:
    a = sites[0]
    layout = RolloutLayout()
    # sorted before the valid one, and a garbage object that is not even a manifest name
    await a.own.put(layout.manifest(0, a.node, 0), b'{"body": {"format": 1}}', timeout=10)
    await a.own.put(layout.manifest(0, a.node, 1), b"\xff" * 100, timeout=10)
    await a.own.put(layout.manifests + "junk.json", b"junk", timeout=10)
    w = a.writer()
    await w.start()
    assert w.next_seq == 0 and w.stats.junk_names == 2  # a planted name never sets the sequence (issue 29)
    await w.write(make_rows(a.node, 1))
    ti = intake(sites)
    assert await ti.poll(1) == 1
    assert ti.stats.rejected == {"malformed": 2}
    await w.write(make_rows(a.node, 1, seed=5))
    assert await ti.poll(1) == 1
    assert ti.stats.rejected == {"malformed": 2}  # remembered by key and ETag: not fetched or counted again
    assert len(ti.take(1)) == 2


async def test_partition_gives_each_batch_to_exactly_one_trainer(sites: list[Site]) -> None:
    for s in sites:
        w = s.writer()
        for i in range(8):
            await w.write(make_rows(s.node, 3 + i % 2, seed=i))
    trainers = [intake(sites, trainer_id=t, participants=("t1", "t0")) for t in ("t0", "t1")]
    alone = intake(sites)
    await alone.poll(4)
    everything = {(b.manifest.node, b.manifest.seq) for b in alone.take(4)}
    assert len(everything) == 16
    taken = []
    for t in trainers:
        await t.poll(4)
        await t.poll(4)
        taken.append({(b.manifest.node, b.manifest.seq) for b in t.take(4)})
    assert taken[0] and taken[1] and not taken[0] & taken[1]
    assert taken[0] | taken[1] == everything
    assert trainers[0].stats.other_trainer == len(taken[1])
    assert owner("x", ["t0", "t1"]) == owner("x", ["t1", "t0", "t1"])


async def test_retention_keeps_storage_bounded(sites: list[Site]) -> None:
    a, b = sites
    w = a.writer(max_staleness=2)
    other = b.writer()
    await other.write(make_rows(b.node, 0))
    counts = []
    for v in range(12):
        for s in range(2):
            await w.write(make_rows(a.node, v, seed=s))
        await w.retain(v)
        counts.append(len(await a.own.list("rollouts/", timeout=10)) - 2)  # less the head and the key
    assert max(counts) <= 2 * 2 * 3  # (manifest + payload) x 2 batches x (max_staleness + 1) versions
    left = RolloutLayout()
    versions = {left.parse_manifest(i.key).version for i in await a.own.list(left.manifests, timeout=10)}
    assert versions == {9, 10, 11}
    assert len(await b.own.list("rollouts/", timeout=10)) == 4  # another node's store is not touched (+ head, key)
    ti = intake(sites)
    assert await ti.poll(11) == 6  # every manifest left names a payload that is still there
    assert ti.stats.rejected == {} and ti.stats.stale_in_flight == 1  # b's v0


async def test_restart_continues_the_sequence_and_never_overwrites(sites: list[Site]) -> None:
    a = sites[0]
    w = a.writer()
    seqs = [(await w.write(make_rows(a.node, 1, seed=i))).seq for i in range(3)]
    assert seqs == [0, 1, 2]
    layout = RolloutLayout()
    await a.own.put(layout.batch(1, a.node, 4, "0" * 64), b"crashed before its manifest", timeout=10)
    restarted = a.writer()
    await restarted.start()
    assert restarted.next_seq == 5
    assert (await restarted.write(make_rows(a.node, 1, seed=3))).seq == 5
    # two instances of one node (a restart racing its old self): the second moves on, nothing is overwritten
    x, y = a.writer(), a.writer()
    await x.start()
    await y.start()
    mx = await x.write(make_rows(a.node, 1, seed=4))
    my = await y.write(make_rows(a.node, 1, seed=5))
    assert (mx.seq, my.seq) == (6, 7) and y.stats.seq_taken == 1
    ti = intake(sites)
    assert await ti.poll(1) == 6
    by_seq = {b.manifest.seq: b.columns.to_rows() for b in ti.take(1)}
    assert by_seq[6] == make_rows(a.node, 1, seed=4) and by_seq[7] == make_rows(a.node, 1, seed=5)


async def test_a_writer_removes_payloads_whose_manifest_was_never_written(sites: list[Site]) -> None:
    """Issue 24 item 3: a writer killed between its payload and manifest puts leaves a payload no
    manifest names. The node's next writer deletes it at start once older than ``orphan_grace_s``
    (kept before: a racing instance may still write its manifest), and retention deletes it once
    it is below the floor; never another node's object, never a payload a manifest names."""
    a, b = sites
    layout = RolloutLayout()
    w = a.writer()
    kept = [await w.write(make_rows(a.node, 1, seed=i)) for i in range(2)]
    orphan = layout.batch(1, a.node, 2, "0" * 64)  # killed between the two puts
    await a.own.put(orphan, b"payload of a batch whose manifest was never written", timeout=10)
    theirs = layout.batch(1, b.node, 0, "1" * 64)  # not this node's: never touched
    await a.own.put(theirs, b"x", timeout=10)

    async def batch_keys() -> set[str]:
        return {i.key for i in await a.own.list(layout.batches, timeout=10)}

    patient = a.writer()  # default grace: the orphan is seconds old and may still get its manifest
    await patient.start()
    assert orphan in await batch_keys() and patient.stats.orphans_deleted == 0
    restarted = a.writer(orphan_grace_s=0.0)
    await restarted.start()
    assert restarted.next_seq == 3  # past the orphan's number: never reused
    assert await batch_keys() == {m.payload.key for m in kept} | {theirs}
    assert restarted.stats.orphans_deleted == 1 == restarted.stats.deleted
    # retention deletes an orphan below the floor whatever its age
    late = layout.batch(2, a.node, 9, "2" * 64)
    await a.own.put(late, b"y", timeout=10)
    await patient.retain(2)  # floor 0: nothing below it; the orphan is young
    assert late in await batch_keys()
    assert await patient.retain(5) == 2 * 2 + 1  # v1's two batches (manifest + payload) and the v2 orphan
    assert await batch_keys() == {theirs}
    assert await patient.retain(5) == 0  # the floor did not move: nothing listed
    ti = intake(sites)
    await ti.poll(3)
    assert ti.stats.rejected == {}  # no manifest was left naming a missing payload
