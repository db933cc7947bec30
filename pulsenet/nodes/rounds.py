"""What closes a trainer's round: nothing (a lone trainer) or a PULSELoCo exchange with its peers.

The trainer daemon's loop is the same either way (``nodes/trainer.py``): take rollouts, run the
round's inner phase, close the round, publish its weights as the next version. What differs sits
behind one small interface, the way torchft's DiLoCo makes the outer sync a step the loop calls:

- ``start(published)``: resume (weights, optimizer, the batches already trained on) and say which
  round the weights are at; the caller publishes that round if it is not out yet;
- ``session()``: the lifetime of whatever runs in the background between rounds;
- ``next_round(train)``: run the caller's inner phase (``train(r)``: H steps on rollouts the
  caller took) and close the round: a ``RoundReport``, or None if the round failed (retried);
- ``inner_steps`` (H) and ``step_wait_s`` (how long a step may wait for rollouts before the round
  goes on with the steps it has).

``LocalRounds`` is the round with one participant, H = 1 and no exchange: the weights after the
step are the version, and the resume point is ``trainer.pt`` (weights, optimizer, RNG, and the
batches trained on, in one atomic file). ``LocoRounds`` wraps ``LocoTrainer``, whose resume point
is its own (``loco/state.pt``) plus ``consumed.json`` for the batches trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from pulsenet.fsutil import atomic_path
from pulsenet.loco import LocoTrainer, RoundReport
from pulsenet.loco.trainer import InnerPhase
from pulsenet.rl.inner import GRPOInner
from pulsenet.rollouts import RolloutIntake

log = logging.getLogger(__name__)

CHECKPOINT = "trainer.pt"
"""The lone trainer's resume point: the round it closed, the whole trainer and the batches taken."""
CONSUMED = "consumed.json"
"""The rollout batches trained on (or dropped by a failed step) up to the resume point's round:
PULSELoCo's record (written as each round closes), and a lone trainer's additions to trainer.pt."""

Published = tuple[int, Mapping[str, torch.Tensor]] | None
"""The newest version this trainer's key signed and its BF16 weights, or None on a new channel."""


class Rounds(Protocol):
    """What closes a trainer's round (alone: ``LocalRounds``; PULSELoCo: ``LocoRounds``); each closed
    round is a ``RoundReport`` (``loco/config.py``: round number, participants, payload bytes), and
    what the trainer itself did in it is its ``nodes.trainer.RoundTally``."""

    inner_steps: int
    step_wait_s: float | None

    def degraded(self) -> str | None:
        """Why closing rounds is held up (a peer or the store), for ``/healthz``; None when it is not."""
        ...

    async def start(self, published: Published) -> int: ...

    def session(self) -> contextlib.AbstractAsyncContextManager[object]: ...

    async def next_round(self, train: InnerPhase) -> RoundReport | None: ...

    def record_consumed(self) -> None:
        """Persist the batches taken so far (a failed step dropped some mid-round: a restart must
        not take them again). Blocking: call it in a thread."""
        ...


class LocalRounds:
    """A lone trainer: a round is one GRPO step, closed by checkpointing it."""

    inner_steps = 1
    step_wait_s = None
    """A lone trainer has no peers to keep up with: a step waits for its rows as long as it takes."""

    def __init__(self, trainer_id: str, policy: GRPOInner, intake: RolloutIntake, state_dir: Path) -> None:
        self.id, self.policy, self.intake = trainer_id, policy, intake
        self.path = Path(state_dir) / CHECKPOINT
        self.consumed_path = Path(state_dir) / CONSUMED
        """Batches dropped by failed steps since the last checkpoint (``record_consumed``)."""
        self.round = 0

    async def start(self, published: Published) -> int:
        """Resume from ``trainer.pt`` when it is the published version's (or the next one's, not yet
        published); else continue from the published weights with a fresh optimizer rather than
        fork the chain."""
        ckpt = await asyncio.to_thread(self._load)
        version = None if published is None else published[0]
        if ckpt is not None:
            self.intake.skip_consumed(ckpt.get("consumed", {}))  # trained on before the restart
        if ckpt is not None and (version is None or ckpt["version"] in (version, version + 1)):
            await asyncio.to_thread(self.policy.restore_full, ckpt["local"])
            self.round = int(ckpt["version"])
        else:
            if published is not None:
                log.warning("%s: no checkpoint for v%d: continuing from the published weights", self.id, published[0])
                state = {n: t.float() for n, t in published[1].items()}
                await asyncio.to_thread(self.policy.load_state_fp32, state)
                self.round = published[0]
            await asyncio.to_thread(self._save, self.round)  # a resume and rollback point from the start
        later = await asyncio.to_thread(load_consumed, self.consumed_path, self.round, self.id)
        if later is not None:  # dropped by failed steps after the checkpoint
            self.intake.skip_consumed(later)
        return self.round

    def degraded(self) -> str | None:
        return None  # no peers to wait for; the store's own health is the status server's

    def record_consumed(self) -> None:
        save_consumed(self.consumed_path, self.round, self.intake.consumed())

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[LocalRounds]:
        yield self

    async def next_round(self, train: InnerPhase) -> RoundReport | None:
        """One step, then the resume point, atomically, before the caller publishes: a restart
        then republishes what it had not. A step that left the weights non-finite is undone from
        the last resume point, and the round fails."""
        r = self.round + 1
        losses = await train(r)
        if not losses:
            return None  # no step taken (nothing to train on): nothing to publish
        if not await asyncio.to_thread(lambda: finite(self.policy.parameters())):
            log.error("%s: round %d left non-finite weights: back to round %d", self.id, r, self.round)
            ckpt = await asyncio.to_thread(self._load)
            if ckpt is not None:
                await asyncio.to_thread(self.policy.restore_full, ckpt["local"])
            return None
        await asyncio.to_thread(self._save, r)
        self.round = r
        return RoundReport(round=r, trainer=self.id, participants=[self.id], included=True, loss=sum(losses) / len(losses))

    def _save(self, round_: int) -> None:
        with atomic_path(self.path, 0o600) as tmp:
            torch.save(
                {"version": round_, "local": self.policy.full_checkpoint(), "consumed": self.intake.consumed()}, tmp
            )

    def _load(self) -> dict[str, Any] | None:
        if not self.path.is_file():
            return None
        try:  # our own file on local disk; a torn or foreign one is ignored, not fatal
            ckpt = torch.load(self.path, weights_only=False)
            return ckpt if {"version", "local"} <= set(ckpt) else None
        except (OSError, RuntimeError, EOFError, ValueError, KeyError, TypeError, AttributeError, pickle.UnpicklingError) as e:
            log.error("%s: checkpoint %s unusable (%s): ignored", self.id, self.path, e)
            return None


