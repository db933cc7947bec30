"""PULSELoCo faults with in-process trainers on the embedded S3 server: poisoned payloads, divergence
repair, resume from the store, and the first-writer-wins round record."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pulsenet.codec import payload as wire
from pulsenet.loco import LocoConfig, LocoTrainer, Record, RoundReport, RoundStore
from pulsenet.loco.documents import trainer_keys
from pulsenet.signed import ObjectRef
from pulsenet.signing import load_private_key
from tests.support.loco_helpers import forge_payloads, make_keys, published_digests, tiny_trainer
from tests.support.store import StoreFactory

pytestmark = pytest.mark.integration
IDS = ("a", "b", "c")


def _config(**kw: object) -> LocoConfig:
    base = dict(
        inner_steps=2, workers_expected=3, min_quorum=2, deadline_s=5.0, poll_s=0.05,
        digest_wait_s=5.0, join_wait_s=10.0, state_every=100, checkpoint_every=0,
    )  # fmt: skip
    base.update(kw)
    return LocoConfig(**base)  # type: ignore[arg-type]


def poison(kind: str, at_round: int = 2) -> Callable[[wire.Payload], wire.Payload | None]:
    """A bad payload in one round: NaN, an index past the tensor, or a 30x norm (an honest one is
    ~2-3% of ‖θ‖, so 30x stays under the weights' cap: the median rule catches it)."""

    def mutate(payload: wire.Payload) -> wire.Payload | None:
        if payload.round != at_round:
            return None
        bad = {
            n: wire.SparseTensor(t.shape, t.indices.copy(), t.values.copy())
            for n, t in payload.tensors.items()
        }
        t = max(bad.values(), key=lambda t: t.indices.size)
        if kind == "nan":
            t.values[0] = np.nan
        elif kind == "index":
            t.indices[-1] = t.numel + 7
        else:
            for other in bad.values():
                other.values *= np.float32(30)
        return wire.Payload(payload.round, payload.mode, bad)

    return mutate


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "kind, reason", [("nan", "non-finite"), ("index", "out of range"), ("norm", "median")]
)
async def test_poisoned_payload_is_rejected_and_the_round_completes(
    s3_factory: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str, reason: str
) -> None:
    caplog.set_level(logging.WARNING, logger="pulsenet.loco")
    keys, pubs = make_keys(tmp_path, IDS)
    trainers = [tiny_trainer(tid, s3_factory(), keys, pubs, _config()) for tid in IDS]
    forge_payloads(trainers[IDS.index("c")], poison(kind))
    await asyncio.gather(*(t.run(3) for t in trainers))
    rs = trainers[0].rs
    record = await rs.read_record(2)
    assert record is not None and sorted(record.participants) == ["a", "b"]
    assert reason in record.rejected["c"]
    digests = await published_digests(rs, IDS, range(1, 4))
    assert all(len(set(d.values())) == 1 and len(d) == 3 for d in digests.values()), digests
    assert any("rejected" in m and "c" in m and reason in m for m in caplog.messages)
    # The poisoner was left out of round 2 (its update kept as error feedback) and back in round 3.
    c2 = next(r for r in trainers[2].reports if r.round == 2)
    assert not c2.included
    assert (await rs.read_record(3)).participants.keys() == set(IDS)  # type: ignore[union-attr]


@pytest.mark.timeout(90)
async def test_divergent_trainer_is_detected_and_repaired_from_the_store(
    s3_factory: StoreFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pulsenet.loco")
    keys, pubs = make_keys(tmp_path, IDS)

    def corrupt(trainer: LocoTrainer, report: RoundReport) -> None:
        if report.round == 2:  # a silent bit flip in the global weights, after round 2 was verified
            t = next(iter(trainer.state.theta.values()))  # type: ignore[union-attr]
            t.view(-1).view(torch.int32)[0] ^= 1 << 3

    trainers = [tiny_trainer(tid, s3_factory(), keys, pubs, _config()) for tid in IDS]

    async def drive(t: LocoTrainer) -> None:
        async with t.session():
            while t.round < 4:
                report = await t.next_round()
                if t.id == "c" and report is not None:
                    corrupt(t, report)

    await asyncio.gather(*(drive(t) for t in trainers))
    c3 = next(r for r in trainers[2].reports if r.round == 3)
    a3 = next(r for r in trainers[0].reports if r.round == 3)
    assert c3.repaired and not a3.repaired and not a3.agreed  # detected within the round it happened
    digests = await published_digests(trainers[0].rs, IDS, range(1, 5))
    assert len(set(digests[4].values())) == 1 and len(digests[4]) == 3
    assert len({t.digest for t in trainers}) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("DIGEST MISMATCH" in m for m in errors) and any("REPAIRED" in m for m in errors)


@pytest.mark.timeout(60)
async def test_resume_from_the_store_checkpoint_without_local_state(
    s3_factory: StoreFactory, tmp_path: Path
) -> None:
    keys, pubs = make_keys(tmp_path, ["solo"])
    cfg = _config(workers_expected=1, min_quorum=1, checkpoint_every=2, state_every=2)
    first = tiny_trainer("solo", s3_factory(), keys, pubs, cfg)  # no state dir: the store is the only copy
    await first.run(4)
    again = tiny_trainer("solo", s3_factory(), keys, pubs, cfg)
    await again.start()
    assert again.round == 4 and again.digest == first.digest
    assert again.inner.local.steps == first.inner.local.steps
    await again.run(5)
    assert again.round == 5


@pytest.mark.timeout(30)
async def test_round_record_first_writer_wins(s3_factory: StoreFactory, tmp_path: Path) -> None:
    keys, pubs = make_keys(tmp_path, IDS)
    trusted = trainer_keys(pubs)
    stores = [RoundStore(s3_factory(), tid, load_private_key(keys[tid]), trusted) for tid in IDS]
    ref = {t: ObjectRef(f"trainers/{t}/00000001/{'0' * 16}.payload", 1, "0" * 64) for t in IDS}
    proposals = [
        Record(round=1, writer=tid, participants={t: ref[t] for t in IDS if t != tid or tid == "a"})
        for tid in IDS
    ]
    results = await asyncio.gather(*(rs.propose_record(p) for rs, p in zip(stores, proposals, strict=True)))
    assert sum(won for _, won in results) == 1
    stood = {(r.writer, tuple(sorted(r.participants))) for r, _ in results}
    assert len(stood) == 1  # everyone follows the one record that was written
    assert (await stores[1].read_record(1)) == results[0][0]
