"""A small deterministic arithmetic task ("12+34=" → "46") for training and RL rewards.

Every batch is a pure function of (seed, step): trainers with different seeds see different
data, a restarted trainer that resumes at step k sees exactly the batches it would have seen.
Text is tokenized by a HF tokenizer when one is given (SmolLM2), else byte-level (ids = UTF-8
bytes, vocab 256) for the tiny model.

Rows are packed: ``prompt answer EOS`` examples back to back until the next would not fit,
then padding. Labels equal input_ids on answer and EOS positions and are -100 on prompts and
padding; the shift for next-token prediction happens in the loss, as in HF models.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

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
