"""RL layer: models, tasks and rewards, and the local training loop."""

from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
from pulsenet.rl.models import (
    bf16_state_dict,
    build_tiny_model,
    load_model,
    load_tokenizer,
    smollm2_checkpoint,
    tiny_qwen2_config,
)
from pulsenet.rl.tasks import ArithmeticTask, Problem, reward

__all__ = [
    "ArithmeticTask",
    "LocalTrainer",
    "LocalTrainerConfig",
    "Problem",
    "bf16_state_dict",
    "build_tiny_model",
    "load_model",
    "load_tokenizer",
    "reward",
    "smollm2_checkpoint",
    "tiny_qwen2_config",
]
