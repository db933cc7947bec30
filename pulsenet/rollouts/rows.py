"""What a trainer trains on: row limits from its own model and task, checked on every batch at intake.

A batch that decodes and matches its signed manifest is still only its node's word. A row with a
token id at or above the vocabulary size, an empty prompt, a group whose rows carry two prompts, a
million-token completion, a positive logprob or a reward of 1e300 (finite in float64, infinite in
the float32 GRPO math) crashes, stalls or poisons a GRPO step (issue 21). So the intake checks
every row against :class:`RowLimits`, which the trainer fills from its model (vocabulary, context)
and task (reward range), and refuses the whole batch with the first failing reason:

=================  ===============================================================================
``empty_row``      a row with no prompt or no completion tokens
``row_too_long``   prompt over ``max_prompt_tokens``, completion over ``max_completion_tokens``, or
                   prompt + completion over ``max_row_tokens`` (the model's context)
``token_range``    a token id outside ``[0, vocab_size)``
``group_prompts``  two rows of one group with different prompts
``logprob_range``  a logprob above 0 or below ``logprob_min``
``reward_range``   a reward outside ``[reward_min, reward_max]``
=================  ===============================================================================

The checks are vectorised over the batch's arrays (``codec.rollout.RolloutColumns``): a batch of
32 Mi tokens is checked in well under a second, in a thread. Group ids need no check here: the
intake qualifies them with node and batch (``RolloutBatch.rows``), so no batch can join another's
group, whatever ids its node chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pulsenet.codec.rollout import MAX_TOKEN_ID, RolloutColumns
from pulsenet.errors import ConfigError, RolloutRowError

ROW_REASONS = ("empty_row", "row_too_long", "token_range", "group_prompts", "logprob_range", "reward_range")

LOGPROB_FLOOR = -80.0
"""Default ``logprob_min``. The GRPO step computes exp(π_old − π_engine) in float32 (TIS weights,
``mismatch_kl``), which overflows above 88.7; a token sampled at probability e^-80 ≈ 2e-35 is not a
draw any sampler makes, so a floor at -80 refuses only forged or broken logprobs."""


@dataclass(kw_only=True, slots=True, frozen=True)
class RowLimits:
    """Per-row limits a trainer accepts; set them from the model and task (``for_model``).

    The defaults are loose format-level bounds (any vocabulary of int32 ids, 16 Ki-token prompts and
    completions, rewards within ±1e4): safe for the GRPO math, not a substitute for the model's own.
    """

    vocab_size: int = MAX_TOKEN_ID + 1
    """Token ids must be below this: the model's vocabulary (embedding rows)."""
    max_prompt_tokens: int = 1 << 14
    max_completion_tokens: int = 1 << 14
    max_row_tokens: int | None = None
    """Prompt plus completion, at most the model's context length; None: the two limits above only."""
    reward_min: float = -1e4
    reward_max: float = 1e4
    """The task's reward range (inclusive)."""
    logprob_min: float = LOGPROB_FLOOR
    """Logprobs must lie in ``[logprob_min, 0]`` (see ``LOGPROB_FLOOR``)."""

    def __post_init__(self) -> None:
        if not 0 < self.vocab_size <= MAX_TOKEN_ID + 1:
            raise ConfigError(f"vocab_size must be in 1..{MAX_TOKEN_ID + 1}, got {self.vocab_size}")
        if self.max_prompt_tokens < 1 or self.max_completion_tokens < 1:
            raise ConfigError("max_prompt_tokens and max_completion_tokens must be >= 1")
        if self.max_row_tokens is not None and self.max_row_tokens < 2:
            raise ConfigError(f"max_row_tokens must be >= 2 (a prompt and a completion token), got {self.max_row_tokens}")
        bounds = (self.reward_min, self.reward_max, self.logprob_min)
        if not all(math.isfinite(b) for b in bounds) or self.reward_min > self.reward_max or self.logprob_min >= 0:
            raise ConfigError(
                f"need finite reward_min <= reward_max and logprob_min < 0, got {self.reward_min}, "
                f"{self.reward_max}, {self.logprob_min}"
            )
        if max(abs(self.reward_min), abs(self.reward_max)) > 1e30:
            raise ConfigError("rewards beyond ±1e30 overflow the float32 GRPO math (advantages, their squares)")

    @classmethod
    def for_model(
        cls,
        *,
        vocab_size: int,
        context_tokens: int,
        reward_range: tuple[float, float],
        max_completion_tokens: int | None = None,
        logprob_min: float = LOGPROB_FLOOR,
    ) -> RowLimits:
        """Limits for a model with ``vocab_size`` embedding rows and ``context_tokens`` positions
        (``max_position_embeddings``), a task rewarding within ``reward_range``, and engines that
        sample at most ``max_completion_tokens`` (default: whatever fits the context)."""
        most = context_tokens - 1
        return cls(
            vocab_size=vocab_size,
            max_prompt_tokens=most,
            max_completion_tokens=min(most, max_completion_tokens or most),
            max_row_tokens=context_tokens,
            reward_min=reward_range[0],
            reward_max=reward_range[1],
            logprob_min=logprob_min,
        )


