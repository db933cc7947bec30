"""A completion's shape: what its length and ending must be under the task's sampling parameters.

Why its own module: the check needs no forward pass, so the trainer's intake runs it on *every*
row of a batch (rl/answers.py), while replay (rl/replay.py, ``replay_params``) runs the same
function on the rows it picked. On only a sample, a node could cut one wrong completion of a
batch to a prefix that scores and drop its stop token, and be caught a quarter of the time.

A completion is well-formed when it is not empty, has one log-prob per token, holds at most
``max_new_tokens`` tokens, has no stop token before its last one and no stop string before its
last token, and ends early (under ``max_new_tokens``) only at a stop token or a stop string:
what both engines produce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pulsenet.rl.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class RowShape:
    """The task's sampling parameters as a check of one completion (``broken``)."""

    params: SamplingParams
    stop_ids: frozenset[int]
    """What ends a completion: the task's stop tokens and, with ``stop_at_eos``, the model's EOS."""
    stopped: Callable[[Sequence[int]], bool] | None = None
    """Whether a completion's decoded text holds a stop string (None: the task has none)."""

    @classmethod
    def of(
        cls, params: SamplingParams, eos: int | Iterable[int] | None, stopped: Callable[[Sequence[int]], bool] | None
    ) -> RowShape:
        """The shape for ``params`` with the model's ``eos`` id(s) (``hf_config.eos_token_id``)."""
        eos_ids = set() if eos is None or not params.stop_at_eos else {eos} if isinstance(eos, int) else set(eos)
        return cls(params, frozenset(params.stop_token_ids) | eos_ids, stopped if params.stop else None)

    def broken(self, ids: Sequence[int], n_logprobs: int) -> str | None:
        """Why the completion ``ids`` (with ``n_logprobs`` log-probs) is not one the engines make, or None."""
        p, stops = self.params, self.stop_ids
        if not ids:
            return "an empty completion"
        if len(ids) > p.max_new_tokens:
            return f"{len(ids)} tokens, max_new_tokens is {p.max_new_tokens}"
        if len(ids) != n_logprobs:
            return f"{len(ids)} tokens but {n_logprobs} log-probs"
        early = next((t for t, tok in enumerate(ids[:-1]) if tok in stops), None)
        if early is not None:
            return f"a stop token at {early} of {len(ids)}: the completion goes on past its end"
        # The text of every shorter prefix is a prefix of this one's: one decode, not one per token.
        if self.stopped is not None and len(ids) > 1 and self.stopped(ids[:-1]):
            return "a stop string ends the completion before its last token"
        if len(ids) < p.max_new_tokens and ids[-1] not in stops and not (self.stopped is not None and self.stopped(ids)):
            return f"ended at {len(ids)} tokens (< max_new_tokens {p.max_new_tokens}) without a stop token or string"
        return None
