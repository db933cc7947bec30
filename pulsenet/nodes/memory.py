"""What a node holds in memory, by holder, against its budget (``/status`` ``memory``, issue 37).

Budgets are peak resident memory of the node's process, ``bytes_per_param x P + overhead``, P the
model's parameters (tied duplicates once):

- trainer, 24 B/P + 2 GiB: the FP32 master, its gradients and AdamW's two moments (16), one BF16
  published state (2), one FP32 forward model for replay and re-scoring (4), 2 for the step's
  transients; the replay's older versions are undo patches against the published state
  (rl/versions.py), not copies;
- inference node, torch engine: 6 B/P + 1.5 GiB: the engine's FP32 compute copy and one verified
  BF16 state (the subscriber's, which the engine compares against without a mirror of its own);
- inference node, vLLM engine: 2 B/P + 1.5 GiB in its own process (vLLM's engine core is another):
  the verified BF16 state, which the engine's host mirror shares.

The holders are counted by storage, each once (a tensor two holders share counts for the first),
so the sum is what the node really holds in weights; ``rss`` and ``peak_rss`` are the kernel's
(``VmRSS``, ``VmHWM`` of /proc/self/status; None where there is no /proc).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Budget:
    """Peak resident memory a node may reach: ``bytes_per_param`` x P + ``overhead`` bytes."""

    bytes_per_param: float
    overhead: int

    def limit(self, params: int) -> int:
        return int(self.bytes_per_param * params + self.overhead)


BUDGETS: dict[str, Budget] = {
    "trainer": Budget(24, 2 * GiB),
    "inference-torch": Budget(6, 3 * GiB // 2),
    "inference-vllm": Budget(2, 3 * GiB // 2),
}
"""By node kind: ``trainer``, ``inference-<engine>``."""


BESIDE: dict[str, Budget] = {
    "loco": Budget(18, 0),
    "vllm-engine": Budget(2, 7 * GiB // 2),
}
"""What a one-machine network holds beyond its nodes' own budgets (``network_need``, the preflight of
``pulsenet up``): ``loco``, a PULSELoCo trainer's outer state beside its inner loop (FP32 global
weights, Nesterov momentum and error feedback, the round's pseudo-gradient and average: 4 bytes a
parameter each, and the decoded peers' updates); 2026-12-07, two SmolLM2-135M trainers held 7.8 GB
each, 42 bytes a parameter + 2 GiB, when the OOM killer took them. ``vllm-engine``, vLLM's engine
core and worker processes beside a vLLM node's own: its copy of the weights (2), the CPU KV cache
(1 GiB by default), ~2 GiB of worker and ~0.7 GiB of engine-core runtime (3.5-3.7 GB and 0.67 GiB
at 0.35B, docs/results/memory-2026-12-06.md). On a GPU the weights and KV cache sit in GPU memory:
there this overcounts the host's."""


def budget_for(role: str, engine: str | None = None) -> Budget:
    return BUDGETS["trainer" if role == "trainer" else f"inference-{engine or 'torch'}"]


def proc_memory(pid: int | str = "self") -> dict[str, int] | None:
    """``rss`` and ``peak_rss`` (bytes) of a process from /proc (``VmRSS``, ``VmHWM``); None
    without /proc or once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return {"rss": int(fields["VmRSS"].split()[0]) * 1024, "peak_rss": int(fields["VmHWM"].split()[0]) * 1024}
    except (KeyError, ValueError, IndexError):
        return None


def held(holders: Mapping[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per holder, each storage counted once (for the first holder that has it); CPU only. A
    sharded parameter (FSDP2's DTensor, a torchrun site) counts its local shard; a tensor with no
    readable storage (a wrapper subclass) is left out rather than failing the node that asked."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in holders.items():
        total = 0
        for t in tensors:
            if t is None or t.device.type != "cpu":
                continue
            local = getattr(t, "to_local", None)  # DTensor: this rank's shard
            try:
                storage = (local() if callable(local) else t).untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
            except RuntimeError:
                continue
            if ptr in seen or size == 0:
                continue
            seen.add(ptr)
            total += size
        out[name] = total
    return out


def report(holders: Mapping[str, int], *, params: int | None, budget: Budget) -> dict[str, Any]:
    """The ``/status`` ``memory`` record: bytes per holder, the process's memory, the budget."""
    mem = proc_memory() or {}
    limit = None if params is None else budget.limit(params)
    return {
        "holders": dict(holders),
        "held": sum(holders.values()),
        "params": params,
        "rss": mem.get("rss"),
        "peak_rss": mem.get("peak_rss"),
        "budget": limit,
        "budget_formula": f"{budget.bytes_per_param:g} B/param + {budget.overhead / GiB:g} GiB",
        "within_budget": None if limit is None or "peak_rss" not in mem else mem["peak_rss"] <= limit,
    }


