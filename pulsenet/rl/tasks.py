"""Reward tasks: arithmetic ("12+34=" → "46"), multi-step chains ("(3+4)*5-2=" → "33") and MATH/GSM8K JSONL.

Every task draws problems from an RNG and scores a completion (``RewardTask``). RL problems are
assigned by ``assign_problems(task, node=, version=, seed=, n=)``, a pure function of those
arguments: a node has no say in which problems it gets (it cannot pick easy ones), a restarted
node draws the same ones, and a trainer can recompute the assignment to check a rollout's prompt.

Every batch is a pure function of (seed, step): trainers with different seeds see different
data, a restarted trainer that resumes at step k sees exactly the batches it would have seen.
Text is tokenized by a HF tokenizer when one is given (SmolLM2), else byte-level (ids = UTF-8
bytes, vocab 256) for the tiny model.

Rows are packed: ``prompt answer EOS`` examples back to back until the next would not fit,
then padding. Labels equal input_ids on answer and EOS positions and are -100 on prompts and
padding; the shift for next-token prediction happens in the loss, as in HF models.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerBase

from pulsenet.errors import ConfigError
from pulsenet.rl.models import BYTE_EOS, BYTE_PAD

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str
    """What the model sees, e.g. ``"12+34="``."""
    answer: str
    """The exact completion that earns reward 1, e.g. ``"46"``."""


def reward(completion: str, answer: str) -> float:
    """1.0 if the completion's first line is exactly the answer (surrounding spaces ignored), else 0.0."""
    lines = completion.strip().splitlines()
    return 1.0 if lines and lines[0].strip() == answer else 0.0


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


# --- MATH / GSM8K-style JSONL ------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the completion was cut off


def extract_answer(completion: str) -> str | None:
    """A completion's answer: its last ``\\boxed{}`` or else its last number (commas dropped)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def reference_answer(answer: str) -> str:
    """The gold answer of a dataset row: after GSM8K's ``####``, or a MATH solution's last box, else as is."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = last_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


def _normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip().rstrip(".")
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", "")):
        s = s.replace(a, b)
    return "".join(s.split())


def _as_number(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Equal as numbers (``"1,000"`` = ``"1000.0"``, ``"0.5"`` = ``"1/2"``), else as whitespace-free strings.

    Not a full MATH equivalence checker (no symbolic algebra): ``\\frac{1}{2}`` and ``0.5`` differ.
    """
    if predicted is None:
        return False
    p, r = _normalize(predicted), _normalize(reference)
    pn, rn = _as_number(p), _as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r


class JsonlTask:
    """Problems from a JSONL file, one ``{"problem": str, "answer": str | number}`` per line.

    ``answer`` may be a bare answer, a GSM8K solution ending in ``#### 42`` or a MATH solution with
    a ``\\boxed{}``. A completion earns 1.0 if its last ``\\boxed{}`` (or else its last number)
    matches (``answers_match``). The task key is the file's SHA-256, so two nodes with different
    files never agree on an assignment a trainer would accept.
    """

    def __init__(self, problems: Sequence[Problem], key: str) -> None:
        if not problems:
            raise ConfigError("a JSONL task needs at least one problem")
        self.problems = list(problems)
        self._key = key

    @classmethod
    def load(cls, path: str | Path) -> JsonlTask:
        data = Path(path).read_bytes()
        problems = []
        for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problem, answer = row["problem"], row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(
                    f"{path}:{n}: expected a JSON object with 'problem' and 'answer' ({e})"
                ) from e
            if not isinstance(problem, str) or not isinstance(answer, str | int | float):
                raise ConfigError(f"{path}:{n}: 'problem' must be a string and 'answer' a string or number")
            problems.append(Problem(prompt=problem, answer=reference_answer(str(answer))))
        return cls(problems, key="jsonl:" + hashlib.sha256(data).hexdigest())

    @property
    def key(self) -> str:
        return self._key

    def draw(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]

    def score(self, completion: str, problem: Problem) -> float:
        return 1.0 if answers_match(extract_answer(completion), problem.answer) else 0.0


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
