"""Bring your own model: local HF directories of two architecture families, hub ids from the local
cache only, and the layout check an inference node runs against a channel's weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.engines.base import SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError
from pulsenet.nodes.common import initial_model, text_codec
from pulsenet.rl.models import (
    bf16_state_dict,
    check_layout_matches,
    model_hf_config,
    resolve_model,
    served_layout,
)
from tests.support.model_dirs import (
    gpt2_config,
    gpt2_dir,
    llama_config,
    llama_dir,
    model_dir,
    smollm2_tokenizer,
)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_local_directory_is_a_model(tmp_path: Path, family: str) -> None:
    path = (llama_dir if family == "llama" else gpt2_dir)(tmp_path / family)
    name = str(path)
    assert resolve_model(name).path == path and resolve_model(name).has_tokenizer
    config = model_hf_config(resolve_model(name))
    assert config.model_type == family
    codec = text_codec(name)
    assert codec.eos_id == smollm2_tokenizer().eos_token_id and codec.decode(codec.encode("12+34=")) == "12+34="
    model = initial_model(name)  # the trainer's start: the directory's FP32 weights
    assert next(model.parameters()).dtype == torch.float32
    state = bf16_state_dict(model)
    check_layout_matches(config, state)  # an inference node's architecture fits the channel
    assert list(served_layout(config)) == list(state)
    engine = TorchEngine.from_state(
        config, state, model_digest(state), version=0, config=TorchEngineConfig(device="cpu"), decode=codec.decode
    )
    out = engine.generate([codec.encode("Hello")] * 2, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3))
    assert all(g.digest == model_digest(state) and 1 <= len(g.completion_ids) <= 6 for g in out)


def test_bad_model_settings_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="none of these"):
        resolve_model("./no/such/dir")
    with pytest.raises(ConfigError, match="hf download org/absent"):
        resolve_model("org/absent", hub_cache=tmp_path / "hub")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "weights.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"no config.json.*weights.bin"):
        resolve_model(str(tmp_path / "empty"))
    bare = model_dir(tmp_path / "bare", llama_config(smollm2_tokenizer()), None)  # no tokenizer files
    assert model_hf_config(resolve_model(str(bare))).model_type == "llama"
    with pytest.raises(ConfigError, match="no tokenizer files"):
        text_codec(str(bare))
    odd = tmp_path / "odd"
    shutil.copytree(bare, odd)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "model_type": "no-such-arch"}))
    with pytest.raises(ConfigError, match="cannot read"):
        model_hf_config(resolve_model(str(odd)))
    small = model_dir(tmp_path / "small", llama_config(smollm2_tokenizer(), vocab_size=1000), smollm2_tokenizer())
    with pytest.raises(ConfigError, match=r"49152 tokens.*1000"):
        text_codec(str(small))


def test_a_hub_id_resolves_from_the_local_cache_only(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    llama_dir(repo / "snapshots" / ("0" * 40))
    ref = resolve_model("org/tiny-llama", hub_cache=hub)
    assert ref.path == repo / "snapshots" / ("0" * 40) and ref.has_tokenizer
    with pytest.raises(ConfigError, match="local Hugging Face cache"):
        resolve_model("org/tiny-gpt2", hub_cache=hub)


def test_a_model_that_does_not_match_the_channel_names_the_tensor() -> None:
    tok = smollm2_tokenizer()
    llama, gpt2 = llama_config(tok), gpt2_config(tok)
    state = {n: torch.zeros(s, dtype=d) for n, (s, d) in served_layout(llama).items()}
    check_layout_matches(llama, state)
    with pytest.raises(ConfigError, match=r"tensor transformer\.wte\.weight .* is missing"):
        check_layout_matches(gpt2, state)  # another family: its first tensor is not there
    wider = llama_config(tok, intermediate_size=96)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight is .*\(64, 32\) in the channel.*\(96, 32\)"):
        check_layout_matches(wider, state)
    fp32 = {**state, "model.norm.weight": state["model.norm.weight"].float()}
    with pytest.raises(ConfigError, match=r"model\.norm\.weight is torch\.float32"):
        check_layout_matches(llama, fp32)
    with pytest.raises(ConfigError, match=r"tensor lm_head\.weight in the channel is not in the model"):
        check_layout_matches(llama, {**state, "lm_head.weight": state["model.embed_tokens.weight"]})  # untied
