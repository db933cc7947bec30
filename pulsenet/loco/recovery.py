"""Agreeing on digests, and rebuilding the agreed global state from the store.

After every round each trainer publishes the digest of (θ, m) and compares it with the round's
participants' (:func:`judge`). A trainer outside a strict majority, or any trainer when there is no
majority, rebuilds the state the store implies (:func:`rebuild`): the newest published global
state at or before the round, then every round record after it replayed on top (:func:`replay`).
The outer step is deterministic, so that state is by definition the agreed one. Stragglers and
restarted trainers use the same replay to catch up. docs/loco.md, "Digests", has the argument.

A digest is a trainer's word. A repair replays at most ``max_replay`` rounds, and a trainer whose
own state is the one the store's chain gives, in a round with no majority (two trainers, one of
them lying), keeps it and leaves the disagreeing trainers out of every later digest vote
(``LocoTrainer.trust``): a liar costs its peers one bounded replay, never their run.

One round's agreement, as the trainer's step 5 calls it: :func:`publish_digest` (in the background),
:func:`gather_digests`, then :func:`settle`, which judges and, outside a majority, repairs; what it
learns about its peers over the run it keeps in a :class:`Trust`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import (
    ManifestError,
    ObjectNotFound,
    PulsenetError,
    RoundError,
    StoreError,
    VerificationError,
)
from pulsenet.loco.documents import Record, RoundStore, StateRef
from pulsenet.loco.progress import LocoStats, Progress, Retry, transient
from pulsenet.loco.state import GlobalState

log = logging.getLogger(__name__)

Loader = Callable[[Record, Mapping[str, torch.Tensor]], Awaitable[dict[str, wire.Payload]]]
"""Fetches, checks and decodes the payloads a round record names, against the round's base weights
(``Collector.load_record``)."""
Apply = Callable[[GlobalState, Mapping[str, wire.Payload]], Awaitable[None]]
"""Averages payloads into a state and takes the outer step, in place (``algorithm.apply_round``)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one trainer's digest compares with those of the round's participants."""

    agreed: str | None
    """The digest a strict majority holds; None if there is none."""
    unanimous: bool
    ours_agreed: bool
    """Our digest is the strict-majority one (true when unanimous)."""
    odd: list[str]
    """Trainers whose digest is not the agreed one (with no majority: not ours)."""


def judge(digests: Mapping[str, str], own: str) -> Verdict:
    """Compare ``digests`` (trainer -> digest, ours included under ``own``)."""
    counts = collections.Counter(digests.values())
    top, votes = max(counts.items(), key=lambda kv: (kv[1], kv[0] == digests[own]))
    agreed = top if 2 * votes > len(digests) else None
    reference = agreed if agreed is not None else digests[own]
    return Verdict(
        agreed=agreed,
        unanimous=len(counts) == 1,
        ours_agreed=agreed is not None and agreed == digests[own],
        odd=sorted(t for t, d in digests.items() if d != reference),
    )


async def replay(state: GlobalState, target: int, rs: RoundStore, load: Loader, apply: Apply) -> None:
    """Apply the round records after ``state.round`` up to ``target`` to ``state``, in place."""
    for r in range(state.round + 1, target + 1):
        record = await rs.read_record(r)
        if record is None:
            raise RoundError(f"cannot replay round {r}: it has no record")
        try:
            payloads = await load(record, state.theta)
        except ObjectNotFound as e:
            raise RoundError(f"cannot replay round {r}: a payload is gone: {e}") from e
        await apply(state, payloads)
        state.round = r


async def vouched(rs: RoundStore, ref: StateRef, quorum: int) -> bool:
    """Whether round ``ref.round``'s participants vouch for a published state: a strict majority of
    them, and at least ``quorum``, published its digest (each under its own key); or it is a state
    this trainer wrote itself, of a round it took part in, with the digest it published for that
    round (its own computation, which a peer lying about its digest cannot outvote in a two-trainer
    run; other readers still need the majority).

    Any one trusted key can write a state manifest first, so the state is taken on the word of the
    trainers that computed it, not of its writer. Genesis (round 0) has no participants: its first
    writer's word stands, and every trainer logs when it differs from its own initial weights.
    """
    if ref.round == 0:
        return True
    record = await rs.read_record(ref.round)
    if record is None:
        return False
    if ref.writer == rs.id and rs.id in record.participants:
        try:
            if await rs.read_digest(rs.id, ref.round) == ref.digest:
                return True
        except ManifestError as e:
            log.warning("%s: round %d: unverifiable digest of our own: %s", rs.id, ref.round, e)
    votes = 0
    for tid in sorted(record.participants):
        try:
            votes += await rs.read_digest(tid, ref.round) == ref.digest
        except ManifestError as e:
            log.warning("%s: round %d: unverifiable digest of %s: %s", rs.id, ref.round, tid, e)
    return 2 * votes > len(record.participants) and votes >= quorum


async def rebuild(
    target: int,
    rs: RoundStore,
    shapes: dict[str, tuple[int, ...]],
    load: Loader,
    apply: Apply,
    *,
    quorum: int = 1,
    max_replay: int | None = None,
) -> GlobalState:
    """The agreed global state after round ``target``: the newest published state <= target that its
    round's participants vouch for (:func:`vouched`), replayed forward.

    Older published states are tried in turn if a newer one cannot be loaded, vouched for or replayed;
    with ``max_replay``, none older than ``target - max_replay`` (RoundError if no nearer one does).
    """
    floor = -1 if max_replay is None else target - max_replay
    for c in sorted((c for c in await rs.state_rounds() if floor <= c <= target), reverse=True):
        try:
            ref = await rs.read_state_ref(c)
            if ref is None:
                continue
            if not await vouched(rs, ref, quorum):
                raise VerificationError(
                    f"state {ref.state.key} by {ref.writer}: digest {ref.digest[:16]} is not the one a "
                    f"majority of round {c}'s participants published"
                )
            state = await rs.fetch_state(ref, shapes)
            await replay(state, target, rs, load, apply)
            return state
        except (PulsenetError, OSError) as e:
            if transient(e):  # the store is away, not the chain broken: the caller retries later
                raise
            log.warning("%s: cannot rebuild round %d from the state of round %d: %s", rs.id, target, c, e)
    within = "" if max_replay is None else f" within {max_replay} rounds"
    raise RoundError(f"no published global state and payload chain in the store reaches round {target}{within}")


# --- agreeing on a round's digest ----------------------------------------------------------------


@dataclass(slots=True)
class Trust:
    """What a trainer has learnt about its peers' digests over its life (``LocoTrainer.trust``)."""

    distrusted: dict[str, int] = field(default_factory=dict)
    """Trainers left out of the digest vote, by the round that showed it: in a round with no
    majority their digest differed from ours while the store's chain gave ours (:func:`settle`).
    For the trainer's life; its payloads still count (they are judged on their own)."""
    unverified: int | None = None
    """The last round kept on our own word (no majority, no chain to check it), until one agrees."""

    def issues(self) -> str | None:
        """Why the digest agreement is not whole, in words for ``/healthz`` (None: it is)."""
        issues = []
        if self.distrusted:
            issues.append(
                f"digests of {', '.join(sorted(self.distrusted))} left out of the vote: they disagree with "
                "the state the store's chain gives (a trainer lying or diverged)"
            )
        if self.unverified is not None:
            issues.append(f"round {self.unverified}: no majority digest, our state kept unverified")
        return "; ".join(issues) or None


