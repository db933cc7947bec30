"""Prompts: from a problem's text to the token ids an engine sees, and from completion ids back to text.

``TextCodec`` is a model's text <-> ids (byte-level for the tiny model, else its HF tokenizer).
``Prompter`` applies a task's prompt settings (``PromptConfig``):

- ``template = "plain"``: the problem text as is (the tokenizer adds its BOS if it has one);
  ``"chat"``: the tokenizer's chat template (``apply_chat_template``) on one user turn, after an
  optional system prompt, with the generation prompt appended;
- ``max_prompt_tokens``: a longer prompt is dropped and counted (``PromptStats.dropped``), never
  truncated; so is one whose prompt plus ``max_new_tokens`` exceeds the model's positions;
- ``stop``: strings that end a completion. Engines stop when the decoded completion contains one
  (the tokens that completed it are kept: the trainer learns to emit them); rewards see the text
  before it (``completion_text``). A stop string is matched on text, not on token ids, because a
  tokenizer may merge it with its neighbours (SmolLM2: "\\n\\n" alone is one token, in "a.\\n\\nb" two).

The inference node and the trainer build the same Prompter from the same settings: the trainer
recomputes a rollout's prompt ids and must find the ones the node sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pulsenet.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from pulsenet.rl.sampling import SamplingParams

BYTE_EOS = 10
BYTE_PAD = 0


@dataclass(frozen=True, slots=True)
class TextCodec:
    """Text <-> token ids for a model: byte-level for the tiny model, else its HF tokenizer."""

    encode: Callable[[str], list[int]]
    """Plain text to ids, no special tokens added."""
    decode: Callable[[Sequence[int]], str]
    """Ids to text, special tokens dropped."""
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...] = ()
    """Every id that ends a turn: the tokenizer's EOS and the model's (generation) EOS ids."""
    tokenizer: PreTrainedTokenizerBase | None = None
    """None for the byte-level tiny model."""


def byte_codec() -> TextCodec:
    """The tiny model's codec: token id = UTF-8 byte, ``\\n`` ends an answer."""
    return TextCodec(
        encode=lambda s: list(s.encode("utf-8")),
        decode=lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace"),
        eos_id=BYTE_EOS,
        pad_id=BYTE_PAD,
        stop_ids=(BYTE_EOS,),
    )


def tokenizer_codec(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig | None = None) -> TextCodec:
    """A HF tokenizer's codec; ``config`` adds the model's own EOS ids (a chat model may end turns
    with a token that is not the tokenizer's EOS, e.g. Llama 3's ``<|eot_id|>``)."""
    ids: list[int] = []
    for eos in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        for i in eos if isinstance(eos, list | tuple) else [eos]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ConfigError("the tokenizer and the model config name no EOS token: completions could never stop")
    eos = ids[0]
    pad = tokenizer.pad_token_id
    return TextCodec(
        encode=lambda s: tokenizer.encode(s, add_special_tokens=False),
        decode=lambda ids_: tokenizer.decode(list(ids_), skip_special_tokens=True),
        eos_id=eos,
        pad_id=int(pad) if pad is not None else eos,
        stop_ids=tuple(ids),
        tokenizer=tokenizer,
    )


@dataclass(kw_only=True, slots=True)
class PromptConfig:
    template: Literal["plain", "chat"] = "plain"
    """plain: the problem text; chat: the tokenizer's chat template on one user turn."""
    system_prompt: str = ""
    """With template chat: a system turn before the problem (empty: none, or the template's default)."""
    max_prompt_tokens: int = 1024
    """Longer prompts are dropped (counted), never truncated."""
    max_new_tokens: int = 256
    """Completion tokens at most."""
    stop: tuple[str, ...] = ()
    """Strings that end a completion (besides EOS)."""

    def __post_init__(self) -> None:
        if self.template not in ("plain", "chat"):
            raise ConfigError(f"template must be plain or chat, got {self.template!r}")
        if self.max_prompt_tokens < 1 or self.max_new_tokens < 1:
            raise ConfigError("max_prompt_tokens and max_new_tokens must be >= 1")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must not be empty")
        self.stop = tuple(self.stop)


