"""Inference engines: sample completions from verified weights and take PULSESync updates in place.

``TorchEngine`` (transformers, CPU and CUDA) is the default; ``VLLMEngine`` (extra ``vllm``) lives in
``pulsenet.engines.vllm_engine`` (its settings, ``VLLMEngineConfig``, in ``vllm_config``) and imports
vLLM only when it is built. ``make_engine(name, ...)``
(engines/factory.py) builds either from a channel's verified weights.
"""

from pulsenet.engines.base import Engine, EngineStats, Generation, SamplingParams
from pulsenet.engines.factory import ENGINES, make_engine
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig

__all__ = [
    "ENGINES",
    "Engine",
    "EngineStats",
    "Generation",
    "SamplingParams",
    "TorchEngine",
    "TorchEngineConfig",
    "make_engine",
]
