"""The local inner loop: FP32 master weights, AdamW, BF16 autocast forward (default), FP32 loss.

Shared by the benchmarks and by PULSELoCo trainers, which read the local weights after H steps
(``state_fp32``) and reset them to the new global weights (``load_state_fp32``) while keeping
the optimizer state. Everything a restart needs to continue bit-identically is exposed:
weights, optimizer state, RNG state and the step counter (``checkpoint`` / ``restore``).

Determinism: on CPU the same inputs, weights and thread count give bit-identical results;
nothing here changes ``torch.set_num_threads``. Set it once per process, before training.
"""

from __future__ import annotations

import contextlib
import copy
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pulsenet.rl.models import bf16_state_dict
from pulsenet.rl.tasks import IGNORE_INDEX, ArithmeticTask


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
    forward_dtype: torch.dtype | None = torch.bfloat16
    """Autocast dtype of the forward; None runs it in FP32. BF16 matches GPU training but is
    ~5x slower on CPUs without AVX512-BF16/AMX (SmolLM2, batch 4x64, 2 AVX2 cores: ~60-90 s vs ~3-18 s a step)."""


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in FP32 over positions whose label is not -100."""
    shifted = logits[:, :-1, :].float()
    target = labels[:, 1:]
    return F.cross_entropy(
        shifted.reshape(-1, shifted.size(-1)), target.reshape(-1), ignore_index=IGNORE_INDEX
    )


class LocalTrainer:
    """AdamW on FP32 master weights with a (by default BF16) autocast forward on CPU."""

    def __init__(self, model: torch.nn.Module, config: LocalTrainerConfig | None = None) -> None:
        self.config = config if config is not None else LocalTrainerConfig()
        if any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError(
                "LocalTrainer needs FP32 master weights: load the model with dtype=torch.float32"
            )
        self.model = model
        # named_parameters() drops the tied lm_head, so tied weights are stepped (and reported) once.
        self._params = dict(model.named_parameters())
        self.optimizer = torch.optim.AdamW(
            self._params.values(),
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.generator = torch.Generator().manual_seed(self.config.seed)
        """Draw trainer-side randomness (e.g. rollout sampling) from here, not the global RNG."""
        self.rng = random.Random(self.config.seed)
        self.steps = 0
        """Optimizer steps taken so far; also the data position used by ``train_step``."""

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One AdamW step on a batch; returns the FP32 loss before the update."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        dtype = self.config.forward_dtype
        autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            logits = self.model(input_ids=input_ids, use_cache=False).logits
        # The loss leaves autocast: BF16 logits are upcast so the softmax/log run in FP32.
        loss = causal_lm_loss(logits, labels)
        loss.backward()
        if self.config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self._params.values(), self.config.grad_clip)
        self.optimizer.step()
        self.steps += 1
        return float(loss.detach())

    def train_step(self, task: ArithmeticTask) -> float:
        """Step on ``task``'s batch for the current step index, so a restored trainer resumes its data too."""
        input_ids, labels = task.batch(self.config.batch_size, self.config.seq_len, step=self.steps)
        return self.step(input_ids, labels)

    # --- weights -------------------------------------------------------------

    def state_fp32(self) -> dict[str, torch.Tensor]:
        """A copy of the FP32 master weights by parameter name (tied duplicate excluded)."""
        return {name: p.detach().clone() for name, p in self._params.items()}

    def load_state_fp32(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` into the master weights; optimizer, RNG and step counter are untouched."""
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
                p.copy_(state[name])

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The BF16 view an inference node would serve (see ``models.bf16_state_dict``)."""
        return bf16_state_dict(self.model)

    # --- checkpointing -------------------------------------------------------

    def optimizer_state(self) -> dict[str, Any]:
        """A deep copy of the AdamW state (later steps mutate the live tensors in place)."""
        return copy.deepcopy(self.optimizer.state_dict())

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def rng_state(self) -> dict[str, Any]:
        """The trainer's generators plus the global torch/python RNGs (HF modules such as dropout use those)."""
        return {
            "torch": self.generator.get_state(),
            "python": self.rng.getstate(),
            "torch_global": torch.get_rng_state(),
            "python_global": random.getstate(),
        }

    def load_rng_state(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["torch"])
        self.rng.setstate(state["python"])
        torch.set_rng_state(state["torch_global"])
        random.setstate(state["python_global"])

    def checkpoint(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically; ``torch.save``-able."""
        return {
            "steps": self.steps,
            "weights": self.state_fp32(),
            "optimizer": self.optimizer_state(),
            "rng": self.rng_state(),
        }

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.load_state_fp32(checkpoint["weights"])
        self.load_optimizer_state(checkpoint["optimizer"])
        self.load_rng_state(checkpoint["rng"])
        self.steps = checkpoint["steps"]
