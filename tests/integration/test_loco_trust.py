"""PULSELoCo against a hostile store: forged, foreign, malformed and oversized documents and objects,
planted by a bucket writer or signed by a compromised trainer key (issue 12; docs/security.md)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest

from pulsenet.errors import (
    DocumentTooLarge,
    ManifestError,
    RoundError,
    SignatureError,
    SizeMismatch,
    StoreUnavailable,
)
from pulsenet.loco import LocoConfig, Record, RoundStore
from pulsenet.loco.documents import (
    KIND_DIGEST,
    KIND_MANIFEST,
    KIND_RECORD,
    trainer_keys,
)
from pulsenet.loco.layout import LocoLayout
from pulsenet.signed import ObjectRef
from pulsenet.signing import load_private_key, sign_document
from pulsenet.store.base import ObjectStore
from tests.support.loco_helpers import forge_payloads, make_keys, tiny_trainer
from tests.support.store import StoreFactory

pytestmark = pytest.mark.integration
LAYOUT = LocoLayout()
IDS = ("t0", "t1", "t2")


@pytest.fixture
def keys(tmp_path: Path) -> tuple[dict[str, Path], list[Path]]:
    return make_keys(tmp_path / "keys", IDS)


def _rs(store: ObjectStore, tid: str, keys: tuple[dict[str, Path], list[Path]], **kw: Any) -> RoundStore:
    priv, pubs = keys
    return RoundStore(store, tid, load_private_key(priv[tid]), trainer_keys(pubs), **kw)


def _manifest_body(tid: str, r: int = 1, **over: Any) -> dict[str, Any]:
    sha = "ab" * 32
    body = {
        "kind": KIND_MANIFEST, "trainer": tid, "round": r, "run": "default",
        "payload": {"key": LAYOUT.payload(tid, r, sha), "size": 10, "sha256": sha},
        "mode": "pulseloco", "sent": 1, "total": 2, "base_digest": "cd" * 32,
    }  # fmt: skip
    body.update(over)
    return body


async def _plant(rs: RoundStore, key: str, body: dict[str, Any], *, context: str | None = None) -> None:
    """Write ``body`` at ``key`` signed with ``rs``'s key: what a holder of that key can do."""
    await rs.store.put(key, sign_document(body, rs.key, context=context or rs.context), timeout=10)


# --- item 7: a trainer's slot speaks only with that trainer's key --------------------------------


async def test_slot_accepts_only_its_trainers_key(s3_factory: StoreFactory, keys: Any) -> None:
    store = s3_factory()
    t0, reader = _rs(store, "t0", keys), _rs(store, "t2", keys)
    # t0's key is trusted, but it signs a manifest and a digest for t1's slot first
    await _plant(t0, LAYOUT.manifest("t1", 1), _manifest_body("t1"))
    await _plant(
        t0,
        LAYOUT.digest("t1", 1),
        {"kind": KIND_DIGEST, "trainer": "t1", "round": 1, "digest": "0" * 64, "run": "default"},
    )
    with pytest.raises(SignatureError, match="untrusted key"):
        await reader.read_manifest("t1", 1)
    with pytest.raises(SignatureError):
        await reader.read_digest("t1", 1)
    # the same document in t0's own slot, about t0, stands
    await _plant(t0, LAYOUT.manifest("t0", 1), _manifest_body("t0"))
    m = await reader.read_manifest("t0", 1)
    assert m is not None and m.trainer == "t0"
    # a document in t0's slot about another trainer does not
    await _plant(t0, LAYOUT.manifest("t0", 2), _manifest_body("t1", 2))
    with pytest.raises(ManifestError):
        await reader.read_manifest("t0", 2)


