"""Where each node is built: the one composition root of a trainer node and of an inference node.

Two steps per node, so that tests build the same node from stores and keys of their own:

- ``build_trainer(config)`` / ``build_inference(config)`` (and ``build_rank``, a torchrun rank
  > 0's GRPO trainer): what the config names, opened once
  (the site's stores, its signing key, the trusted keys, the model, the task and its text codec);
  a setting derived from another component (the GRPO step's ``pad_id``, the model's) is passed
  into a new config object here, never written into the one given;
- ``compose_trainer(config, store=, key=, ...)`` / ``compose_inference(...)``: every component of
  the node (publisher, intake, rounds, demand, rescorer, evaluator, status; subscribers, writer,
  demand reader, engine factory), handed to ``TrainerNode`` / ``InferenceNode``, whose
  ``__init__`` only keeps them. The node classes are constructed nowhere else.

``nodes/run.py`` runs what these build (status server, signals, torchrun ranks).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from pulsenet.engines.factory import make_engine
from pulsenet.engines.torch_engine import TorchEngine
from pulsenet.errors import ConfigError
from pulsenet.fsutil import fresh_scratch
from pulsenet.loco import LocoTrainer
from pulsenet.loco.documents import trainer_keys
from pulsenet.nodes.common import initial_model, key_map, open_site_store, site_map, text_codec
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.nodes.consumers import ConsumerTracker
from pulsenet.nodes.hostile import Hostile, HostileConfig
from pulsenet.nodes.inference import InferenceNode
from pulsenet.nodes.rounds import LocalRounds, LocoRounds, Rounds
from pulsenet.nodes.status import NodeState
from pulsenet.nodes.trainer import TrainerNode
from pulsenet.rl.answers import BatchCheck
from pulsenet.rl.eval import Evaluator
from pulsenet.rl.grpo import GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import model_hf_config, resolve_model
from pulsenet.rl.prompts import TextCodec
from pulsenet.rl.replay import Replayer
from pulsenet.rl.rescore import Rescorer
from pulsenet.rl.shape import RowShape
from pulsenet.rl.tasks import Assignment, Task, build_task
from pulsenet.rollouts import RolloutIntake, RolloutSource, RolloutWriter, RolloutWriterConfig
from pulsenet.rollouts.demand import DemandConfig, DemandReader, DemandSource, DemandWriter
from pulsenet.rollouts.rows import RowLimits
from pulsenet.settings import to_toml_table
from pulsenet.signing import load_private_key, trusted_keys
from pulsenet.store.base import ObjectStore
from pulsenet.sync.manifest import public_model_config
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import OnUpdate, Subscriber
from pulsenet.tracking import NoTracker, Tracker, make_tracker

if TYPE_CHECKING:
    from transformers import PreTrainedModel

OpenStore = Callable[[str], ObjectStore]
"""A store URL -> the store, opened with this site's credentials."""


# --- trainer --------------------------------------------------------------------------------------