@dataclass(frozen=True, slots=True)
class Settled:
    """What :func:`settle` decided for one round."""

    digests: dict[str, str]
    """The digests that count (ours, after a repair the adopted one; never the distrusted)."""
    unanimous: bool
    adopt: tuple[GlobalState, str] | None = None
    """The state rebuilt from the store and its digest, which the trainer must adopt (a repair)."""


async def publish_digest(rs: RoundStore, r: int, digest: str, retry: Retry) -> None:
    """Publish our digest of round r, retried until it lands; an earlier run's stands (logged)."""
    stood = await retry(lambda: rs.publish_digest(r, digest), f"round {r}: publishing our digest")
    if stood != digest:
        log.error("%s: round %d: an earlier run of ours published digest %s", rs.id, r, stood[:16])


async def gather_digests(
    rs: RoundStore,
    record: Record,
    own: str,
    *,
    wait_s: float,
    sleep: Callable[[], Awaitable[None]],
    progress: Progress,
    stats: LocoStats,
) -> tuple[dict[str, str], bool]:
    """Our digest ``own`` and the participants' that arrive within ``wait_s``; and whether all did."""
    r, loop = record.round, asyncio.get_running_loop()
    until = loop.time() + wait_s
    digests = {rs.id: own}
    waiting = [t for t in sorted(record.participants) if t != rs.id]
    while waiting:
        progress.wait(list(waiting), "waiting for the participants' digests")
        for tid in list(waiting):
            try:
                d = await rs.read_digest(tid, r)
                progress.store_ok()
            except StoreError as e:
                log.warning("%s: round %d: store error reading %s's digest: %s", rs.id, r, tid, e)
                progress.store_failed(e)
                stats.store_failures += 1
                continue
            except ManifestError as e:
                log.warning("%s: round %d: unverifiable digest from %s: %s", rs.id, r, tid, e)
                waiting.remove(tid)
                continue
            if d is not None:
                digests[tid] = d
                waiting.remove(tid)
        if not waiting or loop.time() >= until:
            break
        await sleep()
    if waiting:
        log.warning("%s: round %d: no digest from %s within %g s", rs.id, r, waiting, wait_s)
    return digests, not waiting


