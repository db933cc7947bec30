"""Hostile behaviours that choose which honest rows a trainer sees (issue 38): pure functions from
the rows of one honest, scored batch to the batches a cheating node sends instead.

Every row stays an honest draw (its tokens and log-probs are the public draw's): what changes is
which groups, how many rows of a group, which spelling of a group id, which batch number, or how
much of a completion is sent. ``nodes/hostile.py`` lists them; the trainer's batch check
(rl/answers.py) must refuse each before any of its rows reaches a GRPO step.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from pulsenet.codec.rollout import Rollout

REWORKS = ("better-half", "aliases", "copies", "cut-groups", "prefix-cut", "repeat", "reward-one")

RowScore = Callable[[int, Sequence[int]], float]
"""``score(i, completion_ids)``: the node's reward of row ``i``'s problem answered by ``completion_ids``."""

_INDEX = re.compile(r"^(?P<head>.*-p)(?P<index>\d+)$")


def rework(
    behaviour: str, rows: Sequence[Rollout], score: RowScore, *, previous: Sequence[Rollout] | None, n: int, copies: int
) -> list[list[Rollout]]:
    """The batches ``behaviour`` sends for ``rows`` (``previous``: the rows sent for the batch before)."""
    rows = list(rows)
    groups = _groups(rows)
    best = sorted(groups, key=lambda g: -_mean(groups[g]))  # stable: the first of equals
    if behaviour == "better-half":
        keep = set(best[: max(1, (len(best) + 1) // 2)])
        return [[r for r in rows if r.group in keep]]
    if behaviour == "aliases":
        extra = [dataclasses.replace(r, group=alias(g, j)) for g in best[:n] for j in (1, 2) for r in groups[g]]
        return [rows + extra]
    if behaviour == "copies":
        return [[dataclasses.replace(r, group=alias(best[0], j)) for j in range(copies) for r in groups[best[0]]]]
    if behaviour == "cut-groups":
        return [[r for g in groups.values() for r in g[: _peak(g)]]]
    if behaviour == "prefix-cut":
        return [[_cut(i, r, score) for i, r in enumerate(rows)]]
    if behaviour == "repeat":
        return [rows] if previous is None else [rows, list(previous)]
    if behaviour == "reward-one":
        return [[dataclasses.replace(r, reward=1.0) for r in rows]]
    raise ValueError(f"not a rework: {behaviour!r}")


def alias(group: str, zeros: int) -> str:
    """``group`` with ``zeros`` zeros before its problem number: ``i1-v3-b0-p5`` -> ``i1-v3-b0-p05``
    (``int()`` reads the same problem)."""
    m = _INDEX.match(group)
    if m is None:
        raise ValueError(f"not a group id: {group!r}")
    return f"{m['head']}{'0' * zeros}{m['index']}"


def _groups(rows: Sequence[Rollout]) -> dict[str, list[Rollout]]:
    out: dict[str, list[Rollout]] = {}
    for r in rows:
        out.setdefault(r.group, []).append(r)
    return out


def _mean(rows: Sequence[Rollout]) -> float:
    return sum(r.reward for r in rows) / len(rows)


def _peak(rows: Sequence[Rollout]) -> int:
    """How many of a group's first rows to keep: where their mean reward is highest (the fewest on a tie)."""
    means = [_mean(rows[: k + 1]) for k in range(len(rows))]
    return means.index(max(means)) + 1


def _cut(i: int, r: Rollout, score: RowScore) -> Rollout:
    """Row ``i`` cut to its shortest completion prefix that scores more than it does (as it is if none)."""
    for k in range(1, len(r.completion_ids)):
        got = score(i, r.completion_ids[:k])
        if got > r.reward:
            return dataclasses.replace(r, completion_ids=r.completion_ids[:k], logprobs=r.logprobs[:k], reward=got)
    return r
