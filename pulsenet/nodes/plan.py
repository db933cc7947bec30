"""A local network's nodes, planned once: what ``pulsenet up`` writes to each node's config file
and ``pulsenet bench rl`` builds in one process.

``NetworkSettings`` (``nodes/config.py``) is the shape of a network (model, trainers, inference
nodes, rounds, batch sizes, ...); ``plan_network`` turns it into one ``TrainerConfig`` per trainer and one
``InferenceConfig`` per inference node. Model-specific defaults are TOML presets
(``pulsenet/presets/<model>.toml``: the ``[trainer]`` and ``[inference]`` tables a node reads),
applied under the network's own settings: a value given there (non-zero) wins. A preset's
``[task]`` table is the task every node of the network shares (trainers re-score and evaluate
with it, inference nodes prompt and reward with it). The rest is
derived here, in one place: with several trainers a GRPO step takes 1/H of a lone trainer's rows
(a round then costs about one lone step), and each inference node makes enough batches per
version for every trainer's share of a round.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from pulsenet.errors import ConfigError
from pulsenet.nodes.config import InferenceConfig, NetworkSettings, TrainerConfig
from pulsenet.rl.models import model_hf_config, resolve_model
from pulsenet.rl.tasks import TaskConfig
from pulsenet.settings import load_settings, load_toml

PRESETS = ("tiny", "smollm2")
"""Models with a preset of their own; any other model (a Hugging Face directory) takes ``pretrained``."""


@dataclass(frozen=True, slots=True)
class Site:
    """Where one node of the plan lives: its store URL, its key and its state directory."""

    store: str
    key: Path
    state_dir: Path


def trainer_ids(n: NetworkSettings) -> list[str]:
    return [f"t{k}" for k in range(n.trainers)]


def inference_ids(n: NetworkSettings) -> list[str]:
    return [f"i{k}" for k in range(n.inference)]


def preset(model: str) -> Path:
    """The preset TOML of ``model`` (``pulsenet/presets/``)."""
    name = model if model in PRESETS else "pretrained"
    return Path(str(resources.files("pulsenet.presets") / f"{name}.toml"))


def model_context(model: str) -> int | None:
    """The context length (``max_position_embeddings``) of ``model``'s architecture, read without
    weights; None when it cannot be read here (SmolLM2 before its conversion, a missing directory:
    the nodes then check it at start)."""
    if model == "smollm2":
        return None  # 8192, behind a GGUF conversion; its preset's 16 tokens fit
    try:
        config = model_hf_config(resolve_model(model))
    except ConfigError:
        return None
    return getattr(config, "max_position_embeddings", None)


def fit_completions(task: TaskConfig, context: int | None, *, given: bool) -> TaskConfig:
    """``task`` with a default completion length that fits the model: at most half its context (a
    dataset task's default of 512 on a 512-position model left no room for any prompt, and every
    prompt was dropped in silence: issue 29). A length the user gave that leaves no room is a
    ConfigError. A new config when it changes; ``task`` is never written."""
    if context is None:
        return task
    new = task.prompt_config().max_new_tokens
    if new < context and (given or new <= context // 2):
        return task
    if given:
        raise ConfigError(
            f"--max-new-tokens {new} leaves no room for a prompt in the context of the model "
            f"(max_position_embeddings = {context}); give at most {context - 1}, better {context // 4}"
        )
    return replace(task, max_new_tokens=max(1, context // 2))


def plan_network(
    n: NetworkSettings,
    *,
    run: str,
    sites: dict[str, Site],
    public_keys: Path,
    loco_store: str = "",
    cache_dir: Path | None = None,
) -> tuple[list[TrainerConfig], list[InferenceConfig]]:
    """Every node's settings. ``sites``: node id -> its store, key and state directory;
    ``public_keys``: the directory of every node's ``<id>.key.pub``; ``loco_store``: the bucket the
    trainers share (several trainers only)."""
    trainers, inference = trainer_ids(n), inference_ids(n)
    several = n.trainers > 1
    if several and not loco_store:
        raise ValueError("several trainers need the store they share (loco_store)")
    path = preset(n.model)
    toml = load_toml(path)  # the preset, read once: its [trainer], [inference] and [task] tables
    base_t = load_settings(TrainerConfig, table="trainer", config=path, parsed=toml, environ={})
    base_i = load_settings(InferenceConfig, table="inference", config=path, parsed=toml, environ={})
    task = load_settings(TaskConfig, table="task", config=path, parsed=toml, environ={})
    if n.task:  # the user's task: of the preset's task settings only its completion length (the model's)
        task = TaskConfig(task=n.task, max_new_tokens=task.max_new_tokens)
    default = TaskConfig()
    given = {  # what the command sets beyond the task itself
        f.name: copy.deepcopy(getattr(n.task_options, f.name))
        for f in dataclasses.fields(n.task_options)
        if getattr(n.task_options, f.name) != getattr(default, f.name)
    }
    if n.reward:
        given["reward"] = list(n.reward)
    if n.max_new_tokens:
        given["max_new_tokens"] = n.max_new_tokens
    task = fit_completions(replace(task, **given), model_context(n.model), given=bool(n.max_new_tokens))
    rows_per_step = n.rows_per_step or base_t.rows_per_step
    if several and not n.rows_per_step:
        rows_per_step = max(32, rows_per_step // n.inner_steps)  # a round then costs about one lone step
    group_size = n.group_size or base_i.group_size
    if group_size > rows_per_step:  # the trainers would refuse every group (group_size): say so now
        raise ConfigError(
            f"--group-size {group_size} is larger than --rows-per-step {rows_per_step}: a GRPO step takes whole groups"
        )
    prompts = n.prompts or (max(1, rows_per_step // group_size) if several else base_i.prompts)
    batches_per_version = n.batches_per_version or base_i.batches_per_version
    if several and not n.batches_per_version:
        # A round takes inner_steps steps of rows_per_step rows on each trainer, from batches
        # partitioned among them (not evenly): twice that per version, or rounds starve.
        per_step = math.ceil(rows_per_step / (prompts * group_size))  # a step takes whole batches
        need = n.inner_steps * n.trainers * per_step / n.inference
        batches_per_version = max(batches_per_version, 2 * math.ceil(need))

    out_t = []
    for t in trainers:
        base = copy.deepcopy(base_t)  # no two trainers share a nested settings object
        loco = base.loco
        if several:
            loco = replace(
                loco,
                inner_steps=n.inner_steps,
                outer_lr=n.outer_lr,
                outer_momentum=n.outer_momentum,
                # one of two goes on alone past the deadline; the round record forbids a fork
                min_quorum=1 if n.trainers == 2 else loco.min_quorum,
            )
        out_t.append(replace(  # a new config: TrainerConfig's own __post_init__ copies the run into every component
            base,
            id=t, run=run, model=n.model, seed=n.seed, steps=n.rounds,
            store=sites[t].store, key=sites[t].key, state_dir=sites[t].state_dir, cache_dir=cache_dir,
            inference=[f"{i}={sites[i].store}" for i in inference],
            trust_inference=[f"{i}={public_keys / f'{i}.key.pub'}" for i in inference],
            rows_per_step=rows_per_step,
            batches_per_version=batches_per_version, prompts_per_batch=prompts,  # what the nodes make
            intake=replace(base.intake, max_staleness=n.max_staleness, group_size=group_size),  # G, signed in demand
            publish=replace(base.publish, anchor_every=max(n.rounds + 1, 10)),
            task=copy.deepcopy(task), eval_every=n.eval_every, tracker=n.tracker,
            grpo=replace(base.grpo, lr=n.lr) if n.lr else base.grpo,
            loco=loco,
            loco_store=loco_store if several else base.loco_store,
            peers=[f"{p}={public_keys / f'{p}.key.pub'}" for p in trainers] if several else base.peers,
        ))  # fmt: skip
    out_i = []
    for i in inference:
        base = copy.deepcopy(base_i)
        out_i.append(replace(
            base,
            id=i, run=run, model=n.model, seed=n.seed,
            store=sites[i].store, key=sites[i].key, state_dir=sites[i].state_dir,
            policy=[f"{t}={sites[t].store}" for t in trainers],
            trust=[public_keys / f"{t}.key.pub" for t in trainers],
            task=copy.deepcopy(task), engine=n.engine,
            vllm=replace(base.vllm, in_flight=n.in_flight),  # validated
            prompts=prompts, group_size=group_size, batches_per_version=batches_per_version,
            max_staleness=n.max_staleness,
            subscribe=replace(base.subscribe, interval_s=0.25),
        ))  # fmt: skip
    return out_t, out_i
