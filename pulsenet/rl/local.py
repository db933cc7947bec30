"""The local inner loop: FP32 master weights, AdamW, a BF16-faithful forward, FP32 loss.

Shared by the benchmarks and by PULSELoCo trainers, which read the local weights after H steps
(``state_fp32``) and reset them to the new global weights (``load_state_fp32``) while keeping
the optimizer state. Everything a restart needs to continue bit-identically is exposed:
weights, optimizer state, RNG state and the step counter (``checkpoint`` / ``restore``).

Forward modes (``LocalTrainerConfig.forward``), all with FP32 master weights and an FP32 loss:

- ``autocast-bf16``: ``torch.autocast(bfloat16)``, as GPU mixed-precision training runs. BF16
  weights *and* activations; very slow on CPUs without native BF16 matmuls (AVX512-BF16/AMX).
- ``bf16-weights``: the forward sees each master weight rounded to BF16, ``fp32(bf16(θ))``, with
  FP32 matmuls and activations; the gradient passes straight through the rounding to the FP32
  master. Fast on any CPU, and it sees exactly the BF16 weights the PULSE visibility gate is
  about, so a sub-BF16 update is invisible to it as it would be to a BF16 forward.
- ``fp32``: plain FP32; sees updates smaller than a BF16 cell, which the gate withholds.

Determinism: on CPU the same inputs, weights and thread count give bit-identical results;
nothing here changes ``torch.set_num_threads``. Set it once per process, before training.

Device (``LocalTrainerConfig.device``): the model, its AdamW state and every input live there;
what leaves the trainer (``state_fp32``, ``bf16_state``, the optimizer and RNG state of a
checkpoint) is always on the CPU, where the codec, digests and stores read it. On the CPU nothing
is copied that was not copied before.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from pulsenet.errors import ConfigError
from pulsenet.rl import sharding
from pulsenet.rl.models import bf16_state_dict
from pulsenet.rl.tasks import IGNORE_INDEX, ArithmeticTask

Forward = Literal["bf16-weights", "autocast-bf16", "fp32"]
FORWARDS: tuple[str, ...] = get_args(Forward)
"""Forward modes; see the module docstring."""

_CPU = torch.device("cpu")


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` (the current CUDA device: ``cuda:LOCAL_RANK`` under torchrun once
    ``torch.cuda.set_device`` ran, else ``cuda:0``) or ``cuda:N``; ConfigError if CUDA is missing."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device = {name!r} but torch.cuda.is_available() is False on this machine: "
                "set device = \"cpu\" or run on a host with a CUDA GPU and a CUDA build of torch"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(kw_only=True, slots=True)
class LocalTrainerConfig:
    lr: float = 3e-6
    """AdamW learning rate; 3e-6 is the RL post-training rate the PULSE numbers assume."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay; 0 like TRL's defaults (at lr 3e-6 it never crosses a BF16 cell anyway)."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    batch_size: int = 4
    """Rows per step when the trainer draws its own batches (``train_step``)."""
    seq_len: int = 64
    """Tokens per row when the trainer draws its own batches."""
    grad_clip: float | None = None
    """Max global grad norm; None disables clipping."""
    seed: int = 0
    """Seeds the trainer's own torch/python generators (sampling on its behalf)."""
    forward: str = "autocast-bf16"
    """One of ``FORWARDS``. ``autocast-bf16`` matches GPU training but is very slow on CPUs without
    AVX512-BF16/AMX (SmolLM2, batch 4x64, 2 AVX2 cores: ~60-170 s a step); ``bf16-weights`` sees the
    same BF16 weights at FP32 speed (~1-2 s a step at batch 2x32)."""
    device: str = "cpu"
    """Where the model, AdamW state and inputs live: ``cpu``, ``cuda`` or ``cuda:N`` (``resolve_device``)."""

    def __post_init__(self) -> None:
        if self.forward not in FORWARDS:
            raise ConfigError(f"forward must be one of {FORWARDS}, got {self.forward!r}")


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its memory: a shard gathered whole (new already), or a copy."""
    t = t.detach()
    return sharding.full(t).to(_CPU) if sharding.is_shard(t) else t.to(_CPU, copy=True)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in FP32 over positions whose label is not -100."""
    shifted = logits[:, :-1, :].float()
    target = labels[:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX
    )


