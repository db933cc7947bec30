"""PULSELoCo against one hostile trainer key or a planted name (issue 29, items 4-6): a trainer that
lies about its digests costs its honest peer one bounded replay, never its run; a payload's size is
bounded by the model before a byte is read; a planted round-record name never steers catch-up."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pulsenet.codec import payload as wire
from pulsenet.loco import LocoConfig, LocoTrainer
from pulsenet.loco.layout import LocoLayout
from pulsenet.nodes.rounds import LocoRounds
from pulsenet.store import LocalStore
from pulsenet.store.base import ObjectStore
from tests.support.loco_helpers import make_keys, tiny_trainer

LAYOUT = LocoLayout()


def _config(**kw: Any) -> LocoConfig:
    base: dict[str, Any] = dict(
        inner_steps=1, workers_expected=2, deadline_s=5.0, poll_s=0.05, digest_wait_s=5.0, join_wait_s=10.0,
        state_every=100, checkpoint_every=0, retry_base_s=0.1, retry_cap_s=0.5, max_round_failures=1,
    )  # fmt: skip
    base.update(kw)
    return LocoConfig(**base)


def _lies_about_digests(trainer: LocoTrainer) -> None:
    """A compromised trainer: trains and averages honestly, but publishes a wrong digest every round."""
    publish = trainer.rs.publish_digest

    async def lie(round_: int, digest: str) -> str:
        await publish(round_, hashlib.sha256(digest.encode()).hexdigest())
        return digest

    trainer.rs.publish_digest = lie  # type: ignore[method-assign]


def _phases(seen: list[tuple[str, int]]) -> Any:
    def hook(name: str, r: int) -> contextlib.AbstractAsyncContextManager[object]:
        seen.append((name, r))
        return contextlib.nullcontext()

    return hook


# --- item 4: a trainer that lies about its digests ------------------------------------------------


@pytest.mark.timeout(300)
async def test_a_digest_liar_costs_its_honest_peer_one_bounded_replay_and_never_its_run(tmp_path: Path) -> None:
    """Two trainers (``pulsenet up``'s default), ``b`` publishing a wrong digest every round, with
    retention (a state every 2 rounds, 4 rounds kept). On 7876ec8 ``a`` rebuilt from genesis every
    round (no state was ever vouched or written) until retention removed round 1's payloads and it
    died. Now ``a`` replays once (round 1, the store's chain gives its own state), leaves ``b`` out
    of the digest vote (counted, in /healthz), publishes the states, and trains on; restarted, it
    checks itself against its own latest state (one short replay) and excludes ``b`` again."""
    keys, pubs = make_keys(tmp_path / "keys", ("a", "b"))
    cfg = _config(state_every=2, retain_rounds=4)
    seen: list[tuple[str, int]] = []
    a = tiny_trainer("a", LocalStore(tmp_path / "store"), keys, pubs, cfg, state_dir=tmp_path / "a", on_phase=_phases(seen))
    b = tiny_trainer("b", LocalStore(tmp_path / "store"), keys, pubs, cfg, state_dir=tmp_path / "b")
    _lies_about_digests(b)
    await asyncio.gather(a.run(8), b.run(8))
    assert a.round == b.round == 8 and a.digest == b.digest  # b averages honestly; only its word lies
    assert a.stats.rounds_failed == 0 and not any(r.repaired for r in a.reports)
    assert a.trust.distrusted == {"b": 1}
    assert a.stats.digest_disagreements == {"b": 8}
    assert [r for name, r in seen if name == "replay"] == [1]  # one replay of one round, not one per round
    assert 8 in await a.rs.state_rounds()  # a, the honest majority of the ones it trusts, publishes states
    issues = a.trust.issues()
    assert issues is not None and "b" in issues
    healthz = LocoRounds(a, None, tmp_path / "a").degraded()  # type: ignore[arg-type]  (what /healthz says)
    assert healthz is not None and "digests of b left out of the vote" in healthz

    seen.clear()
    again = tiny_trainer("a", LocalStore(tmp_path / "store"), keys, pubs, cfg, state_dir=tmp_path / "a", on_phase=_phases(seen))
    await asyncio.gather(again.run(10), b.run(10))
    assert again.round == 10 and again.digest == b.digest and again.stats.rounds_failed == 0
    assert again.trust.distrusted == {"b": 9}
    assert [r for name, r in seen if name == "replay"] == [9]  # from its own state of round 8


@pytest.mark.timeout(120)
async def test_with_nothing_to_check_against_a_two_trainer_split_keeps_our_own_state(tmp_path: Path) -> None:
    """No published state reachable at all (say retention removed it): ``a`` cannot check its state
    against the store, and no majority holds another, so it keeps its own computation (counted, in
    /healthz) instead of failing rounds until it exits (7876ec8)."""
    keys, pubs = make_keys(tmp_path / "keys", ("a", "b"))
    a = tiny_trainer("a", LocalStore(tmp_path / "store"), keys, pubs, _config())
    b = tiny_trainer("b", LocalStore(tmp_path / "store"), keys, pubs, _config())
    _lies_about_digests(b)

    async def none_published() -> list[int]:
        return []

    a.rs.state_rounds = none_published  # type: ignore[method-assign]
    await asyncio.gather(a.run(3), b.run(3))
    assert a.round == 3 and a.digest == b.digest and a.stats.rounds_failed == 0
    assert a.stats.digest_unverified == 3 and a.trust.distrusted == {}
    issues = a.trust.issues()
    assert issues is not None and "unverified" in issues


async def test_a_trainer_vouches_for_a_state_it_wrote_itself_and_no_one_else_does(tmp_path: Path) -> None:
    """``recovery.vouched``: a state t0 wrote, of a round t0 took part in, with the digest t0
    published, is vouched for by t0 alone (its own computation); t1 still needs the majority; and
    t0's word counts for nothing in a round it did not take part in."""
    from pulsenet.loco import Record, RoundStore
    from pulsenet.loco.documents import StateRef, trainer_keys
    from pulsenet.loco.recovery import vouched
    from pulsenet.signed import ObjectRef
    from pulsenet.signing import load_private_key

    priv, pubs = make_keys(tmp_path / "keys", ("t0", "t1"))
    store = LocalStore(tmp_path / "store")
    rs = {t: RoundStore(store, t, load_private_key(priv[t]), trainer_keys(pubs)) for t in ("t0", "t1")}
    sha, d0, d1 = "ab" * 32, "1" * 64, "2" * 64
    for r, parts in ((4, ("t0", "t1")), (5, ("t1",))):
        refs = {t: ObjectRef(LAYOUT.payload(t, r, sha), 10, sha) for t in parts}
        await rs["t1"].propose_record(Record(round=r, writer="t1", participants=refs))
        await rs["t0"].publish_digest(r, d0)
        await rs["t1"].publish_digest(r, d1)
    state = {r: StateRef(r, ObjectRef(f"state/0000000{r}/{d0[:16]}.safetensors", 1, sha), d0, "t0") for r in (4, 5)}
    assert await vouched(rs["t0"], state[4], quorum=2)
    assert not await vouched(rs["t1"], state[4], quorum=1)  # 1 of 2: no majority for anyone else
    assert not await vouched(rs["t0"], state[5], quorum=1)  # t0 did not take part in round 5


async def test_a_repair_replays_at_most_its_cap(tmp_path: Path) -> None:
    """``rebuild(max_replay=...)`` never tries a state further back than the cap (genesis here)."""
    from pulsenet.errors import RoundError
    from pulsenet.loco.recovery import rebuild

    keys, pubs = make_keys(tmp_path / "keys", ("a",))
    a = tiny_trainer("a", LocalStore(tmp_path / "store"), keys, pubs, _config(workers_expected=1))
    await a.run(3)
    seen: list[int] = []

    async def apply(state: Any, payloads: Any) -> None:
        seen.append(state.round + 1)
        await a._replay_apply(state, payloads)

    with pytest.raises(RoundError, match="within 2 rounds"):
        await rebuild(3, a.rs, a.state.shapes(), a._collector.load_record, apply, max_replay=2)  # type: ignore[union-attr]
    assert seen == []
    state = await rebuild(3, a.rs, a.state.shapes(), a._collector.load_record, apply, max_replay=3)  # type: ignore[union-attr]
    assert seen == [1, 2, 3] and state.digest() == a.digest


# --- item 5: a payload's size is bounded by the model ----------------------------------------------


def test_max_size_bounds_every_payload_the_encoder_writes() -> None:
    """Every entry sent, incompressible values, raw and relative, sparse and dense: all within the bound."""
    rng = np.random.default_rng(0)
    shapes = {"a": (300, 7), "b": (1,), "c": (70_000,), "d": (3, 4, 5)}
    bound = wire.max_size(shapes)
    theta = {n: torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for n, s in shapes.items()}
    sizes = []
    for mode in (wire.SPARSE, wire.DENSE):
        for scale in (1.0, 1e-3):
            tensors = {}
            for n, s in shapes.items():
                k = int(np.prod(s))
                values = (
                    theta[n].numpy().reshape(-1) * np.float32(scale)
                    + rng.standard_normal(k).astype(np.float32) * np.float32(scale)
                )
                idx = np.arange(k, dtype=np.int64) if mode == wire.SPARSE else None
                tensors[n] = wire.SparseTensor(s, idx, values.astype(np.float32))
            for base in (None, theta):
                sizes.append(len(wire.encode(wire.Payload(1, mode, tensors), base)))
    assert max(sizes) <= bound < 4 * max(sizes), (sizes, bound)


class _Gets:
    """Every key a store was asked to GET, and the most it was allowed to read."""

    def __init__(self, store: ObjectStore) -> None:
        self.keys: dict[str, int | None] = {}
        real = store.get

        async def get(key: str, **kw: Any) -> bytes:
            self.keys[key] = kw.get("max_bytes")
            return await real(key, **kw)

        store.get = get  # type: ignore[method-assign]


@pytest.mark.timeout(120)
async def test_a_payload_larger_than_the_model_allows_is_refused_unread(tmp_path: Path) -> None:
    """``e`` signs a manifest for an 8 MiB payload (its real one plus padding); the tiny model's
    largest valid payload is under 1 MiB. ``h`` refuses it from the signed size, never asking the
    store for it (on 7876ec8 it read all 8 MiB, then refused the trailing bytes)."""
    keys, pubs = make_keys(tmp_path / "keys", ("e", "h"))
    cfg = _config(min_quorum=1, deadline_s=3.0)
    store = LocalStore(tmp_path / "store")
    gets = _Gets(store)
    h = tiny_trainer("h", store, keys, pubs, cfg)
    e = tiny_trainer("e", LocalStore(tmp_path / "store"), keys, pubs, cfg)
    publish = e.rs.publish_payload

    async def padded(round_: int, data: bytes, **kw: Any) -> Any:
        manifest, _ = await publish(round_, data + bytes(8 << 20), **kw)
        return manifest, False  # e then judges the stored bytes, as its peers do (forge_payloads)

    e.rs.publish_payload = padded  # type: ignore[method-assign]
    await asyncio.gather(h.run(1), e.run(1))
    record = await h.rs.read_record(1)
    assert record is not None and list(record.participants) == ["h"] and "e" in record.rejected
    assert not [k for k in gets.keys if k.startswith("trainers/e/") and k.endswith(".payload")], gets.keys
    assert h.stats.excluded.get("invalid") == 1 and h.round == 1
    assert h.collector is not None and h.collector.max_payload < 1 << 20


async def test_a_state_larger_than_the_model_allows_is_refused_unread(tmp_path: Path) -> None:
    """The same bound for a published global state: a trusted key's manifest claiming 8 GiB (on
    7876ec8 downloaded to a temporary file up to that size) is refused before any read."""
    from pulsenet.errors import VerificationError
    from pulsenet.loco.documents import StateRef
    from pulsenet.loco.state import GlobalState
    from pulsenet.signed import ObjectRef

    keys, pubs = make_keys(tmp_path / "keys", ("a",))
    store = LocalStore(tmp_path / "store")
    a = tiny_trainer("a", store, keys, pubs, _config(workers_expected=1))
    await a.start()
    assert a.state is not None
    shapes = a.state.shapes()
    sha = "ab" * 32
    ref = StateRef(1, ObjectRef(a.rs.layout.state(1, sha), 8 << 30, sha), a.digest, "a")
    asked: list[str] = []
    real = store.get_file

    async def get_file(key: str, path: Any, **kw: Any) -> None:
        asked.append(key)
        await real(key, path, **kw)

    store.get_file = get_file  # type: ignore[method-assign]
    with pytest.raises(VerificationError, match="this model's state"):
        await a.rs.fetch_state(ref, shapes)
    assert asked == []
    assert GlobalState.max_size(shapes) < 1 << 20


# --- item 6: a planted round-record name -------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_a_planted_round_name_never_steers_catch_up(tmp_path: Path) -> None:
    """``b`` is away while ``a`` goes on to round 3; junk is planted at ``rounds/00000004/record``
    (contiguous: it must fail verification) and ``rounds/99999999/record`` (past a gap: never read).
    ``b``, back, catches up to round 3, the newest record that verifies; on 7876ec8 it aimed at round
    99999999 and failed."""
    keys, pubs = make_keys(tmp_path / "keys", ("a", "b"))
    store = LocalStore(tmp_path / "store")
    cfg = _config(min_quorum=1, deadline_s=1.0)
    a = tiny_trainer("a", store, keys, pubs, cfg, state_dir=tmp_path / "a")
    b = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(1), b.run(1))
    await a.run(3)
    for r in (4, 99_999_999):
        await store.put(LAYOUT.record(r), b'{"body": {"kind": "pulseloco-round"}, "key_id": "00", "sig": "AA=="}', timeout=10)
    gets = _Gets(store)
    again = tiny_trainer("b", store, keys, pubs, cfg, state_dir=tmp_path / "b")
    await again.run(3)
    assert again.round == 3 and again.digest == a.digest
    assert again.reports[0].caught_up_from == 2
    assert again.stats.rounds_failed == 0 and again.stats.ignored_names == 2
    assert LAYOUT.record(99_999_999) not in gets.keys  # past a gap in the sequence: not even read


async def test_a_planted_checkpoint_name_never_makes_retention_delete_the_resume_point(tmp_path: Path) -> None:
    """Retention keeps a trainer's newest checkpoint whatever its round; a checkpoint name planted
    far ahead (round 99999999, which this trainer cannot have written) is not that newest one, so
    the real resume point of round 2 survives a cut at round 6."""
    from pulsenet.loco import RoundStore
    from pulsenet.loco.documents import trainer_keys
    from pulsenet.signing import load_private_key

    priv, pubs = make_keys(tmp_path / "keys", ("t0",))
    store = LocalStore(tmp_path / "store")
    rs = RoundStore(store, "t0", load_private_key(priv["t0"]), trainer_keys(pubs))
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"resume point")
    await rs.publish_checkpoint(2, ckpt)
    await store.put(LAYOUT.checkpoint_manifest("t0", 99_999_999), b"junk")
    await rs.delete_own_before(6, reached=8)
    assert (await rs.latest_checkpoint()) is not None and (await rs.latest_checkpoint())[0] == 2