async def test_record_is_bound_to_its_writers_key(s3_factory: StoreFactory, keys: Any) -> None:
    store = s3_factory()
    t0, reader = _rs(store, "t0", keys), _rs(store, "t2", keys)
    sha = "ab" * 32
    parts = {t: ObjectRef(LAYOUT.payload(t, 1, sha), 10, sha) for t in ("t1", "t2")}
    # a record that names t1 as its writer but is signed with t0's key
    await t0.propose_record(Record(round=1, writer="t1", participants=parts))
    with pytest.raises(SignatureError, match="not by t1's key"):
        await reader.read_record(1)
    # a record by a trainer that is not in the run's key map
    await t0.store.delete([LAYOUT.record(1)], timeout=10)
    await t0.propose_record(Record(round=1, writer="zz", participants=parts))
    with pytest.raises(SignatureError, match="not a trainer"):
        await reader.read_record(1)
    # written and signed by t0 itself: stands, and carries the run
    await t0.store.delete([LAYOUT.record(1)], timeout=10)
    rec, won = await t0.propose_record(Record(round=1, writer="t0", participants=parts))
    assert won and await reader.read_record(1) == rec
    raw = await store.get(LAYOUT.record(1), timeout=10)
    assert b'"run":"default"' in raw


async def test_documents_of_another_run_or_store_are_refused(s3_factory: StoreFactory, keys: Any) -> None:
    store = s3_factory()
    run1 = _rs(store, "t0", keys, run="run-1")
    await _plant(run1, LAYOUT.manifest("t0", 1), _manifest_body("t0", run="run-1"))
    assert await _rs(store, "t1", keys, run="run-1").read_manifest("t0", 1) is not None
    with pytest.raises(SignatureError, match="context"):  # same store, same key, another run
        await _rs(store, "t1", keys, run="run-2").read_manifest("t0", 1)
    # the same bytes replayed into another store location
    other = s3_factory(prefix=f"{store.url.rsplit('/', 1)[-1]}-copy")
    await other.put(LAYOUT.manifest("t0", 1), await store.get(LAYOUT.manifest("t0", 1), timeout=10), timeout=10)
    with pytest.raises(SignatureError, match="context"):
        await _rs(other, "t1", keys, run="run-1").read_manifest("t0", 1)
    # signed for this run and store, but the body names another run
    await _plant(run1, LAYOUT.manifest("t0", 2), _manifest_body("t0", 2, run="run-2"))
    with pytest.raises(ManifestError, match="run"):
        await _rs(store, "t1", keys, run="run-1").read_manifest("t0", 2)


# --- item 1: every malformed body is a typed error -------------------------------------------------


@pytest.mark.parametrize(
    "over",
    [
        {"round": "1"}, {"round": True}, {"round": 1.0}, {"round": 10**30}, {"sent": -1}, {"sent": [1]},
        {"payload": [1, 2, 3]}, {"payload": "x"}, {"payload": {"key": 5, "size": 1, "sha256": "ab" * 32}},
        {"payload": {"key": "trainers/t0/00000001/x", "size": 1.5, "sha256": "ab" * 32}},
        {"payload": {"key": "trainers/t0/00000001/x", "size": 1, "sha256": "AB" * 32}},
        {"mode": {"a": [[[[1]]]]}}, {"base_digest": "x" * 10_000}, {"trainer": None}, {"kind": None},
    ],
)  # fmt: skip
async def test_malformed_manifest_bodies_are_manifest_errors(
    local_factory: StoreFactory, keys: Any, over: dict[str, Any]
) -> None:
    t0 = _rs(local_factory(), "t0", keys)
    await _plant(t0, LAYOUT.manifest("t0", 1), _manifest_body("t0", **over))
    with pytest.raises(ManifestError):
        await t0.read_manifest("t0", 1)


@pytest.mark.parametrize(
    "over",
    [
        {"participants": [["t1", {}]]}, {"participants": {"T1!": {}}}, {"participants": {"t1": None}},
        {"rejected": {"t1": 5}}, {"rejected": ["t1"]}, {"round": -1}, {"writer": 7},
    ],
)  # fmt: skip
async def test_malformed_record_bodies_are_manifest_errors(
    local_factory: StoreFactory, keys: Any, over: dict[str, Any]
) -> None:
    t0 = _rs(local_factory(), "t0", keys)
    sha = "ab" * 32
    body = {
        "kind": KIND_RECORD, "round": 1, "writer": "t0", "run": "default", "base_digest": "",
        "participants": {"t1": {"key": LAYOUT.payload("t1", 1, sha), "size": 10, "sha256": sha}},
        "rejected": {}, "unavailable": {},
    }  # fmt: skip
    body.update(over)
    await _plant(t0, LAYOUT.record(1), body)
    with pytest.raises(ManifestError):
        await t0.read_record(1)


