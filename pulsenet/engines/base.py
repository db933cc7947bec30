"""The one interface every inference engine offers: sample completions, say which weights served
them, take a verified update.

An engine serves exactly one verified policy version at a time. ``update`` is how a PULSESync
``Subscriber`` hands it new weights (``on_update(version, state, digest)`` has the same shape):
a full BF16 state dict by name, already SHA-256 verified. An engine never applies an update in the
middle of a batch; every ``Generation`` names the version and digest that produced it, which is what
a rollout row records and what a trainer checks against the published digest.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Literal

import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import EngineError
from pulsenet.rl.draw import choose
from pulsenet.rl.sampling import SamplingParams

FinishReason = Literal["stop", "length"]

__all__ = [
    "Engine", "EngineStats", "FinishReason", "Generation", "SamplingParams", "check_layout", "draw_token", "same_bits"
]  # fmt: skip
"""``SamplingParams`` lives in rl/sampling.py (rl sits below engines and builds its params); it
is re-exported here, where every engine's ``generate`` takes it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One completion and the weights that produced it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each completion token under the *temperature-scaled* distribution
    ``log_softmax(logits / temperature)``, taken before top-p truncation: the distribution a trainer
    recomputes with the same temperature for its importance ratios (GRPO). Greedy decoding
    (temperature 0) records ``log_softmax(logits)``."""
    finish_reason: FinishReason
    """``"stop"``: an EOS or stop token ended it (and is its last token); ``"length"``: max_new_tokens."""
    version: int | None
    """Policy version served while this completion was sampled (None: weights not from a channel)."""
    digest: str
    """Model digest (codec/digest.py) of those weights."""
    seed: int
    """The seed of this completion's own generator (``SamplingParams.seed + index``)."""
    spans_update: bool = False
    """An update went live while this completion was sampled (vLLM ``in_flight="keep"``): its
    later tokens come from newer weights than ``version``'s, so no replay under one version can
    pass it (rl/replay.py); an inference node discards a batch holding one."""

    def to_rollout(self, *, group: str, reward: float, node: str) -> Rollout:
        """The rollout row (codec/rollout.py) for this completion, once it is scored."""
        if self.version is None:
            raise EngineError("a rollout needs a policy version: serve weights from the channel first")
        return Rollout(
            group=group,
            prompt_ids=self.prompt_ids,
            completion_ids=self.completion_ids,
            logprobs=self.logprobs,
            reward=float(reward),
            version=self.version,
            model_digest=self.digest,
            node=node,
            seed=self.seed,
        )


@dataclass(slots=True)
class EngineStats:
    updates: int = 0
    """Updates applied."""
    update_apply_s: list[float] = field(default_factory=list)
    """Wall time of each applied update: compare, copy, verify (newest last, bounded)."""
    tensors_copied: int = 0
    """Tensors rewritten by updates, over all updates (unchanged ones are never copied)."""
    bytes_copied: int = 0
    """BF16 bytes of those tensors (vLLM: what was handed to its workers, whole layers)."""
    bytes_last_update: int = 0
    """``bytes_copied`` by the last update alone."""
    updates_failed: int = 0
    """Deferred updates that failed when applied (logged); the previous weights kept serving unless
    the digest check failed, which stops generation until a verified update."""
    deferred_updates: int = 0
    """Updates that arrived during a batch and waited for it to end."""
    superseded_updates: int = 0
    """Deferred updates replaced by a newer one before they were applied."""
    mixed_version_completions: int = 0
    """Completions during which an update went live (vLLM ``in_flight="keep"`` only); labelled with
    the version that started them and flagged ``Generation.spans_update``."""
    batches: int = 0
    completions: int = 0
    tokens_generated: int = 0
    generate_s: float = 0.0
    """Wall time inside ``generate`` batches (excluding update application)."""

    def record_update(self, seconds: float, keep: int = 1000) -> None:
        self.updates += 1
        self.update_apply_s.append(seconds)
        del self.update_apply_s[:-keep]


class Engine(abc.ABC):
    """Samples completions from the verified weights it serves."""

    stats: EngineStats

    @property
    @abc.abstractmethod
    def version(self) -> int | None:
        """Policy version being served (None before any update from a channel)."""

    @property
    @abc.abstractmethod
    def digest(self) -> str:
        """Model digest of the weights being served."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """One completion per prompt, in order; repeat a prompt G times for a group of G."""

    @abc.abstractmethod
    def update(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        digest: str,
        *,
        changed: Set[str] | None = None,
    ) -> None:
        """Serve ``state`` (verified BF16 weights by name, hashing to ``digest``) as ``version``.

        Never applied mid-batch: an update that arrives during ``generate`` is applied when that
        batch ends. ``changed``: the names that may differ from the served weights (a hint that spares
        comparing the others; a wrong hint fails the digest check). Safe as a Subscriber's ``on_update``.
        """

    @abc.abstractmethod
    def served_state(self) -> dict[str, torch.Tensor]:
        """A copy of the served BF16 weights by name, in HF coordinates (what a digest checks)."""

    @abc.abstractmethod
    def weights_digest(self) -> str:
        """The model digest recomputed from what the engine serves (slow: hashes every tensor)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the engine holds beyond memory (processes, threads)."""

    def release_shared_state(self) -> None:
        """Drop any reference to the tensors of the state last handed in (construction or ``update``),
        whose owner is about to replace them in place (a Subscriber's rebuild): held here, the old
        tensors would stay resident beside the new ones. The next ``update`` hands a state again.
        Default: nothing (an engine that copies what it is handed holds none)."""
        return None

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The weight tensors this engine holds in the node's own process, by holder (a node's
        ``/status`` ``memory`` counts each storage once, so a tensor shared with the node's verified
        state is not counted twice)."""
        return {}


def check_layout(served: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """An update must name exactly the served tensors with their shapes and dtypes (EngineError)."""
    if state.keys() != served.keys():
        missing = sorted(served.keys() - state.keys())[:5]
        extra = sorted(state.keys() - served.keys())[:5]
        raise EngineError(f"update does not match the served model: missing {missing}, unexpected {extra}")
    for name, t in state.items():
        mine = served[name]
        if t.shape != mine.shape or t.dtype != mine.dtype:
            raise EngineError(
                f"update tensor {name}: {t.dtype} {tuple(t.shape)}, served {mine.dtype} {tuple(mine.shape)}"
            )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a served (host, BF16) tensor and an update's hold the same bits (-0.0 != 0.0)."""
    b = b.detach().cpu()
    if a.is_floating_point() and a.element_size() == 2:
        return torch.equal(a.view(torch.int16), b.view(torch.int16))
    return torch.equal(a, b)


def draw_token(
    logits: torch.Tensor, u: Sequence[float], temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of each row of ``logits`` ``[rows, vocab]`` by the public draw's rule
    (``rl.draw.choose``) for the row's uniform ``u``, and its log-prob under
    ``log_softmax(logits / T)`` in FP32, before top-p (greedy: T = 1): what every engine samples
    and records (``Generation.logprobs``), the torch engine's sampler and vLLM's logits processor alike."""
    logits = logits.float()
    tok = choose(logits, u, temperature, top_p)
    logp = torch.log_softmax(logits if temperature == 0 else logits / temperature, dim=-1)
    return tok, logp.gather(1, tok[:, None])[:, 0]
