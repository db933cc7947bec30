"""What a trainer is doing right now and what it has counted, as plain records a node reads
without a callback; and the one retry rule for store calls that must land.

``LocoTrainer.progress`` (:class:`Progress`) says which phase of which round the trainer is in,
since when, whom it waits for and why, and when the store last answered or failed: enough for a
node's ``/healthz`` to say "degraded: waiting for t1's payload of round 12 for 340 s" or "store
unreachable" (:meth:`Progress.describe`). ``LocoTrainer.stats`` (:class:`LocoStats`) counts what
happened over the trainer's life: rounds, exclusions by reason, void rounds, store failures, retries.

Retries (:func:`retrying`): exponential backoff with full jitter (``store.backoff_delay``, the one
rule: a delay drawn uniformly from ``[0, min(cap, base·2^attempt)]``, so trainers that failed
together do not come back together), logged at every failure, for as long as the failure is
transient (:func:`transient`) and the caller has not cancelled the call (an abandoned round cancels
its upload).

Attempts at a round (:class:`Attempts`): one failure policy for the whole round. An outage is
waited out with the same growing backoff and never counted as a failure; anything the store holds
that cannot be used is counted, and ``max_round_failures`` in a row end the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from pulsenet.errors import (
    AccessDenied,
    BucketNotFound,
    ConditionFailed,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    RoundError,
    RoundTimeout,
    StoreError,
    VerificationError,
)
from pulsenet.store.base import backoff_delay

if TYPE_CHECKING:
    from pulsenet.loco.config import LocoConfig
    from pulsenet.loco.documents import Record

log = logging.getLogger(__name__)
T = TypeVar("T")

PERMANENT = (AccessDenied, BucketNotFound, ObjectNotFound, ConditionFailed, ObjectTooLarge)
"""Store answers that retrying cannot change: the store is up and says no."""


def transient(e: BaseException) -> bool:
    """A store failure that may go away by itself: timeouts, unreachable endpoints, server errors, a
    local disk error. Answers the store gave on purpose (``PERMANENT``) are not."""
    return isinstance(e, StoreError) and not isinstance(e, PERMANENT)


@dataclass(slots=True)
class LocoStats:
    """Counters over a trainer's life (plain ints: a node exports them as they are)."""

    rounds: int = 0
    """Rounds completed: trained and applied, or caught up from the store."""
    rounds_failed: int = 0
    """Round attempts that ended in an error (store content, store outage, no quorum in time)."""
    rounds_timed_out: int = 0
    """Of those, attempts that ran out of ``round_timeout_s`` without a quorum (store reachable)."""
    rounds_void: int = 0
    """Rounds whose outer step would have made θ or m non-finite: nothing was applied."""
    rounds_short: int = 0
    """Rounds applied without every expected trainer (closed on a quorum after the deadline)."""
    excluded: dict[str, int] = field(default_factory=dict)
    """Payloads a round record excluded, in rounds this trainer applied, by reason kind
    (``outsized``, ``invalid``; ``unavailable`` for announced payloads nobody could fetch)."""
    own_excluded: int = 0
    """Rounds in which this trainer's own payload was excluded (its update dropped)."""
    digest_disagreements: dict[str, int] = field(default_factory=dict)
    """Rounds in which a participant's published digest differed from ours while ours stood (we
    held the majority digest, or our state is the one the store's chain gives), by trainer."""
    digest_unverified: int = 0
    """Rounds with no majority digest in which our state could not be checked against the store's
    chain (no published state within ``repair_replay_rounds``): we kept our own computation."""
    ignored_names: int = 0
    """Listed object names ignored because no verified document backs them (planted or out of
    sequence: a listing only narrows a search, e.g. for the newest round record)."""
    store_failures: int = 0
    """Store calls of the protocol that failed (each retry counts)."""
    upload_retries: int = 0
    """Retries of this trainer's own uploads (payload, digest, checkpoint, global state)."""

    def count_round(self, record: Record, own: str, expected: int) -> None:
        """A round ``own`` applies: exclusions by reason, and whether it closed without everyone."""
        for why in record.rejected.values():
            kind = "outsized" if "outsized" in why else "invalid"
            self.excluded[kind] = self.excluded.get(kind, 0) + 1
        if record.unavailable:
            self.excluded["unavailable"] = self.excluded.get("unavailable", 0) + len(record.unavailable)
        self.own_excluded += own in record.rejected
        self.rounds_short += len(record.participants) < expected