def build_trainer(c: TrainerConfig, *, ranks: bool = False, open_store: OpenStore = open_site_store) -> TrainerNode:
    """The trainer node of ``c``. ``ranks``: as rank 0 of a torchrun rank group (the default
    process group is up, the other ranks run ``rl.distributed.serve_rank``). ``open_store``: a
    store URL with this site's credentials (default: from the environment's AWS_* variables)."""
    from pulsenet.rl.distributed import GroupGRPOInner, RankGroup
    from pulsenet.rl.local import resolve_device

    resolve_device(c.device)  # a GPU-less host fails here, before the warm-up
    if not c.store:
        raise ConfigError("trainer: set store (this site's bucket, e.g. s3://pulsenet-t0)")
    sources_urls = site_map(c.inference, "inference")
    open_only = c.intake.open_inference and not c.trust_inference  # every node open: no keys to load
    keys = {} if open_only else key_map(c.trust_inference, "inference")
    missing = sorted(set(sources_urls) - set(keys))
    if missing and not c.intake.open_inference:  # with it, a node without a key is open (rollouts/trust.py)
        raise ConfigError(f"trainer: no trusted key for inference node(s) {missing} (trust_inference ID=PATH)")
    sources = [RolloutSource(n, open_store(url), keys.get(n, {})) for n, url in sources_urls.items()]
    text = text_codec(c.model)
    task = build_task(c.task, seed=c.seed)  # before the model: a bad task or reward fails fast
    model = initial_model(c.model, c.cache_dir, seed=c.seed, warmup_steps=c.warmup_steps)
    grpo = GRPOTrainer(model, c.grpo_config(pad_id=text.pad_id))
    return compose_trainer(
        c,
        store=open_store(c.store),
        key=load_private_key(c.key, allow_open=c.allow_open_key),
        sources=sources,
        policy=GroupGRPOInner(RankGroup(grpo=grpo)) if ranks else GRPOInner(grpo),
        task=task,
        text=text,
        loco_store=open_store(c.loco_store) if c.loco_store else None,
        tracker=make_tracker(
            c.tracker, name=f"{c.run}-{c.id}", config=to_toml_table(c), directory=Path(c.state_dir) / "tracking"
        ),
    )


def build_rank(c: TrainerConfig) -> GRPOTrainer:
    """The GRPO trainer of a rank > 0 of ``c``'s torchrun rank group (``rl.distributed.serve_rank``
    runs it). Rank 0 sends its weights first: the tiny model needs no warm-up here, only its shape."""
    from pulsenet.rl import build_tiny_model

    model = build_tiny_model(c.seed) if c.model == "tiny" else initial_model(c.model, c.cache_dir, seed=c.seed)
    return GRPOTrainer(model, c.grpo_config(pad_id=text_codec(c.model).pad_id))


def compose_trainer(
    c: TrainerConfig,
    *,
    store: ObjectStore,
    key: Any,
    sources: list[RolloutSource],
    policy: GRPOInner,
    task: Task,
    text: TextCodec,
    loco_store: ObjectStore | None = None,
    tracker: Tracker | None = None,
) -> TrainerNode:
    """Every component of a trainer node, from its config and what ``build_trainer`` opened.

    ``policy``: the GRPO model this node trains; under torchrun, rank 0's ``GroupGRPOInner``
    (docs/distributed.md), whose every step and read runs on all ranks. ``task``:
    ``build_task(c.task, seed=c.seed)``; ``text``: the model's text codec. ``loco_store``: the
    PULSELoCo run's store (None: a lone trainer)."""
    # LocalTrainer holds any Module; a node trains a transformers causal LM (nodes/common.initial_model)
    model = cast("PreTrainedModel", policy.grpo.local.model)
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    prompter = task.prompter(text, max_positions=max_positions)
    assignment = Assignment(
        c.batches_per_version, c.prompts_per_batch, max_group_rows=c.rows_per_step, group_size=c.intake.group_size
    )
    rescorer = Rescorer(task, prompter, seed=c.seed, assignment=assignment)
    replayer = (  # replays rows under their version's weights before training (rl/replay.py)
        Replayer(
            model.config,
            prompter.sampling_params(temperature=c.grpo.temperature, top_p=c.replay.top_p),
            c.replay,
            keep=c.intake.max_staleness + 1,
            stopped=prompter.stopped if prompter.config.stop else None,
        )
        if c.replay.enabled
        else None
    )
    evaluator = (  # evals run on a TorchEngine of their own, built from the first state scored
        Evaluator(task, prompter, functools.partial(TorchEngine.from_state, model.config, decode=prompter.codec.decode))
        if c.eval_every
        else None
    )
    digests: dict[int, str] = {}  # the node fills it as it publishes; the intake checks batches against it
    peers = _peer_keys(c) if loco_store is not None else {}
    intake = RolloutIntake(
        sources,
        digests.get,
        replace(c.intake, limits=row_limits(model, c.intake.limits, task.reward_range)),
        trainer_id=c.id,
        participants=tuple(sorted(peers)) or None,
        answer_of=BatchCheck(  # every batch whole, every row's shape, whatever rescore says (rl/answers.py)
            assignment, task, prompter, seed=c.seed,
            shape=RowShape.of(prompter.sampling_params(), getattr(model.config, "eos_token_id", None), prompter.stopped),
        ),
    )
    state = NodeState(role="trainer", node_id=c.id)
    state.rejected = intake.stats.rejected_by_node  # live: /status shows refusals as they happen
    state.rescored = rescorer.stats.nodes  # live: reward disagreements per node
    if replayer is not None:
        state.replay = replayer.stats  # live: rows replayed, refusals, margins
    rounds: Rounds
    if loco_store is not None:
        loco = LocoTrainer(c.id, loco_store, key, peers, policy, c.loco, state_dir=Path(c.state_dir) / "loco")
        rounds = LocoRounds(loco, intake, c.state_dir)
        state.loco = loco.stats  # live: PULSELoCo's counters in /status and /metrics
    else:
        rounds = LocalRounds(c.id, policy, intake, c.state_dir)
    stores = {"own": store, **{f"rollouts-{s.node}": s.store for s in sources}}
    if loco_store is not None:
        stores["loco"] = loco_store
    return TrainerNode(
        c,
        state=state,
        policy=policy,
        task=task,
        assignment=assignment,
        publisher=Publisher(store, key, _spooling(c), model_config=architecture(model)),
        intake=intake,
        digests=digests,
        rounds=rounds,
        demand=DemandWriter(store, key, c.id, DemandConfig(run=c.run, prefix=c.intake.prefix)),
        rescorer=rescorer,
        replayer=replayer,
        evaluator=evaluator,
        tracker=tracker or NoTracker(),
        consumers=ConsumerTracker(bound=c.consumer_bound, ttl_s=c.consumer_ttl_s),
        sources=sources,
        stores=stores,
    )