def meminfo(key: str = "MemAvailable") -> int | None:
    """A line of /proc/meminfo in bytes (``MemAvailable``: what can be had without swapping); None without it."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory() -> int | None:
    return meminfo("MemAvailable")


def network_need(params: int, trainers: int, inference: int, engine: str = "torch") -> int:
    """Peak memory of a one-machine network at its nodes' budgets, with what runs beside them
    (``BESIDE``: PULSELoCo's outer state when trainers > 1, vLLM's own processes); the store's is
    not counted."""
    trainer = BUDGETS["trainer"].limit(params) + (BESIDE["loco"].limit(params) if trainers > 1 else 0)
    node = budget_for("inference", engine).limit(params) + (BESIDE["vllm-engine"].limit(params) if engine == "vllm" else 0)
    return trainers * trainer + inference * node


def network_refusal(params: int, trainers: int, inference: int, engine: str, available: int) -> str | None:
    """Why a network of these nodes does not fit ``available`` bytes, with the flags that make it
    fit (fewer trainers first: each costs the most); None when it fits."""
    need = network_need(params, trainers, inference, engine)
    if need <= available:
        return None
    fits = [
        (t, i) for t in range(trainers, 0, -1) for i in range(inference, 0, -1)
        if network_need(params, t, i, engine) <= available
    ]  # fmt: skip
    t_b, i_b = BUDGETS["trainer"], budget_for("inference", engine)
    loco = f" + {BESIDE['loco'].bytes_per_param:g} for PULSELoCo's outer state" if trainers > 1 else ""
    v = BESIDE["vllm-engine"]
    beside = f", + {v.bytes_per_param:g} + {v.overhead / GiB:g} GiB for vLLM's own processes" if engine == "vllm" else ""
    why = (
        f"{trainers} trainer(s) and {inference} inference node(s) of a {params / 1e6:.1f}M-parameter model need up to "
        f"{need / GiB:.1f} GiB at peak (a trainer {t_b.bytes_per_param:g} bytes per parameter{loco} "
        f"+ {t_b.overhead / GiB:g} GiB, "
        f"an inference node with the {engine} engine {i_b.bytes_per_param:g} + {i_b.overhead / GiB:g} GiB{beside}: "
        f"nodes/memory.py); this machine has {available / GiB:.1f} GiB available"
    )
    if fits:
        t, i = fits[0]
        changes = (f"--trainers {t}" if t != trainers else "", f"--inference {i}" if i != inference else "")
        flags = " ".join(f for f in changes if f)
        return f"{why}: run with {flags} ({network_need(params, t, i, engine) / GiB:.1f} GiB), or --no-memory-check to try anyway"
    return f"{why}: even one trainer and one inference node do not fit; use a larger machine, or --no-memory-check to try anyway"


class Probe:
    """A callable a ``NodeState`` keeps for ``/status``: survives ``dataclasses.asdict`` (no copy).

    ``held``: bytes by holder, counted now (``fn(None)`` is called with them) or, for a node whose
    tensors change under a running step (a trainer: autograd writes ``.grad`` and the forward swaps
    weights in another thread), counted only at ``refresh()``, which its loop calls between steps."""

    def __init__(
        self, fn: Callable[[dict[str, int] | None], dict[str, Any]], *, counted: Callable[[], dict[str, int]] | None = None
    ) -> None:
        self.fn, self.counted = fn, counted
        self.held: dict[str, int] | None = None

    def refresh(self) -> None:
        """Count the holders now (call it where no other thread touches the node's tensors)."""
        if self.counted is not None:
            self.held = self.counted()

    def __call__(self) -> dict[str, Any]:
        return self.fn(self.held)

    def __deepcopy__(self, memo: dict[int, Any]) -> Probe:
        return self


def trainer_holders(node: Any) -> dict[str, list[torch.Tensor | None]]:
    """A ``TrainerNode``'s weights by holder (``node.policy``, ``publisher``, ``replayer``)."""
    local = node.policy.grpo.local
    params = list(local.model.parameters())
    moments = [v for s in local.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    out: dict[str, list[torch.Tensor | None]] = {
        "fp32_master": params,
        "gradients": [p.grad for p in params],
        "adam_moments": moments,
        "published_bf16": list((node.publisher.state or {}).values()),
    }
    if node.policy.grpo.reference is not None:
        out["kl_reference"] = list(node.policy.grpo.reference.model.parameters())
    if node.replayer is not None:
        out["replay_model"] = list(node.replayer.model.parameters())
        out["replay_versions"] = [t for u in node.replayer.versions.patches() for t in (u.positions, u.values)]
    return out


def trainer_probe(node: Any) -> Probe:
    """The ``/status`` ``memory`` of a ``TrainerNode``; its holders are counted at ``refresh()``
    (the trainer calls it after publishing a version: no step runs then), not when ``/status`` is
    read, which may be in the middle of a GRPO step."""
    params = sum(p.numel() for p in node.policy.grpo.local.model.parameters())
    return Probe(lambda counted: report(counted or {}, params=params, budget=BUDGETS["trainer"]),
                 counted=lambda: held(trainer_holders(node)))  # fmt: skip


def inference_probe(node: Any) -> Probe:
    """The ``/status`` ``memory`` of an ``InferenceNode``: its subscribers' verified states, then
    what its engine holds besides (``Engine.held_tensors``), and the bytes of its last update."""
    budget = budget_for("inference", node.config.engine)

    def probe(_: dict[str, int] | None) -> dict[str, Any]:
        states = [s.state for s in node.subscribers if s.state is not None]
        holders: dict[str, list[torch.Tensor | None]] = {"verified_bf16": [t for s in states for t in s.values()]}
        engine = node.engine
        if engine is not None:
            holders |= engine.held_tensors()
        params = sum(t.numel() for t in states[0].values()) if states else None
        out = report(held(holders), params=params, budget=budget)
        if engine is not None:
            out["engine_update_bytes"] = {"last": engine.stats.bytes_last_update, "total": engine.stats.bytes_copied,
                                          "updates": engine.stats.updates}  # fmt: skip
        return out

    return Probe(probe)
