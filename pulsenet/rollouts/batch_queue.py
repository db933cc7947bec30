"""The rollout intake's local queue: accepted batches waiting for the trainer's ``take()``, held as
arrays (``codec.rollout.RolloutColumns``, ~8 bytes per token) and bounded in batches, tokens and
decoded bytes; what does not fit stays in the store for a later poll (intake.py)."""

from __future__ import annotations

import logging

from pulsenet.codec.rollout import RolloutColumns
from pulsenet.rollouts.intake_types import IntakeStats, RolloutBatch, RolloutIntakeConfig
from pulsenet.rollouts.manifest import BatchManifest

log = logging.getLogger(__name__)


class BatchQueue:
    """Accepted batches in arrival order; ``stats.queued``, ``queued_tokens`` and ``queued_bytes``
    always say what it holds."""

    def __init__(self, config: RolloutIntakeConfig, stats: IntakeStats) -> None:
        self.config = config
        self.stats = stats
        self._batches: list[RolloutBatch] = []

    def __len__(self) -> int:
        return len(self._batches)

    def full(self) -> bool:
        """At ``max_queued`` batches: nothing more is fetched this poll."""
        return len(self._batches) >= self.config.max_queued

    def fits(self, m: BatchManifest) -> bool:
        """Whether the batch ``m`` declares fits the token and byte budgets now (else it waits in
        the store for a later poll)."""
        estimate = RolloutColumns.bound_nbytes(rows=m.rows, groups=m.groups, tokens=m.tokens)
        s, cfg = self.stats, self.config
        return s.queued_tokens + m.tokens <= cfg.max_queued_tokens and s.queued_bytes + estimate <= cfg.max_queued_bytes

    def add(self, b: RolloutBatch) -> None:
        self._batches.append(b)
        self.stats.queued += 1
        self.stats.queued_tokens += b.tokens
        self.stats.queued_bytes += b.columns.nbytes

    def take(self, trainer_version: int, max_batches: int | None = None) -> list[RolloutBatch]:
        """Up to ``max_batches`` batches still fresh enough for ``trainer_version``, newest version
        first (arrival order within a version); stale ones are dropped and counted (``stale_queued``).

        Newest first: what is trained on is as fresh as the queue allows, and an older batch is
        taken only when nothing newer waits (issue 23: oldest first trained every round on batches
        two versions old)."""
        fresh: list[RolloutBatch] = []
        for b in self._batches:
            lag = trainer_version - b.version
            if lag <= self.config.max_staleness:
                fresh.append(b)
                continue
            self.stats.stale_queued += 1
            self._remove(b)
            log.info("dropped queued batch %s: %d versions stale", b.batch_id, lag)
        fresh.sort(key=lambda b: -b.version)  # stable
        n = len(fresh) if max_batches is None else max(0, max_batches)
        out, self._batches = fresh[:n], fresh[n:]
        for b in out:
            self._remove(b)
        return out

    def drop_node(self, node: str) -> list[RolloutBatch]:
        """Drop (and return) the batches of ``node``."""
        dropped = [b for b in self._batches if b.node == node]
        self._batches = [b for b in self._batches if b.node != node]
        for b in dropped:
            self._remove(b)
        return dropped

    def _remove(self, b: RolloutBatch) -> None:
        self.stats.queued -= 1
        self.stats.queued_tokens -= b.tokens
        self.stats.queued_bytes -= b.columns.nbytes