def _spooling(c: TrainerConfig) -> PublisherConfig:
    """The publisher's config, its large payloads spooled in the node's own ``spool`` directory
    (emptied now: a payload the last run was uploading when it died is a model's size) unless set."""
    if c.publish.spool_dir is not None:
        return c.publish
    return replace(c.publish, spool_dir=fresh_scratch(Path(c.state_dir) / "spool"))


def _peer_keys(c: TrainerConfig) -> dict:
    """The PULSELoCo trainers' public keys by id (``peers``), this trainer's own among them."""
    keys = trainer_keys(c.peers)
    if c.id not in keys:
        raise ConfigError(f"trainer {c.id!r}: peers must list its own public key too (ID=PATH)")
    return keys


def row_limits(model: PreTrainedModel, given: RowLimits, reward_range: tuple[float, float]) -> RowLimits:
    """``given`` (the configured limits) with what this trainer's model and task fix: its vocabulary
    (embedding rows), context (``max_position_embeddings``) and rewards (the task's declared range),
    never more than configured."""
    # transformers types the input embeddings as any Module; a causal LM's are an nn.Embedding
    vocab = cast(torch.nn.Embedding, model.get_input_embeddings()).num_embeddings
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or given.max_row_tokens
    return replace(
        given,
        vocab_size=min(given.vocab_size, vocab),
        max_row_tokens=context if given.max_row_tokens is None else min(given.max_row_tokens, context),
        max_prompt_tokens=min(given.max_prompt_tokens, (context or given.max_prompt_tokens + 1) - 1),
        max_completion_tokens=min(given.max_completion_tokens, (context or given.max_completion_tokens + 1) - 1),
        reward_min=max(given.reward_min, reward_range[0]),
        reward_max=min(given.reward_max, reward_range[1]),
    )