# --- item 4: nothing is read past its limit -------------------------------------------------------


class _Recorder:
    """Records the ``max_bytes`` of every get (what the store is allowed to read)."""

    def __init__(self, store: ObjectStore) -> None:
        self.limits: dict[str, int | None] = {}
        real = store.get

        async def get(key: str, **kw: Any) -> bytes:
            self.limits[key] = kw.get("max_bytes")
            return await real(key, **kw)

        store.get = get  # type: ignore[method-assign]


async def test_oversized_documents_and_payloads_are_refused_unread(
    s3_factory: StoreFactory, keys: Any
) -> None:
    store = s3_factory()
    seen = _Recorder(store)
    t1 = _rs(store, "t1", keys, max_document=64 << 10)
    big = b"{" * (3 << 20)
    await store.put(LAYOUT.manifest("t0", 1), big, timeout=30)
    await store.put(LAYOUT.record(1), big, timeout=30)
    with pytest.raises(DocumentTooLarge):
        await t1.read_manifest("t0", 1)
    with pytest.raises(DocumentTooLarge):
        await t1.read_record(1)
    assert seen.limits[LAYOUT.manifest("t0", 1)] == seen.limits[LAYOUT.record(1)] == 64 << 10
    # a validly signed manifest for 10 bytes, and 3 MB at the key it names
    sha = hashlib.sha256(b"0123456789").hexdigest()
    ref = ObjectRef(LAYOUT.payload("t0", 2, sha), 10, sha)
    await store.put(ref.key, big, timeout=30)
    with pytest.raises(SizeMismatch):
        await t1.fetch(ref)
    assert seen.limits[ref.key] == 10


# --- item 1: one planted object never stalls the round ----------------------------------------------


def _config(**kw: Any) -> LocoConfig:
    base: dict[str, Any] = dict(
        inner_steps=1, workers_expected=4, min_quorum=2, deadline_s=2.0, poll_s=0.05, digest_wait_s=2.0,
        join_wait_s=0.5, round_timeout_s=20.0, state_every=100, checkpoint_every=0, max_round_failures=1,
    )  # fmt: skip
    base.update(kw)
    return LocoConfig(**base)


