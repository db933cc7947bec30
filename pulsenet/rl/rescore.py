"""The trainer scores: every rollout's reward recomputed with the trainer's own task before training.

An inference node's reward column is its word. A trainer holds the same task (problems, prompt
settings, rewards), so for every row it:

1. recomputes the problem the row answered from its group id (``tasks.parse_group_id``: node,
   version, batch, index) through ``assign_problems``, a pure function; a group id that does not
   parse or does not name the row's own node and version is rejected (``group``), and one whose
   batch or index is past what the trainer's ``Assignment`` allows (``out_of_assignment``) before
   anything is drawn: the numbers are the node's claim, and drawing ``index + 1`` problems for
   ``p99999999999`` hung a trainer (issue 29);
2. checks the row's prompt ids are the ones the prompter makes for that problem; a node that
   answered another prompt (picked its own, or runs other prompt settings) is rejected (``prompt``);
3. scores the decoded completion with the task's rewards and puts that in the row's ``reward``;
   a claimed reward that differs by more than ``tolerance`` is a disagreement, counted per node.
   Rewards are a deterministic function of (problem, completion text) computed by the same code on
   both sides and travel as float64, so an honest node never disagrees: the trainer refuses a
   batch with a disagreement (``reward_mismatch``, a strike: nodes/feed.py). A disagreement on a
   row whose group's reward failed *here* (a timeout or a crash on this side scores 0) is
   ``excused``: not the node's doing.

Rejections and disagreements are counted per node in ``RescoreStats`` (plain data for /status and
/metrics); a node whose rewards disagree is visible at once. Reward failures (a raising or hanging
reward) score 0 on both sides and are counted by the task's ``RewardSet.stats``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pulsenet.codec.rollout import Rollout
from pulsenet.rl.prompts import Prompter
from pulsenet.rl.tasks import Assignment, Problem, Task, assign_problems

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeRescore:
    rows: int = 0
    """Rows re-scored (accepted)."""
    disagreements: int = 0
    """Accepted rows whose claimed reward differs from the trainer's."""
    rejected: dict[str, int] = field(default_factory=dict)
    """Reason (``group``, ``out_of_assignment``, ``prompt``) -> rows rejected."""
    max_abs_diff: float = 0.0
    """Largest |claimed - computed| seen."""


@dataclass(slots=True)
class RescoreStats:
    nodes: dict[str, NodeRescore] = field(default_factory=dict)

    def node(self, node: str) -> NodeRescore:
        return self.nodes.setdefault(node, NodeRescore())

    @property
    def disagreements(self) -> int:
        return sum(n.disagreements for n in self.nodes.values())


@dataclass(frozen=True, slots=True)
class Disagreement:
    node: str
    group: str
    claimed: float
    computed: float
    excused: bool = False
    """The trainer's own reward failed on the row's group (it scored 0 here): not a lie."""


@dataclass(frozen=True, slots=True)
class Rescored:
    rows: list[Rollout]
    """The accepted rows, in order, each with the trainer's reward."""
    rejected: list[tuple[Rollout, str]]
    """Rows not to train on, with the reason (``group``, ``out_of_assignment`` or ``prompt``)."""
    disagreements: list[Disagreement]


class Rescorer:
    """Recomputes rewards for one run: ``rescore(rows)``. ``seed`` is the run seed the inference
    nodes draw their problems with (their ``seed`` setting); ``assignment`` bounds the batch and
    problem numbers a group id may carry."""

    def __init__(
        self, task: Task, prompter: Prompter, *, seed: int, tolerance: float = 1e-6, assignment: Assignment | None = None
    ) -> None:
        self.task, self.prompter, self.seed, self.tolerance = task, prompter, seed, tolerance
        self.assignment = assignment or Assignment()
        self.stats = RescoreStats()
        self._problems: dict[tuple[str, int, int], list[Problem]] = {}
        self._prompt_ids: dict[str, tuple[int, ...]] = {}

    def problem(self, node: str, version: int, batch: int, index: int) -> Problem:
        """Problem ``index`` of ``node``'s batch ``batch`` at ``version`` (cached per batch); the
        numbers must be within ``assignment`` (``rescore`` checks them first)."""
        a = self.assignment
        if not (0 <= batch < a.batches_per_version and 0 <= index < a.prompts_per_batch):
            raise ValueError(f"batch {batch}, problem {index}: past the assignment {a}")
        key = (node, version, batch)
        drawn = self._problems.get(key, [])
        if len(drawn) <= index:
            drawn = assign_problems(self.task, node=node, version=version, seed=self.seed, n=index + 1, batch=batch)
            self._problems[key] = drawn
            if len(self._problems) > 4096:  # old batches are not seen again
                del self._problems[next(iter(self._problems))]
        return drawn[index]

    def rescore(self, rows: Sequence[Rollout]) -> Rescored:
        """Check and re-score ``rows`` (one call: one batch of reward calls). See the module docstring."""
        kept: list[tuple[Rollout, Problem]] = []
        rejected: list[tuple[Rollout, str]] = []
        for row in rows:
            got = self.assignment.check_group(row.group, node=row.node, version=row.version)
            if isinstance(got, str):
                rejected.append((row, "group" if got == "group_id" else got))
                continue
            problem = self.problem(row.node, row.version, *got)
            if tuple(row.prompt_ids) != self._ids(problem.prompt):
                rejected.append((row, "prompt"))
                continue
            kept.append((row, problem))
        for row, reason in rejected:
            stats = self.stats.node(row.node)
            stats.rejected[reason] = stats.rejected.get(reason, 0) + 1
        if rejected:
            log.warning(
                "rescore: %d rows rejected (%s)", len(rejected), sorted({f"{r.node}:{why}" for r, why in rejected})
            )
        texts = [self.prompter.completion_text(r.completion_ids) for r, _ in kept]
        scores = self.task.score_texts([p for _, p in kept], texts, [r.group for r, _ in kept])
        failed_here = {f.tag for f in scores.failures}
        out, disagreements = [], []
        for (row, _), computed in zip(kept, scores.total, strict=True):
            stats = self.stats.node(row.node)
            stats.rows += 1
            diff = abs(row.reward - computed)
            if diff > self.tolerance:
                stats.disagreements += 1
                stats.max_abs_diff = max(stats.max_abs_diff, diff)
                disagreements.append(Disagreement(row.node, row.group, row.reward, computed, row.group in failed_here))
            out.append(replace(row, reward=computed) if row.reward != computed else row)
        for d in disagreements[:3]:
            log.warning("rescore: %s claims %.4g for %s, the trainer computes %.4g", d.node, d.claimed, d.group, d.computed)
        return Rescored(rows=out, rejected=rejected, disagreements=disagreements)

    def _ids(self, prompt: str) -> tuple[int, ...]:
        ids = self._prompt_ids.get(prompt)
        if ids is None:
            ids = tuple(self.prompter.ids(prompt))
            if len(self._prompt_ids) > 65536:
                self._prompt_ids.clear()
            self._prompt_ids[prompt] = ids
        return ids
