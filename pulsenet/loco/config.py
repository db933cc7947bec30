"""Settings of a PULSELoCo run and what each round reports."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from pulsenet.codec import payload as wire
from pulsenet.errors import ConfigError
from pulsenet.loco.documents import Record, Timeouts
from pulsenet.loco.layout import check_run_id

MODES = {"pulseloco": wire.SPARSE, "diloco": wire.DENSE}


@dataclass(kw_only=True, slots=True)
class LocoConfig:
    """Algorithm and protocol settings of one run; every trainer of the run must use the same."""

    run: str = "default"
    """The run's id: every document is signed for it (and the store URL), so one signed for another
    run (or another store) is refused even under a trusted key."""
    mode: Literal["pulseloco", "diloco"] = "pulseloco"
    """``pulseloco`` (gated sparse payload + error feedback) or ``diloco`` (dense FP32 baseline)."""
    inner_steps: int = 8
    """H: local AdamW steps per round (the inner optimizer is the LocalTrainer's)."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate (DiLoCo's 0.7; 1.0 with momentum 0 is plain averaging)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (DiLoCo's 0.9)."""
    gate_scale: float = 1.0
    """Send where ``bf16(θ - gate_scale·s) != bf16(θ)``; 1 is the specified gate. ``outer_lr x (1 +
    outer_momentum)`` (1.33 by default) gates on what the Nesterov step does with a fresh update:
    more bytes, less lag behind DiLoCo (measured in docs/loco.md section 9)."""
    overlap: bool = False
    """The one-round-delayed outer step (asynchronous DiLoCo): round r+1's inner phase runs while
    round r is exchanged, and its progress is re-based onto θ_r when round r closes (docs/loco.md).
    Every trainer computes the same θ either way; the payloads are one round stale."""
    workers_expected: int | None = None
    """A round closes as soon as this many payloads are in, without waiting for the deadline;
    None: every trainer whose key the run trusts (``LocoTrainer`` fills it in)."""
    min_quorum: int | None = None
    """Fewest valid payloads a round may close with after the deadline; None: a majority of
    workers_expected. 1 of 2 is allowed: the create-only round record still decides one set for
    everyone, so a partition cannot fork the policy (docs/loco.md §6)."""
    join_wait_s: float = 120.0
    """At start, wait this long for workers_expected trainers to announce themselves (start-up skew)."""
    deadline_s: float = 60.0
    """How long a trainer waits for peers after its own payload is ready before closing with a quorum."""
    absent_wait_s: float = 5.0
    """How long a round waits (at most ``deadline_s``) for a trainer that was not in the previous
    round's record and has not announced that it trains this one (its ``joining`` document): a
    trainer that is down costs its peers one deadline, not one per round."""
    round_timeout_s: float = 1800.0
    """An attempt at a round without a quorum ends (RoundTimeout, logged, not counted as a failure)
    once this has passed and the store has answered for the last ``deadline_s``; the next attempt
    resumes the same round with the payload already published (docs/loco.md §6)."""
    poll_s: float = 0.5
    """Mean interval between polls of the store (jittered x0.5-1.5 so trainers do not poll in lockstep)."""
    digest_wait_s: float = 15.0
    """How long to wait for the participants' post-round digests before judging with those present."""
    progress_log_s: float = 30.0
    """A trainer that waits (for peers' payloads, for the store) logs why this often."""
    retry_base_s: float = 0.5
    """First backoff of a retried upload or round attempt (doubles per retry, full jitter) ..."""
    retry_cap_s: float = 5.0
    """... up to this. Own uploads (payload, digest, checkpoint, state) retry until they land or
    their round is abandoned; a transient store failure is never counted as a round failure. Each
    failed call has already spent the store's own retries, so the cap mostly bounds how long after
    the store returns the next attempt comes (issue 24: within two polls plus one round)."""
    norm_factor: float = 10.0
    """Exclude a payload whose norm exceeds this multiple of the round's scale: the median norm
    with ``norm_min_payloads`` or more payloads, else the record writer's own payload norm (a
    reader refuses a record over ``norm_factor²`` x its own). Honest peers' norms measured within a
    factor 3.2 of each other in full rounds (docs/loco.md §4, "Validation")."""
    norm_weights_factor: float = 1.0
    """Exclude (and refuse to follow) any payload whose norm exceeds this multiple of the global
    weights' norm ‖θ‖, whatever the others: honest payloads measured at most 7.6% of ‖θ‖."""
    norm_min_payloads: int = 3
    """Valid payloads from which the median is the round's scale (with fewer, the writer's own norm)."""
    state_every: int = 10
    """Publish the agreed global state every this many rounds (repair and catch-up start from it)."""
    checkpoint_every: int = 5
    """Upload this trainer's own resume point every this many rounds (0: never; local disk only)."""
    retain_rounds: int | None = 100
    """Delete own round objects, and the shared global states, older than this many rounds (None keeps
    all: a run of days would grow its buckets without bound). At least 2 x state_every rounds are
    kept, so that replay from a retained state always finds its payloads."""
    repair_replay_rounds: int | None = None
    """The most rounds a repair (a digest mismatch) replays from a published state; None: ``2 x
    state_every``. Older states are not tried: a trainer that lies about its digests costs its
    peers at most this much replay, once (docs/loco.md §5)."""
    max_round_failures: int = 3
    """Consecutive failed rounds (RoundError) before the trainer gives up."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Store deadlines of the protocol's calls (defaults: pulsenet/deadlines.py)."""

    def __post_init__(self) -> None:
        check_run_id(self.run)
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if self.inner_steps < 1 or self.state_every < 1 or (self.workers_expected or 1) < 1:
            raise ConfigError("inner_steps, workers_expected and state_every must be >= 1")
        if self.min_quorum is not None and self.min_quorum < 1:
            raise ConfigError(f"min_quorum must be >= 1 or None, got {self.min_quorum}")
        if not (self.norm_factor > 1 and self.norm_weights_factor > 0 and self.norm_min_payloads >= 1):
            raise ConfigError("norm_factor must be > 1, norm_weights_factor > 0 and norm_min_payloads >= 1")
        if not (self.retry_base_s > 0 and self.retry_cap_s >= self.retry_base_s and self.progress_log_s > 0):
            raise ConfigError("retry_base_s and progress_log_s must be > 0, retry_cap_s >= retry_base_s")
        if self.repair_replay_rounds is not None and self.repair_replay_rounds < 1:
            raise ConfigError(f"repair_replay_rounds must be >= 1 or None, got {self.repair_replay_rounds}")
        if self.retain_rounds is not None and self.retain_rounds < 1:
            raise ConfigError(f"retain_rounds must be >= 1 or None, got {self.retain_rounds}")
        if not self.absent_wait_s >= 0:
            raise ConfigError(f"absent_wait_s must be >= 0, got {self.absent_wait_s}")
        if not self.gate_scale > 0:
            raise ConfigError(f"gate_scale must be > 0, got {self.gate_scale}")
        if self.workers_expected is not None and self.quorum > self.workers_expected:
            raise ConfigError(f"min_quorum {self.quorum} exceeds workers_expected {self.workers_expected}")

    def for_trainers(self, n: int) -> LocoConfig:
        """This config with ``workers_expected`` filled in for a run of ``n`` trusted trainers."""
        return self if self.workers_expected is not None else replace(self, workers_expected=n)

    @property
    def expected(self) -> int:
        if self.workers_expected is None:
            raise ConfigError("workers_expected is not set: use LocoConfig.for_trainers(n) first")
        return self.workers_expected

    @property
    def retention(self) -> int | None:
        """Rounds of objects kept (``retain_rounds``, at least ``2 x state_every``), or None: keep all."""
        return None if self.retain_rounds is None else max(self.retain_rounds, 2 * self.state_every)

    @property
    def repair_replay(self) -> int:
        """Rounds a repair may replay (``repair_replay_rounds``, default ``2 x state_every``)."""
        return self.repair_replay_rounds if self.repair_replay_rounds is not None else 2 * self.state_every

    @property
    def quorum(self) -> int:
        return self.min_quorum if self.min_quorum is not None else self.expected // 2 + 1

    @property
    def sparse(self) -> bool:
        return self.mode == "pulseloco"


@dataclass(slots=True)
class RoundReport:
    """What one round did on one trainer (benchmarks and logs). Phase times: the ``on_phase`` hook."""

    round: int
    trainer: str
    participants: list[str] = field(default_factory=list)
    rejected: dict[str, str] = field(default_factory=dict)
    included: bool = False
    """Whether this trainer's payload was averaged this round."""
    record_writer: str = ""
    sent: int = 0
    total: int = 0
    payload_bytes: int = 0
    """Bytes of this trainer's payload as put into the store (0 if it did not train this round)."""
    loss: float | None = None
    """Mean inner training loss over the H steps."""
    steps: int = 0
    """Inner steps taken this round (fewer than H when the caller's inner phase ran short)."""
    overlapped: bool = False
    """The inner phase ran while the previous round was exchanged (``overlap``)."""
    digest: str = ""
    agreed: bool = True
    """False if some trainer's digest differed from the majority this round."""
    repaired: bool = False
    """This trainer's state diverged and was rebuilt from the store."""
    caught_up_from: int | None = None
    """Set when the round was not trained but replayed/loaded from the store (from this round)."""
    void: str = ""
    """Why the round's outer step was void (it would have made θ or m non-finite: nothing applied)."""
    norms: dict[str, float] = field(default_factory=dict)
    """L2 norm of each participant's payload, as this trainer checked them."""
    weights_norm: float = 0.0
    """‖θ‖ the round started from (the absolute bound on payload norms is ``norm_weights_factor`` x this)."""

    def follow(self, record: Record) -> None:
        """What the round's record decided: its participants, rejections and writer."""
        self.participants = sorted(record.participants)
        self.rejected = dict(record.rejected)
        self.record_writer = record.writer
