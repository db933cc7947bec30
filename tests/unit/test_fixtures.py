"""Fixtures at size (bench/fixtures.py), at a tiny shape of the same code: seconds each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pulsenet.bench.fixtures import SIZES, PairSpec, Shape, build_model_dir, make_pair, param_count
from pulsenet.checkpoint import Checkpoint
from pulsenet.codec.bf16 import bits
from pulsenet.codec.digest import model_digest

TINY = Shape("test", 64, 128, 2, 4, 2, 10000.0, 256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("fx") / "model", params=TINY, seed=3)


def test_published_sizes_have_the_parameter_counts_they_are_named_after():
    counts = {k: param_count(s) for k, s in SIZES.items()}
    assert counts["135M"] == 134_515_008  # SmolLM2-135M, tied embedding stored once
    assert counts["0.35B"] == 361_821_120  # SmolLM2-360M
    assert 1.0e9 < counts["1B"] < 1.1e9 and 2.9e9 < counts["3B"] < 3.0e9


def test_model_dir_loads_is_bf16_and_reproducible(model_dir, tmp_path):
    from pulsenet.rl.models import load_model, load_tokenizer

    model = load_model(model_dir, torch.bfloat16)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    ck = Checkpoint(model_dir)
    assert all(t.dtype == torch.bfloat16 for t in ck.values())
    assert "lm_head.weight" not in ck
    assert float(ck["model.norm.weight"].float().min()) == 1.0
    std = float(ck["model.embed_tokens.weight"].float().std())
    assert 0.018 < std < 0.022
    assert load_tokenizer(model_dir)("1 + 2 =")["input_ids"]
    again = build_model_dir(tmp_path / "again", params=TINY, seed=3)
    other = build_model_dir(tmp_path / "other", params=TINY, seed=4)
    assert model_digest(Checkpoint(again)) == model_digest(ck)
    assert model_digest(Checkpoint(other)) != model_digest(ck)


def test_first_step_pair_matches_a_real_adamw_step(model_dir, tmp_path):
    """The closed-form first step (BF16 weights, per-tensor FP32 update) moves the same entries a
    full FP32-master AdamW step under autocast does, and about as many of them."""
    pairs = {m: make_pair(model_dir, tmp_path / m, PairSpec(method=m)) for m in ("adamw", "first-step")}
    rec = {m: json.loads((p / "pair.json").read_text()) for m, p in pairs.items()}
    assert rec["adamw"]["method"] == "adamw" and rec["first-step"]["method"] == "first-step"
    for r in rec.values():
        assert 0.001 < r["changed_fraction"] < 0.1  # lr 3e-6 on N(0, 0.02): a few percent move
    a, f = Checkpoint(pairs["adamw"] / "new"), Checkpoint(pairs["first-step"] / "new")
    old = Checkpoint(pairs["adamw"] / "old")
    moved_a = moved_f = both = 0
    for n in old:
        ma, mf = bits(a[n]) != bits(old[n]), bits(f[n]) != bits(old[n])
        moved_a, moved_f, both = moved_a + int(ma.sum()), moved_f + int(mf.sum()), both + int((ma & mf).sum())
    assert both >= 0.95 * max(moved_a, moved_f)
    assert model_digest(Checkpoint(pairs["first-step"] / "old")) == model_digest(Checkpoint(model_dir))


def test_adamw_pair_after_several_steps(model_dir, tmp_path):
    pair = make_pair(model_dir, tmp_path / "p", PairSpec(method="adamw", steps=3, forward="bf16-weights"))
    rec = json.loads((pair / "pair.json").read_text())
    assert len(rec["losses"]) == 3 and rec["changed"] > 0
    assert model_digest(Checkpoint(pair / "old")) != model_digest(Checkpoint(model_dir))
