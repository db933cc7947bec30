"""What every node builds the same way: models and their text codec, tasks, stores, keys, key maps."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from transformers import PretrainedConfig, PreTrainedModel

from pulsenet.errors import ConfigError
from pulsenet.rl.models import (
    BYTE_EOS,
    BYTE_PAD,
    load_model,
    load_tokenizer,
    smollm2_checkpoint,
    tiny_qwen2_config,
)
from pulsenet.rl.tasks import ArithmeticTask, ChainTask, FewShotTask, JsonlTask, RewardTask
from pulsenet.rl.warmup import WARMUP_STEPS, tiny_task, warm_tiny_model
from pulsenet.signing import key_id, load_public_key
from pulsenet.store import S3Config, open_store
from pulsenet.store.base import ObjectStore

MODELS = ("tiny", "smollm2")


@dataclass(frozen=True, slots=True)
class TextCodec:
    """Text <-> token ids for a model: byte-level for the tiny model, the HF tokenizer for SmolLM2."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int
    pad_id: int


def text_codec(model: str) -> TextCodec:
    if model == "tiny":
        return TextCodec(
            encode=lambda s: list(s.encode("utf-8")),
            decode=lambda ids: bytes(i for i in ids if 0 <= i < 256).decode("utf-8", "replace"),
            eos_id=BYTE_EOS,
            pad_id=BYTE_PAD,
        )
    if model == "smollm2":
        tok = load_tokenizer(smollm2_checkpoint())
        eos = int(tok.eos_token_id)
        return TextCodec(
            encode=lambda s: tok.encode(s, add_special_tokens=False),
            decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
            eos_id=eos,
            pad_id=int(tok.pad_token_id) if tok.pad_token_id is not None else eos,
        )
    raise ConfigError(f"model must be one of {MODELS}, got {model!r}")


def model_config(model: str) -> PretrainedConfig:
    """The architecture an inference node builds before the first verified weights arrive."""
    if model == "tiny":
        return tiny_qwen2_config()
    if model == "smollm2":
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(smollm2_checkpoint(), local_files_only=True)
    raise ConfigError(f"model must be one of {MODELS}, got {model!r}")


CACHE_DIR = Path("~/.cache/pulsenet")
"""Where derived models are cached (the tiny warm-up, keyed by everything it depends on; SmolLM2's
conversion lives in its own default directory)."""


def initial_model(
    model: str, cache_dir: Path | None = None, seed: int = 0, warmup_steps: int = WARMUP_STEPS
) -> PreTrainedModel:
    """The FP32 policy a run starts from: the warmed-up tiny model (cached), or SmolLM2-135M-Instruct."""
    if model == "tiny":
        return warm_tiny_model((cache_dir or CACHE_DIR).expanduser(), steps=warmup_steps, seed=seed)
    if model == "smollm2":
        return load_model(smollm2_checkpoint(), dtype=torch.float32)
    raise ConfigError(f"model must be one of {MODELS}, got {model!r}")


SHOTS = 4
"""Solved examples before every ``arith-shots`` prompt."""
SHOTS_MAX_OPERAND = 9
"""``arith-shots`` problems are ``a±b`` with single digits: SmolLM2-135M's sampled reward starts
between 0 and 1 (docs/results/loco-grpo-smollm2-2026-12-01.md), so GRPO's groups are not flat."""


def make_task(name: str, seed: int) -> RewardTask:
    """``arith`` (single-digit +/-: what the tiny model is warmed up on), ``arith-shots`` (the same
    after four solved examples, one per line: what a pretrained model answers; pair it with a
    newline stop), ``chain`` (multi-step), or a ``.jsonl`` file of ``{"problem", "answer"}`` rows
    (MATH/GSM8K style)."""
    if name == "arith":
        return tiny_task(seed)
    if name == "arith-shots":
        return FewShotTask(ArithmeticTask(seed, max_operand=SHOTS_MAX_OPERAND), k=SHOTS, seed=seed)
    if name == "chain":
        return ChainTask(seed)
    if name.endswith(".jsonl"):
        return JsonlTask.load(name)
    raise ConfigError(f"task must be arith, arith-shots, chain or a .jsonl file, got {name!r}")


def open_site_store(url: str, *, link_mbps: float | None = None) -> ObjectStore:
    """A store with the site's credentials from the environment (AWS_* variables)."""
    return open_store(url, S3Config.from_env(link_mbps=link_mbps))


def key_map(entries: Iterable[str], what: str) -> dict[str, dict[str, Ed25519PublicKey]]:
    """``id -> {key id: public key}`` from ``ID=PATH`` entries (or a bare ``PATH`` whose file stem,
    before any ``.key``, is the id): a slot accepts only the keys listed for its own id."""
    out: dict[str, dict[str, Ed25519PublicKey]] = {}
    for entry in entries:
        ident, sep, path = str(entry).partition("=")
        if not sep:
            path = ident
            ident = Path(path).name.split(".")[0]
        key = load_public_key(path)
        out.setdefault(ident, {})[key_id(key)] = key
    if not out:
        raise ConfigError(f"no trusted {what} keys given (ID=PATH.pub)")
    return out


def site_map(entries: Iterable[str], what: str) -> dict[str, str]:
    """``id -> store URL`` from ``ID=URL`` entries."""
    out = {}
    for entry in entries:
        ident, sep, url = str(entry).partition("=")
        if not sep or not ident or not url:
            raise ConfigError(f"{what} entries are ID=STORE_URL, got {entry!r}")
        out[ident] = url
    return out


@contextlib.contextmanager
def stop_on_signals(stop: asyncio.Event) -> Iterable[None]:
    """SIGTERM / SIGINT set ``stop``: the node finishes or abandons its step cleanly, then exits."""
    loop = asyncio.get_running_loop()
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield
    finally:
        for sig in sigs:
            loop.remove_signal_handler(sig)
