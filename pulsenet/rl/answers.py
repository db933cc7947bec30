"""What a rollout batch must answer, all of it: the trainer fixes the batch, not the node (issue 38).

The intake's check 10 (rollouts/checks.py) calls a ``BatchCheck`` on every decoded batch,
whatever the trainer's other settings (re-scoring on or off), before the batch can be queued:

1. every group id is exactly what ``tasks.group_id`` writes for the batch's node and version, a
   batch and problem number within the ``Assignment``, one batch number for the whole batch, each
   problem answered by one group only, every group exactly ``group_size`` (G) rows
   (``Assignment.answers``): no zero-padded aliases of one problem, no copies of a good group, no
   groups cut where their mean reward peaks;
2. every problem the assignment gives the batch is there, except those the trainer's own prompter
   drops (too long for its limits), and the node declared exactly those in its signed manifest
   (``BatchManifest.dropped``): ``incomplete`` (a problem missing, undeclared), ``dropped_mismatch``
   (a declaration the trainer's prompter disagrees with), ``assignment_changed`` (the batch is whole
   for fewer problems than assigned: a batch made before a change of ``prompts_per_batch``);
3. every row's prompt is the one the prompter makes for its problem (``wrong_prompt``), and every
   completion has the shape the task's sampling parameters give (``row_shape``, rl/shape.py): one
   stop token at the end exactly when it ends early, no stop string before its end, at most
   ``max_new_tokens``; on every row, not only the rows replay picks.

What it returns is the batch id, ``v{version}-b{batch}``: the intake accepts each once per node.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from pulsenet.codec.rollout import RolloutColumns
from pulsenet.errors import RolloutRowError
from pulsenet.rl.prompts import Prompter
from pulsenet.rl.shape import RowShape
from pulsenet.rl.tasks import Assignment, RewardTask, assign_problems

_CACHED = 1024
"""Assigned batches whose prompts are kept (a few versions' worth of every node's batches)."""


class BatchCheck:
    """``check(columns, dropped)``: the batch id, or RolloutRowError naming what the batch lacks."""

    def __init__(
        self, assignment: Assignment, task: RewardTask, prompter: Prompter, *, seed: int, shape: RowShape | None
    ) -> None:
        """``task`` and ``seed``: the run's (``assign_problems``); ``prompter``: the trainer's own
        (its limits decide which problems are dropped); ``shape``: the completion shape every row
        must have (None: not checked)."""
        self.assignment, self.task, self.prompter, self.seed, self.shape = assignment, task, prompter, seed, shape
        self._prompts: OrderedDict[tuple[str, int, int], list[tuple[int, ...] | None]] = OrderedDict()

    def prompts(self, node: str, version: int, batch: int) -> list[tuple[int, ...] | None]:
        """The prompt ids of each problem of batch ``batch``, None for one the trainer's prompter drops."""
        key = (node, version, batch)
        got = self._prompts.get(key)
        if got is None:
            problems = assign_problems(
                self.task, node=node, version=version, seed=self.seed, n=self.assignment.prompts_per_batch, batch=batch
            )
            got = []
            for p in problems:
                ids = self.prompter.ids(p.prompt)
                got.append(None if self.prompter.drop_reason(ids) is not None else tuple(ids))
            self._prompts[key] = got
            if len(self._prompts) > _CACHED:
                self._prompts.popitem(last=False)
        return got

    def __call__(self, columns: RolloutColumns, dropped: Sequence[int] = ()) -> str:
        cols = columns
        batch, indices = _answers(self.assignment, cols)
        prompts = self.prompts(cols.node, cols.version, batch)
        self._complete(prompts, indices, dropped)
        p_off, c_off = cols.prompt_offsets.tolist(), cols.completion_offsets.tolist()
        for i, g in enumerate(cols.group.tolist()):
            if tuple(cols.prompt_ids[p_off[i] : p_off[i + 1]].tolist()) != prompts[indices[g]]:
                raise RolloutRowError("wrong_prompt", f"row {i} is not the prompt of problem {indices[g]}")
            if self.shape is not None:
                why = self.shape.broken(cols.completion_ids[c_off[i] : c_off[i + 1]].tolist(), c_off[i + 1] - c_off[i])
                if why is not None:
                    raise RolloutRowError("row_shape", f"row {i} (problem {indices[g]}): {why}")
        return f"v{cols.version}-b{batch}"

    def _complete(self, prompts: Sequence[tuple[int, ...] | None], present: Sequence[int], dropped: Sequence[int]) -> None:
        """Every problem present or declared dropped, and declared exactly when the trainer's prompter drops it."""
        have, said = set(present), set(dropped)
        kept = {k for k, ids in enumerate(prompts) if ids is not None}
        if said & have:
            raise RolloutRowError("dropped_mismatch", f"problems {sorted(said & have)[:8]} are declared dropped and answered")
        if have - kept:
            raise RolloutRowError("dropped_mismatch", f"problems {sorted(have - kept)[:8]} are over this trainer's prompt limits")
        missing = kept - have - said
        if missing:
            whole = set(range(max(have | said) + 1)) == have | said
            reason = "assignment_changed" if whole and min(missing) > max(have | said) else "incomplete"
            raise RolloutRowError(reason, f"problems {sorted(missing)[:8]} of {len(prompts)} are missing, none declared dropped")
        wrong = said ^ (set(range(len(prompts))) - kept)
        if wrong:
            raise RolloutRowError("dropped_mismatch", f"problems {sorted(wrong)[:8]}: declared dropped or dropped here, not both")


def answer_id(assignment: Assignment, columns: RolloutColumns, dropped: Sequence[int] = ()) -> str:
    """The batch id under ``assignment``'s group rules alone (``Assignment.answers``: no problems,
    prompts, declarations or completion shapes; ``BatchCheck`` adds those)."""
    return f"v{columns.version}-b{_answers(assignment, columns)[0]}"


def _answers(assignment: Assignment, columns: RolloutColumns) -> tuple[int, list[int]]:
    sizes = np.bincount(columns.group, minlength=len(columns.groups)).tolist()
    return assignment.answers(columns.groups, sizes, node=columns.node, version=columns.version)
