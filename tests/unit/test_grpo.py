"""GRPO: the math against hand-computed values, the trainer's plumbing, and learning on the tiny model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import ConfigError
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer, group_advantages, grpo_token_loss, k3, tis_weights
from pulsenet.rl.models import BYTE_EOS, build_tiny_model
from pulsenet.rl.sampling import LogitsFn, sample_group
from pulsenet.rl.tasks import Problem, RewardTask, assign_problems
from pulsenet.rl.warmup import WARMUP_STEPS, tiny_task, warm_tiny_model
from tests.support.rl import fake_rollouts

D = torch.float64

# --- advantages --------------------------------------------------------------


def test_group_advantages_subtract_the_group_mean() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    assert group_advantages(rewards, groups).tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0]
    # Groups need not be contiguous.
    mixed = group_advantages(torch.tensor([1.0, 3.0, 0.0, 5.0], dtype=D), torch.tensor([0, 1, 0, 1]))
    assert mixed.tolist() == [0.5, -1.0, -0.5, 1.0]


def test_group_advantages_std_scaling_is_optional() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 2.0], dtype=D)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    adv = group_advantages(rewards, groups, scale=True)
    s = math.sqrt(1 / 3) + 1e-4  # unbiased std of (1, 0, 0, 1) is sqrt(1/3), as torch.std (TRL)
    assert adv[:4].tolist() == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s], abs=1e-12)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0]  # flat group and a group of one: 0, not NaN


# --- the token loss ----------------------------------------------------------


def _ratios(ratios: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp with grad, old_logp) whose per-token ratios π_θ/π_old are ``ratios``, one token per row."""
    old = torch.full((len(ratios), 1), -1.0, dtype=D)
    logp = (old + torch.tensor(ratios, dtype=D).log()[:, None]).requires_grad_(True)
    return logp, old


def test_asymmetric_clipping_both_sides() -> None:
    # ρ and A per row; eps_low 0.2 / eps_high 0.28 → clip range [0.8, 1.28].
    logp, old = _ratios([1.5, 0.5, 0.5, 1.5, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=D)
    mask = torch.ones(5, 1, dtype=torch.bool)
    loss, clipped = grpo_token_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    # min(ρA, clip(ρ)A): 1.28 (high clip) | -0.8 (low clip) | 0.5 | -1.5 | 2.2; loss = -Σ/5.
    assert float(loss.detach()) == pytest.approx(-(1.28 - 0.8 + 0.5 - 1.5 + 2.2) / 5, abs=1e-12)
    assert clipped[:, 0].tolist() == [True, True, False, False, False]
    loss.backward()
    # Clipped tokens get no gradient; the others -A ρ / T (d ρ / d logp = ρ).
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 0.0, -0.5 / 5, 1.5 / 5, -2.2 / 5], abs=1e-12)


def test_tis_weights_truncate_at_the_cap_and_carry_no_gradient() -> None:
    old = torch.tensor([[0.0, 0.0, -1.0]], dtype=D, requires_grad=True)
    engine = torch.tensor([[-math.log(3.0), math.log(2.0), -1.0]], dtype=D, requires_grad=True)
    w = tis_weights(old, engine, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 1.0], abs=1e-12)  # 3 → 2, 0.5, 1
    assert not w.requires_grad
    assert tis_weights(old, engine, cap=None).tolist() == [[1.0, 1.0, 1.0]]
    # In the loss: at ρ = 1 with A = 1, ℓ = -w and dℓ/dlogp = -w / T.
    logp = old.detach().clone().requires_grad_(True)
    loss, _ = grpo_token_loss(
        logp, old, torch.tensor([1.0], dtype=D), torch.ones(1, 3, dtype=torch.bool), weights=w
    )
    assert float(loss.detach()) == pytest.approx(-(2.0 + 0.5 + 1.0) / 3, abs=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.0 / 3, -0.5 / 3, -1.0 / 3], abs=1e-12)


