"""Rollout rows: one completion as an inference node served it, the unit GRPO trains on.

The Parquet wire format of a batch of rows (encode/decode, no I/O) lives here too; see
docs/format.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Rollout:
    """One sampled completion with what the trainer needs to weigh it."""

    group: str
    """Id of its group: the G completions sampled for one prompt share it (and ``prompt_ids``)."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The engine's log-probability of each completion token at sampling time (same length)."""
    reward: float
    version: int
    """Policy version whose weights produced it."""
    model_digest: str
    """Model digest (codec/digest.py) of the weights that served it."""
    node: str
    """Id of the inference node that sampled it."""
    seed: int
    """Sampling seed: with the version and the prompt it makes the draw reproducible."""
