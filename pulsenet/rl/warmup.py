"""A supervised warm-up for the tiny model, cached on disk, so GRPO starts from a non-zero reward.

A random tiny model almost never samples a correct answer, so every group is flat (all rewards
0, advantage 0) and GRPO has nothing to learn from. A few hundred packed supervised steps on the
RL task (single-digit ``+``/``-``, ``tiny_task``) take it to a sampled reward of about 0.2-0.6.

The cache file name is the SHA-256 of everything that determines the weights (warm-up config,
seed, steps, model config, torch and transformers versions), so a stale cache is never used, and
it is written atomically (``fsutil.atomic_path``), so a crash never leaves a torn file behind.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen2ForCausalLM

from pulsenet.fsutil import atomic_path
from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
from pulsenet.rl.models import build_tiny_model, tiny_qwen2_config
from pulsenet.rl.tasks import ARITH_MAX_OPERAND, ARITH_OPS, ArithmeticTask

WARMUP_STEPS = 250
"""Default steps: sampled reward ~0.6 on ``tiny_task`` (greedy ~0.8), ~5-10 s on one core."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupConfig:
    lr: float = 3e-3
    """AdamW rate; a random tiny model needs a large one (3e-6 is for pretrained models)."""
    batch_size: int = 16
    """Packed rows per step."""
    seq_len: int = 64
    """Tokens per packed row."""
    max_operand: int = ARITH_MAX_OPERAND
    """Operands of the task in ``[0, max_operand]``: single digits are learnable in seconds."""
    ops: str = ARITH_OPS
    """Operators of the task."""
    forward: str = "bf16-weights"
    """The forward GRPO trains with, so the warm weights are what the engines will serve."""


def tiny_task(seed: int, config: WarmupConfig | None = None) -> ArithmeticTask:
    """The byte-level arithmetic task the tiny model is warmed up on and rewarded by."""
    config = config if config is not None else WarmupConfig()
    return ArithmeticTask(seed, max_operand=config.max_operand, ops=config.ops)


def warmup_key(*, steps: int, seed: int, config: WarmupConfig) -> str:
    """SHA-256 (hex) of everything the warmed weights depend on."""
    model_config = tiny_qwen2_config().to_dict()
    doc = {
        "format": 1,
        "steps": steps,
        "seed": seed,
        "warmup": asdict(config),
        "model": model_config,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def warm_tiny_model(
    cache_dir: str | Path | None,
    *,
    steps: int = WARMUP_STEPS,
    seed: int = 0,
    config: WarmupConfig | None = None,
) -> Qwen2ForCausalLM:
    """``build_tiny_model(seed)`` after ``steps`` supervised steps on ``tiny_task(seed)``, FP32.

    With ``cache_dir`` the result is loaded from (or saved to) ``tiny-warm-<key>.safetensors``
    there. Deterministic for a given thread count (see ``local.py``), so the cache only saves time.
    """
    config = config if config is not None else WarmupConfig()
    model = build_tiny_model(seed)
    key = warmup_key(steps=steps, seed=seed, config=config)
    path = Path(cache_dir) / f"tiny-warm-{key[:32]}.safetensors" if cache_dir is not None else None
    params = dict(model.named_parameters())  # tied lm_head excluded: it follows the embedding
    if path is not None and path.is_file():
        state = load_file(path)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])
        return model
    trainer = LocalTrainer(
        model,
        LocalTrainerConfig(
            lr=config.lr,
            batch_size=config.batch_size,
            seq_len=config.seq_len,
            forward=config.forward,
            seed=seed,
        ),
    )
    task = tiny_task(seed, config)
    for _ in range(steps):
        trainer.train_step(task)
    if path is not None:
        with atomic_path(path) as tmp:
            save_file(
                {n: p.detach().contiguous() for n, p in params.items()}, str(tmp), metadata={"key": key}
            )
    return model
