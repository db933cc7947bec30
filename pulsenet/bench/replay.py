"""``pulsenet bench replay``: what the trainer's replay of rollout rows costs, and how far honest
rows stay from a refusal (issue 30; ``rl/replay.py``).

Honest batches as an inference node makes them: a ``TorchEngine`` serving a version's BF16 weights
samples the task's assigned problems with the public draw (``rl/draw.py``; keys
``DrawId(run, digest, node, version, batch, problem, completion)``, as ``InferenceNode.
generate_batch`` makes them) and the rows are scored with the task's rewards; each row is replayed
with the key its completion was drawn with (``nodes.feed.ReplayRows`` rebuilds the same key
from the row's group id). The model, task, completion length and GRPO settings are the
preset's (``pulsenet/presets/<model>.toml``, as ``pulsenet up`` plans them); a batch is one GRPO
step's rows (``rows_per_step``, the trainer's default 32 = 8 prompts x 4, the SmolLM2 preset's
batch shape).

Cost (``cost``), per batch at a new version (the GRPO step moves the weights, as a lone trainer
does), medians over ``repeats`` batches after one untimed warm-up batch, each figure timed on the
same batch:

- ``step_s``: ``GRPOTrainer.step`` on the batch (forward, backward, AdamW; ``micro_batch_tokens``);
- ``replay_s``: ``Replayer.check`` with the default ``ReplayConfig`` (share 0.375, at least 8 rows),
  the version's weights loaded into the replay model first (a new version each step, as a lone
  trainer sees it); ``replay_loaded_s``: another draw of rows, weights already loaded;
- ``replay_all_s``: every row replayed (share 1.0);
- ``forward_s``: the floor, one no-grad forward of every row through the trainer's forward
  (``LocalTrainer.logits``, same micro-batches): figures from other machines compare as
  ratios to it.

``ratio`` = replay_s / step_s (the issue's bound: <= 0.10), ``ratio_all`` = replay_all_s /
step_s; ``budget_10pct`` the rows a replay can take within 10% of a step (the version's load,
once per version, plus a per-row cost) and so the share a cheat touching one row is caught with.

Margins (``margins``): ``rows`` honest rows (whole batches, at versions cycling over the cost
phase's) replayed in full (every row picked) with the default tolerances; refusals by reason
(0 expected), and the quantiles of each token's |Δ log-prob| and CDF margin (``rl.draw.
boundary_margin``: how far inside its CDF interval the token's uniform lies; < 0: outside, by that
much probability mass) and of each batch's mean |Δ log-prob| (what ``mean_logprob_tolerance``
bounds).
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pulsenet.bench import BenchSettings, config_of

SCHEMA = "pulsenet.bench.replay/1"
THRESHOLDS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
"""Tokens counted with a CDF margin below / a |Δ log-prob| above each: what a tighter tolerance would refuse or allow."""
RUN, NODE = "bench", "i0"
"""The run and node the draw keys name (any strings: they only have to be the same on both sides)."""


@dataclass(kw_only=True)
class ReplayBenchSettings(BenchSettings):
    """Replay's cost against the GRPO step, and honest rows' margins, on the torch engine."""

    model: str = "tiny"
    """tiny (warmed up, cached), smollm2, or a Hugging Face model directory."""
    rows: int = 10_000
    """Honest rows replayed in full for the margins (whole batches: rounded up); 0: cost only."""
    repeats: int = 5
    """Timed batches for the cost (medians reported; 0: margins only)."""
    rows_per_step: int = 32
    """Rows of one GRPO step and one batch (the trainer's default)."""
    group_size: int = 4
    """Completions per prompt (the inference node's default): a batch has rows_per_step / group_size prompts."""
    max_new_tokens: int = 0
    """Tokens per completion at most (0: the preset's: 5 for tiny, 16 for smollm2)."""
    lr: float = 0.0
    """GRPO learning rate (0: the preset's: 5e-4 tiny, 3e-6 smollm2)."""
    seed: int = 0
    """Problems, warm-up and the rows the default replay picks."""
    warmup_steps: int = 250
    """Tiny only: the warm-up steps of the model (the trainer's default; cached)."""
    cache_dir: Path | None = None
    """Where the tiny warm-up is cached (None: ~/.cache/pulsenet)."""
    threads: int | None = None
    """Torch threads (None: torch's default, as the trainer runs)."""


@dataclass(slots=True)
class _Setup:
    """What every batch uses: the policy being trained, the engine, the replayer, the task."""

    grpo: Any
    engine: Any
    replayer: Any
    task: Any
    prompter: Any
    prompts: int


def run(s: ReplayBenchSettings) -> dict[str, Any]:
    if s.rows < 0 or s.repeats < 0 or s.rows_per_step < 1 or not 1 <= s.group_size <= s.rows_per_step:
        raise SystemExit("pulsenet bench replay: --rows, --repeats >= 0, 1 <= --group-size <= --rows-per-step")
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    setup = _build(s)
    t0 = time.perf_counter()
    try:
        cost, states, verdicts = _cost(setup, s)
        margins = _margins(setup, s, states, verdicts)
    finally:
        setup.task.close()
    result = {
        "schema": SCHEMA,
        "config": config_of(s),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "model": {"name": s.model, "parameters": sum(p.numel() for p in setup.grpo.local.model.parameters()),
                  "vocab": setup.grpo.local.model.config.vocab_size},
        "replay_config": _replay_config(setup.replayer.config),
        "grpo": {"lr": setup.grpo.config.lr, "micro_batch_tokens": setup.grpo.config.micro_batch_tokens,
                 "forward": setup.grpo.config.forward, "temperature": setup.grpo.config.temperature},
        "cost": cost,
        "margins": margins,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    _print(result)
    return result


def _build(s: ReplayBenchSettings) -> _Setup:
    """The preset's task, GRPO settings and model, as ``pulsenet up`` plans a trainer and a node."""
    from pulsenet.codec.digest import model_digest
    from pulsenet.engines.factory import make_engine
    from pulsenet.nodes.common import initial_model, text_codec
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
    from pulsenet.nodes.plan import fit_completions, model_context, preset
    from pulsenet.rl.grpo import GRPOTrainer
    from pulsenet.rl.replay import Replayer
    from pulsenet.rl.tasks import TaskConfig, build_task
    from pulsenet.settings import load_settings

    if s.rows_per_step % s.group_size:
        raise SystemExit("pulsenet bench replay: --rows-per-step must be a multiple of --group-size (whole groups)")
    trainer = load_settings(TrainerConfig, table="trainer", config=preset(s.model), environ={})
    node = load_settings(InferenceConfig, table="inference", config=preset(s.model), environ={})
    task_config = load_settings(TaskConfig, table="task", config=preset(s.model), environ={})
    if s.max_new_tokens:
        task_config = replace(task_config, max_new_tokens=s.max_new_tokens)
    task_config = fit_completions(task_config, model_context(s.model), given=bool(s.max_new_tokens))
    text = text_codec(s.model)
    task = build_task(task_config, seed=s.seed)
    grpo_config = replace(trainer.grpo_config(pad_id=text.pad_id), seed=s.seed, lr=s.lr or trainer.grpo.lr)
    grpo = GRPOTrainer(initial_model(s.model, s.cache_dir, seed=s.seed, warmup_steps=s.warmup_steps), grpo_config)
    model = grpo.local.model
    prompter = task.prompter(text, max_positions=getattr(model.config, "max_position_embeddings", None))
    replayer = Replayer(
        model.config,
        prompter.sampling_params(temperature=grpo_config.temperature, top_p=trainer.replay.top_p),
        trainer.replay,
        keep=trainer.intake.max_staleness + 1,
        stopped=prompter.stopped if prompter.config.stop else None,
        rng=random.Random(s.seed),
    )
    if node.temperature != grpo_config.temperature or node.top_p != trainer.replay.top_p:
        raise SystemExit("pulsenet bench replay: the preset's node and trainer sampling settings differ")
    state = grpo.bf16_state()
    engine = make_engine("torch", model=s.model, state=state, digest=model_digest(state), version=0, codec=text)
    return _Setup(grpo, engine, replayer, task, prompter, s.rows_per_step // s.group_size)


# --- one batch ----------------------------------------------------------------------------------


def _publish(setup: _Setup, version: int, state: dict[str, torch.Tensor]) -> str:
    """Serve ``state`` as ``version`` on the engine and hold it in the replayer; its digest."""
    from pulsenet.codec.digest import model_digest

    digest = model_digest(state)
    if setup.engine.version != version:
        setup.engine.update(version, state, digest)
    setup.replayer.remember(version, state)
    return digest


def _batch(setup: _Setup, s: ReplayBenchSettings, version: int, digest: str, index: int) -> tuple[list[Any], list[Any]]:
    """Batch ``index`` at ``version`` as an inference node makes it (``InferenceNode.generate_batch``):
    its rows (``Rollout``, rewarded) and their replay rows with the keys the node drew with."""
    from pulsenet.rl.draw import DrawId
    from pulsenet.rl.replay import ReplayRow
    from pulsenet.rl.tasks import assign_problems, group_id

    problems = assign_problems(setup.task, node=NODE, version=version, seed=s.seed, n=setup.prompts, batch=index)
    asked = [(k, p, ids) for k, p in enumerate(problems) if (ids := setup.prompter.encode(p.prompt)) is not None]
    prompts = [ids for _, _, ids in asked for _ in range(s.group_size)]
    draws = tuple(DrawId(RUN, digest, NODE, version, index, k, i).key() for k, _, _ in asked for i in range(s.group_size))
    params = replace(setup.prompter.sampling_params(temperature=setup.grpo.config.temperature,
                                                    top_p=setup.replayer.config.top_p), draws=draws)  # fmt: skip
    gens = setup.engine.generate(prompts, params)
    groups = [group_id(NODE, version, index, k) for k, _, _ in asked for _ in range(s.group_size)]
    texts = [setup.prompter.completion_text(g.completion_ids) for g in gens]
    scores = setup.task.score_texts([p for _, p, _ in asked for _ in range(s.group_size)], texts, groups)
    rows = [g.to_rollout(group=grp, reward=r, node=NODE) for g, grp, r in zip(gens, groups, scores.total, strict=True)]
    return rows, [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, k) for g, k in zip(gens, draws, strict=True)]


# --- cost ---------------------------------------------------------------------------------------


def _cost(setup: _Setup, s: ReplayBenchSettings) -> tuple[dict[str, Any], list[tuple[int, dict[str, torch.Tensor]]], list[Any]]:
    """Time the step, the replays and the floor on ``repeats`` batches (plus one warm-up), each at
    a new version; returns the figures, the versions made and the every-row verdicts (the margins
    reuse both)."""
    states: list[tuple[int, dict[str, torch.Tensor]]] = []
    verdicts: list[Any] = []
    names = ("gen_s", "step_s", "replay_s", "replay_loaded_s", "replay_all_s", "forward_s")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    tokens, replayed, rows_n = [], [], []
    refused = 0
    r = setup.replayer
    for v in range(s.repeats + 1 if s.repeats else 1):
        state = setup.grpo.bf16_state()
        states.append((v, state))
        digest = _publish(setup, v, state)
        if not s.repeats:
            break
        times: dict[str, tuple[float, float]] = {}
        (rows, replay), times["gen_s"] = _timed(_batch, setup, s, v, digest, 0)
        picked, times["replay_s"] = _timed(r.check, v, replay)  # a new version: its weights are loaded first
        again, times["replay_loaded_s"] = _timed(r.check, v, replay)
        full, times["replay_all_s"] = _timed(r.check, v, replay, picked=range(len(replay)))
        _, times["forward_s"] = _timed(_forward, setup, rows)
        _, times["step_s"] = _timed(setup.grpo.step, rows)
        verdicts.append(full)
        refused += (not picked.ok) + (not again.ok)  # the every-row verdict counts in the margins
        if v == 0:
            continue  # the warm-up batch: allocations, kernels' first runs
        for k, (w, c) in times.items():
            wall[k].append(w)
            cpu[k].append(c)
        tokens.append(sum(len(x.prompt_ids) + len(x.completion_ids) for x in rows))
        replayed.append(len(picked.rows))
        rows_n.append(len(rows))
    if not s.repeats:
        return {}, states, verdicts
    med = {k: statistics.median(x) for k, x in wall.items()}
    low = {k: min(x) for k, x in wall.items()}
    cpu_med = {k: statistics.median(x) for k, x in cpu.items()}
    n = statistics.median(rows_n)
    k = statistics.median(replayed)

    def ratios(t: dict[str, float]) -> dict[str, float]:
        return {
            "replay": round(t["replay_s"] / t["step_s"], 4),
            "replay_loaded": round(t["replay_loaded_s"] / t["step_s"], 4),
            "replay_all": round(t["replay_all_s"] / t["step_s"], 4),
            "step_over_forward": round(t["step_s"] / t["forward_s"], 3),
            "replay_all_over_forward": round(t["replay_all_s"] / t["forward_s"], 3),
        }

    return {
        "batches": s.repeats,
        "rows_per_batch": n,
        "tokens_per_batch": statistics.median(tokens),
        "rows_replayed": statistics.median(replayed),
        "sample_refused": refused,
        "median_s": {k: round(x, 6) for k, x in med.items()},
        "min_s": {k: round(x, 6) for k, x in low.items()},
        "cpu_median_s": {k: round(x, 6) for k, x in cpu_med.items()},
        "ratio": ratios(med),
        "ratio_min": ratios(low),
        "ratio_cpu": ratios(cpu_med),
        "all_s": {k: [round(x, 6) for x in v] for k, v in wall.items()},
        "budget_10pct": _budget(med, n, k),
        "budget_10pct_cpu": _budget(cpu_med, n, k),
        "detect_one_row_default": round(k / n, 4),
    }, states, verdicts


def _budget(t: dict[str, float], n: float, k: float) -> dict[str, float]:
    """The rows of an ``n``-row batch a replay can take within 10% of a step (``k`` rows replayed
    by default): the version's load (``replay_s`` - ``replay_loaded_s``, paid once per version) plus
    a per-row cost (``replay_all_s`` / n, linear in rows), and the share of rows a cheat touching
    one row is caught with then. ``rows`` 0: the load alone is over 10%."""
    load = max(0.0, t["replay_s"] - t["replay_loaded_s"])
    per_row = t["replay_all_s"] / n
    rows = max(0, min(int(n), int((0.10 * t["step_s"] - load) / per_row)))
    return {"load_s": round(load, 4), "per_row_s": round(per_row, 5), "rows": rows, "share": round(rows / n, 4),
            "rows_if_loaded": max(0, min(int(n), int(0.10 * t["step_s"] / per_row)))}


def _timed(fn: Any, *args: Any, **kw: Any) -> tuple[Any, tuple[float, float]]:
    """``fn(*args, **kw)``, its wall and its process CPU seconds (every thread: on a shared machine the CPU
    time is what the work cost, the wall time also what the neighbours took)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args, **kw)
    return out, (time.perf_counter() - w, time.process_time() - c)


def _forward(setup: _Setup, rows: Sequence[Any]) -> None:
    """The floor: one no-grad forward of every row through the trainer's forward, the step's micro-batches."""
    from pulsenet.rl.grpo import micro_batches

    local, cfg = setup.grpo.local, setup.grpo.config
    lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in rows]
    with torch.no_grad():
        for part, width in micro_batches(range(len(rows)), lengths, cfg.micro_batch_size, cfg.micro_batch_tokens):
            ids = torch.full((len(part), width), cfg.pad_id, dtype=torch.long)
            for j, i in enumerate(part):
                ids[j, : lengths[i]] = torch.tensor(rows[i].prompt_ids + rows[i].completion_ids)
            local.logits(ids)


# --- margins ------------------------------------------------------------------------------------


def _margins(
    setup: _Setup, s: ReplayBenchSettings, states: list[tuple[int, dict[str, torch.Tensor]]], given: list[Any]
) -> dict[str, Any]:
    """Replay ``rows`` honest rows in full (the cost phase's batches, ``given``, first), batch by
    batch, at the cost phase's versions in turn."""
    if not s.rows:
        return {}
    margins, diffs, means = [], [], []
    refused: dict[str, int] = {}
    details: list[str] = []
    rows_n = batches = 0

    def count(verdict: Any, where: str) -> None:
        nonlocal rows_n, batches
        batches += 1
        rows_n += len(verdict.rows)
        if not verdict.ok:
            refused[verdict.reason or "?"] = refused.get(verdict.reason or "?", 0) + 1
            details.append(f"{where} row {verdict.row}: {verdict.reason}: {verdict.detail}")
        if verdict.margins.numel():
            margins.append(verdict.margins)
            diffs.append(verdict.logprob_diffs)
            means.append(float(verdict.logprob_diffs.mean()))

    for k, verdict in enumerate(given):
        count(verdict, f"v{k} b0")
    per_version = -(-max(0, s.rows - rows_n) // s.rows_per_step // len(states))
    t0 = time.perf_counter()
    for v, state in states:
        digest = _publish(setup, v, state)
        for b in range(1, per_version + 1):  # batch 0 of each version was the cost phase's
            if rows_n >= s.rows:
                break
            _, replay = _batch(setup, s, v, digest, b)
            count(setup.replayer.check(v, replay, picked=range(len(replay))), f"v{v} b{b}")
    m = torch.cat(margins).double() if margins else torch.zeros(0, dtype=torch.float64)
    d = torch.cat(diffs).double() if diffs else torch.zeros(0, dtype=torch.float64)
    tol = setup.replayer.config.tolerances()
    return {
        "rows": rows_n,
        "batches": batches,
        "tokens": int(m.numel()),
        "versions": len(states),
        "refused": refused,
        "refusals": details[:20],
        "logprob_diff": _quantiles(d, (0.5, 0.99, 0.999)) | {
            "mean": _round(float(d.mean())) if d.numel() else None,
            "above": {f"{x:g}": int((d > x).sum()) for x in THRESHOLDS},
        },
        "cdf_margin": _quantiles(m, (0.0001, 0.001, 0.01, 0.5)) | {
            "min": _round(float(m.min())) if m.numel() else None,
            "negative": int((m < 0).sum()),
            "near_boundary": int((m < tol.cdf).sum()),
            # issue 38: how close honest tokens come to the CDF tolerance, within 10x either way: a
            # miss of more than a tenth of it (a false refusal 10x away), and a margin under 10x it
            "missed_over_tenth_of_tolerance": int((m < -tol.cdf / 10).sum()),
            "within_10x_tolerance": int((m < 10 * tol.cdf).sum()),
            "below": {f"{x:g}": int((m < x).sum()) for x in THRESHOLDS},
        },
        "batch_mean_logprob_diff": _quantiles(torch.tensor(means, dtype=torch.float64), (0.5, 0.99)),
        "tolerances": {"cdf": tol.cdf, "logprob": tol.logprob, "mean_logprob": tol.mean_logprob},
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _quantiles(x: torch.Tensor, qs: Sequence[float]) -> dict[str, float | None]:
    """``{"q50": ..., "max": ...}`` (None when ``x`` is empty); quantile q as ``q`` x 100, e.g. q99.9."""
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"q{q * 100:g}"] = _round(float(torch.quantile(x, q))) if x.numel() else None
    out["max"] = _round(float(x.max())) if x.numel() else None
    return out


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def _replay_config(c: Any) -> dict[str, Any]:
    tol = c.tolerances()
    return {"share": c.share, "min_rows": c.min_rows, "engine": c.engine, "cdf_tolerance": tol.cdf,
            "logprob_tolerance": tol.logprob, "mean_logprob_tolerance": tol.mean_logprob}  # fmt: skip


def _print(r: dict[str, Any]) -> None:
    c, m = r["cost"], r["margins"]
    if c:
        t, q = c["median_s"], c["ratio"]
        print(
            f"cost ({r['model']['name']}, {c['rows_per_batch']:g} rows/batch, median of {c['batches']}): "
            f"step {t['step_s']:.3f} s, replay {t['replay_s']:.3f} s ({c['rows_replayed']:g} rows) = {q['replay']:.1%} "
            f"of a step (CPU time: {c['ratio_cpu']['replay']:.1%}), all rows {t['replay_all_s']:.3f} s = "
            f"{q['replay_all']:.1%}; floor (one forward) {t['forward_s']:.3f} s; 10% of a step replays "
            f"{c['budget_10pct']['rows']} rows (CPU time: {c['budget_10pct_cpu']['rows']})"
        )
    if m:
        print(
            f"margins: {m['rows']} rows, {m['tokens']} tokens, {m['batches']} batches, refused {m['refused'] or 0}; "
            f"|dlogp| q50 {m['logprob_diff']['q50']} q99.9 {m['logprob_diff']['q99.9']} max {m['logprob_diff']['max']}; "
            f"CDF margin min {m['cdf_margin']['min']} q0.1 {m['cdf_margin']['q0.1']} ({m['cdf_margin']['negative']} < 0); "
            f"batch mean |dlogp| max {m['batch_mean_logprob_diff']['max']}"
        )
