"""Trainer side of the rollout channel: poll the trusted inference nodes' stores, verify, queue.

A batch is accepted only if it passes every check of the numbered ladder in checks.py (signed
manifest of the node whose store it is in, not stale, the published digest, declared sizes within
limits, payload hash, rows, and the batch id it answers); the first failing check is the counted
reason.

**Polling costs one request when nothing changed**: one conditional GET of each node's signed
head decides whether to list its manifests (heads.py). Candidates a listing found but a poll could
not take yet (over a budget, from a version not reached yet) are remembered, so they need no new
listing either. Planted manifests never block: batches are still found by the listing and
accepted on their own signed manifests, never on a head's word.

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
``REPLAY_REASONS`` reason), or the intake refuses for what an honest node never sends
(``STRIKE_REASONS``), is a strike against its node; after ``refusals_to_distrust`` strikes the
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

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from pulsenet import runtime
from pulsenet.errors import PulsenetError, StoreError
from pulsenet.rollouts import checks
from pulsenet.rollouts.batch_queue import BatchQueue
from pulsenet.rollouts.demand import Demand
from pulsenet.rollouts.intake_types import AnswerOf, IntakeStats, Refusal, RolloutBatch, RolloutIntakeConfig
from pulsenet.rollouts.layout import BatchName, RolloutLayout, check_node
from pulsenet.rollouts.manifest import BatchManifest
from pulsenet.rollouts.partition import owner
from pulsenet.rollouts.rows import ROW_REASONS
from pulsenet.rollouts.sources import RolloutSource, SourceHead, head_moved, proves_key, read_open_key
from pulsenet.rollouts.trust import DISTRUSTED, PINNED, STRIKES, TRUST_REASONS, Gaps, Trust, answered_batch
from pulsenet.signing import key_id
from pulsenet.store.base import ObjectInfo

log = logging.getLogger(__name__)

REPLAY_REASONS = ("replay_token", "replay_logprob", "replay_params")
"""What the trainer's replay of a batch's rows may refuse it for (``rl.replay``), via ``refused()``."""

REWARD_MISMATCH = "reward_mismatch"
"""A row's claimed reward is not the one the trainer's re-scoring computes (nodes/feed.py): an honest
node never sends one (the same deterministic reward on both sides), so it is a strike like a replay
refusal."""

ANSWER_REASONS = (
    "group_id", "out_of_assignment", "mixed_batches", "problem_repeated", "group_size", "group_size_changed",
    "incomplete", "dropped_mismatch", "assignment_changed", "wrong_prompt", "row_shape",
)  # fmt: skip
"""What ``answer_of`` may refuse a batch for (``rl.answers.BatchCheck``, ``rl.tasks.Assignment.answers``)."""

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
    REWARD_MISMATCH,
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

STRIKE_REASONS = (
    *REPLAY_REASONS, REWARD_MISMATCH, "batch_repeated", "group_id", "mixed_batches", "problem_repeated",
    "group_size", "incomplete", "row_shape",
)  # fmt: skip
"""Refusals that count towards ``refusals_to_distrust``: what an honest node never sends (issue 38;
``reward_mismatch`` is counted by the feed's re-scoring, nodes/feed.py).
Not strikes, as they also follow from a setting changed or differing between the sites, which an
operator fixes without a node having lied (each is still a refusal): ``rescore`` (trust.py),
``out_of_assignment``, ``group_size_changed``, ``assignment_changed`` (batches made before a
change of ``batches_per_version``, G or ``prompts_per_batch``), ``dropped_mismatch`` and
``wrong_prompt`` (other prompt limits or settings), and the row limits (``ROW_REASONS``: another
model or reward range)."""

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
        answer_of: AnswerOf | None = None,
    ) -> None:
        """``digest_of(version)``: the model digest published for a policy version, None if unknown.
        ``participants``: the trainer ids sharing the pool (per version, or fixed); default just us.
        ``answer_of(columns, dropped)``: the batch id a batch answers (unique per node and version;
        None: none to check), or RolloutRowError naming why the batch answers none it may (check 10)."""
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
        self._answered: dict[str, int] = {}  # "node/answer" -> version: each accepted once
        self._answers_taken: dict[str, int] = {}
        """The answers of the batches taken (``consumed``): one accepted but not taken before a
        restart is accepted again after it, not refused as its own repeat (a strike)."""
        self._queue = BatchQueue(config, self.stats)
        self._keys: dict[str, dict[str, Ed25519PublicKey]] = {s.node: dict(s.trusted) for s in sources}
        """Node -> the keys its documents verify under: configured, or an open node's pinned key."""
        self.trust = Trust(
            config.refusals_to_distrust,
            frozenset(STRIKE_REASONS),
            open_nodes=frozenset(s.node for s in sources if not s.trusted) if config.open_inference else frozenset(),
        )
        self.gaps = Gaps()
        self._version = 0  # the trainer version of the last poll: when a node was distrusted
        self._heads: dict[str, SourceHead] = {s.node: SourceHead() for s in sources}
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
        """Queued batches still fresh enough for ``trainer_version``, newest version first
        (``BatchQueue.take``: stale ones are dropped and counted), recorded as taken."""
        out = self._queue.take(trainer_version, max_batches)
        for b in out:
            lag = trainer_version - b.version
            self.stats.taken += 1
            self.stats.taken_by_node[b.node] = self.stats.taken_by_node.get(b.node, 0) + 1
            self.stats.staleness[lag] = self.stats.staleness.get(lag, 0) + 1
            self._taken[b.batch_id] = b.version
            if b.answer is not None:
                self._answers_taken[f"{b.node}/{b.answer}"] = b.version
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
            group_size=self.config.group_size,
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
        return {**self._taken, **{ANSWERED + a: v for a, v in self._answers_taken.items()}, **self.trust.record()}

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
                self._answered[key.removeprefix(ANSWERED)] = self._answers_taken[key.removeprefix(ANSWERED)] = v
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
        return await head_moved(
            source, self._heads[node], self._keys[node], layout=self.layout, config=self.config, stats=self.stats
        )

    async def _open_key(self, source: RolloutSource) -> bool:
        """Whether open ``source`` has a key to verify its documents with now: its key
        (``sources.read_open_key``), pinned on first read. A key that is not one, one another node
        holds, or one other than the pinned: refused (which distrusts an open node)."""
        node, layout = source.node, self.layout
        got = await read_open_key(
            source, self._heads[node], layout=layout, timeout=self.config.timeout_s, have_key=bool(self._keys[node])
        )
        if isinstance(got, Refusal):
            self._reject(node, layout.key, *got)
            return False
        if got is not None:
            kid = key_id(got)
            theirs = any(kid in keys for other, keys in self._keys.items() if other != node)
            if theirs or any(k == kid for other, k in self.trust.pinned.items() if other != node):
                self._reject(node, layout.key, "wrong_node_key", f"key {kid} is another node's")
                return False
            if node not in self.trust.pinned:  # first sight: the node must prove it holds the key
                proof = await proves_key(source, got, layout=layout, config=self.config)
                if proof is not True:
                    self._heads[node].key_etag = None  # read (and prove) it again next poll
                    if isinstance(proof, Refusal):
                        self._reject(node, layout.key, *proof)
                    return False
            if not self.trust.pin(node, kid, self._version):
                self._reject(node, layout.key, "key_changed", f"key {kid}; {self.trust.pinned[node]} was pinned")
                return False
            if kid not in self._keys[node]:
                self._keys[node] = {kid: got}
                self._any_node[kid] = got
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
                if self._queue.full():
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
                    self._queue.add(outcome)
                    self.stats.accepted += 1
                    self.stats.rows_accepted += len(outcome.columns)
                    accepted += 1
                if not queue:
                    turn.remove(source)
        return accepted

    async def _consider(
        self, source: RolloutSource, info: ObjectInfo, name: BatchName, trainer_version: int
    ) -> RolloutBatch | object | None:
        """The batch if it passes every check of the ladder (checks.py, numbered as there); ``_DEFER``
        if it does not fit the queue now; else None with the reason counted and logged.

        Store errors other than a missing or oversized object propagate (nothing is remembered)."""
        cfg, node, key = self.config, source.node, info.key
        m = await checks.read_manifest(
            source, info, name, keys=self._keys[node], any_node=self._any_node, layout=self.layout, config=cfg
        )  # 1, 2
        if not isinstance(m, BatchManifest):
            return None if m is None else self._reject(node, key, *m)
        if (lag := trainer_version - m.version) > cfg.max_staleness:  # 3
            self.stats.stale_in_flight += 1
            log.info("dropped batch %s: %d versions stale in flight", key, lag)
            return None
        refusal = checks.check_digest(m, self.digest_of(m.version)) or checks.check_declared(m, cfg)  # 4, 5
        if refusal is not None:
            return self._reject(node, key, *refusal)
        if not self._queue.fits(m):
            return _DEFER
        payload, downloaded = await checks.fetch_payload(source, m, cfg.transfer_timeout_s)  # 6
        self.stats.bytes_downloaded += downloaded
        if isinstance(payload, Refusal):
            return self._reject(node, key, *payload)
        rows = await checks.read_rows(m, payload, cfg.limits, self.answer_of)  # 7 to 10
        if isinstance(rows, Refusal):
            return self._reject(node, key, *rows, batch=name)
        columns, answer = rows
        if answer is not None and f"{node}/{answer}" in self._answered:  # 10: once per node
            return self._reject(node, key, "batch_repeated", f"batch {answer} of {node} was answered before", batch=name)
        return RolloutBatch(m, columns, self.batch_id(node, name), answer)

    def _reject(self, node: str, key: str, reason: str, why: str, *, batch: BatchName | None = None) -> None:
        """Count and log a refusal; a strike against a signed ``batch`` (``STRIKE_REASONS``) also
        goes into the consumed record, so that a restarted trainer neither fetches it nor counts
        the strike again."""
        if batch is not None and reason in STRIKE_REASONS:
            bid = self.batch_id(node, batch)
            self._taken[bid] = self._accepted[bid] = batch.version
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
        for _ in self._queue.drop_node(node):
            self._count(node, "distrusted")

    def _source_failed(self, source: RolloutSource, e: BaseException) -> None:
        self.stats.errors += 1
        log.warning("rollout source %s (%s) failed: %s: %s", source.node, source.store.url, type(e).__name__, e)
