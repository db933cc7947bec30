"""PULSELoCo under hostile peers and failing stores (issues 21 and 24): a hostile payload excluded
with two trainers as with four, a non-finite outer step void on every trainer, a store outage in
the middle of a round ridden out (a failing link around the real store, and the real SeaweedFS
server paused), a partition that cannot fork the policy, and a lost trainer that does not stop
the others. Every case ends with every trainer on the same digest."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pulsenet.codec import payload as wire
from pulsenet.loco import LocoConfig, LocoTrainer, Record, Timeouts
from pulsenet.store import LocalStore, S3Store
from pulsenet.store.seaweed import SeaweedServer
from tests.support.loco_helpers import FlakyStore, forge_payloads, make_keys, published_digests, tiny_trainer
from tests.support.store import StoreFactory


def _config(**kw: Any) -> LocoConfig:
    base: dict[str, Any] = dict(
        inner_steps=2, deadline_s=5.0, poll_s=0.05, digest_wait_s=5.0, join_wait_s=10.0, state_every=100,
        checkpoint_every=0, retry_base_s=0.1, retry_cap_s=0.5, progress_log_s=0.5,
    )  # fmt: skip
    base.update(kw)
    return LocoConfig(**base)


def scaled(factor: float, at_round: int) -> Callable[[wire.Payload], wire.Payload | None]:
    """Every value of one round's payload times ``factor``; other rounds untouched."""

    def mutate(payload: wire.Payload) -> wire.Payload | None:
        if payload.round != at_round:
            return None
        tensors = {
            n: wire.SparseTensor(t.shape, t.indices, (t.values.astype(np.float64) * factor).astype(np.float32))
            for n, t in payload.tensors.items()
        }
        return wire.Payload(payload.round, payload.mode, tensors)

    return mutate


def _max_abs(trainer: LocoTrainer) -> float:
    assert trainer.state is not None
    return max(float(t.abs().max()) for t in trainer.state.theta.values())


async def _agreed(trainers: list[LocoTrainer], rounds: int) -> None:
    """Every trainer at ``rounds`` on one digest, every digest in the store for that round equal."""
    assert {t.round for t in trainers} == {rounds}
    assert len({t.digest for t in trainers}) == 1
    stored = (await published_digests(trainers[0].rs, [t.id for t in trainers], range(rounds, rounds + 1)))[rounds]
    assert set(stored.values()) == {trainers[0].digest}, stored


# --- issue 21: a hostile payload, with any number of trainers ------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
async def test_a_hostile_payload_is_excluded_with_two_trainers_as_with_four(
    s3_factory: StoreFactory, tmp_path: Path, n: int
) -> None:
    """Round 2's payload of one trainer times 1e30 (before: averaged in by two trainers, max |θ|
    from ~1 to 6.65e26): excluded and counted by the record, every trainer finite and agreed."""
    ids = [f"t{k}" for k in range(n)]
    keys, pubs = make_keys(tmp_path, ids)
    cfg = _config(workers_expected=n, min_quorum=1 if n == 2 else None)
    trainers = [tiny_trainer(t, s3_factory(), keys, pubs, cfg) for t in ids]
    forge_payloads(trainers[-1], scaled(1e30, at_round=2))
    await asyncio.gather(*(t.run(3) for t in trainers))
    record = await trainers[0].rs.read_record(2)
    assert record is not None and ids[-1] not in record.participants
    assert "outsized" in record.rejected[ids[-1]]
    for t in trainers:
        assert t.stats.excluded.get("outsized") == 1, t.stats
        assert _max_abs(t) < 10.0  # the tiny model's weights stay O(1)
    assert trainers[-1].stats.own_excluded == 1
    await _agreed(trainers, 3)
    r3 = await trainers[0].rs.read_record(3)
    assert r3 is not None and sorted(r3.participants) == ids  # the forger is back once honest again


