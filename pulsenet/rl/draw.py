"""The public draw: the randomness every engine samples with, and nobody chooses (docs/format.md).

A rollout is worth training on only if the policy sampled it. pulsenet makes that checkable: the
uniform each completion token is drawn with is a counter-based PRF of public data, and the token
is a fixed function of that uniform and the policy's distribution. A trainer that holds the
version's weights (PULSESync makes them bit-identical to the node's) recomputes the distribution
in its own forward and checks that the token a row claims is the one the uniform selects
(``rl/replay.py``). Nothing here is secret; what matters is that the node cannot vary it.

The rule, for completion ``c`` of problem ``p`` of batch ``(v, b)`` a node answers in run ``run``
with weights of digest ``d``:

    key      = SHA-256("pulsenet-draw-v1" || JSON [run, d, node, v, b, p, c])      (32 bytes)
    u_t      = (first 8 bytes of SHA-256(key || t as u64 little-endian), as u64 LE) >> 11) · 2^-53
    q        = softmax(logits_t / T) in FP64 over the vocabulary, in token-id order;
               with top-p < 1, the tokens outside the nucleus (sorted by probability, stable,
               keeping each token whose more likely tokens hold less than top-p) get q = 0
    token_t  = the first id i with cumsum(q)[i] > u_t · sum(q)   (never a token with q = 0)

Token-id order, not probability order: a CDF over a fixed order moves only by the kernel noise in
the probabilities, so a trainer's forward lands on the same token except within a small window
around a CDF boundary (the tolerance ``rl.replay`` allows and measures). Greedy (T = 0) draws
nothing: the token is the argmax.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

DOMAIN = b"pulsenet-draw-v1"
"""Domain separation of the draw key: no other SHA-256 in pulsenet starts with it."""
_SCALE = 2.0**-53


@dataclass(frozen=True, slots=True)
class DrawId:
    """The public data that fixes one completion's uniforms: what a node answers, never how."""

    run: str
    digest: str
    """The model digest of the version that serves the batch (PULSESync's SHA-256)."""
    node: str
    version: int
    batch: int
    """The trainer-assigned batch number at ``version`` (``rl.tasks.Assignment``)."""
    prompt: int
    """The problem's index in the batch (``rl.tasks.group_id``)."""
    completion: int
    """The completion's index in its group, 0..G-1, in the batch's row order."""

    def key(self) -> bytes:
        fields = [self.run, self.digest, self.node, self.version, self.batch, self.prompt, self.completion]
        return hashlib.sha256(DOMAIN + json.dumps(fields, separators=(",", ":")).encode()).digest()


def seed_key(seed: int) -> bytes:
    """The draw key of an engine call that names no public draw (evals, tests, benches): a pure
    function of its seed, so the same call samples the same tokens on every engine."""
    return hashlib.sha256(DOMAIN + b"seed:" + str(seed).encode()).digest()


def uniform(key: bytes, position: int) -> float:
    """u_t in [0, 1): 53 bits of SHA-256(key || position), exactly representable as a float64."""
    h = hashlib.sha256(key + position.to_bytes(8, "little")).digest()
    return (int.from_bytes(h[:8], "little") >> 11) * _SCALE


def uniforms(key: bytes, start: int, stop: int) -> list[float]:
    """u_t for positions ``start <= t < stop``."""
    return [uniform(key, t) for t in range(start, stop)]


def draw_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """q of the rule (FP64, token-id order, unnormalised outside the nucleus is 0): ``[..., vocab]``."""
    q = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_q, order = q.sort(dim=-1, descending=True, stable=True)
        before = sorted_q.cumsum(dim=-1) - sorted_q  # mass of the more likely tokens
        sorted_q = sorted_q.masked_fill(before >= top_p, 0.0)  # the most likely token always stays
        q = torch.zeros_like(q).scatter(-1, order, sorted_q)
    return q


def choose(logits: torch.Tensor, u: Sequence[float] | torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The rule: one token per row of ``logits`` ``[rows, vocab]`` for the row's uniform ``u``."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    q = draw_probs(logits, temperature, top_p)
    cdf = q.cumsum(dim=-1)
    target = torch.as_tensor(u, dtype=torch.float64, device=cdf.device)[:, None] * cdf[:, -1:]
    tok = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = q.shape[-1] - 1 - (q > 0).flip(-1).to(torch.int8).argmax(dim=-1)  # the last id with q > 0
    return torch.minimum(tok, last)


def boundary_margin(
    logits: torch.Tensor, tokens: torch.Tensor, u: torch.Tensor, temperature: float, top_p: float
) -> torch.Tensor:
    """How far inside its CDF interval each claimed token's uniform lies, in probability mass.

    ``logits`` ``[n, vocab]`` (one row per position), ``tokens`` and ``u`` ``[n]``. For token i the
    interval is [cumsum(q)[i-1], cumsum(q)[i]) / sum(q); the margin is min(u - lo, hi - u): positive
    when the rule picks token i, negative by how much it misses otherwise. A trainer whose
    forward differs from the engine's only by kernel noise sees margins > -tolerance for honest
    tokens (``rl.replay``); a token the rule did not pick misses by a distance of the order of the
    probabilities around it."""
    q = draw_probs(logits, temperature, top_p)
    z = q.sum(dim=-1)
    hi = q.cumsum(dim=-1).gather(-1, tokens[:, None].long())[:, 0]
    lo = hi - q.gather(-1, tokens[:, None].long())[:, 0]
    t = u.double().to(q.device) * z
    return (torch.minimum(t - lo, hi - t) / z).float()
