"""Trainer side of the rollout channel: poll the trusted inference nodes' stores, verify, queue.

A batch is accepted only if, in this order (the first failing check is the counted reason):

1. its manifest is at most ``signing.MAX_DOCUMENT`` bytes (listed size, then the read is capped)
   — ``too_large``;
2. it verifies under a key trusted *for the node whose store it is in*, signed for that node's
   context — ``wrong_node_key`` when a key trusted only for another node validly signed it,
   ``signature`` otherwise;
   malformed bodies and bodies that disagree with their key name — ``malformed``;
3. ``trainer_version - version <= max_staleness`` — else dropped as stale *in flight* (judged
   from the key name before any GET: a body must match its name anyway);
4. its model digest is the one published for its version (``digest_of``) — ``unknown_version``,
   ``wrong_digest``;
5. its declared size, rows and tokens are within limits, and could ever fit the queue's token and
   byte budgets — ``too_large``, refused before download;
6. the payload's size and SHA-256 equal the manifest's (``signed.fetch_object``: never read past the
   signed size) — ``size_mismatch``, ``hash_mismatch``;
7. the Parquet decodes under the limits — ``payload_malformed``;
8. every row's version, digest and node equal the manifest's, and the row, group and token
   counts match — ``row_mismatch``;
9. every row is within the trainer's :class:`~pulsenet.rollouts.rows.RowLimits` (token ids below the
   vocabulary, lengths within the context, one prompt per group, logprobs and rewards in range) —
   ``rows.ROW_REASONS``;
10. with ``answer_of`` (the trainer's ``rl.tasks.Assignment``): the batch answers one batch id the
    trainer allows, every number of its group ids within bounds — ``ANSWER_REASONS``; and no batch
    accepted before answered the same id — ``batch_repeated`` (the ids are part of the consumed
    record, so this holds across a restart).

**Polling costs one request when nothing changed**: each node keeps a signed head
(``layout.head``, manifest.py) rewritten after every batch. A poll asks for it with one
conditional GET per source (a 304 with no body while unchanged) and lists the manifests only when
it moved, is missing, refused or went backwards (each counted), or when ``relist_after_s`` passed
since the last listing (a safety net for a head write that failed). Candidates a listing found
but a poll could not take yet (over a budget, from a version not reached yet) are remembered, so
they need no new listing either. Planted manifests never block: batches are still found by the
listing and accepted on their own signed manifests, never on a head's word.

A refused manifest is remembered by key and ETag and never fetched again while unchanged, so it
never blocks or slows valid ones; every refusal is counted per reason and per node. Accepted
batches wait in a local queue as arrays (``codec.rollout.RolloutColumns``, ~8 bytes per token),
bounded in batches, tokens and bytes: what does not fit stays in the store for a later poll. Each
poll serves the sources round-robin (from a rotating start), newest version first within a source,
so a node that keeps many batches listed cannot starve the others. ``take()`` hands out the newest
fresh batches first and drops those that went stale while queued (counted apart from those stale
in flight). Several trainers share one pool by a deterministic partition (partition.py): each
fetches only the batches it owns. A batch whose GRPO step failed is reported back with
``failed()``: counted, and kept in the consumed record so it is never trained on again.

**Trust** (trust.py): a batch the trainer's replay refuses (``refused()`` with a
``REPLAY_REASONS`` reason) is a strike against its node; after ``refusals_to_distrust`` strikes the
node is distrusted: no GET of its store any more, its batches skipped from a listing made once per
``relist_after_s`` (counted under ``distrusted``), also
after a restart (the trust record is part of ``consumed()``). With ``open_inference``, a source
configured without a key is an open node: its key is pinned from its own store, it gets
``open_budget`` batches per version (``over_budget`` past it), and its first refusal distrusts it.
Batch numbers a node withheld are counted under ``withheld`` (``trust.Gaps``: a lower bound).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet import runtime
from pulsenet.codec.rollout import MAX_ROWS, MAX_TOKENS, Rollout, RolloutColumns, decode_columns
from pulsenet.deadlines import ROLLOUT_TRANSFER_S, SMALL_CALL_S
from pulsenet.errors import (
    DocumentTooLarge,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    PulsenetError,
    RolloutError,
    RolloutRowError,
    SignatureError,
    SizeMismatch,
    StoreError,
    VerificationError,
)
from pulsenet.rollouts.demand import Demand
from pulsenet.rollouts.layout import BatchName, RolloutLayout, check_node
from pulsenet.rollouts.manifest import MAX_HEAD, BatchManifest, batch_manifest_from, head_from
from pulsenet.rollouts.partition import owner
from pulsenet.rollouts.rows import ROW_REASONS, RowLimits, check_rows
from pulsenet.rollouts.trust import DISTRUSTED, PINNED, STRIKES, TRUST_REASONS, Gaps, Trust, answered_batch
from pulsenet.signed import fetch_document, fetch_object
from pulsenet.signing import MAX_DOCUMENT, key_id, verify_document
from pulsenet.store.base import ObjectInfo, ObjectStore

log = logging.getLogger(__name__)

REPLAY_REASONS = ("replay_token", "replay_logprob", "replay_params")
"""What the trainer's replay of a batch's rows may refuse it for (``rl.replay``), via ``refused()``."""

ANSWER_REASONS = ("group_id", "out_of_assignment", "mixed_batches", "group_size")
"""What ``answer_of`` may refuse a batch for (``rl.tasks.Assignment.batch_of``)."""

REASONS = (
    "too_large",
    "signature",
    "wrong_node_key",
    "malformed",
    "unknown_version",
    "wrong_digest",
    "size_mismatch",
    "hash_mismatch",
    "payload_malformed",
    "row_mismatch",
    *ROW_REASONS,
    *ANSWER_REASONS,
    "batch_repeated",
    "step_failed",
    "rescore",
    *REPLAY_REASONS,
    "unverifiable",
    *TRUST_REASONS,
)
"""Why a batch is refused (``IntakeStats.rejected``); ``step_failed`` is counted by ``failed()``,
``rescore`` and ``REPLAY_REASONS`` by ``refused()`` (the trainer's re-scoring found no row it may
train on; its replay found a row the policy did not sample: rl/replay.py); ``unverifiable``: the
trainer no longer holds the weights of the batch's version (a restart), not the node's doing;
``TRUST_REASONS`` by the trust rules (trust.py: batches of a distrusted node or over an open node's
budget skipped, an open node's key that changed, batch numbers withheld)."""

STRIKE_REASONS = REPLAY_REASONS
"""Refusals that count towards ``refusals_to_distrust`` (trust.py says why ``rescore`` does not)."""

@dataclass(frozen=True, slots=True)
class RolloutSource:
    """One inference node's store, read with read-only credentials, and the keys it may sign with."""

    node: str
    store: ObjectStore
    trusted: Mapping[str, Ed25519PublicKey]
    """Key id -> public key of this node only: another node's key is refused here."""


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
    """Batches refused by the trainer's replay (``REPLAY_REASONS``) after which a node's batches
    are no longer taken (trust.py; kept across restarts); 0: never."""
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

    def __post_init__(self) -> None:
        if self.max_staleness < 0 or self.max_batch_bytes < 1:
            raise ValueError("max_staleness must be >= 0 and max_batch_bytes >= 1")
        if min(self.max_queued, self.max_queued_tokens, self.max_queued_bytes) < 1:
            raise ValueError("max_queued, max_queued_tokens and max_queued_bytes must be >= 1")
        if self.refusals_to_distrust < 0 or self.open_budget < 0:
            raise ValueError("refusals_to_distrust and open_budget must be >= 0")


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


@dataclass(slots=True)
class _Head:
    """What this intake knows of one source's head."""

    etag: str | None = None
    """ETag of the head object read last (accepted or not): a 304 on it means "the same object"."""
    seq: int = -1
    """Highest head seq verified."""
    trusted: bool = False
    """The object behind ``etag`` is a verified head not older than ``seq``: its 304 means no change."""
    missing: bool = False
    listed: float = -math.inf
    """time.monotonic() of the last listing."""


ANSWERED = "answered:"
"""Prefix of the answered batch ids in ``consumed()`` (batch ids proper start with a node id)."""

_DEFER = object()
"""``_consider``'s answer for a valid-looking batch that does not fit the queue's budgets now."""


class RolloutIntake:
    """Collects verified rollout batches from the trusted inference nodes for one trainer."""

    def __init__(
        self,
        sources: Sequence[RolloutSource],
        digest_of: Callable[[int], str | None],
        config: RolloutIntakeConfig | None = None,
        *,
        trainer_id: str = "t0",
        participants: Sequence[str] | Callable[[int], Sequence[str]] | None = None,
        answer_of: Callable[[RolloutColumns], str | None] | None = None,
    ) -> None:
        """``digest_of(version)``: the model digest published for a policy version, None if unknown.
        ``participants``: the trainer ids sharing the pool (per version, or fixed); default just us.
        ``answer_of(columns)``: the batch id a batch answers (unique per node and version; None:
        none to check), or RolloutRowError naming why the batch answers none it may (check 10)."""
        nodes = [check_node(s.node) for s in sources]
        if len(set(nodes)) != len(nodes) or not sources:
            raise ValueError(f"rollout sources need distinct node ids, got {nodes}")
        self.sources = list(sources)
        self._any_node = {kid: k for s in sources for kid, k in s.trusted.items()}
        """Every node's keys: a document one of them signed verifies, and its signer is then checked
        against the keys of the node whose store it is in (``wrong_node_key`` otherwise)."""
        self.digest_of = digest_of
        self.config = config = config or RolloutIntakeConfig()
        self.layout = RolloutLayout(config.prefix)
        self.trainer_id = trainer_id
        fixed = tuple(participants) if participants is not None and not callable(participants) else None
        if fixed is not None and trainer_id not in fixed:
            raise ValueError(f"trainer {trainer_id!r} is not among the participants {fixed}")
        self._participants = participants if callable(participants) else (lambda _v: fixed or (trainer_id,))
        self.stats = IntakeStats()
        self._seen: dict[str, dict[str, str]] = {s.node: {} for s in sources}  # node -> key -> etag decided
        self._accepted: dict[str, int] = {}  # batch id -> version: never queued twice
        self._taken: dict[str, int] = {}  # batch id -> version: handed to the trainer (``consumed``)
        self.answer_of = answer_of
        self._answered: dict[str, int] = {}  # "node/answer" -> version: each accepted once (``consumed``)
        self._queue: list[RolloutBatch] = []  # in arrival order; ``take`` hands out the newest first
        self._keys: dict[str, dict[str, Ed25519PublicKey]] = {s.node: dict(s.trusted) for s in sources}
        """Node -> the keys its documents verify under: configured, or an open node's pinned key."""
        self.trust = Trust(
            config.refusals_to_distrust,
            frozenset(STRIKE_REASONS),
            open_nodes=frozenset(s.node for s in sources if not s.trusted) if config.open_inference else frozenset(),
        )
        self.gaps = Gaps()
        self._key_etag: dict[str, str] = {}  # open node -> ETag of the key object read last
        self._version = 0  # the trainer version of the last poll: when a node was distrusted
        self._heads: dict[str, _Head] = {s.node: _Head() for s in sources}
        self._pending: dict[str, list[tuple[ObjectInfo, BatchName]]] = {s.node: [] for s in sources}
        """Per source: listed batches not decided yet (not reached, over a budget): no new listing needed."""

    def __len__(self) -> int:
        return len(self._queue)

    def batch_id(self, node: str, name: BatchName) -> str:
        return self.layout.batch_id(node, name)

    def participants(self, version: int) -> tuple[str, ...]:
        """The trainer ids sharing the pool at ``version`` (the partition's set)."""
        return tuple(sorted(set(self._participants(version))))

    # --- trainer API -------------------------------------------------------------------------

    def take(self, trainer_version: int, max_batches: int | None = None) -> list[RolloutBatch]:
        """Queued batches still fresh enough for ``trainer_version``, newest version first (arrival
        order within a version); stale ones are dropped and counted (``stale_queued``).

        Newest first: what is trained on is as fresh as the queue allows, and an older batch is
        taken only when nothing newer waits (issue 23: oldest first trained every round on batches
        two versions old)."""
        fresh: list[RolloutBatch] = []
        for b in self._queue:
            lag = trainer_version - b.version
            if lag <= self.config.max_staleness:
                fresh.append(b)
                continue
            self.stats.stale_queued += 1
            self._unqueued(b)
            log.info("dropped queued batch %s: %d versions stale", b.batch_id, lag)
        fresh.sort(key=lambda b: -b.version)  # stable
        n = len(fresh) if max_batches is None else max(0, max_batches)
        out, self._queue = fresh[:n], fresh[n:]
        for b in out:
            lag = trainer_version - b.version
            self.stats.taken += 1
            self.stats.taken_by_node[b.node] = self.stats.taken_by_node.get(b.node, 0) + 1
            self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + 1
            self._taken[b.batch_id] = b.version
            self._unqueued(b)
        return out

    def failed(self, batches: RolloutBatch | Iterable[RolloutBatch], why: str) -> None:
        """The GRPO step on ``batches`` (taken earlier) raised: count each under ``step_failed`` for
        its node, and keep it in the consumed record, so that it is never queued again, also after
        a restart (``consumed`` / ``skip_consumed``). The caller drops the step and goes on."""
        for b in [batches] if isinstance(batches, RolloutBatch) else list(batches):
            self._taken[b.batch_id] = b.version
            self._accepted[b.batch_id] = b.version
            self._count(b.node, "step_failed")
            log.warning("rollout batch %s dropped: its GRPO step failed: %s", b.batch_id, why)

    def demand(
        self,
        trainer_version: int,
        rows_in_flight: int,
        *,
        live: Iterable[str] | None = None,
        assignment: tuple[int, int] | None = None,
    ) -> Demand:
        """This trainer's demand record (demand.py) for ``DemandWriter``: ``rows_in_flight`` rows
        wanted outstanding, split evenly over the ``live`` sources (default: all; a node known
        dead gets 0, so the live ones cover its share), and per node the batches taken (or
        failed) at versions this trainer still accepts, from the consumed record; ``assignment``:
        ``(batches_per_version, prompts_per_batch)`` the nodes may answer (``rl.tasks.Assignment``).

        ``rows_in_flight``: what the next steps will take, e.g. ``rows_per_step`` (one version
        per step) or ``2 * rows_per_step`` (PULSELoCo: H steps per version, refilled as taken)."""
        if rows_in_flight < 0:
            raise ValueError(f"rows_in_flight must be >= 0, got {rows_in_flight}")
        floor = trainer_version - self.config.max_staleness
        nodes = [s.node for s in self.sources]
        known = None if live is None else set(live)
        alive = [n for n in nodes if (known is None or n in known) and n not in self.trust.distrusted] or nodes
        share = math.ceil(rows_in_flight / len(alive))
        taken = dict.fromkeys(nodes, 0)
        for bid, v in self._taken.items():
            node = bid.split("/", 1)[0]
            if v >= floor and node in taken:
                taken[node] += 1
        return Demand(
            trainer=self.trainer_id,
            version=trainer_version,
            max_staleness=self.config.max_staleness,
            participants=self.participants(trainer_version),
            grants={n: share if n in alive else 0 for n in nodes},
            taken=taken,
            **({} if assignment is None else {"batches_per_version": assignment[0], "prompts_per_batch": assignment[1]}),
        )

    def refused(self, batch: RolloutBatch, reason: str, why: str) -> None:
        """A batch ``take`` handed out that the trainer will not train on after all (``rescore``:
        none of its rows passed re-scoring; a ``REPLAY_REASONS`` reason: its replay found a row the
        policy did not sample): counted per node under ``reason``, and kept in the consumed
        record, so that it is never taken again, also after a restart. A replay refusal is a
        strike against the node (trust.py), any refusal of an open node distrusts it: call
        ``record_consumed`` after this so that the distrust survives a restart too."""
        self._taken[batch.batch_id] = batch.version
        self._accepted[batch.batch_id] = batch.version
        self._count(batch.node, reason)
        log.warning("rollout batch %s refused (%s): %s", batch.batch_id, reason, why)

    def consumed(self) -> dict[str, int]:
        """``batch id -> version`` of the batches ``take`` handed out (or ``failed`` reported) that
        are still within the staleness window, and ``ANSWERED + node/answer -> version`` of the
        batch ids answered: part of a trainer's resume state, so that a restarted trainer neither
        trains on a batch twice nor accepts a batch id answered again (``skip_consumed``); and the
        trust record (trust.py: strikes, distrusted nodes, open nodes' pinned keys)."""
        return {**self._taken, **{ANSWERED + a: v for a, v in self._answered.items()}, **self.trust.record()}

    def skip_consumed(self, consumed: Mapping[str, int]) -> None:
        """Never queue these batches (what ``consumed`` returned before a restart), and take back
        the trust record; then lift the distrust of the nodes in ``config.forgive``."""
        self.trust.restore(consumed)
        self.trust.forgive(self.config.forgive)
        for node in self.trust.distrusted:
            if node not in self.stats.distrusted:
                self.stats.distrusted[node] = "distrusted before a restart"
                log.warning(
                    "rollout node %s is still distrusted (since v%d): its batches are not taken",
                    node, self.trust.distrusted[node],
                )
        for key, v in consumed.items():
            if key.startswith(ANSWERED):
                self._answered[key.removeprefix(ANSWERED)] = v
            elif key.startswith((DISTRUSTED, STRIKES, PINNED)):
                continue
            else:
                self._taken[key] = v
                self._accepted[key] = v

    async def run(self, trainer_version: Callable[[], int], stop: asyncio.Event | None = None) -> None:
        """Poll until ``stop`` is set or the task is cancelled; failed polls are logged and counted."""
        await runtime.every(
            self.config.interval_s, stop or asyncio.Event(), lambda: self.poll(trainer_version()),
            timeout=self.config.round_timeout_s, on_error=self._poll_failed,
        )  # fmt: skip

    def _poll_failed(self, e: Exception) -> None:
        """A failed poll (``run``): counted and logged; polling goes on."""
        self.stats.errors += 1
        if isinstance(e, (PulsenetError, TimeoutError)):
            log.warning("rollout poll failed: %s: %s", type(e).__name__, e)
        else:
            log.error("unexpected error in a rollout poll", exc_info=e)

    async def poll(self, trainer_version: int) -> int:
        """One pass over every source; returns how many batches were accepted into the queue."""
        self.stats.polls += 1
        self._version = trainer_version
        floor = trainer_version - self.config.max_staleness
        for node, n in self.gaps.settle(floor).items():
            self._count(node, "withheld", n)
            log.warning("rollout node %s withheld at least %d batch number(s) of versions below v%d", node, n, floor)
        self._accepted = {b: v for b, v in self._accepted.items() if v >= floor}
        self._taken = {b: v for b, v in self._taken.items() if v >= floor}
        self._answered = {a: v for a, v in self._answered.items() if v >= floor}  # older: stale anyway
        pending: dict[str, collections.deque[tuple[ObjectInfo, BatchName]]] = {}
        for source in self.sources:
            try:
                wanted = await self._to_list(source)
                if wanted is None:
                    continue
                if wanted:
                    listing = await source.store.list(self.layout.manifests, timeout=self.config.timeout_s)
                    self.stats.lists += 1
                    self._heads[source.node].listed = time.monotonic()
                    self._listed(source, listing, trainer_version)
            except (StoreError, TimeoutError) as e:
                self._source_failed(source, e)
                continue
            pending[source.node] = collections.deque(self._candidates(source, trainer_version))
        return await self._admit(pending, trainer_version)

    # --- one poll ----------------------------------------------------------------------------

    async def _to_list(self, source: RolloutSource) -> bool | None:
        """Whether to list ``source`` now; None: leave it out of this poll. A distrusted node costs
        no GET at all: it is listed once per ``relist_after_s`` (never when that is None) only so
        that its skipped batches are counted. An open node needs its key first (``_open_key``)."""
        node = source.node
        if node in self.trust.distrusted:
            every = self.config.relist_after_s
            return True if every is not None and time.monotonic() - self._heads[node].listed >= every else None
        if self.trust.is_open(node) and not await self._open_key(source):
            return None  # no key to verify it with (yet), or distrusted by this read
        return await self._head_moved(source)

    async def _head_moved(self, source: RolloutSource) -> bool:
        """Whether to list ``source`` now: one conditional GET of its head decides (class docstring)."""
        cfg, st = self.config, self._heads[source.node]
        try:
            got = await source.store.get_if_changed(self.layout.head, st.etag, max_bytes=MAX_HEAD, timeout=cfg.timeout_s)
        except ObjectNotFound:
            if not st.missing:
                self.stats.head_missing += 1
                log.warning("rollout source %s has no head: listing it every poll", source.node)
            st.etag, st.trusted, st.missing = None, False, True
            return True
        except ObjectTooLarge as e:
            self.stats.head_rejected += 1
            st.etag, st.trusted = None, False
            log.warning("rollout head of %s refused: %s", source.node, e)
            return True
        st.missing = False
        if got is None:  # 304: the same object as last time
            self.stats.head_not_modified += 1
            stale = cfg.relist_after_s is not None and time.monotonic() - st.listed >= cfg.relist_after_s
            return not st.trusted or stale
        st.etag = got.etag
        context = self.layout.head_context(cfg.run, source.store.url, source.node)
        try:
            signed = await asyncio.to_thread(verify_document, got.data, self._keys[source.node], context=context)
            head = head_from(signed, source.node)
        except ManifestError as e:  # SignatureError included
            self.stats.head_rejected += 1
            st.trusted = False
            log.warning("rollout head of %s refused: %s: %s", source.node, type(e).__name__, e)
            return True
        if head.seq < st.seq:
            self.stats.head_backwards += 1
            st.trusted = False
            log.warning("rollout head of %s went back from seq %d to %d", source.node, st.seq, head.seq)
            return True
        st.seq, st.trusted = head.seq, True
        return True

    async def _open_key(self, source: RolloutSource) -> bool:
        """Whether open ``source`` has a key to verify its documents with now: its ``layout.key``
        (raw 32 bytes, in its own store), read with one conditional GET per poll (a 304 while
        unchanged) and pinned on first read. A key that is not one, one another node holds, or one
        other than the pinned: refused (which distrusts an open node). Store errors propagate."""
        node, cfg = source.node, self.config
        try:
            got = await source.store.get_if_changed(
                self.layout.key, self._key_etag.get(node) or None, max_bytes=64, timeout=cfg.timeout_s
            )
        except ObjectNotFound:
            got = None  # pinned before (perhaps before a restart): go on with the key we have
            if not self._keys[node] and node not in self._key_etag:
                self._key_etag[node] = ""  # said once
                log.warning("open rollout node %s has no %s yet: nothing of it can be verified", node, self.layout.key)
        except ObjectTooLarge:
            self._reject(node, self.layout.key, "malformed", "a public key object over 64 bytes")
            return False
        if got is not None:
            self._key_etag[node] = got.etag
            try:
                public = Ed25519PublicKey.from_public_bytes(got.data)
            except ValueError as e:
                self._reject(node, self.layout.key, "malformed", f"not a raw Ed25519 public key: {e}")
                return False
            kid = key_id(public)
            if any(kid in keys for other, keys in self._keys.items() if other != node):
                self._reject(node, self.layout.key, "wrong_node_key", f"key {kid} is another node's")
                return False
            if not self.trust.pin(node, kid, self._version):
                self._reject(node, self.layout.key, "key_changed", f"key {kid}; {self.trust.pinned[node]} was pinned")
                return False
            if kid not in self._keys[node]:
                self._keys[node] = {kid: public}
                self._any_node[kid] = public
                log.info("open rollout node %s: key %s pinned", node, kid)
        return bool(self._keys[node])

    def _listed(self, source: RolloutSource, listing: list[ObjectInfo], trainer_version: int) -> None:
        """Remember a listing's undecided batches; forget decisions on what is no longer listed;
        count the node's names per version for the gap bound (trust.Gaps)."""
        seen = self._seen[source.node]
        listed = {i.key for i in listing}
        for k in [k for k in seen if k not in listed]:
            del seen[k]  # memory stays bounded by the listing
        names = [(i, n) for i in listing if (n := self.layout.parse_manifest(i.key)) is not None]
        self._pending[source.node] = [(i, n) for i, n in names if seen.get(i.key) != i.etag]
        per_version = collections.Counter(n.version for _, n in names if n.node == source.node)
        lag = self.config.max_staleness
        self.gaps.saw_listing(source.node, per_version, trainer_version - lag, trainer_version + lag + 16)

    def _candidates(self, source: RolloutSource, trainer_version: int) -> list[tuple[ObjectInfo, BatchName]]:
        """The remembered batches this trainer may fetch now, newest version first (sequence order
        within a version); decides (and remembers)
        the stale ones and those another trainer owns without a GET."""
        node = source.node
        seen = self._seen[node]
        keep, out = [], []
        budget = self.config.open_budget if self.trust.is_open(node) else None
        used = collections.Counter(v for b, v in self._accepted.items() if budget is not None and b.startswith(f"{node}/"))
        for info, name in self._pending[node]:
            if seen.get(info.key) == info.etag:
                continue  # decided since it was listed
            keep.append((info, name))
            if name.version > trainer_version:
                continue  # from a version this trainer has not reached: look again later
            if trainer_version - name.version > self.config.max_staleness:
                # Stale by its name: dropped without a GET. Nothing valid is lost, since a body
                # must name the batch its key names to be accepted at all.
                self.stats.stale_in_flight += 1
                seen[info.key] = info.etag
                continue
            bid = self.batch_id(source.node, name)
            if owner(bid, self._participants(name.version)) != self.trainer_id:
                self.stats.other_trainer += 1
                seen[info.key] = info.etag
                continue
            if bid in self._accepted:
                seen[info.key] = info.etag  # queued, taken or failed before (e.g. before a restart)
                continue
            if node in self.trust.distrusted or (budget is not None and used[name.version] >= budget):
                self._count(node, "distrusted" if node in self.trust.distrusted else "over_budget")
                seen[info.key] = info.etag  # skipped before any GET, counted once
                continue
            used[name.version] += 1
            out.append((info, name))
        self._pending[source.node] = [(i, n) for i, n in keep if seen.get(i.key) != i.etag]
        out.sort(key=lambda c: (-c[1].version, c[1].seq))  # newest version first, in order within one
        return out

    async def _admit(
        self, pending: dict[str, collections.deque[tuple[ObjectInfo, BatchName]]], trainer_version: int
    ) -> int:
        """Fetch candidates one source at a time in turn (from a start that rotates every poll)
        until the queue is at a budget: each node gets an equal share of every poll."""
        k = self.stats.polls % len(self.sources)
        turn = [s for s in self.sources[k:] + self.sources[:k] if pending.get(s.node)]
        accepted = 0
        while turn:
            for source in list(turn):
                queue = pending[source.node]
                if len(self._queue) >= self.config.max_queued:
                    self.stats.deferred += sum(len(pending[s.node]) for s in turn)
                    return accepted
                if source.node in self.trust.distrusted:  # by a refusal earlier in this poll
                    for info, _ in queue:
                        self._count(source.node, "distrusted")
                        self._seen[source.node][info.key] = info.etag
                    queue.clear()
                    turn.remove(source)
                    continue
                info, name = queue.popleft()
                try:
                    outcome = await self._consider(source, info, name, trainer_version)
                except (StoreError, TimeoutError) as e:  # nothing remembered: tried again next poll
                    self._source_failed(source, e)
                    turn.remove(source)
                    continue
                if outcome is _DEFER:
                    self.stats.deferred += 1 + len(queue)
                    turn.remove(source)
                    continue
                self._seen[source.node][info.key] = info.etag  # decided: never fetched again
                if isinstance(outcome, RolloutBatch):
                    self._accepted[outcome.batch_id] = outcome.version
                    if outcome.answer is not None:
                        self._answered[f"{source.node}/{outcome.answer}"] = outcome.version
                    if (vb := answered_batch(outcome.answer)) is not None:
                        self.gaps.saw_accepted(source.node, *vb)
                    self._queue.append(outcome)
                    self.stats.accepted += 1
                    self.stats.rows_accepted += len(outcome.columns)
                    self.stats.queued += 1
                    self.stats.queued_tokens += outcome.tokens
                    self.stats.queued_bytes += outcome.columns.nbytes
                    accepted += 1
                if not queue:
                    turn.remove(source)
        return accepted

    async def _consider(
        self, source: RolloutSource, info: ObjectInfo, name: BatchName, trainer_version: int
    ) -> RolloutBatch | object | None:
        """The batch if it passes every check; ``_DEFER`` if it does not fit the queue now; else
        None with the reason counted and logged.

        Store errors other than a missing or oversized object propagate (nothing is remembered)."""
        cfg = self.config
        node = source.node
        ctx = self.layout.context(cfg.run, source.store.url, node)
        try:  # verified under every node's keys, so that another node's signature is told apart
            signed = await fetch_document(
                source.store,
                info.key,
                self._any_node,
                context=ctx,
                max_bytes=MAX_DOCUMENT,
                timeout=cfg.timeout_s,
                listed_size=info.size,
            )
            if signed.signer not in self._keys[node]:
                return self._reject(node, info.key, "wrong_node_key", f"signed by {signed.signer}, a key of another node")
            m = batch_manifest_from(signed, layout=self.layout, name=name)
        except ObjectNotFound:
            return None  # deleted by its owner's retention since the listing
        except DocumentTooLarge as e:
            return self._reject(node, info.key, "too_large", str(e))
        except SignatureError as e:
            return self._reject(node, info.key, "signature", str(e))
        except ManifestError as e:
            return self._reject(node, info.key, "malformed", str(e))
        if m.node != node:
            return self._reject(node, info.key, "malformed", f"node {m.node!r} in the store of {node!r}")
        lag = trainer_version - m.version
        if lag > cfg.max_staleness:
            self.stats.stale_in_flight += 1
            log.info("dropped batch %s: %d versions stale in flight", info.key, lag)
            return None
        published = self.digest_of(m.version)
        if published is None:
            return self._reject(node, info.key, "unknown_version", f"no published digest for v{m.version}")
        if published != m.model_digest:
            return self._reject(
                node, info.key, "wrong_digest", f"served {m.model_digest[:16]}…, v{m.version} is {published[:16]}…"
            )
        estimate = RolloutColumns.bound_nbytes(rows=m.rows, groups=m.groups, tokens=m.tokens)
        if (
            m.payload.size > cfg.max_batch_bytes
            or m.rows > cfg.max_rows
            or m.tokens > min(cfg.max_tokens, cfg.max_queued_tokens)
            or estimate > cfg.max_queued_bytes
        ):
            return self._reject(
                node, info.key, "too_large", f"{m.payload.size} bytes, {m.rows} rows, {m.tokens} tokens declared"
            )
        s = self.stats
        if s.queued_tokens + m.tokens > cfg.max_queued_tokens or s.queued_bytes + estimate > cfg.max_queued_bytes:
            return _DEFER
        try:
            payload = await fetch_object(source.store, m.payload, timeout=cfg.transfer_timeout_s)
        except ObjectNotFound:
            return self._reject(node, info.key, "size_mismatch", f"payload {m.payload.key} is missing")
        except SizeMismatch as e:
            return self._reject(node, info.key, "size_mismatch", str(e))
        except VerificationError as e:
            self.stats.bytes_downloaded += m.payload.size
            return self._reject(node, info.key, "hash_mismatch", str(e))
        self.stats.bytes_downloaded += len(payload)
        try:
            columns = await asyncio.to_thread(_decode_and_check, m, payload, cfg.limits)
            answer = None if self.answer_of is None else await asyncio.to_thread(self.answer_of, columns)
        except RolloutRowError as e:
            return self._reject(node, info.key, e.reason, str(e))
        except RolloutError as e:
            return self._reject(node, info.key, "payload_malformed", str(e))
        if answer is not None and f"{node}/{answer}" in self._answered:
            return self._reject(node, info.key, "batch_repeated", f"batch {answer} of {node} was answered before")
        return RolloutBatch(m, columns, self.batch_id(node, name), answer)

    def _reject(self, node: str, key: str, reason: str, why: str) -> None:
        self._count(node, reason)
        log.warning("rejected rollout batch %s of %s (%s): %s", key, node, reason, why)
        return None

    def _count(self, node: str, reason: str, n: int = 1) -> None:
        """Count ``n`` refusals of ``node`` for ``reason``; one that distrusts the node (trust.py)
        drops its queued batches."""
        self.stats.rejected[reason] = self.stats.rejected.get(reason, 0) + n
        per = self.stats.rejected_by_node.setdefault(node, {})
        per[reason] = per.get(reason, 0) + n
        why = self.trust.refused(node, reason, self._version)
        if why is not None:
            self._distrust(node, why)

    def _distrust(self, node: str, why: str) -> None:
        """``node`` is distrusted from now on: said once, loudly; its queued batches are dropped
        (counted under ``distrusted``) and nothing more of it is fetched."""
        self.stats.distrusted[node] = why
        log.error(
            "DISTRUSTED rollout node %s: %s. None of its batches will be taken from now on, also after a "
            "restart (lift it with [trainer.intake] forgive = [%r])", node, why, node,
        )  # fmt: skip
        dropped = [b for b in self._queue if b.node == node]
        self._queue = [b for b in self._queue if b.node != node]
        for b in dropped:
            self._unqueued(b)
            self._count(node, "distrusted")

    def _unqueued(self, b: RolloutBatch) -> None:
        self.stats.queued -= 1
        self.stats.queued_tokens -= b.tokens
        self.stats.queued_bytes -= b.columns.nbytes

    def _source_failed(self, source: RolloutSource, e: BaseException) -> None:
        self.stats.errors += 1
        log.warning("rollout source %s (%s) failed: %s: %s", source.node, source.store.url, type(e).__name__, e)


def _decode_and_check(m: BatchManifest, payload: bytes, limits: RowLimits) -> RolloutColumns:
    """The rows (decoded under the manifest's counts), checked against the manifest and ``limits``:
    RolloutError (payload), RolloutRowError (``row_mismatch`` or a ROW_REASONS reason)."""
    cols = decode_columns(payload, max_rows=m.rows, max_tokens=m.tokens)
    if (cols.version, cols.model_digest, cols.node) != (m.version, m.model_digest, m.node):
        raise RolloutRowError(
            "row_mismatch", f"rows say node {cols.node!r} v{cols.version}; the manifest says {m.node!r} v{m.version}"
        )
    if len(cols) != m.rows or len(cols.groups) != m.groups or cols.tokens != m.tokens:
        raise RolloutRowError(
            "row_mismatch",
            f"{len(cols)} rows in {len(cols.groups)} groups, {cols.tokens} tokens; manifest says "
            f"{m.rows} in {m.groups}, {m.tokens} tokens",
        )
    check_rows(cols, limits)
    return cols