async def test_a_non_finite_outer_step_is_void_on_every_trainer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Both payloads of round 2 carry 3e38 (finite) wherever they were sent: their mean overflows.
    Screens set wide open (as a record writer that screens nothing would): every trainer finds the
    step non-finite, applies nothing, stays on round 1's weights and agrees; round 3 goes on."""
    caplog.set_level(logging.ERROR, logger="pulsenet.loco")
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    cfg = _config(workers_expected=2, outer_lr=1.0, outer_momentum=0.0, norm_factor=1e300, norm_weights_factor=1e300)
    store = LocalStore(tmp_path / "store")
    trainers = [tiny_trainer(t, store, keys, pubs, cfg) for t in ids]

    def huge(payload: wire.Payload) -> wire.Payload | None:
        if payload.round != 2:
            return None
        tensors = {n: wire.SparseTensor(t.shape, t.indices, np.full_like(t.values, 3e38)) for n, t in payload.tensors.items()}
        return wire.Payload(payload.round, payload.mode, tensors)

    for t in trainers:
        forge_payloads(t, huge)
    after: dict[str, list[str]] = {t: [] for t in ids}

    async def drive(t: LocoTrainer) -> None:
        async with t.session():
            while t.round < 3:
                if await t.next_round() is not None:
                    after[t.id].append(t.digest)

    await asyncio.gather(*(drive(t) for t in trainers))
    for t in trainers:
        r2 = next(r for r in t.reports if r.round == 2)
        assert "non-finite" in r2.void and t.stats.rounds_void == 1
        assert after[t.id][1] == after[t.id][0]  # round 2 changed nothing
        assert all(np.isfinite(v.numpy()).all() for v in t.state.theta.values())  # type: ignore[union-attr]
    assert after["a"] == after["b"] and after["a"][2] != after["a"][1]  # agreed, and round 3 moved on
    assert sum("VOID" in m for m in caplog.messages) == 2
    await _agreed(trainers, 3)


# --- issue 24: store outages ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def sampling(trainer: LocoTrainer, every_s: float = 0.05) -> AsyncIterator[list[tuple[bool, str]]]:
    """``(store_unreachable, describe())`` of a trainer's progress, sampled while the block runs
    (what a node's /healthz would read)."""
    seen: list[tuple[bool, str]] = []

    async def sample() -> None:
        while True:
            seen.append((trainer.progress.store_unreachable, trainer.progress.describe()))
            await asyncio.sleep(every_s)

    task = asyncio.create_task(sample())
    try:
        yield seen
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def outage_at_upload(
    who: str, r: int, start: Callable[[], None], end: Callable[[], None], seconds: float
) -> Callable[[str, int], contextlib.AbstractAsyncContextManager[None]]:
    """An ``on_phase`` hook: when trainer ``who`` starts uploading round ``r``, ``start()`` the
    outage, and ``end()`` it ``seconds`` later."""

    @contextlib.asynccontextmanager
    async def hook(phase: str, round_: int) -> AsyncIterator[None]:
        if phase == "upload" and round_ == r:
            start()
            asyncio.get_running_loop().call_later(seconds, end)
        yield

    return hook