@dataclass(slots=True)
class PromptStats:
    built: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    """Reason -> prompts dropped: ``prompt_too_long`` (over max_prompt_tokens), ``context_too_long``
    (prompt + max_new_tokens over the model's positions)."""


class Prompter:
    """A task's prompt settings applied with one model's codec; see the module docstring."""

    def __init__(self, codec: TextCodec, config: PromptConfig, *, max_positions: int | None = None) -> None:
        self.codec, self.config, self.max_positions = codec, config, max_positions
        self.stats = PromptStats()
        if max_positions is not None and min(config.max_prompt_tokens, max_positions - config.max_new_tokens) < 1:
            # Every prompt would be dropped, each batch logged and nothing trained: say so at start.
            raise ConfigError(
                f"task max_new_tokens = {config.max_new_tokens} leaves no room for a prompt in the model's "
                f"context (max_position_embeddings = {max_positions}): every prompt would be dropped; "
                f"set max_new_tokens below {max_positions} (e.g. --max-new-tokens {max(1, max_positions // 4)})"
            )
        tok = codec.tokenizer
        if config.template == "chat":
            if tok is None:
                raise ConfigError("template chat needs a tokenizer; the tiny model is byte-level (use plain)")
            if not getattr(tok, "chat_template", None):
                raise ConfigError("template chat: this tokenizer has no chat template (use plain)")
        elif config.system_prompt:
            raise ConfigError("system_prompt needs template chat")

    def text(self, prompt: str) -> str:
        """The prompt as the model reads it (after the template)."""
        if self.config.template == "plain":
            return prompt
        messages = [{"role": "user", "content": prompt}]
        if self.config.system_prompt:
            messages.insert(0, {"role": "system", "content": self.config.system_prompt})
        assert self.codec.tokenizer is not None
        return self.codec.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def ids(self, prompt: str) -> list[int]:
        """Token ids of ``text(prompt)``, limits not applied."""
        tok = self.codec.tokenizer
        if tok is None:
            return self.codec.encode(prompt)
        if self.config.template == "chat":  # the template writes its own special tokens
            return tok.encode(self.text(prompt), add_special_tokens=False)
        return tok.encode(prompt, add_special_tokens=True)

    def drop_reason(self, ids: Sequence[int]) -> str | None:
        """Why a prompt of ``ids`` is dropped (``prompt_too_long``, ``context_too_long``), or None;
        nothing counted: what a trainer asks to know which assigned problems a node must leave out."""
        if len(ids) > self.config.max_prompt_tokens:
            return "prompt_too_long"
        if self.max_positions is not None and len(ids) + self.config.max_new_tokens > self.max_positions:
            return "context_too_long"
        return None

    def encode(self, prompt: str) -> list[int] | None:
        """The prompt's ids, or None (counted in ``stats.dropped``) when it is over a limit."""
        ids = self.ids(prompt)
        reason = self.drop_reason(ids)
        if reason is not None:
            self.stats.dropped[reason] = self.stats.dropped.get(reason, 0) + 1
            return None
        self.stats.built += 1
        return ids

    def sampling_params(self, *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0) -> SamplingParams:
        """The engine's params for this task: max_new_tokens, EOS ids and stop strings."""
        from pulsenet.rl.sampling import SamplingParams

        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=self.config.max_new_tokens,
            stop_token_ids=self.codec.stop_ids,
            stop=self.config.stop,
            seed=seed,
        )

    def stopped(self, completion_ids: Sequence[int]) -> bool:
        """Whether a completion's decoded text holds one of the task's stop strings (what ends an
        engine's completion early, as the engines decode it: stop tokens included)."""
        text = self.codec.decode(list(completion_ids))
        return any(s in text for s in self.config.stop)

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        """What rewards judge: the decoded completion without EOS ids, cut before the first stop string."""
        stops = set(self.codec.stop_ids)
        text = self.codec.decode([t for t in completion_ids if t not in stops])
        return cut_at_stop(text, self.config.stop)


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
    return text[:cut]
