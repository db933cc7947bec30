"""Sampling: ``SamplingParams`` (what every engine's ``generate`` takes), and a minimal reference
sampler: the G completions of one prompt, no KV cache. For tests and warm-up checks.

Not an inference engine (``pulsenet/engines/`` is: batched, KV-cached, hot-swapped weights). This
one recomputes the whole sequence for every new token, which costs nothing on the tiny byte-level
model and a few answer tokens, and it samples through any ``logits_fn``, so a test can sample with
the trainer's own forward (``LocalTrainer.logits``) and measure how far the engine-vs-trainer
log-probs drift when nothing but the batch shape differs.

The recorded log-prob of each token is that of the distribution it was drawn from, i.e. of
``softmax(logits / temperature)``, as the GRPO trainer recomputes it (``GRPOConfig.temperature``).
The EOS token is part of the completion: the policy must learn to stop, so it is trained on too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pulsenet.errors import ConfigError
from pulsenet.rl.draw import seed_key

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""``[rows, tokens]`` int64 ids → ``[rows, tokens, vocab]`` logits (causal, no padding)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """What an engine's ``generate`` samples with (engines/base.py re-exports it): here, below the
    engines, so rl (``Prompter.sampling_params``, eval) builds it without importing an engine."""

    temperature: float = 1.0
    """Logits are divided by it before softmax; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: sample from the smallest set of most likely tokens whose probability
    reaches ``top_p`` (1.0 disables truncation)."""
    max_new_tokens: int = 64
    """Completion length limit; reaching it ends the completion with ``finish_reason="length"``."""
    stop_at_eos: bool = True
    """Stop at the model's EOS token(s) (``config.eos_token_id``)."""
    stop_token_ids: tuple[int, ...] = ()
    """More token ids that end a completion. The stop token is kept as the last completion token,
    so a trainer can learn to emit it."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion once its decoded text contains one (needs the engine's
    tokenizer); the tokens that completed it are kept, as with stop tokens."""
    seed: int = 0
    """Without ``draws``, completion ``i`` of a call draws with ``rl.draw.seed_key(seed + i)``: the
    same prompts, seed and weights give the same samples on every engine, whatever else runs."""
    draws: tuple[bytes, ...] = ()
    """The public draw key of each prompt's completion (``rl.draw.DrawId.key``), one per prompt of
    the call: its tokens are then drawn with that key's uniforms (rl/draw.py), which a trainer
    replays (rl/replay.py). Empty: keys from ``seed``."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        if any(not isinstance(k, bytes) or len(k) != 32 for k in self.draws):
            raise ConfigError("draws must be 32-byte keys (rl.draw.DrawId.key)")
        if any(not isinstance(x, str) or not x for x in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def draw_keys(self, n: int, offset: int = 0) -> list[bytes]:
        """The draw keys of prompts ``offset .. offset + n - 1`` of a call."""
        if self.draws:
            if offset + n > len(self.draws):
                raise ConfigError(f"{len(self.draws)} draw keys for a call of {offset + n} prompts")
            return list(self.draws[offset : offset + n])
        return [seed_key(self.seed + offset + i) for i in range(n)]


@dataclass(frozen=True, slots=True)
class Sample:
    completion_ids: tuple[int, ...]
    """Sampled tokens, ending with EOS unless ``max_new_tokens`` ran out first."""
    logprobs: tuple[float, ...]
    """Log-prob of each sampled token under the temperature-scaled distribution (greedy: T=1)."""


@torch.no_grad()
def sample_group(
    logits_fn: LogitsFn,
    prompt_ids: Sequence[int],
    n: int,
    *,
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Sample]:
    """``n`` completions of one prompt; ``temperature=0`` is greedy (log-probs then at T=1)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    x = torch.tensor([list(prompt_ids)] * n, dtype=torch.long)
    ids: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        logits = logits_fn(x)[:, -1, :].float()
        if temperature == 0:
            logp = torch.log_softmax(logits, dim=-1)
            tok = logp.argmax(dim=-1)
        else:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
        picked = logp.gather(1, tok[:, None]).squeeze(1)
        for i in range(n):
            if not done[i]:
                ids[i].append(int(tok[i]))
                logps[i].append(float(picked[i]))
        done |= tok == eos_id
        if bool(done.all()):
            break
        x = torch.cat([x, tok[:, None]], dim=1)
    return [Sample(tuple(a), tuple(b)) for a, b in zip(ids, logps, strict=True)]
