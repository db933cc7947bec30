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
(``LocoTrainer.distrusted``): a liar costs its peers one bounded replay, never their run.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch

from pulsenet.codec import payload as wire
from pulsenet.errors import ManifestError, ObjectNotFound, PulsenetError, RoundError, VerificationError
from pulsenet.loco.documents import Record, RoundStore, StateRef
from pulsenet.loco.progress import transient
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
