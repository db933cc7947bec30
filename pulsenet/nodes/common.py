"""What every node builds the same way and rl/ does not know: the starting model and its text codec,
the site's stores, key maps, the stop signals. (Tasks: ``rl.tasks.build_task``; a model's
architecture: ``rl.models.model_hf_config``.)"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterable
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from transformers import PreTrainedModel

from pulsenet.errors import ConfigError
from pulsenet.rl.models import (
    load_initial_model,
    model_hf_config,
    model_tokenizer,
    resolve_model,
)
from pulsenet.rl.prompts import TextCodec, byte_codec, tokenizer_codec
from pulsenet.rl.warmup import WARMUP_STEPS, warm_tiny_model
from pulsenet.signing import key_id, load_public_key
from pulsenet.store import S3Config, open_store
from pulsenet.store.base import ObjectStore


def text_codec(model: str) -> TextCodec:
    """Byte-level for ``tiny``; else the model directory's tokenizer (ConfigError if it has none, or
    if it has more tokens than the model's embedding)."""
    ref = resolve_model(model)
    if ref.path is None:
        return byte_codec()
    config = model_hf_config(ref)
    tok = model_tokenizer(ref)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise ConfigError(f"model {model!r}: the tokenizer has {len(tok)} tokens, the model's embedding only {vocab}")
    return tokenizer_codec(tok, config)


CACHE_DIR = Path("~/.cache/pulsenet")
"""Where derived models are cached (the tiny warm-up, keyed by everything it depends on; SmolLM2's
conversion lives in its own default directory)."""


def initial_model(
    model: str, cache_dir: Path | None = None, seed: int = 0, warmup_steps: int = WARMUP_STEPS
) -> PreTrainedModel:
    """The FP32 policy a run starts from: the warmed-up tiny model (cached), or the weights of
    SmolLM2-135M-Instruct, a Hugging Face directory or a cached hub id."""
    if model == "tiny":
        return warm_tiny_model((cache_dir or CACHE_DIR).expanduser(), steps=warmup_steps, seed=seed)
    return load_initial_model(resolve_model(model))


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
