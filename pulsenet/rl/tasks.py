"""Reward tasks: arithmetic ("12+34=" → "46"), multi-step chains ("(3+4)*5-2=" → "33") and datasets.

A run's task is one ``TaskConfig`` turned into a ``Task`` by ``build_task``: the problems (a
generator, or a dataset file: rl/data.py), the prompt settings (rl/prompts.py), the rewards
(rl/rewards.py) and a held-out eval split. The inference node and the trainer build the same Task
from the same settings; the trainer re-scores every rollout with it (rl/rescore.py).

Every task draws problems from an RNG and scores a completion (``RewardTask``). RL problems are
assigned by ``assign_problems(task, node=, version=, seed=, n=, batch=)``, a pure function of those
arguments, with the batch numbers and problem counts bounded by the trainer (``Assignment``, signed
into its demand record): a node has no say in which problems it gets (it cannot pick easy ones),
a restarted node draws the same ones, and a trainer can recompute the assignment to check a
rollout's prompt.

Every batch is a pure function of (seed, step): trainers with different seeds see different
data, a restarted trainer that resumes at step k sees exactly the batches it would have seen.
Text is tokenized by a HF tokenizer when one is given (SmolLM2), else byte-level (ids = UTF-8
bytes, vocab 256) for the tiny model.

Rows are packed: ``prompt answer EOS`` examples back to back until the next would not fit,
then padding. Labels equal input_ids on answer and EOS positions and are -100 on prompts and
padding; the shift for next-token prediction happens in the loss, as in HF models.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import torch
from transformers import PreTrainedTokenizerBase

from pulsenet.errors import ConfigError, RolloutRowError
from pulsenet.rl.models import BYTE_EOS, BYTE_PAD
from pulsenet.rl.prompts import PromptConfig, Prompter, TextCodec
from pulsenet.rl.rewards import (
    Completion,
    RewardConfig,
    RewardSet,
    Scores,
    answers_match,
    extract_answer,
    first_line_matches,
    last_boxed,
    reference_answer,
)

__all__ = [  # the answer helpers live in rl/rewards.py (no torch there); re-exported for callers
    "answers_match",
    "extract_answer",
    "last_boxed",
    "reference_answer",
]

IGNORE_INDEX = -100
ARITH_MAX_OPERAND = 9
"""``arith``: operands in ``[0, 9]``, what the tiny model is warmed up on (``rl.warmup``)."""
ARITH_OPS = "+-"


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str
    """What the model sees, e.g. ``"12+34="``."""
    answer: str
    """The gold answer, e.g. ``"46"`` (for a dataset row: what ``reference_answer`` extracts)."""
    row: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """A dataset row's columns (what custom rewards receive by name); None for generated problems."""


def reward(completion: str, answer: str) -> float:
    """1.0 if the completion's first line is exactly the answer (surrounding spaces ignored), else 0.0."""
    return 1.0 if first_line_matches(completion, answer) else 0.0


class RewardTask(Protocol):
    """What RL needs from a task: a name for its problem distribution, a draw, a score."""

    @property
    def key(self) -> str:
        """Names the problem distribution; part of the assignment stream, so tasks never share draws."""
        ...

    def draw(self, rng: random.Random) -> Problem:
        """One problem, a function of ``rng``'s state only."""
        ...

    def score(self, completion: str, problem: Problem) -> float:
        """The reward of ``completion`` (decoded text after the prompt) for ``problem``."""
        ...


def assign_problems(
    task: RewardTask, *, node: str, version: int, seed: int, n: int, batch: int = 0
) -> list[Problem]:
    """The ``n`` problems ``node`` must answer for policy ``version`` in run ``seed``: a pure function.

    ``batch`` numbers the batches a node generates while the policy stays at one version, so a
    slow trainer does not make a node answer the same problems again.

    The RNG is seeded with a string (SHA-512 inside ``random.Random``), stable across processes
    and Python versions, unlike ``hash()``; a node id cannot collide with another field because
    the fields are JSON-encoded.
    """
    rng = random.Random("pulsenet-assign:" + json.dumps([task.key, seed, node, version, batch]))
    return [task.draw(rng) for _ in range(n)]


