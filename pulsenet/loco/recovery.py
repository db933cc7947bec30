"""Agreeing on digests, and rebuilding the agreed global state from the store.

After every round each trainer publishes the digest of (θ, m) and compares it with the round's
participants' (:func:`judge`). A trainer outside a strict majority, or any trainer when there is no
majority, rebuilds the state the store implies (:func:`rebuild`): the newest published global
state at or before the round, then every round record after it replayed on top (:func:`replay`).
The outer step is deterministic, so that state is by definition the agreed one. Stragglers and
restarted trainers use the same replay to catch up. docs/loco.md, "Digests", has the argument.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import torch

from pulsenet.errors import ObjectNotFound, PulsenetError, RoundError
from pulsenet.loco import payload as wire
from pulsenet.loco.round import Record, RoundStore
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

    @property
    def must_rebuild(self) -> bool:
        return not self.ours_agreed


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


async def rebuild(
    target: int, rs: RoundStore, shapes: dict[str, tuple[int, ...]], load: Loader, apply: Apply
) -> GlobalState:
    """The agreed global state after round ``target``: the newest published state <= target, replayed forward.

    Older published states are tried in turn if a newer one cannot be loaded or replayed.
    """
    for c in sorted((c for c in await rs.state_rounds() if c <= target), reverse=True):
        try:
            ref = await rs.read_state_ref(c)
            if ref is None:
                continue
            state = await rs.fetch_state(ref, shapes)
            await replay(state, target, rs, load, apply)
            return state
        except (PulsenetError, OSError) as e:
            log.warning("%s: cannot rebuild round %d from the state of round %d: %s", rs.id, target, c, e)
    raise RoundError(f"no published global state and payload chain in the store reaches round {target}")
