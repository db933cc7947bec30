"""Replay: the trainer's check that each rollout row is what the policy sampled (docs/rollouts.md).

An inference node serves weights bit-identical to a version the trainer published, and draws every
token with the public draw (rl/draw.py). So the trainer, holding that version's weights, can
recompute each completion position's distribution in one teacher-forced forward and check, per
token:

(a) ``replay_token``: the token is the one the position's public uniform selects: its CDF interval
    (token-id order) contains u, up to ``cdf_tolerance`` of probability mass for kernel noise
    at a boundary (a trainer's forward and an engine's differ in batch shape, KV cache and kernels);
(b) ``replay_logprob``: the reported log-prob is the trainer's within ``logprob_tolerance``, and
    within ``mean_logprob_tolerance`` on average over the batch's replayed tokens (noise averages
    out; other weights shift every token);
(c) ``replay_params``: the completion obeys the task's sampling parameters: at most
    ``max_new_tokens``, ended by a stop token or string exactly when it ends early, nothing
    after it (temperature and top-p are checked by (a) and (b): they shape the distribution).

One failing row refuses its batch. What a row proves: its tokens are the policy's draw for public
data the node cannot vary (run, version digest, node, trainer-assigned batch and problem, its index
in the group, the position), so a node cannot choose completions, keep the best of n, rescale its
log-probs, sample at another temperature, or serve other weights, beyond what the tolerances let
through (measured: docs/rollouts.md).

Rows checked: ``ReplayConfig.share`` of each batch (at least ``min_rows``, all if fewer), drawn by
the trainer after the node committed the batch (the node cannot know which), so a cheat touching
every row is caught in every batch; the share bounds the cost (one no-grad forward of those rows;
``pulsenet bench replay`` measures it against the GRPO step).

The forward: FP32 math on the version's BF16 values (the trainer's ``bf16-weights`` forward and
the torch engine's on CPU), from the trainer's own copy of that version's published state.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pulsenet.errors import ConfigError
from pulsenet.rl.draw import boundary_margin, uniforms
from pulsenet.rl.grpo import micro_batches
from pulsenet.rl.sampling import SamplingParams
from pulsenet.rl.versions import VersionStore
from pulsenet.rollouts.intake import REPLAY_REASONS

REASONS = REPLAY_REASONS
"""Why a batch is refused by replay (counted per node in /status ``rejected`` and /metrics)."""


@dataclass(kw_only=True, slots=True)
class ReplayConfig:
    """The trainer's replay of the rows it takes ([trainer.replay]).

    The default tolerances fit engines that compute in FP32 on the BF16 weights, as both engines do
    on CPU, with a margin of ~70x or more over what honest rows showed (|Δ log-prob| at most 7.2e-5,
    batch means at most 4.6e-6, CDF margins above -4.3e-6 over 10,000+ honest rows per engine;
    docs/rollouts.md). They were 0.02 / 0.05 / 0.01 until the measurements showed honest rows 1,000x
    inside them and a one-version-stale or weakly perturbed model passing.

    An engine computing in BF16 (vLLM and the torch engine on CUDA) differs from the trainer's FP32
    replay by far more: on vLLM-CPU in BF16 every SmolLM2 batch was refused even at those looser
    values (|Δ log-prob| up to 0.3, CDF margins down to -0.045, docs/engines.md). A run with BF16
    engines either computes in FP32 (``vllm.dtype``, ``torch.compute_dtype``) or loosens these
    three settings, and what a node may then hide grows with them (docs/security.md); BF16 margins
    on a GPU are not measured yet."""

    enabled: bool = True
    """Replay rows before training on them; off trusts every allowlisted node's rows as signed."""
    top_p: float = 1.0
    """The nucleus the inference nodes sample with (their ``top_p``); the temperature is GRPO's."""
    share: float = 0.25
    """Share of each batch's rows replayed (drawn by the trainer after the batch is committed)."""
    min_rows: int = 8
    """Rows replayed per batch at least (all of a smaller batch)."""
    cdf_tolerance: float = 1e-3
    """Probability mass a claimed token's uniform may lie outside its CDF interval (kernel noise:
    honest rows on both CPU engines came within 4.3e-6 of it; the window is also what a node may
    shift a token within, so it is kept near the noise, not near a token's mass)."""
    logprob_tolerance: float = 5e-3
    """|reported − recomputed| log-prob allowed per token (honest: at most 7.2e-5 measured)."""
    mean_logprob_tolerance: float = 1e-3
    """Mean |reported − recomputed| log-prob allowed over a batch's replayed tokens: kernel noise
    averages out (honest batch means at most 4.6e-6 measured), a model that is not the version's
    (stale, perturbed) shifts every token a little."""
    micro_batch_tokens: int = 4096
    """Padded tokens per replay forward at most."""

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"replay.top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.share <= 1:
            raise ConfigError(f"replay.share must be in (0, 1], got {self.share}")
        if self.min_rows < 1:
            raise ConfigError(f"replay.min_rows must be >= 1, got {self.min_rows}")
        if not 0 <= self.cdf_tolerance < 0.5 or not self.logprob_tolerance >= 0 or not self.mean_logprob_tolerance >= 0:
            raise ConfigError("replay tolerances must be >= 0 (cdf_tolerance < 0.5)")
        if self.micro_batch_tokens < 1:
            raise ConfigError("replay.micro_batch_tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class ReplayRow:
    """What replay needs of one row: the tokens, the node's log-probs and the row's draw key."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    key: bytes


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of replaying a batch's chosen rows: ``reason`` None when every row passed."""

    rows: tuple[int, ...]
    """The rows (indices into the batch) that were replayed."""
    reason: str | None = None
    row: int | None = None
    """The first failing row (an index into the batch)."""
    detail: str = ""
    margins: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """Each replayed token's CDF margin (``rl.draw.boundary_margin``; < 0: outside its interval)."""
    logprob_diffs: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """Each replayed token's |reported − recomputed| log-prob."""

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(slots=True)
class ReplayStats:
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    """Batches refused, by reason."""
    unverifiable: int = 0
    """Batches whose version's weights this trainer no longer (or never) held: not taken, not
    held against the node (a restarted trainer holds only the versions it published since)."""
    seconds: float = 0.0
    worst_margin: float | None = None
    """The smallest CDF margin an accepted batch had (how close honest rows came to a refusal)."""
    worst_logprob_diff: float | None = None
    """The largest |Δ log-prob| an accepted batch had."""


class Replayer:
    """Holds the last ``keep`` versions' BF16 weights (``versions``) and replays rows against them
    in one FP32 forward model."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        params: SamplingParams,
        config: ReplayConfig | None = None,
        *,
        keep: int,
        stopped: Callable[[Sequence[int]], bool] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """``params``: the task's sampling parameters (what every node must sample with);
        ``stopped(completion_ids)``: whether a completion's text ends at one of ``params.stop``
        (needs the tokenizer; None when the task has no stop strings); ``keep``: versions held."""
        if params.stop and stopped is None:
            raise ConfigError("replay needs the task's decode to check stop strings")
        self.config = config or ReplayConfig()
        self.params, self.keep, self.stopped = params, max(1, keep), stopped
        self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
        self._params = dict(self.model.named_parameters())
        self.versions = VersionStore(self.keep)
        """The versions held: the newest whole, older ones as undo patches (rl/versions.py)."""
        self._loaded: int | None = None
        self.rng = rng or random.SystemRandom()
        self.stats = ReplayStats()
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = set() if eos is None or not params.stop_at_eos else {eos} if isinstance(eos, int) else set(eos)
        self._stop_ids = frozenset(params.stop_token_ids) | eos_ids
        """What ends a completion: the task's stop tokens and, as the engines do, the model's EOS."""

    # --- the versions held ---------------------------------------------------------------------

    def remember(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """A version this trainer published (its BF16 state, not copied: published states are
        never written to; the previous newest is kept as an undo patch against it); the oldest
        beyond ``keep`` is forgotten."""
        missing = set(self._params) - set(state)
        if missing:
            raise ConfigError(f"replay: the published state lacks {sorted(missing)[:4]}")
        self.versions.remember(version, state)

    def holds(self, version: int) -> bool:
        return version in self.versions

    def _load(self, version: int) -> None:
        if self._loaded != version:
            self.versions.load_into(version, self._params)
            self._loaded = version

    # --- the check -----------------------------------------------------------------------------

    def pick(self, n: int) -> list[int]:
        """The rows of an ``n``-row batch to replay: drawn now, by this trainer, after the batch
        was committed (sorted, so a forward reads them in order)."""
        c = self.config
        k = min(n, max(c.min_rows, round(c.share * n)))
        return sorted(self.rng.sample(range(n), k))

    @torch.inference_mode()
    def check(self, version: int, rows: Sequence[ReplayRow], picked: Sequence[int] | None = None) -> Verdict:
        """Replay ``picked`` rows of a batch served at ``version`` (default: ``pick``). The version
        must be held (``holds``)."""
        chosen = tuple(self.pick(len(rows)) if picked is None else picked)
        read = [rows[i] for i in chosen]  # only these are read (``rows`` may make them on demand)
        for i, row in zip(chosen, read, strict=True):
            why = self._params_broken(row)
            if why is not None:
                return self._count(Verdict(chosen, "replay_params", i, why))
        self._load(version)
        sizes = [len(r.prompt_ids) + len(r.completion_ids) for r in read]
        parts = [self._replay([read[j] for j in part])
                 for part, _ in micro_batches(range(len(read)), sizes, None, self.config.micro_batch_tokens)]  # fmt: skip
        margins = torch.cat([m for m, _ in parts]) if parts else torch.zeros(0)
        diffs = torch.cat([d for _, d in parts]) if parts else torch.zeros(0)
        verdict = Verdict(chosen, margins=margins, logprob_diffs=diffs)
        if not margins.numel():
            return self._count(verdict)
        # Every token at once; the first row with a failing token is named (micro-batches keep
        # ``chosen``'s order), by its worst token if any is not the draw's, else its worst log-prob.
        owner = torch.repeat_interleave(torch.tensor(chosen), torch.tensor([len(r.completion_ids) for r in read]))
        c = self.config
        bad_token, bad_logprob = margins < -c.cdf_tolerance, diffs > c.logprob_tolerance
        failing = bad_token | bad_logprob
        if bool(failing.any()):
            row = int(owner[int(failing.nonzero()[0, 0])])
            mine = (owner == row).nonzero()[:, 0]
            if bool(bad_token[mine].any()):
                t = int(margins[mine].argmin())
                return self._count(_with(verdict, "replay_token", row, f"token {t} is not the public draw's "
                                         f"(its uniform lies {-float(margins[mine[t]]):.4f} of mass outside "
                                         "the token's CDF interval)"))  # fmt: skip
            t = int(diffs[mine].argmax())
            off = float(diffs[mine[t]])
            return self._count(_with(verdict, "replay_logprob", row, f"token {t}'s log-prob is off by {off:.4f}"))
        mean = float(diffs.mean())
        if mean > c.mean_logprob_tolerance:
            return self._count(_with(verdict, "replay_logprob", None, f"the replayed tokens' log-probs are off by "
                                     f"{mean:.4f} on average"))  # fmt: skip
        return self._count(verdict)

    def _replay(self, rows: Sequence[ReplayRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """One right-padded causal forward (padding after a row cannot reach it), logits only from
        the first completion position on; the CDF margin and |Δ log-prob| of each completion token,
        rows in order, computed for all the rows' tokens at once."""
        seqs = [r.prompt_ids + r.completion_ids for r in rows]
        width = max(map(len, seqs))
        first = min(len(r.prompt_ids) for r in rows) - 1  # the first position that predicts a completion token
        ids = torch.tensor([q + (0,) * (width - len(q)) for q in seqs], dtype=torch.long)
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=width - first).logits
        lengths = torch.tensor([len(r.completion_ids) for r in rows])
        at_row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        starts = torch.tensor([len(r.prompt_ids) - 1 - first for r in rows])  # each row's first completion position
        offsets = torch.arange(len(at_row)) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        # [tokens, vocab]: the distribution each completion token was drawn from
        at = logits[at_row, torch.repeat_interleave(starts, lengths) + offsets].float()
        tokens = torch.tensor([t for r in rows for t in r.completion_ids], dtype=torch.long)
        reported = torch.tensor([x for r in rows for x in r.logprobs], dtype=torch.float32)
        p = self.params
        logp_all = torch.log_softmax(at if p.greedy else at / p.temperature, dim=-1)
        logp = logp_all.gather(1, tokens[:, None])[:, 0]
        if p.greedy:  # no draw: the token must be the argmax, up to the same tolerance in log-prob
            margins = logp - logp_all.max(dim=-1).values
        else:
            u = torch.tensor([x for r in rows for x in uniforms(r.key, 0, len(r.completion_ids))], dtype=torch.float64)
            margins = boundary_margin(at, tokens, u, p.temperature, p.top_p)
        return margins, (logp - reported).abs()

    def _params_broken(self, r: ReplayRow) -> str | None:
        """(c): the completion's length and ending obey the task's sampling parameters."""
        p, ids = self.params, r.completion_ids
        if not ids:
            return "an empty completion"
        if len(ids) > p.max_new_tokens:
            return f"{len(ids)} tokens, max_new_tokens is {p.max_new_tokens}"
        if len(ids) != len(r.logprobs):
            return f"{len(ids)} tokens but {len(r.logprobs)} log-probs"
        stops = self._stop_ids
        early = next((t for t, tok in enumerate(ids[:-1]) if tok in stops), None)
        if early is not None:
            return f"a stop token at {early} of {len(ids)}: the completion goes on past its end"
        # The text of every shorter prefix is a prefix of this one's: one decode, not one per token.
        if p.stop and self.stopped is not None and len(ids) > 1 and self.stopped(ids[:-1]):
            return "a stop string ends the completion before its last token"
        if len(ids) < p.max_new_tokens and ids[-1] not in stops and not (p.stop and self.stopped and self.stopped(ids)):
            return f"ended at {len(ids)} tokens (< max_new_tokens {p.max_new_tokens}) without a stop token or string"
        return None

    def _count(self, v: Verdict) -> Verdict:
        s = self.stats
        s.batches += 1
        s.rows += len(v.rows)
        s.tokens += int(v.margins.numel())
        if v.reason is not None:
            s.refused[v.reason] = s.refused.get(v.reason, 0) + 1
        elif v.margins.numel():
            s.worst_margin = min(float(v.margins.min()), s.worst_margin if s.worst_margin is not None else 1.0)
            worst = float(v.logprob_diffs.max())
            s.worst_logprob_diff = max(worst, s.worst_logprob_diff or 0.0)
        return v


def _with(v: Verdict, reason: str, row: int | None, detail: str) -> Verdict:
    return Verdict(v.rows, reason, row, detail, v.margins, v.logprob_diffs)