def test_loss_is_normalised_by_the_batch_tokens_dapo() -> None:
    # Row 0: one completion token, A = +1; row 1: three tokens, A = -1; padding after row 0's token.
    logp = torch.zeros(2, 3, dtype=D, requires_grad=True)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, -1.0], dtype=D)
    loss, _ = grpo_token_loss(logp, logp.detach(), adv, mask)
    # Token level: (-1 + 3) / 4 = 0.5 (a per-sequence mean would give (-1 + 1) / 2 = 0).
    assert float(loss.detach()) == pytest.approx(0.5, abs=1e-12)
    # Micro-batches with n_tokens = T add up to the whole batch.
    a, _ = grpo_token_loss(logp[:1], logp[:1].detach(), adv[:1], mask[:1], n_tokens=4)
    b, _ = grpo_token_loss(logp[1:], logp[1:].detach(), adv[1:], mask[1:], n_tokens=4)
    assert float(a.detach()) == -0.25 and float(b.detach()) == 0.75
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.25, 0.0, 0.0, 0.25, 0.25, 0.25], abs=1e-12)


def test_kl_to_reference_k3() -> None:
    logp = torch.zeros(1, 1, dtype=D, requires_grad=True)
    ref = torch.full((1, 1), math.log(2.0), dtype=D)
    assert float(k3(logp.detach(), ref)) == pytest.approx(1 - math.log(2.0), abs=1e-12)
    loss, _ = grpo_token_loss(
        logp,
        logp.detach(),
        torch.zeros(1, dtype=D),
        torch.ones(1, 1, dtype=torch.bool),
        ref_logp=ref,
        beta=0.5,
    )
    assert float(loss.detach()) == pytest.approx(0.5 * (1 - math.log(2.0)), abs=1e-12)  # A = 0: only β·k3
    with pytest.raises(ValueError):
        grpo_token_loss(
            logp, logp.detach(), torch.zeros(1, dtype=D), torch.ones(1, 1, dtype=torch.bool), beta=0.1
        )


def test_config_validation() -> None:
    for bad in (
        {"forward": "fp16"},
        {"temperature": 0.0},
        {"eps_low": 1.0},
        {"tis_cap": 0.0},
        {"steps_per_batch": 0},
    ):
        with pytest.raises(ConfigError):
            GRPOConfig(**bad)  # type: ignore[arg-type]
    cfg = GRPOConfig()
    assert (cfg.lr, cfg.forward, cfg.eps_low, cfg.eps_high, cfg.tis_cap, cfg.beta) == (
        3e-6,
        "bf16-weights",
        0.2,
        0.28,
        2.0,
        0.0,
    )


# --- the trainer -------------------------------------------------------------


def _rollouts(
    logits_fn: LogitsFn,
    task: RewardTask,
    problems: Sequence[Problem],
    g: int,
    generator: torch.Generator,
    *,
    version: int = 0,
    temperature: float = 1.0,
) -> list[Rollout]:
    out = []
    for k, p in enumerate(problems):
        prompt = tuple(p.prompt.encode())
        for s in sample_group(
            logits_fn,
            prompt,
            g,
            max_new_tokens=5,
            eos_id=BYTE_EOS,
            temperature=temperature,
            generator=generator,
        ):
            text = bytes(s.completion_ids).decode("utf-8", errors="replace")
            out.append(
                Rollout(
                    group=f"{version}-{k}",
                    prompt_ids=prompt,
                    completion_ids=s.completion_ids,
                    logprobs=s.logprobs,
                    reward=task.score(text, p),
                    version=version,
                    model_digest="test",
                    node="test",
                    seed=0,
                )
            )
    return out


def _reward(logits_fn: LogitsFn, task: RewardTask, problems: Sequence[Problem], g: int = 8) -> float:
    rolls = _rollouts(logits_fn, task, problems, g, torch.Generator().manual_seed(123))
    return sum(r.reward for r in rolls) / len(rolls)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return tmp_path_factory.mktemp("warm")