@pytest.mark.timeout(90)
async def test_planted_manifests_do_not_block_valid_peers(
    s3_factory: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Member ``a`` has a manifest the store cannot serve (every read fails), member ``d`` a planted
    one nesting 10 000 levels deep; ``b`` and ``c`` must close the round together."""
    ids = ("a", "b", "c", "d")
    priv, pubs = make_keys(tmp_path / "keys", ids)
    store = s3_factory()
    for tid in ("a", "d"):
        await RoundStore(store, tid, load_private_key(priv[tid]), trainer_keys(pubs)).join()
    await store.put(LAYOUT.manifest("d", 1), b"[" * 10_000 + b"]" * 10_000, timeout=10)
    await store.put(LAYOUT.manifest("a", 1), b"x", timeout=10)

    def flaky() -> ObjectStore:
        s = s3_factory()
        real = s.get

        async def get(key: str, **kw: Any) -> bytes:
            if key == LAYOUT.manifest("a", 1):
                raise StoreUnavailable("injected: the store cannot serve a's manifest")
            return await real(key, **kw)

        s.get = get  # type: ignore[method-assign]
        return s

    caplog.set_level(logging.WARNING)
    trainers = [tiny_trainer(t, flaky(), priv, pubs, _config()) for t in ("b", "c")]
    await asyncio.gather(*(t.run(1) for t in trainers))
    for t in trainers:
        assert t.reports[-1].participants == ["b", "c"]
    assert trainers[0].digest == trainers[1].digest
    assert "ignoring d's manifest" in caplog.text
    record = await trainers[0].rs.read_record(1)
    assert record is not None and record.unavailable["d"].startswith("ManifestError")  # recorded, with why


@pytest.mark.timeout(60)
async def test_planted_record_is_a_round_error(s3_factory: StoreFactory, tmp_path: Path) -> None:
    priv, pubs = make_keys(tmp_path / "keys", ("a",))
    store = s3_factory()
    await store.put(
        LAYOUT.record(1), b'{"body": {"kind": "pulseloco-round"}, "key_id": "00", "sig": "AA=="}', timeout=10
    )
    trainer = tiny_trainer("a", store, priv, pubs, _config(workers_expected=1, min_quorum=1))
    with pytest.raises(RoundError, match="record"):
        await trainer.run(1)


# --- item 10: a background task's unexpected failure fails the run ----------------------------------


@pytest.mark.timeout(60)
async def test_unexpected_background_failure_fails_the_run(s3_factory: StoreFactory, tmp_path: Path) -> None:
    priv, pubs = make_keys(tmp_path / "keys", ("a",))
    store = s3_factory()
    real = store.put_file

    async def put_file(key: str, path: Any, **kw: Any) -> None:
        if "/checkpoint/" in key:
            raise RuntimeError("injected: a bug in the checkpoint upload")
        await real(key, path, **kw)

    store.put_file = put_file  # type: ignore[method-assign]
    trainer = tiny_trainer(
        "a", store, priv, pubs, _config(workers_expected=1, min_quorum=1, checkpoint_every=1)
    )
    with pytest.raises(RuntimeError, match="injected"):
        await trainer.run(3)
    assert trainer.round < 3


# --- item 1: the trainer's own state files ------------------------------------------------------------


@pytest.mark.parametrize(
    "over",
    [{"round": "5"}, {"round": -1}, {"theta": [1, 2]}, {"momentum": {"w": "x"}}, {"error": 3},
     {"inner": {"rng": {}, "steps": 1}}, {"inner": {"optimizer": {}, "rng": {}, "steps": "1"}}, {"theta": None}],
)  # fmt: skip
def test_malformed_trainer_state_files_are_verification_errors(tmp_path: Path, over: dict[str, Any]) -> None:
    import torch

    from pulsenet.errors import VerificationError
    from pulsenet.loco.state import TRAINER_FORMAT, TrainerState

    w = {"w": torch.zeros(3, 4)}
    obj = {"format": TRAINER_FORMAT, "round": 5, "theta": w, "momentum": w, "error": None,
           "inner": {"optimizer": {}, "rng": {}, "steps": 1}, **over}  # fmt: skip
    torch.save(obj, tmp_path / "state.pt")
    with pytest.raises(VerificationError):
        TrainerState.load(tmp_path / "state.pt", {"w": (3, 4)})


# --- item 7: a record is only as good as its writer's key: followers check what it names --------------


async def test_record_cannot_name_a_payload_its_owner_did_not_sign(
    s3_factory: StoreFactory, keys: Any
) -> None:
    import torch

    from pulsenet.loco.collect import Collector

    store = s3_factory()
    t0, t1 = _rs(store, "t0", keys), _rs(store, "t1", keys)
    await _plant(t1, LAYOUT.manifest("t1", 1), _manifest_body("t1", 1))  # t1 signed its payload ab..ab
    sha = hashlib.sha256(b"0123456789").hexdigest()
    planted = ObjectRef(LAYOUT.payload("t1", 1, sha), 10, sha)
    await store.put(planted.key, b"0123456789", timeout=10)  # a bucket writer's object under t1's prefix
    record, _ = await t0.propose_record(Record(round=1, writer="t0", participants={"t1": planted}))
    collector = Collector(_rs(store, "t2", keys), LocoConfig(min_quorum=1), {"w": (4,)})
    with pytest.raises(RoundError, match="signed round-1 manifest"):
        await collector.load_record(record, {"w": torch.zeros(4)})


@pytest.mark.timeout(90)
async def test_compromised_record_writer_cannot_average_an_outsized_payload(
    s3_factory: StoreFactory, tmp_path: Path
) -> None:
    """``e`` holds a trusted key, sends a 1000x payload, screens nothing and writes the record first:
    the honest trainers refuse to average it (and fail the round) instead of following."""
    import numpy as np

    from pulsenet.codec import payload as wire

    def outsized(payload: wire.Payload) -> wire.Payload:
        big = {
            n: wire.SparseTensor(t.shape, t.indices, t.values * np.float32(1000))
            for n, t in payload.tensors.items()
        }
        return wire.Payload(payload.round, payload.mode, big)

    priv, pubs = make_keys(tmp_path / "keys", ("e", "h1", "h2"))
    cfg = _config(workers_expected=3, deadline_s=10.0)
    screens_nothing = _config(workers_expected=3, norm_min_payloads=99, norm_weights_factor=1e30)
    evil = tiny_trainer("e", s3_factory(), priv, pubs, screens_nothing)
    forge_payloads(evil, outsized)
    honest = [tiny_trainer(t, s3_factory(), priv, pubs, cfg) for t in ("h1", "h2")]
    written = asyncio.Event()  # e's record is in the store (or e's write failed): the others' may follow
    propose_e = evil.rs.propose_record

    async def first(record: Record) -> Any:
        try:
            return await propose_e(record)
        finally:
            written.set()

    evil.rs.propose_record = first  # type: ignore[method-assign]
    for h in honest:  # let e's record win the race: by waiting for it, not for a head start of 3 s
        propose = h.rs.propose_record

        async def late(record: Record, propose: Any = propose) -> Any:
            await asyncio.wait_for(written.wait(), 120)
            return await propose(record)

        h.rs.propose_record = late  # type: ignore[method-assign]
    results = await asyncio.gather(evil.run(1), *(h.run(1) for h in honest), return_exceptions=True)
    assert evil.reports and evil.reports[-1].participants == ["e", "h1", "h2"]  # e's record stood
    for h, res in zip(honest, results[1:], strict=True):
        assert isinstance(res, RoundError) and "norm screen" in str(res), res
        assert h.round == 0  # nothing was averaged


async def test_a_published_state_needs_its_participants_digests(s3_factory: StoreFactory, keys: Any) -> None:
    """Any trusted key can write a round's state manifest first; repair and catch-up use it only if a
    majority of the round's participants (and a quorum) published its digest under their own keys."""
    from pulsenet.loco.documents import StateRef
    from pulsenet.loco.recovery import vouched

    store = s3_factory()
    rs = {t: _rs(store, t, keys) for t in IDS}
    sha = "ab" * 32
    parts = {t: ObjectRef(LAYOUT.payload(t, 4, sha), 10, sha) for t in ("t1", "t2")}
    await rs["t1"].propose_record(Record(round=4, writer="t1", participants=parts))
    good, bogus = "1" * 64, "2" * 64
    ref = {
        d: StateRef(4, ObjectRef(f"state/00000004/{d[:16]}.safetensors", 1, sha), d, "t0")
        for d in (good, bogus)
    }
    assert not await vouched(rs["t0"], ref[good], quorum=2)  # no digests yet
    await rs["t1"].publish_digest(4, good)
    assert not await vouched(rs["t0"], ref[good], quorum=2)  # 1 of 2 is no majority
    await rs["t2"].publish_digest(4, good)
    assert await vouched(rs["t0"], ref[good], quorum=2)
    assert not await vouched(rs["t0"], ref[bogus], quorum=2)  # what t0 alone says
    await _plant(
        rs["t0"], LAYOUT.digest("t0", 4), {"kind": KIND_DIGEST, "trainer": "t0", "round": 4, "digest": bogus}
    )
    assert not await vouched(rs["t0"], ref[bogus], quorum=1)  # t0 is not a participant of round 4
