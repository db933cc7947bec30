"""Eval: a policy scored greedily on the task's held-out problems (mean total reward, n).

``evaluate(engine, task, prompter)`` runs on any engine. A trainer calls ``Evaluator.evaluate``
every ``eval_every`` versions with the BF16 state it publishes: the evaluator builds one engine
on first use (with the ``build`` its caller passes in: nodes/ picks the engine, rl only samples
through it) and updates it in place (a TorchEngine copies and rehashes only the tensors that
changed), so an eval costs the greedy decoding and the rewards, not a model build. The held-out problems are
the task's (``Task.eval_problems``: a dataset's eval split, or a fixed draw for generated tasks),
the same for every version, so the eval curve moves only with the policy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pulsenet.codec.digest import model_digest
from pulsenet.errors import ConfigError
from pulsenet.rl.prompts import Prompter
from pulsenet.rl.sampling import SamplingParams
from pulsenet.rl.tasks import Task


class Completion(Protocol):
    """What eval reads of an engine's ``Generation``."""

    @property
    def completion_ids(self) -> Sequence[int]: ...


class EvalEngine(Protocol):
    """What eval needs of an engine (engines/base.py ``Engine`` has it): sample, take an update."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> Sequence[Completion]: ...

    def update(self, version: int, state: Mapping[str, torch.Tensor], digest: str) -> None: ...


class EngineBuilder(Protocol):
    """Builds the eval engine from the first state scored, e.g.
    ``functools.partial(TorchEngine.from_state, hf_config, decode=codec.decode)``."""

    def __call__(self, state: Mapping[str, torch.Tensor], digest: str, /, *, version: int) -> EvalEngine: ...


@dataclass(frozen=True, slots=True)
class EvalResult:
    version: int | None
    reward: float
    """Mean total reward over the scored problems (greedy, one completion each)."""
    n: int
    """Problems scored."""
    by_reward: dict[str, float]
    """Mean of each reward (None and failures count 0)."""
    dropped: int
    """Held-out prompts over the prompt limits, not scored."""
    wall_s: float

    def as_dict(self) -> dict[str, float | int | None]:
        """The ``summary.json`` ``eval`` entry: {version, reward, n}."""
        return {"version": self.version, "reward": self.reward, "n": self.n}


def evaluate(
    engine: EvalEngine, task: Task, prompter: Prompter, *, version: int | None = None, batch_size: int = 64
) -> EvalResult:
    """Greedy completions of every held-out problem on ``engine``, scored with the task's rewards."""
    if not task.eval_problems:
        raise ConfigError(f"task {task.config.task!r} has no held-out problems (set eval_task or eval_fraction)")
    t0 = time.perf_counter()
    problems, prompts = [], []
    for p in task.eval_problems:
        ids = prompter.encode(p.prompt)
        if ids is not None:
            problems.append(p)
            prompts.append(ids)
    dropped = len(task.eval_problems) - len(problems)
    if not problems:
        raise ConfigError(f"every held-out prompt of {task.config.task!r} is over the prompt limits")
    params = prompter.sampling_params(temperature=0.0)
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        for g in engine.generate(prompts[start : start + batch_size], params):
            texts.append(prompter.completion_text(g.completion_ids))
    tag = f"eval-v{version}" if version is not None else "eval"
    scores = task.score_texts(problems, texts, [f"{tag}-{i}" for i in range(len(problems))])
    n = len(problems)
    return EvalResult(
        version=version,
        reward=sum(scores.total) / n,
        n=n,
        by_reward={name: sum(v or 0.0 for v in vals) / n for name, vals in scores.by_reward.items()},
        dropped=dropped,
        wall_s=time.perf_counter() - t0,
    )


class Evaluator:
    """The trainer's evals: one engine built on first use (by ``build``), then updated in place each eval."""

    def __init__(self, task: Task, prompter: Prompter, build: EngineBuilder, *, batch_size: int = 64) -> None:
        self.task, self.prompter, self.build = task, prompter, build
        self.batch_size = batch_size
        self.engine: EvalEngine | None = None
        self.history: list[EvalResult] = []

    def evaluate(self, version: int, state: Mapping[str, torch.Tensor], digest: str | None = None) -> EvalResult:
        """Score ``state`` (BF16 weights by name, e.g. what the trainer publishes as ``version``).

        ``digest``: its model digest when known (the published one): the engine checks it after
        the update; None computes it here."""
        digest = digest if digest is not None else model_digest(state)
        if self.engine is None:
            self.engine = self.build(state, digest, version=version)
        else:
            self.engine.update(version, state, digest)
        result = evaluate(self.engine, self.task, self.prompter, version=version, batch_size=self.batch_size)
        self.history.append(result)
        return result