def test_micro_batches_accumulate_to_the_same_step() -> None:
    torch.set_num_threads(1)
    rolls = fake_rollouts()
    states = []
    for mb in (None, 5):
        trainer = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, micro_batch_size=mb))
        m = trainer.step(rolls)
        assert m.step == trainer.steps == 1 and m.tokens == sum(len(r.completion_ids) for r in rolls)
        states.append((trainer.local.state_fp32(), m))
    (a, ma), (b, mb_) = states
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    assert ma.loss == pytest.approx(mb_.loss, abs=1e-6) and ma.entropy == pytest.approx(mb_.entropy, rel=1e-5)
    # The engine logprobs (-2 each) are not the model's: mismatch and truncation are measured.
    assert ma.mismatch_kl > 0 and 0 <= ma.tis_frac <= 1 and ma.clip_frac == 0.0  # one step: ρ = 1
    assert ma.flat_groups == 0.0 and ma.reward_mean == 0.5 and ma.groups == 3 and ma.completions == 12


def test_compute_then_apply_gradients_is_step() -> None:
    """The split a data-parallel caller uses (``.grad`` averaged in between) is ``step``, to the bit."""
    torch.set_num_threads(1)
    whole = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3))
    split = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3))
    for n_groups in (3, 2):
        m = whole.step(fake_rollouts(n_groups))
        half = split.compute_gradients(fake_rollouts(n_groups))
        assert split.steps == m.step - 1 and half.grad_norm is None  # no optimizer step yet
        assert split.apply_gradients() == m.grad_norm and split.steps == m.step
        assert (half.loss, half.entropy, half.reward_mean) == (m.loss, m.entropy, m.reward_mean)
    a, b = whole.local.state_fp32(), split.local.state_fp32()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="steps_per_batch"):
        GRPOTrainer(build_tiny_model(0), GRPOConfig(steps_per_batch=2)).compute_gradients(fake_rollouts())


def test_several_steps_per_batch_clip_and_kl_reference() -> None:
    torch.set_num_threads(1)
    trainer = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=3e-2, steps_per_batch=3, beta=0.1))
    m = trainer.step(fake_rollouts())
    assert trainer.steps == m.step == 3
    assert m.clip_frac > 0  # by the later steps on the same batch ρ has left [0.8, 1.28]
    assert m.kl_ref == 0.0  # the reference is the initial weights: identical at the first step
    m2 = trainer.step(fake_rollouts())
    assert m2.kl_ref is not None and m2.kl_ref > 0


def test_malformed_rollouts_are_refused() -> None:
    trainer = GRPOTrainer(build_tiny_model(0))
    good = fake_rollouts(1, 2)
    with pytest.raises(ValueError, match="logprobs"):
        trainer.step([good[0], Rollout(**{**_asdict(good[1]), "logprobs": (-1.0,) * 9})])
    with pytest.raises(ValueError, match="mixes different prompts"):
        trainer.step([good[0], Rollout(**{**_asdict(good[1]), "prompt_ids": (1, 2)})])
    with pytest.raises(ValueError):
        trainer.step([])
    assert trainer.steps == 0


def _asdict(r: Rollout) -> dict[str, object]:
    return {f: getattr(r, f) for f in r.__slots__}  # type: ignore[attr-defined]


def test_temperature_is_applied_like_the_engine(cache_dir: Path) -> None:
    task = tiny_task(0)
    problems = assign_problems(task, node="t", version=0, seed=1, n=4)
    for temp, expect_zero in ((0.7, True), (1.0, False)):
        trainer = GRPOTrainer(warm_tiny_model(cache_dir), GRPOConfig(lr=1e-3, temperature=temp))
        rolls = _rollouts(
            trainer.local.logits, task, problems, 4, torch.Generator().manual_seed(0), temperature=0.7
        )
        m = trainer.step(rolls)
        assert (m.mismatch_kl < 1e-9) is expect_zero, (temp, m.mismatch_kl)


# --- learning ----------------------------------------------------------------