def architecture(model: PreTrainedModel) -> dict[str, Any]:
    """The model's config.json contents, signed into every anchor so that ``pulsenet export``
    rebuilds the architecture from the channel alone."""
    return public_model_config(json.loads(model.config.to_json_string(use_diff=False)))


# --- inference ------------------------------------------------------------------------------------


def build_inference(c: InferenceConfig, *, open_store: OpenStore = open_site_store) -> InferenceNode:
    """The inference node of ``c`` (``open_store``: as for ``build_trainer``)."""
    if not c.store or not c.policy or not c.trust:
        raise ConfigError(
            "inference: set store (this site's bucket), policy (trainer store URLs) and trust (trainer public keys)"
        )
    channels = [entry.partition("=") for entry in c.policy]
    return compose_inference(
        c,
        store=open_store(c.store),
        policy_stores=[open_store(url if sep else ident) for ident, sep, url in channels],
        trainers=[ident if sep else None for ident, sep, _ in channels],
        trusted=trusted_keys(c.trust),
        key=load_private_key(c.key, allow_open=c.allow_open_key),
        task=build_task(c.task, seed=c.seed),
        text=text_codec(c.model),
    )


def compose_inference(
    c: InferenceConfig,
    *,
    store: ObjectStore,
    policy_stores: list[ObjectStore],
    trusted: dict,
    trainers: list[str | None] | None = None,
    key: Any,
    task: Task,
    text: TextCodec,
) -> InferenceNode:
    """Every component of an inference node, from its config and what ``build_inference`` opened.

    ``policy_stores``: the trainer channels to follow, ``trainers`` their trainer ids where known
    (their demand records are read there); ``trusted``: the trainers' public keys by key id."""
    hf_config = model_hf_config(resolve_model(c.model))
    prompter = task.prompter(text, max_positions=getattr(hf_config, "max_position_embeddings", None))
    state = NodeState(role="inference", node_id=c.id)
    state.prompts_dropped = prompter.stats.dropped  # live: /status and /metrics count drops per reason
    ids = trainers or [None] * len(policy_stores)
    demand = DemandReader(
        [DemandSource(t, st, trusted) for t, st in zip(ids, policy_stores, strict=True) if t is not None],
        DemandConfig(run=c.run),
    )
    return InferenceNode(
        c,
        state=state,
        store=store,
        key=key,
        task=task,
        prompter=prompter,
        writer=RolloutWriter(store, key, c.id, RolloutWriterConfig(run=c.run, max_staleness=c.max_staleness)),
        channels=len(policy_stores),
        subscriber=functools.partial(_subscriber, c, policy_stores, trusted),
        demand=demand,
        engine=functools.partial(
            make_engine, c.engine, model=c.model, codec=text, torch_config=c.torch, vllm_config=c.vllm
        ),
        stores={"own": store, **{f"policy-{k}": s for k, s in enumerate(policy_stores)}},
        hostile=Hostile(HostileConfig.parse(c.hostile), hf_config, text.decode) if c.hostile else None,
    )


def _subscriber(
    c: InferenceConfig,
    policy_stores: list[ObjectStore],
    trusted: dict,
    channel: int,
    on_update: OnUpdate,
    on_consume: Callable[[], object],
) -> Subscriber:
    """Channel ``channel``'s subscriber; the node hands it ``on_update`` and ``on_consume`` (its own methods)."""
    return Subscriber(
        policy_stores[channel],
        trusted,
        replace(
            c.subscribe,
            state_dir=Path(c.state_dir) / f"policy-{channel}",
            # One cache per channel: a subscriber prunes its cache, and must never prune
            # a payload another channel's subscriber has just downloaded. In the node's state dir
            # unless set, not a temporary directory: what a killed download leaves (up to an
            # anchor, the model's size) is swept by the next start instead of piling up in /tmp.
            cache_dir=Path(c.subscribe.cache_dir or Path(c.state_dir) / "cache") / f"policy-{channel}",
        ),
        on_update=on_update,
        on_consume=on_consume,
    )
