"""The vLLM worker extension: runs inside every vLLM worker process, applies changed tensors in place.

vLLM mixes this class into its GPU worker (``worker_extension_cls``), so the methods below see the
worker's ``self.model_runner`` and ``self.device``; ``collective_rpc`` calls them on every worker
(each tensor-parallel rank). This module imports nothing from vLLM, so vLLM can import it by
qualified name in a fresh worker process and the tests can drive it with a stand-in model.

Why ``load_weights`` and not ``param.copy_``: the runtime tensors are not the HF tensors. vLLM fuses
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, and under tensor
parallelism each rank holds a shard. The model's own ``load_weights`` maps every HF name to its
slot in the fused, sharded parameter, exactly as at start-up, and copies in place, so captured
CUDA graphs stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Weights = Sequence[tuple[str, torch.Tensor]]


class PulsenetWorkerExtension:
    """Methods ``VLLMEngine`` calls through ``collective_rpc``."""

    model_runner: object
    device: torch.device

    def pulsenet_load_weights(self, weights: Weights) -> int:
        """Load HF-named tensors (host BF16) into the running model in place; returns how many."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = getattr(self, "device", None) or next(model.parameters()).device
        model.load_weights(weights=((name, t.to(device, non_blocking=True)) for name, t in weights))
        if torch.cuda.is_available() and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return len(weights)

    def pulsenet_parameter_names(self) -> list[str]:
        """Runtime (vLLM) parameter names of this rank, for diagnostics."""
        return [name for name, _ in self.model_runner.model.named_parameters()]  # type: ignore[attr-defined]
