"""Inference engines: sample completions from verified weights and take PULSESync updates in place.

``TorchEngine`` (transformers, CPU and CUDA) is the default; ``VLLMEngine`` (extra ``vllm``) lives in
``pulsenet.engines.vllm_engine`` and imports vLLM only when it is built.
"""

from pulsenet.engines.base import Engine, EngineStats, Generation, SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig

__all__ = ["Engine", "EngineStats", "Generation", "SamplingParams", "TorchEngine", "TorchEngineConfig"]
