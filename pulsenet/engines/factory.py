"""One way to build an inference engine: ``make_engine("torch" | "vllm", ...)`` from a channel's weights.

An inference node knows its ``model`` setting (architecture and tokenizer: ``rl.models.resolve_model``)
and receives its weights from PULSESync. ``make_engine`` checks that the first verified weights fit
the architecture (``check_layout_matches``: a ConfigError naming the first mismatching tensor) and
builds the engine serving them. Later versions go to ``engine.update(version, state, digest,
changed=names)`` with the names the verified patch changed, so no engine compares or rehashes the
others.

vLLM needs a model directory: a HF directory is used as it is (vLLM reads only its config and
tokenizer: the weights are pushed from the channel); the built-in tiny model gets its config written
to a temporary directory that lives as long as the engine.
"""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from pulsenet.engines.base import Engine
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError
from pulsenet.rl.models import ModelRef, check_layout_matches, model_hf_config, resolve_model
from pulsenet.rl.prompts import TextCodec

ENGINES = ("torch", "vllm")
EngineName = Literal["torch", "vllm"]


def make_engine(
    name: str,
    *,
    model: str | ModelRef,
    state: Mapping[str, torch.Tensor],
    digest: str,
    version: int | None = None,
    codec: TextCodec | None = None,
    torch_config: TorchEngineConfig | None = None,
    vllm_config: object | None = None,
) -> Engine:
    """The ``name`` engine serving ``state`` (verified BF16 weights hashing to ``digest``) as ``version``.

    ``codec``: the model's text codec, for stop strings. ``vllm_config``: a ``VLLMEngineConfig``.
    ConfigError for an unknown engine or weights that do not fit the model's architecture.
    """
    if name not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {name!r}")
    ref = model if isinstance(model, ModelRef) else resolve_model(model)
    hf_config = model_hf_config(ref)
    check_layout_matches(hf_config, state, what="the channel")
    if name == "torch":
        return TorchEngine.from_state(
            hf_config, state, digest, version=version, config=torch_config, decode=codec.decode if codec else None
        )
    from pulsenet.engines.vllm_config import VLLMEngineConfig
    from pulsenet.engines.vllm_engine import VLLMEngine

    if vllm_config is not None and not isinstance(vllm_config, VLLMEngineConfig):
        raise ConfigError("vllm_config must be a VLLMEngineConfig")
    tmp = None
    model_dir = ref.path
    if model_dir is None:  # the tiny model: vLLM reads its architecture from a directory
        tmp = tempfile.TemporaryDirectory(prefix="pulsenet-vllm-model-")
        hf_config.save_pretrained(tmp.name)
        model_dir = Path(tmp.name)
    engine = VLLMEngine(model_dir, vllm_config, state=state, version=version, digest=digest)
    if tmp is not None:  # removed with the engine (the finalizer holds it until then)
        weakref.finalize(engine, tmp.cleanup)
    return engine