@dataclass(slots=True)
class Progress:
    """Where a trainer is now (a plain record; wall-clock times from ``time.time()``)."""

    trainer: str = ""
    phase: str = "starting"
    """``starting``, ``inner``, ``encode``, ``upload``, ``collect``, ``apply``, ``agree``,
    ``persist``, ``catch-up``, ``backoff`` (between failed attempts), ``idle`` (between rounds)."""
    round: int = 0
    """The round in hand (the global state is at ``round - 1`` until it completes)."""
    since: float = field(default_factory=time.time)
    """When the current phase began."""
    waiting_for: list[str] = field(default_factory=list)
    """Trainers whose payload (``collect``) or digest (``agree``) has not arrived yet."""
    reason: str = ""
    """Why the trainer waits, in words ("" while it works)."""
    last_store_ok: float | None = None
    """When a store call of the protocol last succeeded."""
    last_store_failure: float | None = None
    """When one last failed, and why (``last_store_error``)."""
    last_store_error: str = ""

    def enter(self, phase: str, round_: int, reason: str = "") -> None:
        self.phase, self.round, self.since, self.reason = phase, round_, time.time(), reason
        self.waiting_for = []

    def wait(self, waiting_for: list[str], reason: str) -> None:
        self.waiting_for, self.reason = waiting_for, reason

    def store_ok(self) -> None:
        self.last_store_ok = time.time()

    def store_failed(self, e: BaseException) -> None:
        self.last_store_failure = time.time()
        self.last_store_error = f"{type(e).__name__}: {str(e)[:300]}"

    @property
    def store_unreachable(self) -> bool:
        """The store's last answer to this trainer was a failure."""
        return self.last_store_failure is not None and (
            self.last_store_ok is None or self.last_store_failure > self.last_store_ok
        )

    def describe(self, now: float | None = None) -> str:
        """One line for a health check: what the trainer does and for how long."""
        now = time.time() if now is None else now
        took = f"{now - self.since:.0f} s"
        if self.store_unreachable:
            return f"store unreachable ({self.last_store_error}); {self.phase} of round {self.round} for {took}"
        if self.waiting_for:
            what = "digest" if self.phase == "agree" else "payload"
            if len(self.waiting_for) == 1:
                return f"waiting for {self.waiting_for[0]}'s {what} of round {self.round} for {took}"
            return f"waiting for the {what}s of {', '.join(self.waiting_for)} for round {self.round} for {took}"
        if self.reason:
            return f"{self.phase} of round {self.round} for {took}: {self.reason}"
        return f"{self.phase} of round {self.round} for {took}"


class Retry(Protocol):
    """``retry(call, what)``: a store call that must land, retried through transient failures
    (:func:`retrying` with a trainer's settings: ``LocoTrainer._retry``)."""

    def __call__(self, call: Callable[[], Awaitable[T]], what: str, /) -> Awaitable[T]: ...


async def retrying(
    call: Callable[[], Awaitable[T]],
    what: str,
    *,
    base_s: float,
    cap_s: float,
    progress: Progress | None = None,
    stats: LocoStats | None = None,
) -> T:
    """``await call()`` until it succeeds: transient store failures (:func:`transient`) are logged
    and retried after a full-jitter backoff; anything else is raised. Cancel the caller to stop."""
    attempt = 0
    while True:
        try:
            result = await call()
        except StoreError as e:
            if progress is not None:
                progress.store_failed(e)
            if stats is not None:
                stats.store_failures += 1
            if not transient(e):
                raise
            attempt += 1
            delay = backoff_delay(attempt - 1, base_s, cap_s)
            log.warning("%s failed (attempt %d): %s: %s; retrying in %.1f s", what, attempt, type(e).__name__, e, delay)
            if stats is not None:
                stats.upload_retries += 1
            await asyncio.sleep(delay)
            continue
        if progress is not None:
            progress.store_ok()
        if attempt:
            log.warning("%s landed after %d retries", what, attempt)
        return result


@dataclass(slots=True)
class Attempts:
    """One trainer's attempts at its rounds, one after another (``LocoTrainer.next_round``)."""

    who: str
    config: LocoConfig
    progress: Progress
    stats: LocoStats
    failures: int = 0
    """Attempts in a row that failed on something the store holds that cannot be used."""
    waits: int = 0
    """Attempts in a row that ended because the store or the peers were away (not counted as
    failures: they set the backoff before the next attempt)."""

    async def run(self, r: int, attempt: Awaitable[T], sleep: Callable[[], Awaitable[None]]) -> T | None:
        """``await attempt`` (round r); None if it failed. An outage (a transient store failure, or no
        quorum in time while the store answers) is waited out with a growing backoff and never
        counted; anything the store holds that cannot be used is counted and waits ``sleep()`` (one
        poll), and ``max_round_failures`` in a row re-raise."""
        try:
            result = await attempt
        except (RoundError, StoreError, ManifestError, VerificationError) as e:
            self.stats.rounds_failed += 1
            why = f"{type(e).__name__}: {str(e)[:300]}"
            if isinstance(e, RoundTimeout) or transient(e):
                self.stats.rounds_timed_out += isinstance(e, RoundTimeout)
                self.waits += 1
                delay = backoff_delay(self.waits - 1, self.config.retry_base_s, self.config.retry_cap_s)
                log.warning(
                    "%s: round %d not done (%s: %s); trying again in %.1f s (attempt %d)",
                    *(self.who, r, type(e).__name__, e, delay, self.waits + 1),
                )
                if transient(e):
                    self.progress.store_failed(e)
                    self.stats.store_failures += 1
                self.progress.enter("backoff", r, why)
                await asyncio.sleep(delay)
                return None
            self.failures += 1
            log.error("%s: round %d failed (%d in a row): %s: %s", self.who, r, self.failures, type(e).__name__, e)
            if self.failures >= self.config.max_round_failures:
                raise
            self.progress.enter("backoff", r, why)
            await sleep()
            return None
        self.failures = self.waits = 0
        return result
