"""GRPO on rollouts an inference engine sampled, corrected for the engine being a different program.

A batch is a list of ``Rollout`` rows: G completions o_i per prompt q, grouped by ``Rollout.group``,
each with its reward r_i and the log-prob the engine gave every token it sampled. With
T = Σ_i |o_i| the batch's completion tokens and π(·) short for π(o_{i,t} | q, o_{i,<t}) / temperature:

    A_i     = r_i − mean_{j ∈ group(i)} r_j            (÷ (std_group + 1e-4) only if scale_rewards)
    ρ_{i,t} = π_θ / π_old                              (π_old: the trainer's weights before this batch)
    w_{i,t} = min(π_old / π_engine, C)                 (truncated IS, detached; C = tis_cap = 2)
    ℓ_{i,t} = −w_{i,t} · min(ρ_{i,t} A_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high) A_i)  [+ β k3(π_ref ‖ π_θ)]
    L(θ)    = (1/T) Σ_i Σ_t ℓ_{i,t}

- Dr. GRPO: no division by the group std by default (it up-weights groups that are nearly all right or
  all wrong), and DAPO's token-level 1/T instead of a per-sequence mean (a long completion's
  tokens count as much as a short one's).
- DAPO's asymmetric clip, ε_high 0.28 > ε_low 0.2: lets unlikely tokens that paid off grow faster.
- TIS (verl, TRL): the tokens were drawn from π_engine, not π_old (a stale version, BF16 kernels,
  a KV cache). Weighing each token by π_old/π_engine makes the gradient an estimate under π_old;
  the cap bounds its variance. With one optimizer step per batch (``steps_per_batch=1``, the
  default) π_old is π_θ detached: ρ = 1 and no clipping happens, but ∇ρ = ∇ log π_θ, the right
  policy gradient; the clip matters from the second step on the same batch.
- Temperature: the engine records log-probs of softmax(logits / T), so the trainer divides its
  logits by the same ``GRPOConfig.temperature`` before every log-softmax. A mismatch shows up as
  a large ``mismatch_kl`` and TIS weights far from 1.

Metrics (``GRPOMetrics``): ``mismatch_kl`` is the k3 estimator of KL(π_engine ‖ π_old) on the sampled
tokens, mean over tokens of (ρ_e − 1) − log ρ_e with ρ_e = π_old/π_engine (prime-rl's
``mismatch_kl``): unbiased, ≥ 0, and exactly 0 only if both log-probs agree to the bit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pulsenet.codec.rollout import Rollout
from pulsenet.errors import ConfigError
from pulsenet.rl.local import FORWARDS, LocalTrainer, LocalTrainerConfig
from pulsenet.rl.parallel import DataParallel


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    lr: float = 3e-6
    """AdamW learning rate on the FP32 master; 3e-6 for real models (the tiny test model needs ~1e-3)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (TRL's default 0)."""
    grad_clip: float | None = 1.0
    """Max global grad norm (TRL's ``max_grad_norm``); None disables it."""
    forward: str = "bf16-weights"
    """One of ``local.FORWARDS``: the BF16 weights the engines serve, FP32 math (fast on any CPU)."""
    seed: int = 0
    """Seeds the underlying ``LocalTrainer``'s generators."""
    eps_low: float = 0.2
    """Lower clip: ρ below 1 − eps_low stops pushing a token down (negative advantage)."""
    eps_high: float = 0.28
    """Upper clip (DAPO's clip-higher): ρ above 1 + eps_high stops pushing a token up."""
    tis_cap: float | None = 2.0
    """Truncated IS cap C on π_old/π_engine (verl's 2.0); None turns the correction off (w = 1)."""
    scale_rewards: bool = False
    """Divide advantages by the group's reward std (original GRPO); off as in Dr. GRPO."""
    beta: float = 0.0
    """Weight of the k3 KL to a frozen copy of the initial weights; 0 (TRL, DAPO) keeps no copy."""
    temperature: float = 1.0
    """The engines' sampling temperature: logits are divided by it before every log-softmax, so
    the trainer's log-probs are those of the distribution the engine drew from."""
    steps_per_batch: int = 1
    """Optimizer steps on each batch (μ). 1: π_old = π_θ detached; >1: π_old is fixed at the first step."""
    micro_batch_size: int | None = None
    """Rows per forward/backward at most; gradients accumulate so the step is the same. None: as
    many as ``micro_batch_tokens`` allows."""
    micro_batch_tokens: int = 4096
    """Padded tokens (rows x the longest row's tokens) of one forward/backward at most (one row
    at least): each micro-batch is padded to its own longest row, so what one step holds at once is
    bounded by this whatever its rows' lengths (1024 short rows and one of 396 tokens, padded as one
    batch, drove a step past 3 GiB: issue 29). Logits take ``4 x vocab`` bytes per token."""
    pad_id: int = 0
    """Fills rows to a common length; padding comes after each row's tokens, so causal attention never sees it."""
    device: str = "cpu"
    """Where the model and the batch tensors live (``LocalTrainerConfig.device``); metrics stay on the CPU."""

    def __post_init__(self) -> None:
        if self.forward not in FORWARDS:
            raise ConfigError(f"forward must be one of {FORWARDS}, got {self.forward!r}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ConfigError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ConfigError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.temperature <= 0:
            raise ConfigError(
                f"temperature must be > 0 (greedy rollouts have no policy gradient), got {self.temperature}"
            )
        if self.steps_per_batch < 1 or (self.micro_batch_size is not None and self.micro_batch_size < 1):
            raise ConfigError("steps_per_batch and micro_batch_size must be >= 1")
        if self.micro_batch_tokens < 1:
            raise ConfigError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.beta < 0:
            raise ConfigError(f"beta must be >= 0, got {self.beta}")

    def local_config(self) -> LocalTrainerConfig:
        return LocalTrainerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            forward=self.forward,
            seed=self.seed,
            device=self.device,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class GRPOMetrics:
    """One ``GRPOTrainer.step``; token means are over the batch's completion tokens."""

    step: int
    """Optimizer steps taken so far, this batch's included: the policy version it produced."""
    reward_mean: float
    groups: int
    completions: int
    tokens: int
    """Completion tokens T, the DAPO normaliser."""
    flat_groups: float
    """Fraction of groups whose rewards are all equal: zero advantage, no learning signal."""
    loss: float
    """L(θ) at the first optimizer step on the batch."""
    clip_frac: float
    """Tokens whose clipped term was active (ρ < 1−ε_low with A < 0, or ρ > 1+ε_high with A > 0), mean over steps."""
    entropy: float
    """Mean per-token entropy of the trainer's temperature-scaled distribution (π_old)."""
    mismatch_kl: float
    """k3 estimate of KL(π_engine ‖ π_old) on the sampled tokens (see module docstring)."""
    mismatch_max: float
    """Largest |log π_engine − log π_old| over the tokens."""
    tis_frac: float
    """Tokens whose IS weight π_old/π_engine was truncated at ``tis_cap``."""
    kl_ref: float | None
    """Mean k3 KL(π_θ ‖ π_ref) at the first step when ``beta > 0``, else None."""
    grad_norm: float | None
    """Global grad norm before clipping at the last step (None when clipping is off)."""

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


# --- the math, as pure functions ---------------------------------------------


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, *, scale: bool = False, eps: float = 1e-4
) -> torch.Tensor:
    """A_i = r_i − mean of its group (÷ (unbiased group std + eps) if ``scale``, as TRL).

    ``groups`` holds a group index in ``[0, n_groups)`` per reward; groups need not be contiguous.
    A group of one has advantage 0.
    """
    n = int(groups.max()) + 1 if groups.numel() else 0
    count = torch.zeros(n, dtype=rewards.dtype).index_add_(0, groups, torch.ones_like(rewards))
    mean = torch.zeros(n, dtype=rewards.dtype).index_add_(0, groups, rewards) / count
    adv = rewards - mean[groups]
    if scale:
        sq = torch.zeros(n, dtype=rewards.dtype).index_add_(0, groups, adv * adv)
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        adv = adv / (std[groups] + eps)
    return adv


def tis_weights(old_logp: torch.Tensor, engine_logp: torch.Tensor, cap: float | None) -> torch.Tensor:
    """w = min(π_old/π_engine, cap), no gradient; all ones when ``cap`` is None."""
    if cap is None:
        return torch.ones_like(old_logp)
    return torch.exp(old_logp - engine_logp).clamp(max=cap).detach()


def grpo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    ref_logp: torch.Tensor | None = None,
    beta: float = 0.0,
    n_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/T) Σ masked ℓ_{i,t} and the bool map of tokens where the clip was active.

    ``logp``/``old_logp``/``weights``/``ref_logp``/``mask``: ``[rows, tokens]``; ``advantages``:
    ``[rows]``. ``n_tokens`` is T, the whole batch's completion tokens: pass it when this call
    sees one micro-batch, so the accumulated gradients equal the full batch's (DAPO).
    """
    adv = advantages[:, None]
    ratio = torch.exp(logp - old_logp.detach())
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    per_token = -surrogate if weights is None else -weights * surrogate
    if beta:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp.detach() - logp
        per_token = per_token + beta * (torch.exp(d) - d - 1)  # k3 estimator of KL(π_θ ‖ π_ref)
    clipped = ((ratio < 1 - eps_low) & (adv < 0)) | ((ratio > 1 + eps_high) & (adv > 0))
    total = int(mask.sum()) if n_tokens is None else n_tokens
    loss = (per_token * mask).sum() / max(total, 1)
    return loss, clipped & mask


def k3(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """Per-sample k3 estimate of KL(p ‖ q) from samples of p: (q/p − 1) − log(q/p)."""
    d = logp_q - logp_p
    return torch.exp(d) - d - 1


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# --- the trainer -------------------------------------------------------------


@dataclass(slots=True)
class _Batch:
    ids: torch.Tensor
    """[rows, L] prompt + completion, padded after."""
    mask: torch.Tensor
    """[rows, L-1] True where position t predicts a completion token ids[:, t+1]."""
    engine_logp: torch.Tensor
    """[rows, L-1] the engine's log-probs on the masked positions, 0 elsewhere."""
    advantages: torch.Tensor
    rewards: torch.Tensor
    groups: torch.Tensor


