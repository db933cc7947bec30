"""``pulsenet up``'s memory preflight (nodes/memory.py, nodes/up): a network whose nodes' peak
budgets exceed the machine's available memory is refused at start, naming the flag to change."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig

from pulsenet.errors import ConfigError
from pulsenet.nodes import memory
from pulsenet.nodes.memory import GiB, network_need, network_refusal
from pulsenet.nodes.up import _check
from pulsenet.nodes.up.config import UpConfig

P = 361_821_120  # SmolLM2-360M's shape


def _model_dir(tmp_path: Path) -> Path:
    """A SmolLM2-360M-shaped Llama directory: its config only (the preflight reads no weights)."""
    LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                num_attention_heads=15, num_key_value_heads=5, tie_word_embeddings=True).save_pretrained(tmp_path)  # fmt: skip
    (tmp_path / "model.safetensors").write_bytes(b"")
    return tmp_path


def test_the_refusal_names_what_fits() -> None:
    assert network_need(P, 1, 2) == 24 * P + 2 * GiB + 2 * (6 * P + 3 * GiB // 2)
    # two trainers run PULSELoCo: its outer state counts too (18 bytes a parameter each)
    assert network_need(P, 2, 1) == 2 * (42 * P + 2 * GiB) + 6 * P + 3 * GiB // 2
    why = network_refusal(P, 2, 2, "torch", int(22.9 * GiB))
    assert why is not None and "39.3 GiB" in why and "PULSELoCo" in why
    assert "--trainers 1 (17.1 GiB)" in why and "--inference" not in why
    assert network_refusal(P, 1, 2, "torch", int(22.9 * GiB)) is None
    assert "--trainers 1 --inference 1" in (network_refusal(P, 2, 2, "torch", 14 * GiB) or "")
    assert "even one trainer" in (network_refusal(P, 1, 1, "torch", 5 * GiB) or "")
    assert network_refusal(P, 2, 2, "vllm", int(22.9 * GiB)) is not None  # 2 trainers alone need 20.2 GiB + vLLM nodes


def test_vllm_s_own_processes_count_beside_each_vllm_node() -> None:
    """SmolLM2-135M, ``pulsenet up --engine vllm`` with its defaults (2 trainers, 2 inference nodes):
    on 2026-12-07 the OOM killer took both trainers on this 24 GiB machine, which the preflight had
    let through (it counted neither vLLM's engine core and worker nor PULSELoCo's outer state)."""
    smollm2 = 134_515_008
    assert network_need(smollm2, 1, 1, "vllm") - network_need(smollm2, 1, 1, "torch") == (
        2 * smollm2 + 7 * GiB // 2 - 4 * smollm2  # vLLM's processes, less the torch engine's FP32 copy
    )
    why = network_refusal(smollm2, 2, 2, "vllm", 22 * GiB)
    assert why is not None and "vLLM's own processes" in why and "--inference 1" in why, why
    assert network_refusal(smollm2, 2, 2, "torch", 22 * GiB) is None  # the torch engine's network fits


def test_up_refuses_at_start_and_the_flag_turns_it_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(_model_dir(tmp_path))
    monkeypatch.setattr(memory, "available_memory", lambda: int(22.9 * GiB))
    with pytest.raises(ConfigError, match="--trainers 1"):
        _check(UpConfig(model=model, trainers=2, inference=2))
    _check(UpConfig(model=model, trainers=1, inference=2))
    _check(UpConfig(model=model, trainers=2, inference=2, memory_check=False))
    monkeypatch.setattr(memory, "available_memory", lambda: GiB)
    _check(UpConfig(model="tiny"))  # the tiny model is never refused
