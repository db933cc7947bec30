"""How far a trainer trusts each inference node: strikes, distrust, open nodes' keys and budgets,
and the batches a node withheld (issue 30). Plain records and decisions, no I/O: the intake
(intake.py) asks them and carries out the answer, and keeps them across a restart through its
consumed record (``record`` / ``restore``).

- **Strikes**: each batch the trainer refuses for a ``strike_reasons`` reason (its replay found a
  row the policy did not sample; or the batch is one an honest node never sends: answered before,
  a malformed or incomplete set of groups, a completion of a shape no engine makes: intake.py's
  ``STRIKE_REASONS``) is a strike against the node; at ``refusals_to_distrust`` strikes
  (0: never) the node is *distrusted*: its batches are skipped before any GET from then on.
  ``rescore`` (no row of the batch passed re-scoring) is not a strike for an allowlisted node: it
  also follows from a task or prompt setting that differs between the sites, which an operator fixes
  without the node having lied, and a re-scored batch trains on the trainer's own rewards anyway.
- **Open nodes** (``open_inference``): a node the trainer holds no key for. Its key is read from its
  own store and pinned on first read (another key later: ``key_changed``); it gets ``open_budget``
  batches per version; its first refused batch, for any reason the node answers for (every reason
  but ``NOT_THE_NODES_FAULT``), distrusts it.
- **Gaps** (``Gaps``): a lower bound on the batch numbers a node generated and did not publish.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TRUST_REASONS = ("distrusted", "over_budget", "key_changed", "withheld")
"""Per-node counts the trust rules add to the intake's refusals: batches skipped because their node
is distrusted or over its open budget, an open node's key that changed after it was pinned, and
batch numbers a node withheld (``Gaps``: a lower bound, counted once a version leaves the window)."""

NOT_THE_NODES_FAULT = frozenset({"step_failed", "unverifiable"})
"""Refusals that say nothing about the node: the trainer's own GRPO step raised, or the trainer no
longer holds the weights to replay the batch's version (after a restart)."""

DISTRUSTED = "distrusted:"
"""Consumed-record prefix: ``distrusted:{node}`` -> the trainer version it was distrusted at."""
STRIKES = "strikes:"
"""Consumed-record prefix: ``strikes:{node}`` -> strikes counted so far."""
PINNED = "pinned:"
"""Consumed-record prefix: ``pinned:{node}/{key id}`` -> the trainer version the key was pinned at."""

_ANSWER = re.compile(r"v(\d+)-b(\d+)")


@dataclass(slots=True)
class Trust:
    """Strikes, distrust and pinned keys of the nodes one intake reads."""

    refusals_to_distrust: int
    strike_reasons: frozenset[str]
    open_nodes: frozenset[str] = frozenset()
    strikes: dict[str, int] = field(default_factory=dict)
    distrusted: dict[str, int] = field(default_factory=dict)
    """Node -> the trainer version at which it was distrusted."""
    pinned: dict[str, str] = field(default_factory=dict)
    """Open node -> the key id pinned for it."""
    pinned_at: dict[str, int] = field(default_factory=dict)

    def is_open(self, node: str) -> bool:
        return node in self.open_nodes

    def refused(self, node: str, reason: str, version: int) -> str | None:
        """A batch of ``node`` was refused for ``reason``: the reason it is distrusted now (a
        sentence for the log), or None (still trusted, or distrusted before)."""
        if node in self.distrusted or reason in NOT_THE_NODES_FAULT or reason in ("distrusted", "over_budget", "withheld"):
            return None
        if self.is_open(node):
            self.distrusted[node] = version
            return f"an open node's first refused batch ({reason})"
        if reason not in self.strike_reasons:
            return None
        self.strikes[node] = n = self.strikes.get(node, 0) + 1
        if self.refusals_to_distrust and n >= self.refusals_to_distrust:
            self.distrusted[node] = version
            return (
                f"{n} batches refused for what an honest node never sends "
                f"(refusals_to_distrust = {self.refusals_to_distrust}; last: {reason})"
            )
        return None

    def pin(self, node: str, kid: str, version: int) -> bool:
        """Pin ``kid`` for open ``node`` on first sight; whether ``kid`` is the node's pinned key."""
        if node not in self.pinned:
            self.pinned[node], self.pinned_at[node] = kid, version
        return self.pinned[node] == kid

    def forgive(self, nodes: Iterable[str]) -> None:
        """Lift distrust and strikes, and unpin an open node's key (it is pinned again on its next
        read): an operator's decision, ``RolloutIntakeConfig.forgive``."""
        for n in nodes:
            for record in (self.distrusted, self.strikes, self.pinned, self.pinned_at):
                record.pop(n, None)

    def record(self) -> dict[str, int]:
        """What a restart must keep, as consumed-record entries (the prefixes above)."""
        return {
            **{DISTRUSTED + n: v for n, v in self.distrusted.items()},
            **{STRIKES + n: k for n, k in self.strikes.items()},
            **{f"{PINNED}{n}/{kid}": self.pinned_at.get(n, 0) for n, kid in self.pinned.items()},
        }

    def restore(self, consumed: Mapping[str, int]) -> None:
        """Take back what ``record`` wrote (other entries are ignored)."""
        for key, v in consumed.items():
            if key.startswith(DISTRUSTED):
                self.distrusted[key.removeprefix(DISTRUSTED)] = v
            elif key.startswith(STRIKES):
                node = key.removeprefix(STRIKES)
                self.strikes[node] = max(self.strikes.get(node, 0), v)
            elif key.startswith(PINNED):
                node, _, kid = key.removeprefix(PINNED).rpartition("/")
                if node and kid:
                    self.pinned[node], self.pinned_at[node] = kid, v