class LocoRounds:
    """A PULSELoCo trainer: a round is H GRPO steps, closed by the exchange with the peers."""

    def __init__(self, loco: LocoTrainer, intake: RolloutIntake, state_dir: Path) -> None:
        self.loco, self.intake = loco, intake
        self.path = Path(state_dir) / CONSUMED
        self.inner_steps = loco.config.inner_steps
        self.step_wait_s: float | None = loco.config.deadline_s / 2
        """A trainer whose share of the rollouts is thin (the partition is by hash) goes on after half
        a round deadline with the steps it made (possibly none: its payload is then its error
        feedback) instead of falling out of the round."""

    @property
    def round(self) -> int:
        return self.loco.round

    async def start(self, published: Published) -> int:
        """Join the run (resume point or genesis agreement); the agreed θ is in the inner model."""
        await self.loco.start()
        consumed = await asyncio.to_thread(load_consumed, self.path, self.loco.round, self.loco.id)
        if consumed is not None:
            self.intake.skip_consumed(consumed)
        return self.loco.round

    def session(self) -> contextlib.AbstractAsyncContextManager[object]:
        return self.loco.session()

    def degraded(self, now: float | None = None) -> str | None:
        """The round's progress (``loco.progress``) when the store does not answer, or when an
        exchange phase has waited longer than a round deadline for its peers; and any peer left out
        of the digest vote (``LocoTrainer.trust``)."""
        p = self.loco.progress
        now = time.time() if now is None else now
        stalled = p.phase in ("upload", "collect", "agree", "backoff") and now - p.since > self.loco.config.deadline_s
        why = [p.describe(now)] if p.store_unreachable or stalled else []
        if (trust := self.loco.trust.issues()) is not None:  # a peer lying about its digests, say
            why.append(trust)
        return "; ".join(why) or None

    async def next_round(self, train: InnerPhase) -> RoundReport | None:
        report = await self.loco.next_round(train)
        if report is not None:
            await asyncio.to_thread(save_consumed, self.path, report.round, self.intake.consumed())
        return report

    def record_consumed(self) -> None:
        save_consumed(self.path, self.loco.round, self.intake.consumed())


def save_consumed(path: Path, round_: int, consumed: dict[str, int]) -> None:
    """The batches trained on (or dropped) up to round ``round_`` (its resume point's), atomically."""
    with atomic_path(path, 0o600) as tmp:
        tmp.write_text(json.dumps({"round": round_, "consumed": consumed}))


def load_consumed(path: Path, round_: int, trainer_id: str) -> dict[str, int] | None:
    """The batches ``save_consumed`` kept for round ``round_``; None (logged) if it has no such
    record: a crash between the round's resume point and this file, or a foreign file. Then the
    batches of round ``round_`` that are still fresh may be trained on once more."""
    try:
        data = json.loads(path.read_text())
        if data["round"] == round_:
            return {str(k): int(v) for k, v in data["consumed"].items()}
        why = f"it is for round {data['round']}"
    except FileNotFoundError:
        if round_ == 0:
            return None
        why = "there is none"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"unreadable: {e}"
    log.info("%s: no record of the batches taken after round %d's resume point (%s)", trainer_id, round_, why)
    return None


def finite(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether every value of every tensor is finite."""
    return all(bool(torch.isfinite(t).all()) for t in state.values())