class ArithmeticTask:
    """Addition/subtraction of integers in ``[0, max_operand]``, seeded by (seed, step)."""

    def __init__(
        self,
        seed: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        max_operand: int = 99,
        ops: str = "+-",
    ) -> None:
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        self.seed = seed
        self.tokenizer = tokenizer
        self.max_operand = max_operand
        self.ops = ops
        self.next_step = 0
        """The step ``batch`` uses when none is given; advanced by each such call."""
        if tokenizer is None:
            self.eos_id, self.pad_id = BYTE_EOS, BYTE_PAD
        else:
            if tokenizer.eos_token_id is None:
                raise ValueError("the tokenizer needs an eos token to end answers")
            self.eos_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def _rng(self, stream: str, step: int) -> random.Random:
        # A str seed goes through SHA-512 in random.Random: stable across processes and
        # Python runs (unlike hash()), and distinct streams never share a sequence.
        return random.Random(f"pulsenet-arith:{self.seed}:{stream}:{step}")

    def _problem(self, rng: random.Random) -> Problem:
        a = rng.randint(0, self.max_operand)
        b = rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(prompt=f"{a}{op}{b}=", answer=str(value))

    # --- RewardTask ----------------------------------------------------------

    @property
    def key(self) -> str:
        return f"arith:{self.max_operand}:{self.ops}"

    def draw(self, rng: random.Random) -> Problem:
        return self._problem(rng)

    def score(self, completion: str, problem: Problem) -> float:
        """Exact answer on the first line (``reward``): the format is part of what is learned."""
        return reward(completion, problem.answer)

    def problems(self, step: int, n: int) -> list[Problem]:
        """``n`` prompts with answers for RL rollouts at ``step`` (a stream separate from ``batch``)."""
        rng = self._rng("problems", step)
        return [self._problem(rng) for _ in range(n)]

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def batch(
        self, batch_size: int, seq_len: int, step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed ``(input_ids, labels)``, both ``[batch_size, seq_len]`` int64.

        With ``step=None`` the task uses and advances ``next_step``; pass ``step`` explicitly
        when the caller owns the position (checkpointed trainers).
        """
        if step is None:
            step = self.next_step
            self.next_step += 1
        rng = self._rng("batch", step)
        input_ids = torch.full((batch_size, seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
        for row in range(batch_size):
            pos = 0
            while True:
                p = self._problem(rng)
                prompt = self.encode(p.prompt)
                target = [*self.encode(p.answer), self.eos_id]
                n = len(prompt) + len(target)
                if n > seq_len:
                    raise ValueError(f"seq_len={seq_len} is shorter than one example ({n} tokens)")
                if pos + n > seq_len:
                    break
                input_ids[row, pos : pos + n] = torch.tensor(prompt + target)
                labels[row, pos + len(prompt) : pos + n] = torch.tensor(target)
                pos += n
        return input_ids, labels


def _apply(value: int, op: str, b: int) -> int:
    return value + b if op == "+" else value - b if op == "-" else value * b


class ChainTask(ArithmeticTask):
    """Multi-step integer chains, ``n_ops`` operations evaluated left to right: ``(3+4)*5-2=`` → ``33``.

    Parentheses appear exactly where precedence would otherwise change the order, so the prompt
    reads as ordinary arithmetic. ``batch`` and ``problems`` work as for ``ArithmeticTask``
    (packed supervised rows for a warm-up, seeded problem lists).
    """

    def __init__(
        self,
        seed: int,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        max_operand: int = 20,
        ops: str = "+-*",
        n_ops: int = 2,
    ) -> None:
        if n_ops < 1:
            raise ValueError(f"n_ops must be >= 1, got {n_ops}")
        super().__init__(seed, tokenizer, max_operand=max_operand, ops=ops)
        self.n_ops = n_ops

    def _problem(self, rng: random.Random) -> Problem:
        value = rng.randint(0, self.max_operand)
        text, last = str(value), ""
        for _ in range(self.n_ops):
            op, b = rng.choice(self.ops), rng.randint(0, self.max_operand)
            if op == "*" and last in ("+", "-"):
                text = f"({text})"
            text, value, last = f"{text}{op}{b}", _apply(value, op, b), op
        return Problem(prompt=f"{text}=", answer=str(value))

    @property
    def key(self) -> str:
        return f"chain:{self.max_operand}:{self.ops}:{self.n_ops}"


class FewShotTask:
    """``task`` with ``k`` solved examples before every prompt: ``"3+4=7\\n12-5=7\\n" + "87+20="``.

    A pretrained model given a bare ``87+20=`` rambles (SmolLM2-135M-Instruct: ``111, so 11``,
    greedy reward 0/16); with three solved examples before the prompt it answers on the first
    line (2/16 greedy on ``a±b`` and on 2-step chains, measured with hand-written shots), so GRPO
    gets groups that are not flat. The shots are drawn once, fixed by ``(task.key, k, seed)``.
    """

    def __init__(self, task: RewardTask, k: int = 3, seed: int = 0) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        rng = random.Random("pulsenet-shots:" + json.dumps([task.key, k, seed]))
        self.task = task
        self.shots = [task.draw(rng) for _ in range(k)]
        self.prefix = "".join(f"{p.prompt}{p.answer}\n" for p in self.shots)
        self._key = f"{task.key}+shots:{k}:{seed}"

    @property
    def key(self) -> str:
        return self._key

    def draw(self, rng: random.Random) -> Problem:
        p = self.task.draw(rng)
        return Problem(prompt=self.prefix + p.prompt, answer=p.answer)

    def score(self, completion: str, problem: Problem) -> float:
        return self.task.score(completion, problem)


# --- datasets ---------------------------------------------------------------------------------------


class DatasetTask:
    """Problems drawn uniformly from a dataset's training rows (rl/data.py); key = the data's."""

    def __init__(self, problems: Sequence[Problem], key: str, eval_problems: Sequence[Problem] | None = None) -> None:
        if not problems:
            raise ConfigError("a dataset task needs at least one problem")
        self.problems = list(problems)
        self.eval_problems = list(eval_problems) if eval_problems is not None else None
        self._key = key

    @classmethod
    def load(cls, path: str, **kwargs: Any) -> DatasetTask:
        """``data.load_problem_set(path, **kwargs)`` as a task."""
        from pulsenet.rl.data import load_problem_set

        data = load_problem_set(path, **kwargs)

        def problems(rows: Sequence[Any]) -> list[Problem]:
            return [Problem(r.prompt, r.answer, r.columns) for r in rows]

        return cls(problems(data.train), data.key, problems(data.eval) if data.eval is not None else None)

    @property
    def key(self) -> str:
        return self._key

    def draw(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]

    def score(self, completion: str, problem: Problem) -> float:
        """The ``numeric`` check, in-process (a Task scores with its configured rewards instead)."""
        return 1.0 if answers_match(extract_answer(completion), problem.answer) else 0.0


# --- a run's task: problems + prompts + rewards + eval split -----------------------------------------

GENERATED = ("arith", "arith-shots", "chain")
SHOTS = 4
"""Solved examples before every ``arith-shots`` prompt."""
SHOTS_MAX_OPERAND = 9
"""``arith-shots`` problems are ``a±b`` with single digits: SmolLM2-135M's sampled reward starts
between 0 and 1 (docs/results/loco-grpo-smollm2-2026-12-01.md), so GRPO's groups are not flat."""
GENERATED_EVAL = 64
"""Held-out problems of a generated task: a fixed draw from a stream of its own."""


@dataclass(kw_only=True)
class TaskConfig:
    """What a run trains on and how it is judged; the same on the trainer and every inference node."""

    task: str = "arith"
    """arith, arith-shots, chain, or a dataset: .jsonl/.json/.parquet/.csv file or a save_to_disk directory."""
    prompt_column: str = ""
    """Dataset column holding the prompt (empty: the first of prompt, question, problem)."""
    answer_column: str = ""
    """Dataset column holding the gold answer or solution (empty: the first of answer, solution)."""
    split: str = "train"
    """Split of a save_to_disk DatasetDict to train on."""
    eval_task: str = ""
    """Held-out data file (same columns); or eval_fraction; or a DatasetDict's "test" split."""
    eval_fraction: float = 0.0
    """Fraction of the dataset's rows held out for eval (chosen by hash: the same rows everywhere)."""
    eval_problems: int = 0
    """Held-out problems scored per eval, the first of the split (0: all)."""
    template: str = "plain"
    """plain: the problem text; chat: the tokenizer's chat template."""
    system_prompt: str = ""
    """With template chat: a system turn before each problem."""
    max_prompt_tokens: int = 1024
    """Longer prompts are dropped and counted, never truncated."""
    max_new_tokens: int | None = None
    """Completion tokens at most (None: 8 for generated tasks, 512 for datasets)."""
    stop: list[str] | None = None
    """Strings that end a completion besides EOS (None: a newline for arith-shots, else none)."""
    reward: list[str] = field(default_factory=list)
    """Reward functions: math, exact, numeric, format, or module:function (empty: exact for generated
    tasks, math for datasets)."""
    reward_weights: list[float] = field(default_factory=list)
    """One weight per reward (empty: all 1)."""
    reward_timeout_s: float = 10.0
    """Deadline of one reward call on one completion (numeric, math and custom rewards run in a worker process)."""

    @property
    def is_dataset(self) -> bool:
        return self.task not in GENERATED

    def prompt_config(self) -> PromptConfig:
        default_new, default_stop = (512, []) if self.is_dataset else (8, ["\n"] if self.task == "arith-shots" else [])
        return PromptConfig(
            template=cast(Literal["plain", "chat"], self.template),  # a setting's text: PromptConfig checks it (ConfigError)
            system_prompt=self.system_prompt,
            max_prompt_tokens=self.max_prompt_tokens,
            max_new_tokens=self.max_new_tokens if self.max_new_tokens is not None else default_new,
            stop=tuple(self.stop if self.stop is not None else default_stop),
        )

    def reward_config(self) -> RewardConfig:
        names = list(self.reward) or (["math"] if self.is_dataset else ["exact"])
        return RewardConfig(rewards=names, weights=list(self.reward_weights), timeout_s=self.reward_timeout_s)


class Task:
    """A ``RewardTask`` (key, draw, score) with its prompt settings, rewards and held-out problems.

    ``close()`` stops the reward worker process (numeric, math and custom rewards), if one was started.
    """

    def __init__(self, config: TaskConfig, problems: RewardTask, eval_problems: Sequence[Problem]) -> None:
        self.config = config
        self.problems = problems
        self.prompt_config = config.prompt_config()
        self.rewards = RewardSet(config.reward_config())
        limit = config.eval_problems or len(eval_problems)
        self.eval_problems = list(eval_problems)[:limit]

    @property
    def key(self) -> str:
        return self.problems.key

    def draw(self, rng: random.Random) -> Problem:
        return self.problems.draw(rng)

    @property
    def reward_range(self) -> tuple[float, float]:
        """[lo, hi] of every total reward (what a trainer's intake accepts in a reward column)."""
        return self.rewards.range

    def prompter(self, codec: TextCodec, *, max_positions: int | None = None) -> Prompter:
        """This task's prompt settings with a model's codec (``max_positions``: its context length)."""
        return Prompter(codec, self.prompt_config, max_positions=max_positions)

    def score_texts(self, problems: Sequence[Problem], texts: Sequence[str], tags: Sequence[str] | None = None) -> Scores:
        """Every reward on each (problem, completion text) pair; failures score 0 and are counted."""
        if len(problems) != len(texts) or (tags is not None and len(tags) != len(texts)):
            raise ValueError("problems, texts and tags must have one entry per completion")
        items = [
            Completion(
                completion=text,
                prompt=p.prompt,
                answer=p.answer,
                columns=dict(p.row) if p.row is not None else {},
                tag=tags[i] if tags is not None else "",
            )
            for i, (p, text) in enumerate(zip(problems, texts, strict=True))
        ]
        return self.rewards.score(items)

    def score(self, completion: str, problem: Problem) -> float:
        """One completion's total reward (``RewardTask``); batches go through ``score_texts``."""
        return self.score_texts([problem], [completion]).total[0]

    def close(self) -> None:
        self.rewards.close()


def build_task(config: TaskConfig | str, *, seed: int = 0) -> Task:
    """The Task of ``config``: generated problems or a dataset (ConfigError naming what is wrong).
    A bare name is ``TaskConfig(task=name)``: ``arith`` (single-digit +/-: what the tiny model is
    warmed up on), ``arith-shots`` (the same after four solved examples, one per line, stopped at
    a newline: what a pretrained model answers), ``chain`` (multi-step), or a dataset
    file/directory (rl/data.py). ``close()`` the task when done (its reward worker process)."""
    if isinstance(config, str):
        config = TaskConfig(task=config)
    name = config.task
    if name in GENERATED:
        if config.eval_task or config.eval_fraction:
            raise ConfigError(f"task {name} is generated: its eval problems are a fixed draw, not eval_task/eval_fraction")
        if name == "arith":
            problems: RewardTask = ArithmeticTask(seed, max_operand=ARITH_MAX_OPERAND, ops=ARITH_OPS)  # the warm-up's
        elif name == "arith-shots":
            problems = FewShotTask(ArithmeticTask(seed, max_operand=SHOTS_MAX_OPERAND), k=SHOTS, seed=seed)
        else:
            problems = ChainTask(seed)
        rng = random.Random("pulsenet-eval:" + json.dumps([problems.key, seed]))
        return Task(config, problems, [problems.draw(rng) for _ in range(GENERATED_EVAL)])
    from pulsenet.rl.data import is_dataset_path

    if not is_dataset_path(name):
        raise ConfigError(
            f"task must be {', '.join(GENERATED)}, a .jsonl/.json/.parquet/.csv file or a save_to_disk directory, got {name!r}"
        )
    data = DatasetTask.load(
        name,
        prompt_column=config.prompt_column,
        answer_column=config.answer_column,
        split=config.split,
        eval_path=config.eval_task or None,
        eval_fraction=config.eval_fraction,
    )
    return Task(config, data, data.eval_problems or [])


# --- rollout groups ---------------------------------------------------------------------------------

_GROUP = re.compile(r"(?P<node>.+)-v(?P<version>\d{1,15})-b(?P<batch>\d{1,15})-p(?P<index>\d{1,15})")
"""At most 15 digits per number: ``int()`` of a longer run of digits costs quadratic time (and
raises past 4300); every real number here is far smaller, and ``Assignment`` bounds them further."""


def group_id(node: str, version: int, batch: int, index: int) -> str:
    """The id of the group of completions of problem ``index`` of ``assign_problems(..., batch=batch)``:
    what lets a trainer recompute the problem a rollout answered (``parse_group_id``)."""
    return f"{node}-v{version}-b{batch}-p{index}"


def parse_group_id(group: str) -> tuple[str, int, int, int] | None:
    """``(node, version, batch, index)`` of a ``group_id``, or None if it is not one: exactly the
    text ``group_id`` writes for them. ``p5``, ``p05`` and ``p005`` would all read as problem 5 under
    ``int()``: as distinct groups of one problem, each replayed from completion 0, a node could send
    its best group several times as honest draws (issue 38)."""
    m = _GROUP.fullmatch(group)
    if m is None:
        return None
    parsed = m["node"], int(m["version"]), int(m["batch"]), int(m["index"])
    return parsed if group_id(*parsed) == group else None


# --- what a node may answer -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assignment:
    """The batches a trainer lets an inference node answer, and how it checks a batch (issue 29).

    A node answers, at each policy version ``v`` it serves, batches ``b = 0, 1, ...`` below
    ``batches_per_version``; batch ``b``'s problems are ``assign_problems(task, node=, version=v,
    seed=, n=prompts_per_batch, batch=b)``, a pure function of (run seed, node, version, b): the node
    picks none of them. Every group id of one rollout batch names the same ``(node, v, b)`` (the
    batch id) and a distinct problem index below ``prompts_per_batch``; a trainer accepts each
    batch id once (``RolloutIntake``: ``batch_repeated``). The trainer signs both bounds into its
    demand record (rollouts/demand.py), and a node never makes more than they allow. So a node can
    neither choose its problems (before: any batch number of its choosing, per group) nor answer
    one twice; it can still withhold a batch it does not like (issue 30 counts gaps). Which of a
    batch's problems and rows it sends is not its choice either (issue 38, ``answers`` and
    rl/answers.py): each group id in ``group_id``'s one spelling, each problem once, G rows a group.

    Every number of a group id is bounded here before anything is drawn: a group id is a claim.
    """

    batches_per_version: int = 16
    """Batch numbers a node may use per version: ``b < batches_per_version``."""
    prompts_per_batch: int = 64
    """Problems per batch: ``index < prompts_per_batch`` (``rl.answers.BatchCheck``: every one answered)."""
    max_group_rows: int | None = None
    """Rows one group may hold (a GRPO step never splits a group: at most its rows; None: no bound)."""
    group_size: int | None = None
    """GRPO's G: every group holds exactly this many rows (signed into the demand record); None: any."""

    def __post_init__(self) -> None:
        if self.batches_per_version < 1 or self.prompts_per_batch < 1:
            raise ConfigError("batches_per_version and prompts_per_batch must be >= 1")
        if self.max_group_rows is not None and self.max_group_rows < 1:
            raise ConfigError("max_group_rows must be >= 1")
        if self.group_size is not None and self.group_size < 1:
            raise ConfigError("group_size must be >= 1")

    def check_group(self, group: str, *, node: str, version: int) -> tuple[int, int] | str:
        """``(batch, index)`` of a group id of ``node``'s rows served at ``version``, or the reason it
        is refused: ``group_id`` (not one, or another node's or version's), ``out_of_assignment``
        (a number past the bounds)."""
        parsed = parse_group_id(group)
        if parsed is None or parsed[0] != node or parsed[1] != version:
            return "group_id"
        _, _, batch, index = parsed
        if batch >= self.batches_per_version or index >= self.prompts_per_batch:
            return "out_of_assignment"
        return batch, index

    def answers(
        self, groups: Sequence[str], rows_per_group: Sequence[int], *, node: str, version: int
    ) -> tuple[int, list[int]]:
        """The one batch number every group of a rollout batch answers and each group's problem
        index; RolloutRowError otherwise, reason ``group_id``, ``out_of_assignment``, ``group_size``
        (a group over ``max_group_rows``, or groups of unequal sizes or not of ``group_size``
        rows), ``mixed_batches``, ``problem_repeated`` (two groups of one problem), or
        ``group_size_changed`` (every group of one size, another than ``group_size``: what a batch
        made before a change of G looks like)."""
        batches, indices = set(), []
        for group, rows in zip(groups, rows_per_group, strict=True):
            got = self.check_group(group, node=node, version=version)
            if isinstance(got, str):
                raise RolloutRowError(got, f"group id {group[:120]!r} of {node} v{version}: {got}")
            if self.max_group_rows is not None and rows > self.max_group_rows:
                raise RolloutRowError("group_size", f"group {group!r} has {rows} rows, a step takes {self.max_group_rows}")
            batches.add(got[0])
            indices.append(got[1])
        if len(batches) != 1:
            raise RolloutRowError("mixed_batches", f"one rollout batch answers batches {sorted(batches)[:8]}")
        if len(set(indices)) != len(indices):
            twice = sorted(k for k in set(indices) if indices.count(k) > 1)
            raise RolloutRowError("problem_repeated", f"problems {twice[:8]} are answered by more than one group")
        sizes = set(rows_per_group)
        if len(sizes) > 1:
            raise RolloutRowError("group_size", f"groups of {sorted(sizes)[:8]} rows in one batch")
        if self.group_size is not None and sizes != {self.group_size}:
            raise RolloutRowError("group_size_changed", f"groups of {sizes.pop()} rows; G is {self.group_size}")
        return batches.pop(), indices

    def batch_of(self, groups: Sequence[str], rows_per_group: Sequence[int], *, node: str, version: int) -> int:
        """The one batch number every group of a rollout batch answers (``answers``)."""
        return self.answers(groups, rows_per_group, node=node, version=version)[0]
