"""The public draw inside vLLM: a logits processor that makes vLLM's token the rule's (rl/draw.py).

vLLM samples with its own seeded generator (Gumbel / exponential noise on top-k/top-p logits): a
token it picks is not a function of the public uniforms, so no trainer could replay it. This
processor makes it one. ``VLLMEngine`` builds vLLM with it (``logits_processors``) and
``logprobs_mode="processed_logits"``, and sends every request *greedy* (temperature 0) with the
draw in ``SamplingParams.extra_args[EXTRA]`` (``draw_args``): the key, the task's temperature and
top-p. At each step, for each such row, the processor takes the row's FP32 logits (vLLM's, before
any temperature), picks the token with ``engines.base.draw_token`` (``rl.draw.choose`` for the
uniform of the row's key at position ``len(output_tok_ids)``, and its log-prob under
``log_softmax(logits / T)`` before top-p: the torch engine's very function), and rewrites the row
to -inf everywhere except that token, whose value becomes that log-prob. vLLM's greedy path then
takes the argmax (the chosen token) and, in ``processed_logits`` mode, returns the processed
logits as the sampled token's "logprob": exactly the value written (vllm/v1/sample/sampler.py,
``Sampler.sample``, all-greedy branch).

Declared not argmax-invariant, so vLLM runs it in ``apply_logits_processors`` before it samples,
greedy or not. Rows without ``EXTRA`` are left untouched. The position is the length of the
request's live output-token list (vLLM hands processors a reference to it; with async scheduling
its not-yet-known tokens are placeholders, still counted), so a request preempted and resumed,
or reset by an in-place update (``in_flight="keep"``), draws each position's uniform once.

What this needs from the engine (``VLLMEngine`` does all of it): every request it sends carries
the draw and temperature 0 (``validate_params`` refuses a draw with another temperature: vLLM's
random sampler would rescale the value written), and no speculative decoding (vLLM refuses custom
logits processors then).

Runs in vLLM's engine-core process (loaded by its name, ``vllm_engine.DRAW_PROCESSOR``): imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from pulsenet.engines.base import draw_token
from pulsenet.rl.draw import uniform

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTRA = "pulsenet_draw"
"""The ``SamplingParams.extra_args`` entry that carries a request's draw."""


def draw_args(key: bytes, temperature: float, top_p: float) -> dict[str, Any]:
    """``extra_args`` of a request drawn with ``key`` at ``temperature`` and ``top_p``."""
    return {EXTRA: {"key": key.hex(), "temperature": float(temperature), "top_p": float(top_p)}}


@dataclass(frozen=True, slots=True)
class _Row:
    key: bytes
    temperature: float
    top_p: float
    output: list[int]
    """vLLM's live list of the request's output tokens (its length is the next position)."""


def _parse(args: dict[str, Any] | None) -> tuple[bytes, float, float] | None:
    """The draw of a request's ``extra_args`` (None without one); ValueError when malformed."""
    d = (args or {}).get(EXTRA)
    if d is None:
        return None
    try:
        key, temperature, top_p = bytes.fromhex(d["key"]), float(d["temperature"]), float(d["top_p"])
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{EXTRA}: malformed draw {d!r} ({e})") from e
    if len(key) != 32 or not temperature >= 0 or not 0 < top_p <= 1:
        raise ValueError(f"{EXTRA}: a 32-byte key, temperature >= 0 and top_p in (0, 1] are needed, got {d!r}")
    return key, temperature, top_p


class PublicDraw(LogitsProcessor):
    """See the module docstring."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        if _parse(sampling_params.extra_args) is not None and sampling_params.temperature != 0:
            raise ValueError(f"{EXTRA}: a drawn request must be sent greedy (temperature 0)")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, _Row] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new(params: SamplingParams, _prompt: list[int] | None, output: list[int]) -> _Row | None:
            draw = _parse(params.extra_args)
            return None if draw is None else _Row(*draw, output)

        process_dict_updates(self.rows, batch_update, new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        groups: dict[tuple[float, float], list[int]] = {}
        for i, r in self.rows.items():
            groups.setdefault((r.temperature, r.top_p), []).append(i)
        for (temperature, top_p), idx in groups.items():
            rows = torch.tensor(idx, dtype=torch.long, device=logits.device)
            u = [uniform(self.rows[i].key, len(self.rows[i].output)) for i in idx]
            tok, logp = draw_token(logits[rows], u, temperature, top_p)
            logits[rows] = float("-inf")
            logits[rows, tok] = logp.to(logits.dtype)
        return logits


__all__ = ["EXTRA", "PublicDraw", "draw_args"]