def check_rows(cols: RolloutColumns, limits: RowLimits) -> None:
    """RolloutRowError (``reason`` one of ROW_REASONS) for the first limit a row of ``cols`` breaks."""
    plen, clen = cols.prompt_lengths, cols.completion_lengths
    if len(cols) == 0 or int(plen.min()) < 1 or int(clen.min()) < 1:
        row = int(np.argmin(np.minimum(plen, clen))) if len(cols) else 0
        raise RolloutRowError("empty_row", f"row {row} has {_at(plen, row)} prompt and {_at(clen, row)} completion tokens")
    if int(plen.max()) > limits.max_prompt_tokens or int(clen.max()) > limits.max_completion_tokens:
        raise RolloutRowError(
            "row_too_long",
            f"a row has {int(plen.max())} prompt or {int(clen.max())} completion tokens; limits "
            f"{limits.max_prompt_tokens} and {limits.max_completion_tokens}",
        )
    if limits.max_row_tokens is not None and int((plen + clen).max()) > limits.max_row_tokens:
        raise RolloutRowError(
            "row_too_long", f"a row has {int((plen + clen).max())} tokens; the context is {limits.max_row_tokens}"
        )
    for name in ("prompt_ids", "completion_ids"):
        ids = getattr(cols, name)
        if int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size:
            raise RolloutRowError(
                "token_range", f"{name} holds id {int(ids.max())} or {int(ids.min())}; vocabulary is {limits.vocab_size}"
            )
    _check_group_prompts(cols, plen)
    lp = cols.logprobs
    if not (np.isfinite(lp).all() and float(lp.max()) <= 0.0 and float(lp.min()) >= limits.logprob_min):
        raise RolloutRowError(
            "logprob_range", f"logprobs span [{float(lp.min())}, {float(lp.max())}]; allowed [{limits.logprob_min}, 0]"
        )
    r = cols.reward
    if not (np.isfinite(r).all() and float(r.min()) >= limits.reward_min and float(r.max()) <= limits.reward_max):
        raise RolloutRowError(
            "reward_range",
            f"rewards span [{float(r.min())}, {float(r.max())}]; the task's range is "
            f"[{limits.reward_min}, {limits.reward_max}]",
        )


def _check_group_prompts(cols: RolloutColumns, plen: np.ndarray) -> None:
    """Every row's prompt equals the first row of its group's, compared token by token, a block
    of rows (about ``_BLOCK`` tokens) at a time so the index arrays stay small."""
    groups, first = np.unique(cols.group, return_index=True)  # each group's first row
    ref = first[np.searchsorted(groups, cols.group)]  # each row's group's first row
    if not np.array_equal(plen, plen[ref]):
        row = int(np.flatnonzero(plen != plen[ref])[0])
        raise RolloutRowError("group_prompts", f"group {cols.groups[cols.group[row]][:80]!r} has prompts of two lengths")
    po, ids, n = cols.prompt_offsets, cols.prompt_ids, len(cols)
    start = 0
    while start < n:
        end = min(n, max(start + 1, int(np.searchsorted(po, po[start] + _BLOCK, side="right")) - 1))
        row_of = np.repeat(np.arange(start, end), plen[start:end])
        pos = np.arange(po[start], po[end]) - po[row_of]  # each token's position in its row
        same = ids[po[start] : po[end]] == ids[po[ref[row_of]] + pos]
        if not same.all():
            row = int(row_of[np.argmin(same)])
            raise RolloutRowError("group_prompts", f"group {cols.groups[cols.group[row]][:80]!r} mixes different prompts")
        start = end


_BLOCK = 1 << 20


def _at(a: np.ndarray, i: int) -> int:
    return int(a[i]) if len(a) else 0