class GRPOTrainer:
    """GRPO steps on ``list[Rollout]`` over a ``LocalTrainer`` (FP32 master, AdamW, BF16-faithful forward)."""

    def __init__(self, model: torch.nn.Module, config: GRPOConfig | None = None) -> None:
        self.config = config if config is not None else GRPOConfig()
        self.local = LocalTrainer(model, self.config.local_config())
        self.reference: LocalTrainer | None = None
        if self.config.beta > 0:
            ref_model = copy.deepcopy(model)
            ref_model.requires_grad_(False)
            self.reference = LocalTrainer(ref_model, self.config.local_config())
        self.parallel: DataParallel | None = None
        """Set by a data-parallel rank group (``rl.distributed.RankGroup``): this process steps on its shares only."""

    @property
    def steps(self) -> int:
        return self.local.steps

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """The BF16 weights to publish (PULSESync) after a step."""
        return self.local.bf16_state()

    def checkpoint(self) -> dict[str, Any]:
        """``LocalTrainer.checkpoint`` plus the reference weights when ``beta > 0``; ``torch.save``-able."""
        ck = self.local.checkpoint()
        if self.reference is not None:
            ck["reference"] = self.reference.state_fp32()
        return ck

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.local.restore(checkpoint)
        if self.reference is not None:
            self.reference.load_state_fp32(checkpoint["reference"])

    def step(self, rollouts: Sequence[Rollout]) -> GRPOMetrics:
        """``steps_per_batch`` optimizer steps on one batch of rollouts; returns its metrics.

        See ``_step`` for a data-parallel rank group (``self.parallel``)."""
        return self._step(rollouts, apply=True)

    def compute_gradients(self, rollouts: Sequence[Rollout]) -> GRPOMetrics:
        """The first half of ``step``: the gradient of L(θ) on one batch into the parameters'
        ``.grad``, and no optimizer step; ``apply_gradients`` is the other half.

        Between the two, a data-parallel caller replaces ``.grad`` with the average of every
        worker's (``bench/loco_grpo.run_ddp``), so every worker takes the same step. Needs
        ``steps_per_batch`` = 1: a second step on the batch would need the first applied. The
        metrics' ``step`` is the step count before the update and ``grad_norm`` is None (the norm
        that counts is the averaged gradient's: ``apply_gradients`` returns it).
        """
        if self.config.steps_per_batch != 1:
            raise ConfigError("compute_gradients needs steps_per_batch = 1; use step for more")
        return self._step(rollouts, apply=False)

    def apply_gradients(self) -> float | None:
        """Clip and AdamW-step the gradients in ``.grad`` (``LocalTrainer.apply_gradients``)."""
        return self.local.apply_gradients()

    def _step(self, rollouts: Sequence[Rollout], *, apply: bool) -> GRPOMetrics:
        """``step`` (``apply``), or its gradients only (``compute_gradients``).

        With ``self.parallel`` set (a data-parallel rank group, ``rl.parallel.DataParallel``) this
        process computes only its shares of the batch, rows ``r::world`` for each share ``r``, every
        loss still normalised by the whole batch's token count T; ``parallel.sum_gradients`` then
        sums the shares' gradients over the rank group before the one optimizer step, so every rank
        takes the whole batch's step. Metrics are summed over the rank group the same way.
        """
        cfg = self.config
        batch = self._collate(rollouts)
        n_tokens = int(batch.mask.sum())
        rows = len(rollouts)
        par = self.parallel
        world, shares = (1, (0,)) if par is None else (par.world, par.shares)
        lengths = [len(x.prompt_ids) + len(x.completion_ids) for x in rollouts]
        slices = []  # (share, row indices of one micro-batch, its padded width), shares in rank order
        for r in shares:
            mine = list(range(r, rows, world))
            slices += [
                (r, torch.tensor(s), w) for s, w in micro_batches(mine, lengths, cfg.micro_batch_size, cfg.micro_batch_tokens)
            ]
        old: list[torch.Tensor] = []
        # loss at step 0, entropy, k3 to the reference, clipped tokens: sums over this process's rows
        sums = torch.zeros(4, dtype=torch.float64)
        grad_norm = None
        for k in range(cfg.steps_per_batch):
            self.local.model.train()
            self.local.optimizer.zero_grad(set_to_none=True)
            for j, (r, s, w) in enumerate(slices):
                ids, mask, engine = batch.ids[s, :w], batch.mask[s, : w - 1], batch.engine_logp[s, : w - 1]
                logits = self._logits(self.local, ids)
                logp = _gather(logits, ids)
                if k == 0:
                    # π_old is the weights the batch found; ρ = 1 at the first step, gradient intact.
                    old.append(logp.detach())
                    with torch.no_grad():
                        sums[1] += float((token_entropy(logits) * mask).sum())
                del logits  # the largest tensor of the step: not kept through the backward's peak
                ref_logp = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref_logp = _gather(self._logits(self.reference, ids), ids)
                    if k == 0:
                        sums[2] += float((k3(logp.detach(), ref_logp) * mask).sum())
                loss, clipped = grpo_token_loss(
                    logp, old[j], batch.advantages[s], mask,
                    weights=tis_weights(old[j], engine, cfg.tis_cap),
                    eps_low=cfg.eps_low, eps_high=cfg.eps_high, ref_logp=ref_logp, beta=cfg.beta,
                    n_tokens=n_tokens,
                )  # fmt: skip
                if par is not None:
                    par.before_backward(self.local.model, last=j + 1 == len(slices))
                loss.backward()
                sums[3] += int(clipped.sum())
                if k == 0:
                    sums[0] += float(loss.detach())
                if par is not None and (j + 1 == len(slices) or slices[j + 1][0] != r):
                    par.share_done(self.local.model)
            if par is not None and not slices:  # fewer rows than ranks: join the rank group's gradient sum with zeros
                par.before_backward(self.local.model, last=True)
                (self._logits(self.local, batch.ids[:1]).sum() * 0).backward()
            if par is not None:
                par.sum_gradients(self.local.model)
            norms = par.chunk_norms if par is not None else None
            grad_norm = self.local.apply_gradients(norms) if apply else None
        diffs, kl_sum = [], 0.0  # each micro-batch at its own width
        for (_, s, w), old_logp in zip(slices, old, strict=True):
            tokens, engine = batch.mask[s, : w - 1], batch.engine_logp[s, : w - 1]
            diffs.append((old_logp - engine)[tokens])
            kl_sum += float(k3(engine[tokens], old_logp[tokens]).sum())
        diff = torch.cat(diffs) if diffs else torch.zeros(0)
        truncated = 0
        if cfg.tis_cap is not None:
            truncated = int((torch.exp(diff) > cfg.tis_cap).sum())
        worst = torch.tensor([float(diff.abs().max()) if diff.numel() else 0.0], dtype=torch.float64)
        sums = torch.cat([sums, torch.tensor([truncated, kl_sum], dtype=torch.float64)])
        if par is not None:
            sums, worst = par.sum_metrics(sums), par.max_metrics(worst)
        loss0, entropy, kl_ref, clip_count, truncated, kl_sum = sums.tolist()
        denom = max(n_tokens, 1)
        flat = _flat_groups(batch.rewards, batch.groups)
        return GRPOMetrics(
            step=self.local.steps,
            reward_mean=float(batch.rewards.mean()),
            groups=int(batch.groups.max()) + 1,
            completions=rows,
            tokens=n_tokens,
            flat_groups=flat,
            loss=loss0,
            clip_frac=clip_count / (denom * cfg.steps_per_batch),
            entropy=entropy / denom,
            mismatch_kl=kl_sum / denom,
            mismatch_max=float(worst[0]),
            tis_frac=truncated / denom,
            kl_ref=kl_ref / denom if self.reference is not None else None,
            grad_norm=grad_norm,
        )

    # --- helpers -------------------------------------------------------------

    def _logits(self, trainer: LocalTrainer, ids: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled FP32 logits at the positions that predict a next token."""
        return trainer.logits(ids)[:, :-1, :].float() / self.config.temperature

    def _collate(self, rollouts: Sequence[Rollout]) -> _Batch:
        if not rollouts:
            raise ValueError("GRPO needs at least one rollout")
        group_index: dict[str, int] = {}
        prompts: dict[str, tuple[int, ...]] = {}
        for r in rollouts:
            if not r.prompt_ids:
                raise ValueError(f"rollout in group {r.group!r} has an empty prompt")
            if len(r.completion_ids) != len(r.logprobs):
                raise ValueError(
                    f"rollout in group {r.group!r}: {len(r.completion_ids)} tokens but {len(r.logprobs)} logprobs"
                )
            if prompts.setdefault(r.group, r.prompt_ids) != r.prompt_ids:
                raise ValueError(f"group {r.group!r} mixes different prompts")
            group_index.setdefault(r.group, len(group_index))
        width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
        ids = torch.full((len(rollouts), width), self.config.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rollouts), width - 1), dtype=torch.bool)
        engine = torch.zeros((len(rollouts), width - 1), dtype=torch.float32)
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            ids[i, : p + c] = torch.tensor(r.prompt_ids + r.completion_ids, dtype=torch.long)
            mask[i, p - 1 : p + c - 1] = True  # logits at t predict token t+1
            engine[i, p - 1 : p + c - 1] = torch.tensor(r.logprobs, dtype=torch.float32)
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        groups = torch.tensor([group_index[r.group] for r in rollouts], dtype=torch.long)
        adv = group_advantages(rewards, groups, scale=self.config.scale_rewards)
        dev = self.local.device  # what the loss reads goes to the model; rewards and groups feed CPU metrics
        return _Batch(
            ids=ids.to(dev), mask=mask.to(dev), engine_logp=engine.to(dev), advantages=adv.to(dev),
            rewards=rewards, groups=groups,
        )  # fmt: skip


def micro_batches(
    rows: Sequence[int], lengths: Sequence[int], max_rows: int | None, max_tokens: int
) -> list[tuple[list[int], int]]:
    """``rows`` (indices into ``lengths``) cut in order into micro-batches of at most ``max_rows``
    rows and ``max_tokens`` padded tokens (rows x the longest one's length; a row longer than that
    alone), each with its padded width: the largest shape a forward of the step sees."""
    out: list[tuple[list[int], int]] = []
    cur: list[int] = []
    width = 0
    for i in rows:
        w = max(width, lengths[i])
        if cur and ((max_rows is not None and len(cur) >= max_rows) or (len(cur) + 1) * w > max_tokens):
            out.append((cur, width))
            cur, w = [], lengths[i]
        cur.append(i)
        width = w
    if cur:
        out.append((cur, width))
    return out


def _gather(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[t, ids[t+1]]: the log-prob of each next token, ``[rows, L-1]``."""
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def _flat_groups(rewards: torch.Tensor, groups: torch.Tensor) -> float:
    n = int(groups.max()) + 1
    flat = sum(1 for g in range(n) if rewards[groups == g].unique().numel() == 1)
    return flat / n