@pytest.mark.timeout(120)
async def test_a_trainer_keeps_its_temporary_files_in_its_state_dir_and_a_restart_clears_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A global state (a model's FP32 size) or checkpoint on its way up passes through disk; a
    trainer killed there left it in the system's /tmp, 1.1 GB a kill at 135M, piling up over days
    of restarts (2026-12-07: the disk filled and the embedded store refused every write). Now they
    go through ``state_dir/tmp``, which the next start empties; nothing goes to the system's."""
    import tempfile

    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    keys, pubs = make_keys(tmp_path / "keys", ("a", "b"))
    cfg = _config(state_every=1, checkpoint_every=1)
    leftover = tmp_path / "a" / "tmp" / "pulseloco-state-killed" / "state.safetensors"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"\0" * 1024)  # what a kill mid-upload leaves
    made: list[str] = []
    real = tempfile.mkdtemp

    def recording(*args, **kw):
        path = real(*args, **kw)
        made.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", recording)
    a = tiny_trainer("a", LocalStore(tmp_path / "store"), keys, pubs, cfg, state_dir=tmp_path / "a")
    b = tiny_trainer("b", LocalStore(tmp_path / "store"), keys, pubs, cfg, state_dir=tmp_path / "b")
    await asyncio.gather(a.run(2), b.run(2))
    assert a.round == b.round == 2 and a.digest == b.digest
    assert not leftover.exists() and (tmp_path / "a" / "tmp").is_dir()
    ours = [Path(p) for p in made if Path(p).name.startswith("pulseloco-")]
    assert {p.parent for p in ours} == {tmp_path / "a" / "tmp", tmp_path / "b" / "tmp"}, made  # states and checkpoints
    assert not list(system_tmp.glob("pulseloco-*"))
