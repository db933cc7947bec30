"""A run's summary, from its nodes' version events (nodes/events.py) and nothing else.

``pulsenet up`` reads the events from each node's ``events.jsonl``; ``pulsenet bench rl`` takes them
from its in-process nodes' ``EventLog``. Both then call ``summarize``: one round per version after
v0, each node's last verified version and digest, and the run's checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pulsenet.nodes.events import VersionEvent

CHANNELS = ("pulsesync", "full_sync", "pulseloco", "diloco", "ddp", "rollouts")
"""Byte totals a summary reports: what was sent, and what the dense alternatives would have cost."""


def summarize(
    events: Mapping[str, Sequence[VersionEvent]], roles: Mapping[str, str], *, max_staleness: int
) -> dict[str, Any]:
    """``rounds``, ``nodes`` and ``checks`` of a run; ``events``: node id -> its events in order,
    ``roles``: node id -> ``trainer`` or ``inference`` (every node of the run, events or not).

    Bytes per round: PULSESync as every inference node downloads it (each follows one channel's
    whole chain) and what full checkpoints would have cost them; PULSELoCo, DiLoCo and DDP per
    worker per round (the PULSE paper's measure: the first trainer's); rollouts summed over the
    trainers (each takes its own share)."""
    trainers = sorted(n for n, role in roles.items() if role == "trainer")
    inference = sorted(n for n, role in roles.items() if role == "inference")
    events = {n: events.get(n, ()) for n in roles}
    published: dict[int, VersionEvent] = {}
    """The first trainer's event per version (every trainer publishes the same weights)."""
    every: dict[int, list[VersionEvent]] = {}
    for t in trainers:
        for e in events[t]:
            if e.kind == "published":
                published.setdefault(e.version, e)
                every.setdefault(e.version, []).append(e)
    k = len(inference)
    rounds = []
    for v in sorted(x for x in published if x > 0):
        p, all_ = published[v], every[v]
        stale = [s for e in all_ for s in e.staleness]
        rounds.append(
            {
                "round": v,
                "reward": _mean_reward(all_),
                "staleness": max(stale) if stale else None,
                "sparsity": p.sparsity,
                "bytes": {
                    "pulsesync": p.bytes.get("pulsesync", 0) * k,
                    "full_sync": p.bytes.get("full", 0) * k,
                    "pulseloco": p.bytes.get("pulseloco", 0),
                    "diloco": p.bytes.get("diloco", 0),
                    "ddp": p.bytes.get("ddp", 0),
                    "rollouts": sum(e.bytes.get("rollouts", 0) for e in all_),
                },
            }
        )
    nodes: dict[str, dict[str, Any]] = {}
    for t in trainers:
        last = max((e for e in events[t] if e.kind == "published"), key=lambda e: e.version, default=None)
        nodes[t] = {"role": "trainer", "version": _get(last, "version"), "digest": _get(last, "digest")}
    for n in inference:
        served = [e for e in events[n] if e.kind == "served"]
        stopped = next((e for e in reversed(events[n]) if e.kind == "stopped"), None)
        last = stopped or (served[-1] if served else None)
        nodes[n] = {
            "role": "inference",
            "version": _get(last, "version"),
            "digest": _get(last, "digest"),
            "weights_digest": _get(stopped, "weights_digest"),
            "served": [e.version for e in served],
            "served_verified": bool(served) and all(
                e.version in published and published[e.version].digest == e.digest for e in served
            ),
            "pulsesync_downloaded": int(stopped.totals.get("pulsesync_bytes", 0)) if stopped else None,
        }
    digests = {d["digest"] for d in nodes.values()}
    checks = {
        "served_verified": all(nodes[n]["served_verified"] for n in inference),
        "own_weights_verified": all(
            nodes[n]["weights_digest"] is not None and nodes[n]["weights_digest"] == nodes[n]["digest"]
            for n in inference
        ),
        "final_digests_equal": len(digests) == 1 and None not in digests,
        "trainers_agree": all(len({e.digest for e in all_}) == 1 for all_ in every.values()),
        "staleness_within_bound": all((r["staleness"] or 0) <= max_staleness for r in rounds),
    }
    return {"rounds": rounds, "nodes": nodes, "checks": checks}


def _get(event: VersionEvent | None, name: str) -> Any:
    return getattr(event, name) if event is not None else None


def _mean_reward(events: Sequence[VersionEvent]) -> float | None:
    """The round's mean reward over every trainer's rows (each event: its mean over its rows)."""
    rated = [(e.reward, e.counts.get("rows", 0) or 1) for e in events if e.reward is not None]
    rows = sum(n for _, n in rated)
    return sum(r * n for r, n in rated) / rows if rows else None
