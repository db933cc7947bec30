"""A minimal reference sampler: the G completions of one prompt, no KV cache. For tests and warm-up checks.

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

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""``[rows, tokens]`` int64 ids → ``[rows, tokens, vocab]`` logits (causal, no padding)."""


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