def test_grpo_raises_reward_from_a_warm_start(cache_dir: Path) -> None:
    """Warm-up lifts the sampled reward off 0; GRPO raises it further; mismatch measured (same forward)."""
    task = tiny_task(0)
    eval_set = assign_problems(task, node="eval", version=0, seed=99, n=32)
    cold = build_tiny_model(0)
    cold_reward = _reward(lambda x: cold(input_ids=x).logits, task, eval_set, g=2)
    model = warm_tiny_model(cache_dir, steps=WARMUP_STEPS, seed=0)
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3, seed=0))
    warm_reward = _reward(trainer.local.logits, task, eval_set, g=2)
    print(
        f"\nsampled reward: random init {cold_reward:.3f}, after {WARMUP_STEPS} warm-up steps {warm_reward:.3f}"
    )
    assert cold_reward < 0.05 and warm_reward > 0.2

    # GRPO on a fixed pool of 8 problems, G = 8, sampled by the model itself (the trainer's forward).
    pool = assign_problems(task, node="train", version=0, seed=0, n=8)
    gen = torch.Generator().manual_seed(0)
    curve, mismatch = [], []
    for step in range(16):
        m = trainer.step(_rollouts(trainer.local.logits, task, pool, 8, gen, version=step))
        curve.append(m.reward_mean)
        mismatch.append((m.mismatch_kl, m.mismatch_max))
    print(f"GRPO reward per step: {[round(r, 3) for r in curve]}")
    print(f"mismatch (k3 KL, max |dlogp|) per step: {sorted(set(mismatch))}")
    assert sum(curve[-4:]) / 4 > sum(curve[:4]) / 4 + 0.15
    # Same weights, same forward, different batch shapes: identical to the last bit on this CPU build.
    assert all(kl < 1e-6 and mx < 1e-4 for kl, mx in mismatch)


def test_a_bf16_engine_shows_up_as_mismatch(cache_dir: Path) -> None:
    """An engine computing in BF16 (weights and activations) is a different program: measured, not hidden."""
    task = tiny_task(0)
    model = warm_tiny_model(cache_dir)
    engine = build_tiny_model(0).to(torch.bfloat16)
    engine.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    trainer = GRPOTrainer(model, GRPOConfig(lr=1e-3))
    pool = assign_problems(task, node="bf16", version=0, seed=0, n=8)
    rolls = _rollouts(
        lambda x: engine(input_ids=x).logits.float(), task, pool, 8, torch.Generator().manual_seed(0)
    )
    m = trainer.step(rolls)
    print(
        f"\nBF16 engine vs bf16-weights trainer: mismatch k3 KL {m.mismatch_kl:.2e}, max |dlogp| {m.mismatch_max:.3f}, "
        f"TIS-truncated {m.tis_frac:.4f}"
    )
    assert 0 < m.mismatch_kl < 0.05 and m.mismatch_max > 0


def test_reference_sampler_records_tempered_logprobs_and_stops() -> None:
    base = torch.tensor([0.0, 1.0, 4.0])

    def logits_fn(x: torch.Tensor) -> torch.Tensor:
        return base.expand(x.shape[0], x.shape[1], 3)

    (greedy,) = sample_group(logits_fn, [0], 1, max_new_tokens=4, eos_id=2, temperature=0)
    assert greedy.completion_ids == (2,)  # EOS is kept in the completion, then it stops
    assert greedy.logprobs == pytest.approx([float(torch.log_softmax(base, 0)[2])], abs=1e-6)
    gen = torch.Generator().manual_seed(0)
    samples = sample_group(logits_fn, [0, 1], 6, max_new_tokens=3, eos_id=7, temperature=2.0, generator=gen)
    tempered = torch.log_softmax(base / 2.0, 0)
    for s in samples:
        assert len(s.completion_ids) == len(s.logprobs) == 3  # no EOS in the vocab: runs to the limit
        assert s.logprobs == pytest.approx([float(tempered[t]) for t in s.completion_ids], abs=1e-6)


def test_checkpoint_restore_continues_identically() -> None:
    torch.set_num_threads(1)
    cfg = GRPOConfig(lr=1e-3, beta=0.1)
    a = GRPOTrainer(build_tiny_model(0), cfg)
    a.step(fake_rollouts())
    ck = a.checkpoint()
    ma = a.step(fake_rollouts(2))
    b = GRPOTrainer(build_tiny_model(5), cfg)  # other weights and reference until restored
    b.restore(ck)
    mb = b.step(fake_rollouts(2))
    assert ma == mb and b.steps == 2
    sa, sb = a.local.state_fp32(), b.local.state_fp32()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
