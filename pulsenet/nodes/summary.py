"""A run's summary, from its nodes' version events (nodes/events.py) and nothing else.

``pulsenet up`` reads the events from each node's ``events.jsonl``; ``pulsenet bench rl`` takes them
from its in-process nodes' ``EventLog``. Both then call ``summarize``: one round per version after
v0, each node's last verified version and digest, and the run's checks.
"""

from __future__ import annotations

import itertools
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
            "pulsesync_downloaded": int(run_totals(events[n]).get("pulsesync_bytes", 0)) if stopped else None,
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
    evals = [published[v].eval for v in sorted(published) if published[v].eval is not None]
    return {"rounds": rounds, "nodes": nodes, "checks": checks, "eval": evals}


def _get(event: VersionEvent | None, name: str) -> Any:
    return getattr(event, name) if event is not None else None


def _mean_reward(events: Sequence[VersionEvent]) -> float | None:
    """The round's mean reward over every trainer's rows (each event: its mean over its rows)."""
    rated = [(e.reward, e.counts.get("rows", 0) or 1) for e in events if e.reward is not None]
    rows = sum(n for _, n in rated)
    return sum(r * n for r, n in rated) / rows if rows else None


def efficiency(events: Mapping[str, Sequence[VersionEvent]], roles: Mapping[str, str]) -> dict[str, Any]:
    """How much of what the network paid for it used (issue 23's figures, named the same in
    ``pulsenet up``'s ``summary.json`` and ``bench rl``'s JSON).

    - ``trained_fraction``: rows trained on over rows generated; ``dropped_fraction``: batches
      dropped stale (in flight or queued) over batches generated; ``never_taken_fraction``: the rest
      (still queued or in the store when the run ended, or refused);
    - ``staleness_mean`` and ``staleness``: lag (trainer version minus rollout version) of every
      batch trained on, mean and histogram;
    - ``engine_busy``: generating over generating plus waiting (for a newer version or for demand),
      after each engine's first version; ``trainer_busy``: in GRPO steps over the trainers' rounds;
    - ``replay_cost``: the trainers' replay of rollout rows (rl/replay.py) over their GRPO steps
      (``of_train``: what it adds to the compute) and over their rounds' wall time
      (``of_rounds``: what it adds to a step as the run lived it, waits included);
    - ``round_s``: mean time between versions; ``update_latency_s``: from a version's publication
      (the first trainer's publish returned) to each inference node serving it, p50/p95/max, and
      ``update_latency_fraction``: the same over ``round_s``.
    """
    trainers = [n for n, r in roles.items() if r == "trainer"]
    inference = [n for n, r in roles.items() if r == "inference"]
    published = [e for t in trainers for e in events.get(t, ()) if e.kind == "published" and e.version > 0]
    last_t = [run_totals(events.get(t, ())) for t in trainers]
    last_i = [run_totals(events.get(n, ())) for n in inference]
    produced_rows = sum(t.get("rows_produced", 0) for t in last_i)
    produced = sum(t.get("batches_produced", 0) for t in last_i)
    trained_rows = sum(e.counts.get("rows", 0) for e in published)
    trained = sum(e.counts.get("batches", 0) for e in published)
    dropped = sum(t.get("stale_in_flight", 0) + t.get("stale_queued", 0) for t in last_t)
    lags = [s for e in published for s in e.staleness]
    generating = sum(t.get("generating_s", 0.0) for t in last_i)
    waiting = sum(t.get("waiting_version_s", 0.0) + t.get("waiting_demand_s", 0.0) for t in last_i)
    busy = sum(e.phases.get("train", 0.0) for e in published)
    replay = sum(e.phases.get("replay", 0.0) for e in published)
    spent = sum(sum(e.phases.values()) for e in published)
    first = sorted((e for e in published if e.node == min(trainers)), key=lambda e: e.version)
    gaps = [b.at - a.at for a, b in itertools.pairwise(first)]  # from v1 on: v0 waits for the start-up
    round_s = sum(gaps) / len(gaps) if gaps else None
    at: dict[int, float] = {}
    for e in (e for t in trainers for e in events.get(t, ()) if e.kind == "published"):
        at[e.version] = min(at.get(e.version, e.at), e.at)
    latency = sorted(
        max(0.0, e.at - at[e.version])
        for n in inference
        for e in events.get(n, ())
        if e.kind == "served" and e.version > 0 and e.version in at
    )
    quantiles = {"p50": _quantile(latency, 0.5), "p95": _quantile(latency, 0.95), "max": latency[-1] if latency else None}
    return {
        "trained_fraction": _ratio(trained_rows, produced_rows),
        "dropped_fraction": _ratio(dropped, produced),
        "never_taken_fraction": _ratio(max(0, produced - trained - dropped), produced),
        "batches": {"generated": int(produced), "trained": int(trained), "dropped": int(dropped)},
        "staleness_mean": sum(lags) / len(lags) if lags else None,
        "staleness": {str(k): lags.count(k) for k in sorted(set(lags))},
        "engine_busy": _ratio(generating, generating + waiting),
        "trainer_busy": _ratio(busy, spent),
        "replay_cost": {"of_train": _ratio(replay, busy), "of_rounds": _ratio(replay, spent)},
        "round_s": round_s,
        "update_latency_s": quantiles,
        "update_latency_fraction": {k: _ratio(v, round_s) for k, v in quantiles.items()},
    }


def requests(events: Mapping[str, Sequence[VersionEvent]], roles: Mapping[str, str]) -> dict[str, Any]:
    """Store requests an inference node makes: one idle poll of its policy channel (measured on the
    way out, when nothing changes any more) and, per version it served, every request of its stores
    (following the channel, writing its rollouts, reading demand), averaged over the nodes."""
    idle: dict[str, list[int]] = {}
    per_version: dict[str, list[float]] = {}
    for n in (n for n, r in roles.items() if r == "inference"):
        ev = events.get(n, ())
        stopped = next((e for e in reversed(ev) if e.kind == "stopped"), None)
        served = len([e for e in ev if e.kind == "served"])
        if stopped is None or not served:
            continue
        for k, v in stopped.counts.items():
            if k.startswith("idle_poll:"):
                idle.setdefault(k.split(":", 1)[1], []).append(v)
        for k, v in run_totals(ev).items():
            if k.startswith("requests:"):
                per_version.setdefault(k.split(":", 1)[1], []).append(v / served)
    return {
        "idle_poll": {k: sum(v) / len(v) for k, v in idle.items()},
        "per_version_per_inference_node": {k: round(sum(v) / len(v), 2) for k, v in per_version.items()},
    }


def run_totals(events: Sequence[VersionEvent]) -> dict[str, float]:
    """A node's counters over the whole run. ``totals`` are cumulative within one process, and a
    restarted node counts from zero again: a life starts where a counter goes down, and the last
    totals of every life are summed. What a killed life did after its last event is not counted."""
    out: dict[str, float] = {}
    prev: dict[str, float] = {}
    for e in events:
        if any(e.totals.get(k, 0) < v for k, v in prev.items()):  # counters restarted: a new life
            for k, v in prev.items():
                out[k] = out.get(k, 0) + v
        prev = e.totals
    for k, v in prev.items():
        out[k] = out.get(k, 0) + v
    return out


def _ratio(a: float, b: float | None) -> float | None:
    return round(a / b, 4) if b else None


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]