def _disagreed(stats: LocoStats, tid: str) -> None:
    stats.digest_disagreements[tid] = stats.digest_disagreements.get(tid, 0) + 1


async def settle(
    r: int,
    own_id: str,
    heard: dict[str, str],
    trust: Trust,
    stats: LocoStats,
    rebuild: Callable[[], Awaitable[GlobalState]],
) -> Settled:
    """The digests that count in round r (ours, and the participants' not ``trust.distrusted``), and
    the state to adopt if we diverged. ``heard``: :func:`gather_digests`'; ``rebuild``: the agreed
    state of round r from the store, within ``repair_replay`` rounds (RoundError if it cannot be).

    Ours stands if it is the majority's. Outside a majority we rebuild from the store and adopt what
    it gives; if that is our own state and no majority held another (two trainers, one lying), the
    trainers whose digest differs are left out of every later vote (``distrusted``); if it cannot be
    rebuilt and no majority is against us, we keep our own computation (counted). A liar costs one
    bounded replay, never the run."""
    own = heard[own_id]
    digests = {t: d for t, d in heard.items() if t not in trust.distrusted}
    for tid in sorted(heard.keys() - digests.keys()):
        if heard[tid] != own:
            _disagreed(stats, tid)
    verdict = judge(digests, own_id)
    if verdict.unanimous:
        trust.unverified = None
        return Settled(digests, unanimous=True)
    if verdict.ours_agreed:
        log.warning(
            "%s: round %d: trainers %s diverged from the majority digest %s; they must repair",
            *(own_id, r, verdict.odd, own[:16]),
        )
        for tid in verdict.odd:
            _disagreed(stats, tid)
        return Settled(digests, unanimous=False)
    log.error(
        "%s: round %d: DIGEST MISMATCH: ours %s, %s; rebuilding the agreed state from the store",
        *(own_id, r, own[:16], {t: d[:16] for t, d in sorted(digests.items()) if t != own_id}),
    )
    try:
        state = await rebuild()
    except RoundError as e:
        if verdict.agreed is not None:
            raise
        stats.digest_unverified += 1
        trust.unverified = r
        log.error(
            "%s: round %d: no majority digest, and our state cannot be checked against the store (%s); "
            "keeping our own computation", own_id, r, e,
        )  # fmt: skip
        return Settled(digests, unanimous=False)
    digest = await asyncio.to_thread(state.digest)
    if verdict.agreed is not None and digest != verdict.agreed:
        raise RoundError(
            f"round {r}: rebuilt state {digest[:16]} still differs from the majority {verdict.agreed[:16]}"
        )
    if digest == own:
        # No majority, and the store's chain gives exactly our state: the others' digests
        # disagree with a replay we verified. Leave them out of every later vote.
        odd = [t for t, d in digests.items() if d != digest]
        for tid in odd:
            trust.distrusted.setdefault(tid, r)
            _disagreed(stats, tid)
        log.error(
            "%s: round %d: the store's chain agrees with our state %s; leaving %s out of the digest "
            "vote from now on (their digests disagree with a replay we verified)", own_id, r, digest[:16], odd,
        )  # fmt: skip
        return Settled({t: d for t, d in digests.items() if t not in odd}, unanimous=False)
    log.error("%s: round %d: REPAIRED: adopting the agreed state %s from the store", own_id, r, digest[:16])
    return Settled({**digests, own_id: digest}, unanimous=False, adopt=(state, digest))


