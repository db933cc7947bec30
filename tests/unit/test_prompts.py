"""Prompts: plain text or the tokenizer's chat template, limits that drop (and count) instead of
truncating, and stop strings matched on text by the engine and cut before the rewards see them."""

from __future__ import annotations

import pytest
import torch

from pulsenet.engines.base import SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError, EngineError
from pulsenet.rl.models import build_tiny_model
from pulsenet.rl.prompts import PromptConfig, Prompter, byte_codec, cut_at_stop, tokenizer_codec
from tests.support.model_dirs import smollm2_tokenizer


def test_plain_and_chat_templates() -> None:
    tok = smollm2_tokenizer()
    codec = tokenizer_codec(tok)
    plain = Prompter(codec, PromptConfig())
    assert plain.ids("12+34=") == tok("12+34=").input_ids
    chat = Prompter(codec, PromptConfig(template="chat", system_prompt="Answer with a number."))
    text = chat.text("12+34=")
    assert text.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\n12+34=")
    assert text.endswith("<|im_start|>assistant\n")
    ids = chat.ids("12+34=")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.decode(ids) == text  # specials once
    assert "SmolLM" in Prompter(codec, PromptConfig(template="chat")).text("x")  # the template's default system turn
    with pytest.raises(ConfigError, match="byte-level"):
        Prompter(byte_codec(), PromptConfig(template="chat"))
    with pytest.raises(ConfigError, match="needs template chat"):
        Prompter(codec, PromptConfig(system_prompt="x"))


def test_over_long_prompts_are_dropped_and_counted() -> None:
    p = Prompter(byte_codec(), PromptConfig(max_prompt_tokens=6, max_new_tokens=4), max_positions=9)
    assert p.encode("12+34=") is None  # 6 + 4 > 9 positions
    assert p.encode("1+2=") == list(b"1+2=")
    assert p.encode("123+456=") is None
    assert p.stats.built == 1 and p.stats.dropped == {"context_too_long": 1, "prompt_too_long": 1}


def test_stop_strings_end_completions_on_text() -> None:
    codec = byte_codec()
    eng = TorchEngine(build_tiny_model(0), TorchEngineConfig(device="cpu"), version=0, decode=codec.decode)
    free = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, stop_at_eos=False)
    prompts = [list(b"12+34=")] * 6
    unstopped = eng.generate(prompts, free)
    texts = [codec.decode(g.completion_ids) for g in unstopped]
    # a stop string made of two printable characters that the free samples contain somewhere
    pairs = [t[i : i + 2] for t in texts for i in range(1, len(t) - 1)]
    stop = max((p for p in pairs if p.isascii() and p.isprintable()), key=pairs.count)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=5, stop_at_eos=False, stop=(stop,))
    for g, free_g in zip(eng.generate(prompts, params), unstopped, strict=True):
        ids = free_g.completion_ids
        ends = [k for k in range(1, len(ids) + 1) if stop in codec.decode(ids[:k])]
        if ends:  # same seed: the same draws up to the token that completes the stop string, then the end
            assert g.completion_ids == ids[: ends[0]] and g.finish_reason == "stop"
            assert g.logprobs == free_g.logprobs[: ends[0]]
        else:
            assert g.completion_ids == ids and g.finish_reason == "length"
    assert any(stop in t for t in texts)
    prompter = Prompter(codec, PromptConfig(stop=(stop,)))
    assert prompter.completion_text(list(f"46{stop}junk".encode())) == "46"
    assert cut_at_stop("a;b.c", [".", ";"]) == "a"
    with pytest.raises(EngineError, match="decode"):
        TorchEngine(build_tiny_model(0), TorchEngineConfig(device="cpu")).generate(prompts, params)


def test_sampling_params_carry_the_task_settings() -> None:
    tok = smollm2_tokenizer()
    p = Prompter(tokenizer_codec(tok), PromptConfig(max_new_tokens=12, stop=("\n\n",)))
    sp = p.sampling_params(temperature=0.7, seed=4)
    assert (sp.max_new_tokens, sp.stop, sp.temperature, sp.seed) == (12, ("\n\n",), 0.7, 4)
    assert tok.eos_token_id in sp.stop_token_ids
    ids = [*tok("The answer is 4.\n\nNext").input_ids, tok.eos_token_id]
    assert p.completion_text(ids) == "The answer is 4."
    assert torch.tensor(ids).numel() == len(ids)