async def test_a_store_outage_mid_round_is_ridden_out(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Every store call of both trainers fails for 2 s from the moment ``a`` uploads its round-2
    payload: the upload retries (logged), /healthz-style progress says the store is unreachable,
    and the round completes once the store is back, both trainers on one digest."""
    caplog.set_level(logging.WARNING, logger="pulsenet.loco")
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    real = LocalStore(tmp_path / "store")
    down = False
    links = {t: FlakyStore(real, lambda op, key: down) for t in ids}

    def cut() -> None:
        nonlocal down
        down = True

    def mend() -> None:
        nonlocal down
        down = False

    cfg = _config(workers_expected=2)
    a = tiny_trainer("a", links["a"], keys, pubs, cfg, on_phase=outage_at_upload("a", 2, cut, mend, 2.0))
    b = tiny_trainer("b", links["b"], keys, pubs, cfg)
    async with sampling(a) as seen:
        await asyncio.gather(a.run(3), b.run(3))
    assert links["a"].failed > 0 and links["b"].failed > 0  # the outage happened to both
    assert a.stats.upload_retries >= 1
    assert any(m.startswith("a: round 2: uploading our payload failed") for m in caplog.messages)
    assert any(unreachable and "store unreachable" in text for unreachable, text in seen), seen[-5:]
    assert not a.progress.store_unreachable and not b.progress.store_unreachable  # recovered
    for t in (a, b):  # every round trained and applied, none caught up or lost
        assert [(r.round, r.participants, r.caught_up_from) for r in t.reports] == [
            (k, ["a", "b"], None) for k in (1, 2, 3)
        ]
    await _agreed([a, b], 3)


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_the_real_store_paused_mid_round_is_ridden_out(tmp_path: Path) -> None:
    """The SeaweedFS server itself stopped (SIGSTOP) for 6 s as ``a`` uploads round 2, then
    continued (SIGCONT): both trainers' calls time out meanwhile, and the run completes after it,
    both trainers on one digest."""
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    with SeaweedServer(tmp_path / "seaweed") as server:
        server.create_buckets("outage")
        assert server.pid is not None
        pid = server.pid
        s3 = server.config(timeout_s=3.0, read_timeout_s=1.0, connect_timeout_s=1.0, max_retries=1)
        cfg = _config(workers_expected=2, timeouts=Timeouts(small_s=3.0, transfer_s=6.0), deadline_s=20.0)
        stores = [S3Store("outage", "run", s3) for _ in ids]
        paused = []

        def pause() -> None:
            os.kill(pid, signal.SIGSTOP)
            paused.append(True)

        hook = outage_at_upload("a", 2, pause, lambda: os.kill(pid, signal.SIGCONT), 6.0)
        a = tiny_trainer("a", stores[0], keys, pubs, cfg, on_phase=hook)
        b = tiny_trainer("b", stores[1], keys, pubs, cfg)
        try:
            async with sampling(a, 0.2) as seen:
                await asyncio.gather(a.run(3), b.run(3))
            assert paused and a.stats.store_failures + b.stats.store_failures > 0
            assert any(unreachable for unreachable, _ in seen)
            assert [r.round for r in a.reports] == [1, 2, 3] and [r.round for r in b.reports] == [1, 2, 3]
            await _agreed([a, b], 3)
        finally:
            os.kill(pid, signal.SIGCONT)
            for s in stores:
                await s.close()


# --- issue 24: quorum, partition, a lost trainer ----------------------------------------------------


async def test_a_partition_cannot_fork_the_policy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two trainers, min_quorum 1, each unable to read anything under the other's prefix: both may
    close round 1 alone, but the round record is create-only, so exactly one record stands; the
    other trainer follows it (after the partition heals it can read the winner's payload), catches
    up, and both end on one digest."""
    caplog.set_level(logging.INFO, logger="pulsenet.loco")
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    real = LocalStore(tmp_path / "store")
    healed = asyncio.Event()

    def cut_from(other: str) -> Callable[[str, str], bool]:
        return lambda op, key: not healed.is_set() and op != "put" and key.startswith(f"trainers/{other}/")

    cfg = _config(workers_expected=2, min_quorum=1, deadline_s=1.0)
    trainers = {
        t: tiny_trainer(t, FlakyStore(real, cut_from("b" if t == "a" else "a")), keys, pubs, cfg) for t in ids
    }
    proposals: list[tuple[str, int, bool]] = []
    for t in trainers.values():
        propose = t.rs.propose_record

        async def counted(record: Record, propose: Any = propose, tid: str = t.id) -> tuple[Record, bool]:
            stood, won = await propose(record)
            proposals.append((tid, record.round, won))
            return stood, won

        t.rs.propose_record = counted  # type: ignore[method-assign]

    async def heal_when_the_winner_is_ahead() -> None:
        while not any(t.round >= 2 for t in trainers.values()):
            await asyncio.sleep(0.05)
        healed.set()

    await asyncio.gather(heal_when_the_winner_is_ahead(), *(t.run(4) for t in trainers.values()))
    record = await trainers["a"].rs.read_record(1)
    assert record is not None and len(record.participants) == 1
    winner = record.writer
    loser = "b" if winner == "a" else "a"
    assert [won for tid, r, won in proposals if r == 1].count(True) == 1
    assert any(m.startswith(f"{loser}: round 1: following {winner}'s record") for m in caplog.messages)
    assert any(r.caught_up_from is not None for r in trainers[loser].reports)  # it caught up, not forked
    assert trainers[loser].stats.rounds_failed >= 1 and not trainers[loser].attempts.failures  # waited, never counted
    await _agreed(list(trainers.values()), 4)


async def test_losing_a_trainer_does_not_stop_the_network(tmp_path: Path) -> None:
    """Two trainers, min_quorum 1: ``b`` stops after round 1; ``a`` closes rounds 2 and 3 alone after
    the deadline, saying whom it waits for; ``b`` restarts from its state directory, catches up
    from the agreed state and takes part again; both end on one digest."""
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    store = LocalStore(tmp_path / "store")
    cfg = _config(workers_expected=2, min_quorum=1, deadline_s=1.0)
    a = tiny_trainer("a", store, keys, pubs, cfg, state_dir=tmp_path / "a")
    b = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(1), b.run(1))
    async with sampling(a) as seen:
        await a.run(3)  # b is gone
    assert any("waiting for b's payload of round 2" in text for _, text in seen), seen[-5:]
    assert [r.participants for r in a.reports] == [["a", "b"], ["a"], ["a"]] and a.stats.rounds_short == 2
    again = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(5), again.run(5))
    assert again.reports[0].caught_up_from == 2  # rejoined from the agreed state
    assert any(r.participants == ["a", "b"] for r in a.reports[3:])  # and took part again
    await _agreed([a, again], 5)


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_retention_bounds_the_shared_bucket_and_a_long_absent_trainer_still_rejoins(tmp_path: Path) -> None:
    """Retention (``retain_rounds`` 4, a state every 2 rounds): ``a`` goes on alone to round 10 while
    ``b`` is away; old payloads and old shared states are deleted (genesis and every round record
    stay), so ``b``, back from round 1, cannot replay and rebuilds from a retained state; both end
    on one digest."""
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    store = LocalStore(tmp_path / "store")
    cfg = _config(workers_expected=2, min_quorum=1, deadline_s=1.0, state_every=2, retain_rounds=4)
    a = tiny_trainer("a", store, keys, pubs, cfg, state_dir=tmp_path / "a")
    b = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(1), b.run(1))
    await a.run(10)  # b is away
    await a.drain()  # the retention task of round 10
    keys_now = {i.key for i in await store.list("")}
    assert a.rs.layout.record(1) in keys_now and a.rs.layout.record(10) in keys_now  # records stay
    assert await a.rs.state_rounds() == [0, 6, 8, 10]  # genesis, and the states within 4 rounds
    assert not any(k.startswith(("state/00000002/", "state/00000004/")) for k in keys_now)
    own = {a.rs.layout.parse_own("a", k) for k in keys_now} - {None}
    assert min(r for kind, r in own if kind == "round") == 6  # a's payloads of rounds 1-5 are gone
    again = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(12), again.run(12))
    assert again.reports[0].caught_up_from == 2
    await _agreed([a, again], 12)