# --- joining the run, and catching up ------------------------------------------------------------


async def members(rs: RoundStore, progress: Progress, stats: LocoStats) -> list[str]:
    """The members announced so far; none while the store does not answer (logged)."""
    try:
        joined = await rs.members()
    except StoreError as e:
        log.warning("%s: store error listing the run's members: %s", rs.id, e)
        progress.store_failed(e)
        stats.store_failures += 1
        return []
    progress.store_ok()
    return joined


async def announce_joining(rs: RoundStore, r: int) -> None:
    """Back after a round decided without us (or not knowing: a start): say we train round r, so
    that peers wait for our payload until the deadline again. Best effort: if it fails they may
    close r without us, and we catch up and say it again for the next round."""
    try:
        await rs.announce_joining(r)
    except StoreError as e:
        log.warning("%s: round %d: could not announce that we join: %s", rs.id, r, e)


async def wait_for_members(
    rs: RoundStore,
    expected: int,
    *,
    wait_s: float,
    sleep: Callable[[], Awaitable[None]],
    progress: Progress,
    stats: LocoStats,
) -> None:
    """Wait up to ``wait_s`` for ``expected`` trainers to announce themselves; start anyway after."""
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    while len(joined := await members(rs, progress, stats)) < expected:
        progress.wait(sorted(set(rs.keys) - set(joined)), "waiting for the run's trainers to join")
        if loop.time() >= until:
            log.warning("%s: only %s joined within %g s; starting anyway", rs.id, joined, wait_s)
            return
        await sleep()


async def genesis(
    rs: RoundStore, state: GlobalState, digest: str, retry: Retry
) -> tuple[GlobalState, str] | None:
    """Round 0: the first trainer publishes its initial state; everyone else must hold the same.
    The run's genesis state and its digest if it is not ours (to adopt), else None."""
    ref = await retry(lambda: rs.read_state_ref(0), "reading the genesis state")
    if ref is None:
        ref = await retry(lambda: rs.publish_state(state, digest), "publishing the genesis state")
    if ref.digest == digest:
        return None
    log.warning(
        "%s: initial weights (digest %s) differ from the run's genesis state %s by %s; adopting it",
        *(rs.id, digest[:16], ref.digest[:16], ref.writer),
    )
    return await retry(lambda: rs.fetch_state(ref, state.shapes()), "fetching genesis"), ref.digest


async def catch_up_state(
    own: GlobalState, target: int, rs: RoundStore, load: Loader, apply: Apply, *, quorum: int
) -> GlobalState:
    """The agreed global state of round ``target`` for a trainer at ``own`` (left untouched): ours
    replayed forward when no newer state was published (cheapest), else :func:`rebuild`."""
    state = None
    if not [c for c in await rs.state_rounds() if own.round < c <= target]:
        try:
            state = own.copy()
            await replay(state, target, rs, load, apply)
        except (RoundError, StoreError, VerificationError) as e:
            if transient(e):  # the store is away: try again later rather than rebuild
                raise
            log.warning("%s: replaying to round %d from our state failed (%s); rebuilding", rs.id, target, e)
    if state is None or state.round != target:
        state = await rebuild(target, rs, own.shapes(), load, apply, quorum=quorum)
    return state