def answered_batch(answer: str | None) -> tuple[int, int] | None:
    """``(version, batch number)`` of an answer id ``v{version}-b{batch}`` (``rl.tasks.Assignment``
    via the trainer's ``answer_of``), or None for another form (no gap can be judged)."""
    m = None if answer is None else _ANSWER.fullmatch(answer)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@dataclass(slots=True)
class Gaps:
    """A lower bound on the batch numbers each node withheld, per version.

    A node answers batch numbers ``b = 0, 1, ...`` at each version, one after the other, each
    published before the next is made (``nodes/inference.py``). So when this trainer accepts batch
    ``b`` of version ``v`` that it found in a listing, an honest node had published ``b + 1``
    batches of ``v`` by then, all named in that listing: had the listing named ``n < b + 1`` of
    them, ``b + 1 - n`` were made and never published. ``listed`` keeps the most names of each
    ``(node, v)`` any listing of this process showed, ``accepted`` the highest ``b`` this process
    accepted from a listing; ``settle`` counts the difference once ``v`` leaves the staleness window
    (no batch of it can be accepted any more) and forgets the version.

    Only this process's own listings and acceptances count (not the consumed record of a run
    before a restart): a listing made after the node's retention deleted ``v`` never stands
    against a batch accepted before it. The bound is per trainer: with several trainers each sees
    the batch numbers it owns (the partition), and every one lists every name."""

    listed: dict[tuple[str, int], int] = field(default_factory=dict)
    accepted: dict[tuple[str, int], int] = field(default_factory=dict)

    def saw_listing(self, node: str, versions: Mapping[int, int], lowest: int, highest: int) -> None:
        """One listing of ``node``'s store: version -> manifest names of ``node`` in it; only the
        versions in ``[lowest, highest]`` are kept (names are claims: planted names of far
        versions must not grow this record)."""
        for v, n in versions.items():
            if not lowest <= v <= highest:
                continue
            key = (node, v)
            self.listed[key] = max(self.listed.get(key, 0), n)

    def saw_accepted(self, node: str, version: int, batch: int) -> None:
        key = (node, version)
        self.accepted[key] = max(self.accepted.get(key, -1), batch)

    def settle(self, floor: int) -> dict[str, int]:
        """Node -> batch numbers withheld at the versions below ``floor`` (left the window), each
        version counted once and then forgotten; nodes with none are left out."""
        out: dict[str, int] = {}
        for key in [k for k in self.accepted if k[1] < floor]:
            top = self.accepted.pop(key)
            if key not in self.listed:
                continue  # no listing of this process kept the version: nothing known, nothing blamed
            gap = top + 1 - self.listed[key]
            if gap > 0:
                out[key[0]] = out.get(key[0], 0) + gap
        for key in [k for k in self.listed if k[1] < floor]:
            del self.listed[key]
        return out