@pytest.mark.integration
@pytest.mark.timeout(180)
async def test_a_trainer_that_stays_down_costs_one_deadline_and_is_waited_for_again_when_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two trainers, min_quorum 1, a deadline of 8 s and ``absent_wait_s`` 0.2: ``b`` misses round 2
    (``a`` waits out the deadline once, since ``b`` was in round 1); rounds 3 and 4 close without
    waiting, ``b`` being absent and silent. Once ``b`` announces it joins round 5, ``a`` waits for it
    to the deadline again. ``b`` comes back, catches up and takes part; both end on one digest."""
    caplog.set_level(logging.INFO, logger="pulsenet.loco")
    ids = ("a", "b")
    keys, pubs = make_keys(tmp_path / "keys", ids)
    store = LocalStore(tmp_path / "store")
    cfg = _config(workers_expected=2, min_quorum=1, deadline_s=8.0, absent_wait_s=0.2)
    a = tiny_trainer("a", store, keys, pubs, cfg, state_dir=tmp_path / "a")
    b = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(1), b.run(1))
    await a.run(4)  # b is gone
    assert [r.participants for r in a.reports] == [["a", "b"], ["a"], ["a"], ["a"]]
    early = [m for m in caplog.messages if "closing without ['b'] (absent last round, not joining)" in m]
    assert [m.split(":")[1].strip() for m in early] == ["round 3", "round 4"]  # round 2 waited
    await b.rs.announce_joining(5)  # b says it trains round 5 (and then does not deliver)
    await a.run(5)
    assert not any("round 5: closing without" in m for m in caplog.messages)
    assert any("round 5: b is back and joins this round" in m for m in caplog.messages)
    assert a.reports[-1].participants == ["a"]  # closed at the deadline
    again = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(8), again.run(8))
    assert again.reports[0].caught_up_from == 2
    assert any(r.participants == ["a", "b"] for r in a.reports[5:]), [r.participants for r in a.reports]
    await _agreed([a, again], 8)
