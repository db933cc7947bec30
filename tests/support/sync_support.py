"""Shared helpers for the PULSESync tests: real training states, keys, bit comparisons (waiting:
``tests/support/waiting.py``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from pulsenet.codec.bf16 import bits
from pulsenet.signing import key_id

StateDict = Mapping[str, torch.Tensor]


def train_states(n: int, *, lr: float = 1e-4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive BF16 states of the tiny Qwen2: the initial one, then one per AdamW step.

    A larger lr than RL's 3e-6 so that every step changes the BF16 view (the tiny model's weights
    are large; at 3e-6 most steps would change nothing).
    """
    from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.models import build_tiny_model
    from pulsenet.rl.tasks import ArithmeticTask

    trainer = LocalTrainer(build_tiny_model(seed), LocalTrainerConfig(lr=lr, seed=seed))
    task = ArithmeticTask(seed)
    states = [trainer.bf16_state()]
    for _ in range(n - 1):
        trainer.train_step(task)
        states.append(trainer.bf16_state())
    return states


def perturbed_states(base: StateDict, n: int, *, fraction: float = 0.01, seed: int = 0) -> list[dict]:
    """``n`` states, each nudging ``fraction`` of the previous one's entries by one BF16 step (cheap)."""
    gen = torch.Generator().manual_seed(seed)
    states = [dict(base)]
    for _ in range(n - 1):
        nxt = {}
        for name, t in states[-1].items():
            raw = t.view(torch.int16).clone()
            hit = torch.rand(raw.shape, generator=gen) < fraction
            raw[hit] += 1
            nxt[name] = raw.view(torch.bfloat16)
        states.append(nxt)
    return states


def same_bits(a: StateDict, b: StateDict) -> bool:
    """Byte equality: same names, dtypes, shapes and value bits."""
    if set(a) != set(b):
        return False
    return all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (bits(a[k]) == bits(b[k])).all() for k in a
    )


def keypair() -> tuple[Ed25519PrivateKey, dict[str, Ed25519PublicKey]]:
    key = Ed25519PrivateKey.generate()
    return key, {key_id(key.public_key()): key.public_key()}