class _RoundToBF16(torch.autograd.Function):
    """``fp32(bf16(x))`` forward, identity backward: the straight-through estimator of mixed precision.

    The FP32 master gets the full FP32 gradient of the loss with respect to the rounded weight it
    was used as (autograd through ``.to(bfloat16)`` would round the gradient to BF16 as well).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16).to(torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def bf16_rounded(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every FP32 parameter as the BF16 value a BF16 forward would use, in FP32, gradients straight through."""
    return {name: _RoundToBF16.apply(p) for name, p in params.items()}


@contextlib.contextmanager
def _rounded_per_module(model: torch.nn.Module) -> Iterator[None]:
    """The ``bf16-weights`` forward with one module's rounded weights alive at a time.

    Each module's own parameters are swapped for ``fp32(bf16(θ))`` (``_RoundToBF16``) just before
    its forward and put back just after it, so the rounded copies of the whole model (4 bytes per
    parameter) never exist at once; a rounded weight the backward needs (a matmul saves it) is
    saved as its FP32 master and rounded again when the backward reads it, the same bits (the
    master does not move before the step). The values every op sees are those of rounding every
    weight up front, as ``torch.func.functional_call`` with ``bf16_rounded`` did."""
    live: dict[int, torch.Tensor] = {}  # the storage of each rounded weight in use -> its master
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []

    def before(module: torch.nn.Module, args: Any) -> None:
        for name, p in list(module._parameters.items()):
            if p is not None and p.dtype == torch.float32:
                r = _RoundToBF16.apply(p)
                live[r.untyped_storage().data_ptr()] = p
                swapped.append((module, name, p))
                module._parameters[name] = r  # the registration (and its order) stays: only its value

    def after(module: torch.nn.Module, args: Any, out: Any) -> None:
        while swapped and swapped[-1][0] is module:
            _, name, p = swapped.pop()
            live.pop(module._parameters[name].untyped_storage().data_ptr(), None)  # its memory may be reused
            module._parameters[name] = p

    def pack(t: torch.Tensor) -> Any:
        master = live.get(t.untyped_storage().data_ptr()) if t.dtype == torch.float32 else None
        return t if master is None else (master, t.size(), t.stride(), t.storage_offset())

    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        master, size, stride, offset = saved
        return master.detach().to(torch.bfloat16).to(torch.float32).as_strided(size, stride, offset)

    owners = [m for m in model.modules() if any(p is not None for p in m._parameters.values())]
    handles = [h for m in owners for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for h in handles:
            h.remove()
        for module, name, p in reversed(swapped):  # a forward that raised: put every master back
            module._parameters[name] = p


class LocalTrainer:
    """AdamW on FP32 master weights with a BF16-faithful forward (``LocalTrainerConfig.forward``)."""

    def __init__(self, model: torch.nn.Module, config: LocalTrainerConfig | None = None) -> None:
        self.config = config if config is not None else LocalTrainerConfig()
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError(
                "LocalTrainer needs FP32 master weights: load the model with dtype=torch.float32"
            )
        self.device = resolve_device(self.config.device)
        # before AdamW: its state is created beside the parameters (a no-op on the CPU)
        self.model = model.to(self.device)
        self.optimizer = self._bind_parameters()
        self.generator = torch.Generator().manual_seed(self.config.seed)
        """Draw trainer-side randomness (e.g. rollout sampling) from here, not the global RNG."""
        self.rng = random.Random(self.config.seed)
        self.steps = 0
        """Optimizer steps taken so far; also the data position used by ``train_step``."""
        self.skipped = 0
        """Updates dropped for a non-finite gradient norm (``apply_gradients``); not in ``steps``."""
        self.read_guard: Callable[[], None] | None = None
        """Set on a rank group's rank 0 (``rl.distributed.RankGroup``): raises when a read of the whole sharded
        model bypasses the rank group, which would otherwise wait forever for the other ranks."""

    def _bind_parameters(self) -> torch.optim.AdamW:
        # named_parameters() drops the tied lm_head, so tied weights are stepped (and reported) once.
        self._params = dict(self.model.named_parameters())
        return torch.optim.AdamW(
            self._params.values(),
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )

    def shard(self, group: Any = None) -> None:
        """FSDP2 over the process group (``rl.sharding``): weights, gradients and AdamW state split
        across its ranks. Collective, on every rank alike, before the first step (the optimizer is
        rebuilt over the shards). Afterwards every weight read or write (``state_fp32``,
        ``load_state_fp32``, ``bf16_state``, the optimizer state) is a collective too, which
        ``rl.distributed.RankGroup`` runs on every rank."""
        if self.steps or self.optimizer.state:
            raise RuntimeError("shard a LocalTrainer before its first step")
        sharding.shard_model(self.model, self.device, round_bf16=self.config.forward == "bf16-weights", group=group)
        self.optimizer = self._bind_parameters()

    @property
    def sharded(self) -> bool:
        return sharding.is_sharded(self.model)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One AdamW step on a batch; returns the FP32 loss before the update."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss(input_ids, labels)
        loss.backward()
        self.apply_gradients()
        return float(loss.detach())

    def apply_gradients(self, norms: Callable[[list[torch.Tensor | None]], torch.Tensor] | None = None) -> float | None:
        """Clip (if configured) and AdamW-step the gradients already in ``.grad``; count the step.

        For losses built outside ``step`` (GRPO accumulates micro-batches, then steps once).
        ``norms``: a data-parallel rank group's ``chunk_norms`` (``rl.parallel.DataParallel.chunk_norms``),
        so the clipping norm is the same bits on every rank and in the single-process reference.
        Returns the global grad norm before clipping, or None when clipping is off.

        A non-finite norm (a hostile or overflowing reward, a NaN activation) skips the update: the
        gradients are dropped and the weights and AdamW moments stay as they were, the same on every
        rank (the norm is all-reduced). Without clipping there is no norm and no such guard; the
        trainer daemon still refuses to publish non-finite weights.
        """
        norm = None
        if self.config.grad_clip is not None:
            params = list(self._params.values())
            if norms is None:
                norm = float(torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip))
            else:
                grads = [p.grad for p in params]
                norm = sharding.clip_to_norm(grads, norms(grads), self.config.grad_clip)
        if norm is not None and not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
        else:
            self.optimizer.step()
            self.steps += 1
        if self.sharded:
            sharding.reshard(self.model)
        return norm

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[rows, tokens, vocab]`` logits of the current weights through the configured forward.

        Autograd follows the caller's mode; under ``autocast-bf16`` they are BF16, so upcast
        before a softmax.
        """
        with self._forward_context():
            return self._forward(input_ids.to(self.device)).logits

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The FP32 loss of the current weights through the configured forward (autograd as the caller's mode)."""
        # The loss runs outside autocast: BF16 logits are upcast so the softmax/log run in FP32.
        return causal_lm_loss(self.logits(input_ids), labels.to(self.device))

    def eval_loss(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``(input_ids, labels)`` batches, without gradients, through the trainer's forward.

        Evaluate with the forward you train with: PULSELoCo withholds exactly the updates a BF16
        forward cannot see, so an FP32 evaluation would credit a dense baseline with them.
        """
        self.model.eval()
        losses = []
        with torch.no_grad():
            for input_ids, labels in batches:
                losses.append(float(self.loss(input_ids, labels)))
        return sum(losses) / len(losses)

    def _forward(self, input_ids: torch.Tensor) -> Any:
        if self.config.forward != "bf16-weights" or self.sharded:  # sharded: rl.sharding's hooks round
            return self.model(input_ids=input_ids, use_cache=False)
        # Every module's weights rounded as it runs (the tied lm_head rounds the embedding's
        # master again: the same values); buffers (rotary frequencies) stay as they are.
        with _rounded_per_module(self.model):
            return self.model(input_ids=input_ids, use_cache=False)

    def _forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.forward == "autocast-bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, task: ArithmeticTask) -> float:
        """Step on ``task``'s batch for the current step index, so a restored trainer resumes its data too."""
        input_ids, labels = task.batch(self.config.batch_size, self.config.seq_len, step=self.steps)
        return self.step(input_ids, labels)

    # --- weights -------------------------------------------------------------

    def state_fp32(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the FP32 master weights by parameter name (tied duplicate excluded)."""
        self._whole_read()
        return {name: _cpu_copy(p) for name, p in self._params.items()}

    def load_state_fp32(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (on any device) into the master weights; optimizer, RNG and step counter are untouched.

        Sharded, every rank passes the whole state and keeps its chunk."""
        missing = self._params.keys() - state.keys()
        extra = state.keys() - self._params.keys()
        if missing or extra:
            raise KeyError(
                f"weight names differ: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}"
            )
        for name, p in self._params.items():
            src = state[name]
            if src.shape != p.shape or src.dtype != torch.float32:
                raise ValueError(
                    f"{name}: expected float32 {tuple(p.shape)}, got {src.dtype} {tuple(src.shape)}"
                )
        with torch.no_grad():
            for name, p in self._params.items():
                sharding.local(p).copy_(sharding.local_chunk(state[name], p))
        if self.sharded:
            sharding.reshard(self.model)

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The BF16 view an inference node would serve (see ``models.bf16_state_dict``), on the CPU."""
        self._whole_read()
        if self.sharded:  # the masters gathered whole (tied duplicates are not in _params), buffers as they are
            state = self.model.state_dict()
            return bf16_state_dict({n: _cpu_copy(t) for n, t in state.items() if n in self._params or not sharding.is_shard(t)})
        state = bf16_state_dict(self.model)
        return state if self.device == _CPU else {name: t.cpu() for name, t in state.items()}

    def _whole_read(self) -> None:
        if self.read_guard is not None:
            self.read_guard()

    # --- checkpointing -------------------------------------------------------

    def optimizer_state(self) -> dict[str, Any]:
        """A deep copy of the AdamW state (later steps mutate the live tensors in place), on the CPU;
        sharded, the moments are gathered whole, so the checkpoint is a one-process trainer's."""
        self._whole_read()
        state = self.optimizer.state_dict()
        if self.device == _CPU and not self.sharded:
            return copy.deepcopy(state)
        moments = {
            i: {k: _cpu_copy(v) if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in state["state"].items()
        }
        return {"state": moments, "param_groups": copy.deepcopy(state["param_groups"])}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """``optimizer_state`` put back; torch casts the moments to the parameters' device (sharded:
        every rank passes the whole state and keeps its chunks)."""
        if self.sharded:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            moments = {i: {k: sharding.cut_like(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()}
            state = {**state, "state": moments}
        self.optimizer.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """The trainer's generators plus the global torch/python RNGs (HF modules such as dropout use
        those), and the device's generator on CUDA (dropout there draws from it)."""
        state = {
            "torch": self.generator.get_state(),
            "python": self.rng.getstate(),
            "torch_global": torch.get_rng_state(),
            "python_global": random.getstate(),
        }
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def load_rng_state(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["torch"])
        self.rng.setstate(state["python"])
        torch.set_rng_state(state["torch_global"])
        random.setstate(state["python_global"])
        if self.device.type == "cuda" and "cuda" in state:  # absent in a CPU trainer's checkpoint
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def checkpoint(self, *, snapshot: bool = True) -> dict[str, Any]:
        """Everything needed to continue bit-identically; ``torch.save``-able.

        ``snapshot=False``, on the CPU unsharded: the live weight and AdamW moment tensors, not
        copies (12 bytes per parameter less at the moment a lone trainer writes its resume point),
        for a caller that serialises them before the next step; else the same as a snapshot."""
        if snapshot or self.device != _CPU or self.sharded:
            weights, optimizer = self.state_fp32(), self.optimizer_state()
        else:
            weights = {name: p.detach() for name, p in self._params.items()}
            optimizer = self.optimizer.state_dict()
        return {"steps": self.steps, "weights": weights, "optimizer": optimizer, "rng": self.rng_state()}

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.load_state_fp32(checkpoint["weights"])
        self.load_optimizer_state(checkpoint["optimizer"])
        self.load_rng_state(checkpoint["rng"])
        self.steps = checkpoint["steps"]
