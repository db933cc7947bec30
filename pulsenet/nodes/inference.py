"""The inference node: follow the policy, generate rollout groups with the newest verified weights,
upload them to this site's own store.

One asyncio loop (``InferenceNode.run``) with, in one TaskGroup:

- PULSESync: one ``Subscriber`` per trusted trainer channel, one of them active. Every trainer
  publishes every version (bit-identical global weights, so equal digests); following one channel
  downloads each patch once. When the active channel brings nothing newer for ``failover_s`` while
  another channel's signed head announces a newer version, the node switches to that channel (a
  dead trainer, even the first, costs at most ``failover_s`` of staleness); time spent building a
  version (``Subscriber.building``: its download, rebuild and the engine taking it) is not stalling;
- the generation loop: draw problems as a pure function of (node, version, batch), sample G
  completions each on the engine in a thread, score them, write one signed rollout batch, apply
  retention;
- the status server (``/healthz``, ``/status``, ``/metrics``);
- the signed status object ``status/<id>.json`` in its own store (version served, digest, time),
  rewritten every ``status_every_s``: trainers' retention keeps the chain it still needs
  (nodes/consumers.py).

The engine takes a verified update only between batches (the torch engine parks one that arrives
mid-batch), so every row of a batch carries the version and digest that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pulsenet import runtime
from pulsenet.engines.base import Engine, Generation
from pulsenet.errors import ConfigError, EngineError, PulsenetError
from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.consumers import write_status
from pulsenet.nodes.events import EVENTS_FILE, EventLog, VersionEvent, inference_event
from pulsenet.nodes.hostile import Hostile
from pulsenet.nodes.memory import inference_probe
from pulsenet.nodes.status import NodeState, StatusServer
from pulsenet.rl.draw import DrawId
from pulsenet.rl.prompts import Prompter
from pulsenet.rl.tasks import Task, assign_problems, group_id
from pulsenet.rollouts import RolloutWriter
from pulsenet.rollouts.demand import DemandReader, assigned, assigned_group_size, batches_to_generate
from pulsenet.store.base import REQUEST_KINDS, ObjectStore
from pulsenet.sync.subscriber import OnUpdate, Subscriber

log = logging.getLogger(__name__)


class InferenceNode:
    """Subscribers, an engine and a rollout writer; ``await node.run(stop)``.

    Built by ``nodes/build.py`` (``build_inference`` / ``compose_inference``), which makes every
    component; this class keeps them and drives the loop."""

    def __init__(
        self,
        config: InferenceConfig,
        *,
        state: NodeState,
        store: ObjectStore,
        key: Any,
        task: Task,
        prompter: Prompter,
        writer: RolloutWriter,
        channels: int,
        subscriber: Callable[[int, OnUpdate, Callable[[], object]], Subscriber],
        demand: DemandReader,
        engine: Callable[..., Engine],
        stores: dict[str, ObjectStore],
        hostile: Hostile | None = None,
    ) -> None:
        """``subscriber(k, on_update, on_consume)``: channel k's subscriber, delivering to ``on_update``
        and warning ``on_consume`` (this node's own ``_on_update`` and ``_on_consume``, so it is made
        here); ``engine(state=, digest=, version=)``: the engine, built from the first verified weights."""
        self.config = config
        self.state = state
        """What /status and /metrics show (the prompter's drops among them, live)."""
        self.task, self.prompter = task, prompter
        self.state.rollouts |= {"discarded_moved": 0, "discarded_spanning": 0}  # generate_batch
        self.store, self.key = store, key
        """This site's own store and key: rollout batches and the signed status object."""
        self.writer = writer
        self.subscribers = [
            subscriber(k, functools.partial(self._on_update, k), functools.partial(self._on_consume, k))
            for k in range(channels)
        ]
        self.state.memory = inference_probe(self)  # /status memory: what each holder holds (nodes/memory.py)
        self.demand = demand
        """The trainers' signed demand records (the channels whose trainer id is known): how many batches
        to generate at the served version (``rollouts.demand.batches_to_generate``)."""
        self._make_engine = engine
        self.stores = stores
        """Every store this node talks to, by name: their request counts and health go to /metrics, /healthz."""
        self._fatal: ConfigError | None = None
        """A channel whose weights do not fit this node's model: the node stops with it."""
        self._delivered: dict[int, int] = {}
        """Channel -> the version its subscriber last delivered (``_on_update``)."""
        self.engine: Engine | None = None
        self._engine_channel: int | None = None
        """The channel whose verified state the engine was last handed (it may hold its tensors)."""
        self.events = EventLog(Path(config.state_dir) / EVENTS_FILE)
        """One ``served`` event per verified version swapped in, one ``stopped`` on the way out."""
        self._downloaded = 0
        """PULSESync bytes downloaded when the last version was served."""
        self._update_lock = asyncio.Lock()
        self._first = asyncio.Event()
        self._newer = asyncio.Event()
        """Set by each update: a generation loop waiting for a newer version wakes up."""
        self._batches_at: dict[int, int] = {}
        self._start_floor: int | None = None
        """The newest version a trusted channel announced and a verified manifest backed at start:
        generation waits until the engine serves at least this (``_floor_at_start``)."""
        self.time = {"generating": 0.0, "waiting_first": 0.0, "waiting_version": 0.0, "waiting_demand": 0.0}
        """Seconds the engine spent generating, waiting for its first version, for a newer one, or
        for demand (``engine_busy`` in a run's efficiency: generating over all but the first wait)."""
        self._active = 0
        """The channel followed now (``_follow``)."""
        self._dropping: str | None = None
        """Why /healthz says degraded while every prompt of the last batch was dropped (``generate_batch``)."""
        self.hostile = hostile
        """A hostile behaviour this node plays (``InferenceConfig.hostile``: tests, ``pulsenet chaos
        --hostile``; nodes/hostile.py), or None: an honest node."""

    # --- policy ---------------------------------------------------------------------------------

    async def _on_update(
        self, channel: int, version: int, state: dict[str, torch.Tensor], digest: str, *, changed: frozenset[str] | None = None
    ) -> None:
        """Verified weights from any trainer channel: the newest version wins, once.

        ``changed``: the tensors the channel's verified patches rewrote since the version it last
        delivered. The engine touches only those when that version is the one it serves; after a
        switch of channel the two may differ (a tensor can change and change back), so it compares
        all of them then."""
        async with self._update_lock:
            since, self._delivered[channel] = self._delivered.get(channel), version
            if self.engine is not None and self.engine.version is not None and version <= self.engine.version:
                return
            if self.hostile is not None:
                self.hostile.observe(version, state, digest)
            t = time.perf_counter()
            if self.engine is None:
                try:
                    self.engine = await asyncio.to_thread(self._make_engine, state=state, digest=digest, version=version)
                except ConfigError as e:  # the channel's weights do not fit this node's model: stop, named
                    self._fatal = e
                    self._newer.set()
                    raise
            else:
                same_base = since is not None and since == self.engine.version
                await asyncio.to_thread(self.engine.update, version, state, digest, changed=changed if same_base else None)
            self._engine_channel = channel  # a refused update leaves the engine with what it held
            self._emit("served", version, digest, apply_s=time.perf_counter() - t)
            if self._start_floor is None or version >= self._start_floor:
                if self._start_floor is not None and not self._first.is_set():
                    log.info(
                        "%s: caught up to v%d (at least v%d at start): generating", self.config.id, version, self._start_floor
                    )
                    self.state.degraded = None
                self._first.set()
            self._newer.set()

    async def _on_consume(self, channel: int) -> None:
        """Channel ``channel``'s subscriber is about to rebuild its state in place: if the engine was
        handed that state, it lets go of its tensors first (``Engine.release_shared_state``), so the
        node holds one BF16 copy through the rebuild, not two (issue 37)."""
        async with self._update_lock:  # never in the middle of an engine update
            if self.engine is not None and self._engine_channel == channel:
                await asyncio.to_thread(self.engine.release_shared_state)

    def _emit(self, kind: str, version: int, digest: str, **fields: Any) -> VersionEvent:
        """Emit this node's ``kind`` event (``events.inference_event``; ``fields``: its own)."""
        downloaded = sum(sub.stats.bytes_downloaded for sub in self.subscribers)
        event = inference_event(
            kind,
            node=self.config.id,
            version=version,
            digest=digest,
            pulsesync_bytes=downloaded - self._downloaded,
            totals={
                "rows_produced": self.state.rollouts["produced"],
                "rows_discarded_moved": self.state.rollouts["discarded_moved"],
                "rows_discarded_spanning": self.state.rollouts["discarded_spanning"],
                "batches_produced": self.writer.stats.batches,
                "rollout_bytes": self.writer.stats.bytes_uploaded,
                "pulsesync_bytes": downloaded,
                **{f"{k}_s": round(v, 3) for k, v in self.time.items()},
                **{f"requests:{k}": sum(getattr(st.requests, k) for st in self.stores.values()) for k in REQUEST_KINDS},
            },
            **fields,
        )
        self._downloaded = downloaded
        self.state.record(self.events.emit(event))
        return event

    @property
    def served(self) -> list[tuple[int, str]]:
        """(version, digest) of every version this node served, as verified by its subscriber."""
        return [(e.version, e.digest) for e in self.events.events if e.kind == "served"]

    def newest_verified(self) -> int | None:
        """The newest version any followed channel built and verified. Retention and staleness go by
        this, never by what a head announces: a signed head for v999999999999 with no verifiable
        manifest behind it must not make this node delete the batches it writes."""
        return max((s.version for s in self.subscribers if s.version is not None), default=None)

    # --- the loop ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, status: StatusServer | None = None) -> None:
        """Follow, generate and upload until ``stop``; a SIGTERM finishes the batch in hand."""
        await self._start_writer()
        await self._floor_at_start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._follow(stop))
                tg.create_task(self._generate_loop(stop))
                tg.create_task(self._report_status(stop))
        finally:
            for sub in self.subscribers:
                await sub.close()
            await asyncio.to_thread(self.task.close)  # the reward worker process
            if self.engine is not None:  # vLLM: its engine core process and handoff directory
                await asyncio.to_thread(self.engine.close)

    async def _start_writer(self) -> None:
        """Continue this node's batch sequence from what its own key signed; names in its bucket
        that did not verify are counted in ``/status`` ``rejected`` (and ``/metrics``
        ``pulsenet_rollouts_rejected_total``) under this node as ``planted_name``."""
        await self.writer.start()
        for name in self.writer.produced:  # a restart goes on with the next batch number of a version
            self._batches_at[name.version] = self._batches_at.get(name.version, 0) + 1
        if self.writer.stats.junk_names:
            self.state.rejected[self.config.id] = {"planted_name": self.writer.stats.junk_names}

    async def _floor_at_start(self) -> None:
        """Before any subscriber resumes from its saved weights: the newest version any channel
        announces and a verified manifest backs. A restarted node then serves its saved version
        (it has nothing newer yet) but generates nothing until it has caught up to that floor:
        batches of a version the trainers have left behind would be discarded as stale. A store
        that does not answer within the subscriber's small-call deadline leaves no floor (nothing
        newer can be verified now, so the saved version is what the node has)."""
        announced = []
        for sub in self.subscribers:
            try:
                async with asyncio.timeout(self.config.subscribe.timeout_s):
                    v = await sub.announced()  # store errors: None (logged there)
            except TimeoutError:
                log.warning("%s: a channel did not answer at start: no catch-up floor from it", self.config.id)
                continue
            if v is not None:
                announced.append(v)
        self._start_floor = max(announced, default=None)
        if self._start_floor is not None:
            self.state.degraded = f"catching up to v{self._start_floor} before generating"
            log.info("%s: v%d is verifiable: no generation below it", self.config.id, self._start_floor)

    async def _follow(self, stop: asyncio.Event) -> None:
        """Run one channel's subscriber; fail over to a channel that announces a newer version."""
        active = 0
        while not stop.is_set():
            task = asyncio.create_task(self.subscribers[active].run(stop))
            try:
                active = self._active = await self._watch(active, task, stop)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _watch(self, active: int, task: asyncio.Task[None], stop: asyncio.Event) -> int:
        """Return the channel to follow next once the active one stalls (or ``stop``)."""
        seen, since = self.state.version, time.monotonic()
        while not stop.is_set() and not task.done():
            await runtime.wait(stop, min(1.0, self.config.failover_s))
            if self.state.version != seen or self.subscribers[active].building is not None:
                # building a version is not stalling: an anchor over a slow link, a vLLM engine's
                # start or a large model's apply can outlast failover_s; switching would start over
                seen, since = self.state.version, time.monotonic()
            elif len(self.subscribers) > 1 and time.monotonic() - since > self.config.failover_s:
                mine = -1 if seen is None else seen
                for k in (*range(active + 1, len(self.subscribers)), *range(active)):
                    announced = await self.subscribers[k].announced()  # store errors: None (logged there)
                    if announced is not None and announced > mine:
                        log.warning(
                            "%s: channel %d stalled at v%s; following channel %d (v%d)",
                            self.config.id, active, seen, k, announced,
                        )
                        return k
                since = time.monotonic()
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            raise error
        return active

    async def _report_status(self, stop: asyncio.Event) -> None:
        """Keep the signed status object (nodes/consumers.py) current; a failed write is retried."""
        async def step() -> None:
            s = self.state
            if s.version is not None and s.digest is not None:
                await write_status(
                    self.store, self.key, run=self.config.run, node=self.config.id, version=s.version, digest=s.digest
                )

        await runtime.every(self.config.status_every_s, stop, step, on_error=self._status_not_written)

    def _status_not_written(self, e: Exception) -> None:
        """A store or signing failure writing the status object: logged, written again next time."""
        if not isinstance(e, PulsenetError):
            raise e
        log.warning("%s: status object not written: %s", self.config.id, e)

    async def _generate_loop(self, stop: asyncio.Event) -> None:
        """Generate what the trainers will take: a batch whenever their demand records say they are
        short (``rollouts.demand``), never more than ``batches_per_version`` per version; with no
        demand record naming this node, up to ``batches_per_version`` per version."""
        while not stop.is_set():
            if self._fatal is not None:
                raise self._fatal
            t0 = time.monotonic()
            wait = await self._wait_reason()
            if wait is not None:
                self._newer.clear()  # a newer version (or the next demand poll) wakes the loop
                await runtime.wait(stop, self.demand.config.interval_s if wait == "waiting_demand" else 1.0, wake=self._newer)
                self.time[wait] += time.monotonic() - t0
                self.state.beat()  # waiting for a version or for demand is progress of a kind
                continue
            try:
                await self.generate_batch()
            except PulsenetError as e:  # store hiccup, a bad update: logged, counted, retried
                self.state.error(e)
                log.error("%s: batch failed: %s", self.config.id, e)
                await runtime.wait(stop, 1.0)
            self.time["generating"] += time.monotonic() - t0
        await self._log_final()

    async def _wait_reason(self) -> str | None:
        """None to generate a batch now, else what the engine waits for."""
        engine = self.engine
        if not self._first.is_set() or engine is None or engine.version is None:
            return "waiting_first"
        if self._batches_at.get(engine.version, 0) >= self._assigned()[0]:
            return "waiting_version"
        if not self.demand.sources:
            return None
        live = await self.demand.poll()
        _, prompts, size = self._assigned()
        wanted = batches_to_generate(
            live, node=self.config.id, version=engine.version, produced=self.writer.produced, rows_per_batch=prompts * size
        )
        return "waiting_demand" if wanted == 0 else None

    def _assigned(self) -> tuple[int, int, int]:
        """(batches per version, prompts per batch, G) this node makes: its own settings, but never
        more batches than the trainers' demand records allow, and exactly the problems and G they
        sign (``rl.tasks.Assignment``: a trainer refuses a batch missing a problem or a group of
        another size)."""
        c, live = self.config, self.demand.live()
        bound, g = assigned(live, c.id), assigned_group_size(live, c.id)
        if bound is None:
            return c.batches_per_version, c.prompts, g or c.group_size
        return min(c.batches_per_version, bound[0]), bound[1], g or c.group_size

    async def _log_final(self) -> None:
        """On the way out: the bits this node ends with, hashed again from the engine's own weights,
        as the ``stopped`` event (what an operator, or ``pulsenet up``, compares with the trainer's
        digest), with what one idle poll of the channel cost."""
        if self.engine is None:
            return
        idle = await self._idle_poll()  # not under the update lock: a poll may still bring a version
        async with self._update_lock:  # no swap between the hash and the version it is logged with
            engine = self.engine
            if engine.version is None:
                return
            try:
                own: str | None = await asyncio.to_thread(engine.weights_digest)
            except EngineError as e:  # e.g. its host copy released to a rebuild that did not finish
                own = None
                log.warning("%s: own weights not hashed again: %s", self.config.id, e)
            assert engine.digest is not None
            self._emit("stopped", engine.version, engine.digest, weights_digest=own, counts=idle)

    async def _idle_poll(self) -> dict[str, int]:
        """What one poll of the followed channel costs when nothing changed (measured on the way out,
        when the trainers are done): requests by kind, as ``idle_poll:<kind>``; {} if it moved."""
        sub, store = self.subscribers[self._active], self.stores[f"policy-{self._active}"]
        before, version = store.requests.snapshot(), sub.version
        try:
            await sub.sync_once()
        except PulsenetError as e:
            log.info("%s: no idle poll measured: %s", self.config.id, e)
            return {}
        if sub.version != version:
            return {}
        spent = (store.requests - before).as_dict()
        return {f"idle_poll:{k}": spent[k] for k in REQUEST_KINDS}

    async def generate_batch(self) -> int:
        """One batch at the engine's current version; returns the version it was generated with."""
        c, engine = self.config, self.engine
        assert engine is not None and engine.version is not None
        version, engine_digest = engine.version, engine.digest
        index = self._batches_at.get(version, 0)
        self._batches_at[version] = index + 1
        _, n, size = self._assigned()
        problems = assign_problems(self.task, node=c.id, version=version, seed=c.seed, n=n, batch=index)
        asked = [(k, p, ids) for k, p in enumerate(problems) if (ids := self.prompter.encode(p.prompt)) is not None]
        dropped = sorted(set(range(n)) - {k for k, _, _ in asked})  # declared in the manifest: the trainer checks
        if not asked:  # every prompt over the limits: counted by the prompter (prompts_dropped), nothing to send
            why = ", ".join(f"{n} {k}" for k, n in sorted(self.prompter.stats.dropped.items()))
            self._dropping = self.state.degraded = (
                f"every prompt of v{version} batch {index} was dropped ({why} so far): nothing generated; "
                f"max_new_tokens {self.prompter.config.max_new_tokens}, max_prompt_tokens "
                f"{self.prompter.config.max_prompt_tokens}, model context {self.prompter.max_positions}"
            )
            log.warning("%s: %s", c.id, self._dropping)
            return version
        if self._dropping is not None and self.state.degraded == self._dropping:
            self.state.degraded = None  # prompts get through again
        self._dropping = None
        prompts = [ids for _, _, ids in asked for _ in range(size)]
        # Every token is drawn with the public draw of (run, digest, node, batch, problem, completion):
        # what a trainer replays (rl/replay.py); the node chooses none of it.
        ids = [DrawId(c.run, engine_digest, c.id, version, index, k, i) for k, _, _ in asked for i in range(size)]
        params = replace(
            self.prompter.sampling_params(
                temperature=c.temperature, top_p=c.top_p, seed=_sample_seed(c.seed, c.id, version, index)
            ),
            draws=tuple(d.key() for d in ids),
        )
        groups = [group_id(c.id, version, index, k) for k, _, _ in asked for _ in range(size)]
        problems = [p for _, p, _ in asked for _ in range(size)]

        def score(gens: Sequence[Generation]) -> list[float]:
            texts = [self.prompter.completion_text(g.completion_ids) for g in gens]
            return list(self.task.score_texts(problems, texts, groups).total)

        if self.hostile is None:
            gens = await asyncio.to_thread(engine.generate, prompts, params)
        else:
            gens = await asyncio.to_thread(self.hostile.generate, engine, prompts, params, ids, score)
        if any(g.version != version or g.digest != engine_digest for g in gens):  # an update landed first
            log.info("%s: the engine moved past v%d before batch %d ran: discarded", c.id, version, index)
            self._discard("discarded_moved", len(gens))
            return version
        if any(g.spans_update for g in gens):  # vLLM in_flight="keep": tokens of two versions, no replay passes
            log.info("%s: an update went live during v%d batch %d: discarded", c.id, version, index)
            self._discard("discarded_spanning", len(gens))
            return version
        rewards = await asyncio.to_thread(score, gens)
        if self.hostile is not None and not self.hostile.publish(rewards):
            log.warning("%s: hostile: v%d batch %d withheld (reward %.3f)", c.id, version, index, sum(rewards) / len(rewards))
            return version
        rows = [x.to_rollout(group=grp, reward=r, node=c.id) for x, grp, r in zip(gens, groups, rewards, strict=True)]
        def score_row(i: int, completion: Sequence[int]) -> float:
            return self.task.score(self.prompter.completion_text(completion), problems[i])

        # A hostile node (nodes/hostile.py) may send other batches than the one it made.
        sends = [rows] if self.hostile is None else await asyncio.to_thread(self.hostile.rework, rows, score_row)
        manifest = None
        for batch in sends:
            manifest = await self.writer.write(batch, dropped=dropped)
        newest = self.newest_verified()
        if newest is not None:
            await self.writer.retain(newest)
        s = self.state
        s.rollouts["produced"] += len(rows)
        s.reward = sum(rewards) / len(rewards)
        s.staleness = None if newest is None else newest - version
        s.bytes["rollouts"] = self.writer.stats.bytes_uploaded
        s.beat()
        log.info("%s: v%d batch %d, %d rows, reward %.3f (%s)", c.id, version, index, len(rows), s.reward, manifest)
        return version

    def _discard(self, outcome: str, rows: int) -> None:
        """Count rows generated and thrown away (``/status`` ``rollouts``, ``/metrics`` ``pulsenet_rollouts``)."""
        self.state.rollouts[outcome] = self.state.rollouts.get(outcome, 0) + rows


def _sample_seed(seed: int, node: str, version: int, index: int) -> int:
    """A sampling seed that is a pure function of (run seed, node, version, batch)."""
    import hashlib

    h = hashlib.sha256(f"pulsenet-sample:{seed}:{node}:{version}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "little")


