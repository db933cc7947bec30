"""RL layer: models, tasks and rewards, and the local training loop.

The names below are imported on first use (PEP 562), not with the package: the reward worker
process (``rl/rewards.py``) imports ``pulsenet.rl.rewards`` and must start without torch and
transformers (4-5 s on two cores), since a hung reward restarts it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LocalTrainer": "pulsenet.rl.local",
    "LocalTrainerConfig": "pulsenet.rl.local",
    "bf16_state_dict": "pulsenet.rl.models",
    "build_tiny_model": "pulsenet.rl.models",
    "load_model": "pulsenet.rl.models",
    "load_tokenizer": "pulsenet.rl.models",
    "smollm2_checkpoint": "pulsenet.rl.models",
    "tiny_qwen2_config": "pulsenet.rl.models",
    "ArithmeticTask": "pulsenet.rl.tasks",
    "Problem": "pulsenet.rl.tasks",
    "reward": "pulsenet.rl.tasks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pulsenet.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
