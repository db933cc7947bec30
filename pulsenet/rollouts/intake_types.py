"""What the rollout intake (intake.py) is set with, hands out and counts: its settings
(``RolloutIntakeConfig``, the ``[trainer.intake]`` table), an accepted batch (``RolloutBatch``),
a check's ``Refusal`` and its counters (``IntakeStats``, shown in /status and /metrics). The
sources it reads are in sources.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from pulsenet.codec.rollout import MAX_ROWS, MAX_TOKENS, Rollout, RolloutColumns
from pulsenet.deadlines import ROLLOUT_TRANSFER_S, SMALL_CALL_S
from pulsenet.rollouts.manifest import BatchManifest
from pulsenet.rollouts.rows import RowLimits


class Refusal(NamedTuple):
    """Why a check refuses a batch: ``reason`` (one of intake.py's ``REASONS``) and the detail logged."""

    reason: str
    why: str


AnswerOf = Callable[[RolloutColumns, tuple[int, ...]], str | None]
"""``answer_of(columns, dropped)``: the batch id a decoded batch answers, its manifest declaring the
problems in ``dropped`` left out (the trainer's ``rl.answers.BatchCheck``); RolloutRowError names
why it answers none the trainer allows (check 10)."""


@dataclass(kw_only=True, slots=True)
class RolloutIntakeConfig:
    run: str = "default"
    """Run id of the signing context (must equal the writers')."""
    prefix: str = "rollouts"
    """Key prefix of the channel inside each node's store."""
    max_staleness: int = 2
    """Largest ``trainer_version - rollout_version`` trained on."""
    limits: RowLimits = field(default_factory=RowLimits)
    """What a row may hold: set from the trainer's model and task (``RowLimits.for_model``)."""
    max_batch_bytes: int = 256 << 20
    """Payloads declared larger are refused before download."""
    max_rows: int = MAX_ROWS
    max_tokens: int = MAX_TOKENS
    """Rows and tokens of one batch: declared more, it is refused before download."""
    max_queued: int = 64
    """Batches held for ``take()``; a full queue leaves the rest in the store for later polls."""
    max_queued_tokens: int = 1 << 24
    """Tokens held for ``take()`` (16 Mi: ~140 MB as arrays); the rest waits in the store."""
    max_queued_bytes: int = 256 << 20
    """Decoded bytes held for ``take()``; the rest waits in the store."""
    timeout_s: float | None = SMALL_CALL_S
    """Deadline of each small store call (list, manifest get)."""
    transfer_timeout_s: float | None = ROLLOUT_TRANSFER_S
    """Deadline of one payload download."""
    interval_s: float = 1.0
    """Time between polls in ``run()``."""
    relist_after_s: float | None = 60.0
    """A source whose head has not moved is listed anyway this long after its last listing (a
    head write that failed cannot hide batches for longer); None: only when the head moves."""
    round_timeout_s: float | None = 600.0
    """Deadline of one whole poll in ``run()``."""
    refusals_to_distrust: int = 3
    """Strikes (batches refused by the trainer's replay, or at intake for what an honest node never
    sends: intake.py's ``STRIKE_REASONS``) after which a node's batches are no longer taken
    (trust.py; kept across restarts); 0: never."""
    forgive: list[str] = field(default_factory=list)
    """Nodes whose distrust and strikes are lifted when the intake resumes (an operator's call
    after a node was fixed; an open node's pinned key is forgotten too, and pinned again)."""
    open_inference: bool = False
    """Accept batches from sources configured without a trusted key (*open* nodes): each one's
    key is read from its own store (``layout.key``) and pinned on first read; it gets
    ``open_budget`` batches per version, and its first refused batch distrusts it. Needs the
    trainer's replay on (a trainer checks that): rows are still replayed."""
    open_budget: int = 2
    """Batches per version this trainer takes from one open node; more are skipped before any GET."""
    group_size: int | None = None
    """GRPO's G: every group of a batch holds exactly this many rows (``rl.tasks.Assignment``),
    signed into the demand record so that the nodes make it; None: not set (any, equal sizes)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.max_batch_bytes < 1:
            raise ValueError("max_staleness must be >= 0 and max_batch_bytes >= 1")
        if min(self.max_queued, self.max_queued_tokens, self.max_queued_bytes) < 1:
            raise ValueError("max_queued, max_queued_tokens and max_queued_bytes must be >= 1")
        if self.refusals_to_distrust < 0 or self.open_budget < 0:
            raise ValueError("refusals_to_distrust and open_budget must be >= 0")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError("group_size must be >= 1")


@dataclass(frozen=True, slots=True)
class RolloutBatch:
    """An accepted batch: its verified manifest and its rows as arrays."""

    manifest: BatchManifest
    columns: RolloutColumns
    batch_id: str
    """``node/manifest key``: names the batch in the partition and the consumed record."""

    answer: str | None = None
    """The batch id it answers (``answer_of``), e.g. ``v3-b1``: accepted once per node."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def node(self) -> str:
        return self.manifest.node

    @property
    def tokens(self) -> int:
        return self.columns.tokens

    @property
    def group_prefix(self) -> str:
        """``{node}/{seq}/``, put before every group id of the batch for a GRPO step: groups never
        span batches, so no node's ids (reused, or chosen to match another node's) can join or
        change another batch's groups and advantages."""
        return f"{self.manifest.node}/{self.manifest.seq}/"

    @property
    def rows(self) -> list[Rollout]:
        """The rows as ``Rollout`` objects for a GRPO step, each group id qualified (``group_prefix``)."""
        return self.columns.to_rows(group_prefix=self.group_prefix)


@dataclass(slots=True)
class IntakeStats:
    polls: int = 0
    accepted: int = 0
    rows_accepted: int = 0
    taken: int = 0
    """Batches handed to the trainer by ``take()``."""
    taken_by_node: dict[str, int] = field(default_factory=dict)
    bytes_downloaded: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    """Reason (REASONS) -> batches refused for it."""
    rejected_by_node: dict[str, dict[str, int]] = field(default_factory=dict)
    """Node -> reason -> batches of that node refused for it (the same counts, per source)."""
    stale_in_flight: int = 0
    """Batches already too old when first seen in the store."""
    stale_queued: int = 0
    """Accepted batches that went too old in the local queue before ``take()``."""
    other_trainer: int = 0
    """Batches left to another participant by the partition."""
    deferred: int = 0
    """Times a batch was left in the store for a later poll: the queue was at a budget."""
    staleness: dict[int, int] = field(default_factory=dict)
    """``trainer_version - version`` -> batches taken at that lag."""
    queued: int = 0
    queued_tokens: int = 0
    queued_bytes: int = 0
    """What the local queue holds now (batches, tokens, decoded bytes)."""
    errors: int = 0
    """Store errors and failed polls (logged); the sources are retried next poll."""
    lists: int = 0
    """Listings of a source's manifests (the request class stores bill most)."""
    head_not_modified: int = 0
    """Source polls answered by a 304 on the head: nothing new, nothing listed."""
    head_missing: int = 0
    """Times a source's head was found missing (it had one, or never had): listed every poll then."""
    head_backwards: int = 0
    """Heads older than one already verified (replayed): listed every poll until a newer one."""
    head_rejected: int = 0
    """Heads refused (bad signature, another node's, malformed, too large): listed every poll."""
    distrusted: dict[str, str] = field(default_factory=dict)
    """Node -> why its batches are no longer taken (trust.py); the batches skipped since are
    counted in ``rejected_by_node`` under ``distrusted``."""
