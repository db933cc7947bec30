"""The chaos checker: audit a finished run from its own records, Jepsen-style.

Inputs are what the run left behind, nothing a node reports about itself at the end: every node's
``events.jsonl`` (each version a trainer published, each version an inference node verified and
swapped in), the supervisor's journal (exits, restarts, faults), the fault records with their
recovery, the ``/proc`` samples, the store's listing after the run, the processes still alive, and
the node settings as written (retention bounds). ``audit`` returns one JSON-able dict: ``verdict``
(``pass`` when every check holds), ``checks`` (name -> ``ok`` and ``detail``) and the figures.

Checks:

- ``run_completed``: the launcher's exit code was 0 (every node at the last version);
- ``served_verified``: every version an inference node swapped in was published by a trainer with
  the same digest (``unverified`` counts the others);
- ``no_forks``: every version every trainer published has one digest (trainers digest-equal at
  every completed round);
- ``monotonic``: within each life of each node (lives split at the journal's restarts), versions
  only go up; a trainer never publishes a version twice, across lives too;
- ``converged``: every trainer's last version is the run's last, and every inference node stopped
  serving it with its own weights rehashed to its digest;
- ``recovered``: every injected fault was recovered from within the timeout;
- ``no_orphans``: no process of the run is alive after it;
- ``store_bounded``: what retention bounds stays within it: versions per policy channel (anchors
  kept, plus the slowest live consumer's bound), rollout batches per inference node (within the
  staleness bound), each trainer's own PULSELoCo rounds and the shared global states
  (``retain_rounds``). Kinds no retention covers (the PULSELoCo round records, kept by design) are
  listed under ``store`` as unbounded, not judged;
- ``hostile`` (when a node plays a hostile behaviour: ``--hostile``): the trainers refused batches
  of each hostile node, by replay or at intake for what an honest node never sends
  (``STRIKE_REASONS``, issue 38; a lied reward is ``reward_mismatch``), but a ``withhold`` one (its
  batches are honest: it only leaves some out), and no
  batch of an honest node;
- ``resources``: each node life of at least ``min_life_s`` kept its RSS slope (second half of the
  life, least squares) and its descriptor growth within the limits; shorter lives and the store are
  reported only.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pulsenet.nodes.events import VersionEvent
from pulsenet.rollouts.intake import ANSWER_REASONS, STRIKE_REASONS

_POLICY_MANIFEST = re.compile(r"(?:^|/)policy/manifests/v(\d{12})\.json$")
_POLICY_PAYLOAD = re.compile(r"(?:^|/)policy/payloads/v(\d{12})-(anchor|patch)-[0-9a-f]{16}\.pnp$")
_ROLLOUT_MANIFEST = re.compile(r"(?:^|/)rollouts/manifests/v(\d{12})-[A-Za-z0-9._-]+-(\d{8})\.json$")
_ROLLOUT_BATCH = re.compile(r"(?:^|/)rollouts/batches/v(\d{12})-[A-Za-z0-9._-]+-(\d{8})-[0-9a-f]{16}\.parquet$")
_LOCO_OWN = re.compile(r"^trainers/([a-z0-9_-]+)/(\d{8})/")
_LOCO_SHARED = re.compile(r"^(rounds|state)/(\d{8})/")


@dataclass(frozen=True, slots=True)
class Limits:
    """What the resource check holds a node life to."""

    rss_slope_mb_per_min: float = 4.0
    fd_growth: int = 16
    min_life_s: float = 600.0


def audit(
    *,
    events: Mapping[str, Sequence[VersionEvent]],
    roles: Mapping[str, str],
    journal: Sequence[Mapping[str, Any]] = (),
    faults: Sequence[Mapping[str, Any]] = (),
    samples: Sequence[Mapping[str, Any]] = (),
    listing: Mapping[str, Sequence[tuple[str, int]]] | None = None,
    stores: Mapping[str, str] | None = None,
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    orphans: Sequence[str] = (),
    exit_code: int = 0,
    reason: str = "",
    limits: Limits = Limits(),
) -> dict[str, Any]:
    """The verdict and figures of a run (see the module docstring)."""
    trainers = sorted(n for n, r in roles.items() if r == "trainer")
    inference = sorted(n for n, r in roles.items() if r == "inference")
    published: dict[int, set[str]] = defaultdict(set)
    for t in trainers:
        for e in events.get(t, ()):
            if e.kind == "published":
                published[e.version].add(e.digest)
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, detail: Any) -> None:
        checks[name] = {"ok": bool(ok), "detail": detail}

    check("run_completed", exit_code == 0, reason or f"exit code {exit_code}")

    served = [(n, e) for n in inference for e in events.get(n, ()) if e.kind == "served"]
    unverified = [f"{n} v{e.version} {e.digest[:12]}" for n, e in served if e.digest not in published.get(e.version, ())]
    check("served_verified", not unverified, {"served": len(served), "unverified": len(unverified), "examples": unverified[:5]})

    forks = {v: sorted(d) for v, d in sorted(published.items()) if len(d) > 1}
    check("no_forks", not forks, {"versions": len(published), "forks": {str(v): d for v, d in forks.items()}})

    lives = _lives(events, journal)
    bad_order = _order_violations(lives, roles)
    check("monotonic", not bad_order, bad_order[:10] or {n: len(ls) for n, ls in lives.items()})

    check("converged", *_converged(events, trainers, inference, published, exit_code))

    injected = [f for f in faults if f.get("injected")]
    missed = [f"{f['kind']} {f['target']}" for f in injected if f.get("recovery_s") is None]
    times = [float(f["recovery_s"]) for f in injected if f.get("recovery_s") is not None]
    check(
        "recovered",
        not missed,
        {"injected": len(injected), "skipped": len(faults) - len(injected), "not_recovered": missed},
    )

    check("no_orphans", not orphans, list(orphans)[:10])

    hostile = {n: str(s["hostile"]) for n, s in (settings or {}).items() if n in inference and s.get("hostile")}
    if hostile:
        check("hostile", *_hostile(events, trainers, inference, hostile))

    store = _store(listing or {}, stores or {}, settings or {}) if listing is not None else {}
    over = [
        f"{url} {kind}: {d['present']} > {d['bound']}"
        for url, kinds in store.items()
        for kind, d in kinds.items()
        if d.get("bound") is not None and d["present"] > d["bound"]
    ]
    check("store_bounded", listing is not None and not over, over or ("listed" if listing is not None else "not listed"))

    resources = _resources(samples, limits)
    too_big = [
        f"{node} pid {life['pid']}: {why}"
        for node, info in resources.items()
        if node not in ("store", "up")
        for life in info["lives"]
        for why in life.get("over", ())
    ]
    check("resources", not too_big, too_big or "within limits (or lives too short to judge)")

    restarts = defaultdict(int)
    for r in journal:
        if r.get("kind") == "restart":
            restarts[r["node"]] += 1
        elif r.get("kind") == "store_restart":
            restarts["store"] += 1
    return {
        "verdict": "pass" if all(c["ok"] for c in checks.values()) else "fail",
        "checks": checks,
        "figures": {
            "faults_injected": len(injected),
            "recovered": len(times),
            "max_recovery_s": max(times, default=None),
            "mean_recovery_s": round(sum(times) / len(times), 2) if times else None,
            "served": len(served),
            "unverified_served": len(unverified),
            "forks": len(forks),
            "versions": max(published, default=-1),
            "restarts": dict(restarts),
            "trainer_outages": _trainer_outages(events, journal, trainers),
        },
        "faults": list(faults),
        "store": store,
        "resources": resources,
    }


def _lives(
    events: Mapping[str, Sequence[VersionEvent]], journal: Sequence[Mapping[str, Any]]
) -> dict[str, list[list[VersionEvent]]]:
    """Each node's events split into its lives at the journal's restart times."""
    starts: dict[str, list[float]] = defaultdict(list)
    for r in journal:
        if r.get("kind") == "restart":
            starts[r["node"]].append(float(r["at"]))
    out = {}
    for node, evs in events.items():
        bounds = sorted(starts.get(node, ()))
        lives: list[list[VersionEvent]] = [[] for _ in range(len(bounds) + 1)]
        for e in evs:
            lives[sum(1 for b in bounds if e.at >= b)].append(e)
        out[node] = lives
    return out


def _trainer_outages(
    events: Mapping[str, Sequence[VersionEvent]], journal: Sequence[Mapping[str, Any]], trainers: list[str]
) -> list[dict[str, Any]]:
    """For each trainer killed: how long until it published again, what the others published
    meanwhile, and the longest wait between two versions of the network across it (does losing a
    trainer stop the network?)."""
    first: dict[int, float] = {}  # each version's first publication, by any trainer
    for e in (e for n in trainers for e in events.get(n, ()) if e.kind == "published"):
        first[e.version] = min(first.get(e.version, math.inf), e.at)
    firsts = sorted(first.values())
    out = []
    for f in journal:
        if f.get("kind") != "fault" or f.get("target") not in trainers or not str(f.get("fault", "")).startswith("kill-"):
            continue
        t, at = f["target"], float(f["at"])
        back = next((e.at for e in events.get(t, ()) if e.kind == "published" and e.at > at), None)
        until = back if back is not None else math.inf
        before = max((a for a in firsts if a <= at), default=at)
        after = [a for a in firsts if a > at]
        gaps = [b - a for a, b in itertools.pairwise([before, *after]) if a < until]
        others = sorted({
            e.version
            for n in trainers
            if n != t
            for e in events.get(n, ())
            if e.kind == "published" and at < e.at < until
        })
        out.append({
            "target": t, "down_s": None if back is None else round(back - at, 1),
            "versions_while_down": len(others), "max_gap_s": round(max(gaps), 1) if gaps else None,
        })  # fmt: skip
    return out


def _order_violations(lives: Mapping[str, list[list[VersionEvent]]], roles: Mapping[str, str]) -> list[str]:
    bad = []
    for node, node_lives in lives.items():
        kind = "published" if roles.get(node) == "trainer" else "served"
        seen: set[int] = set()
        for k, life in enumerate(node_lives):
            versions = [e.version for e in life if e.kind == kind]
            for a, b in itertools.pairwise(versions):
                if b <= a:
                    bad.append(f"{node} life {k}: v{a} then v{b}")
            if kind == "published":
                again = sorted(seen & set(versions))
                if again:
                    bad.append(f"{node} life {k}: published again {again}")
                seen |= set(versions)
    return bad


def _converged(
    events: Mapping[str, Sequence[VersionEvent]],
    trainers: list[str],
    inference: list[str],
    published: Mapping[int, set[str]],
    exit_code: int,
) -> tuple[bool, Any]:
    if not published:
        return False, "nothing published"
    last = max(published)
    digests = published[last]
    ends = {}
    for t in trainers:
        e = next((e for e in reversed(events.get(t, ())) if e.kind == "published"), None)
        ends[t] = None if e is None else e.version
    for n in inference:
        stop = next((e for e in reversed(events.get(n, ())) if e.kind == "stopped"), None)
        ends[n] = None if stop is None else stop.version
    problems = [f"{n} ended at v{v}" for n, v in ends.items() if v != last]
    for n in inference:
        stop = next((e for e in reversed(events.get(n, ())) if e.kind == "stopped"), None)
        if stop is not None and stop.version == last and (stop.digest not in digests or stop.weights_digest != stop.digest):
            problems.append(
                f"{n}: stopped at v{last} with digest {stop.digest[:12]}, own weights {str(stop.weights_digest)[:12]}"
            )
    if exit_code != 0:
        problems.append(f"the run did not complete (exit code {exit_code})")
    return not problems, problems or f"every node at v{last} ({sorted(digests)[0][:16]}…)"


def _store(
    listing: Mapping[str, Sequence[tuple[str, int]]],
    stores: Mapping[str, str],
    settings: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per store URL and kind of object: how many are present, and the bound retention promises."""
    owner = {url: node for node, url in stores.items()}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for url, objects in listing.items():
        node = owner.get(url, "")
        keys = [k for k, _ in objects]
        kinds: dict[str, dict[str, Any]] = {"objects": {"present": len(keys), "bytes": sum(s for _, s in objects)}}
        cfg = settings.get(node, {})
        if node == "loco":
            own: dict[str, set[int]] = defaultdict(set)
            shared: dict[str, set[int]] = defaultdict(set)
            for k in keys:
                if m := _LOCO_OWN.match(k):
                    own[m.group(1)].add(int(m.group(2)))
                elif m := _LOCO_SHARED.match(k):
                    shared[m.group(1)].add(int(m.group(2)))
            loco = next((s.get("loco", {}) for n, s in settings.items() if n.startswith("t")), {})
            every = int(loco.get("state_every", 10))
            keep = max(int(loco["retain_rounds"]), 2 * every) if loco.get("retain_rounds") else None  # .retention
            for t, rounds in sorted(own.items()):
                kinds[f"{t} rounds"] = {"present": len(rounds), "bound": keep + every + 1 if keep else None}
            records, states = shared.get("rounds", set()), shared.get("state", set())
            kinds["round records (rounds/)"] = {
                "present": len(records), "bound": None, "note": "kept by design: ~1 KB a round, the fork guard",
            }  # fmt: skip
            # genesis, one state per state_every rounds within the window, and one retention period late
            kinds["global states (state/)"] = {"present": len(states), "bound": (keep + every) // every + 2 if keep else None}
        elif node.startswith("t"):
            manifests = {int(m.group(1)) for k in keys if (m := _POLICY_MANIFEST.search(k))}
            payloads = {int(m.group(1)) for k in keys if (m := _POLICY_PAYLOAD.search(k))}
            pub = cfg.get("publish", {})
            every, anchors = int(pub.get("anchor_every", 10)), pub.get("keep_anchors", 2)
            rounds = int(cfg.get("steps", 0))
            bound = None
            if anchors and every <= rounds:  # one anchor per run: retention never deletes anything
                bound = int(anchors) * every + int(cfg.get("consumer_bound", 50)) + 2
            kinds["policy versions"] = {"present": len(manifests), "bound": bound}
            kinds["policy payloads without a manifest"] = {"present": len(payloads - manifests), "bound": None}
        elif node.startswith("i"):
            manifests = {(int(m.group(1)), int(m.group(2))) for k in keys if (m := _ROLLOUT_MANIFEST.search(k))}
            batches = {(int(m.group(1)), int(m.group(2))) for k in keys if (m := _ROLLOUT_BATCH.search(k))}
            per_version = int(cfg.get("batches_per_version", 2))
            stale = int(cfg.get("max_staleness", 2))
            kinds["rollout batches"] = {"present": len(manifests), "bound": (stale + 2) * per_version}
            kinds["rollout payloads without a manifest"] = {"present": len(batches - manifests), "bound": None}
        out[url] = kinds
    return out


def _resources(samples: Sequence[Mapping[str, Any]], limits: Limits) -> dict[str, dict[str, Any]]:
    """Per node and life (pid): RSS and descriptors at start and end, and their slopes per minute
    over the second half of the life (start-up excluded)."""
    by: dict[tuple[str, int], list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        by[(s["node"], int(s["pid"]))].append(s)
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"lives": []})
    for (node, pid), ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[1][0]["t"])):
        ss = sorted(ss, key=lambda s: s["t"])
        life = float(ss[-1]["t"] - ss[0]["t"])
        half = [s for s in ss if s["t"] >= ss[0]["t"] + life / 2]
        rss_slope = _slope([(s["t"], s["rss_mb"]) for s in half])
        fd_slope = _slope([(s["t"], s["fds"]) for s in half])
        info: dict[str, Any] = {
            "pid": pid,
            "life_s": round(life, 1),
            "samples": len(ss),
            "rss_mb": [round(ss[0]["rss_mb"], 1), round(ss[-1]["rss_mb"], 1)],
            "rss_mb_second_half": [round(half[0]["rss_mb"], 1), round(half[-1]["rss_mb"], 1)] if half else None,
            "rss_slope_mb_per_min": None if rss_slope is None else round(rss_slope * 60, 3),
            "fds": [int(ss[0]["fds"]), int(ss[-1]["fds"])],
            "fds_max": max(int(s["fds"]) for s in ss),
            "fd_slope_per_min": None if fd_slope is None else round(fd_slope * 60, 3),
        }
        if life >= limits.min_life_s:
            over = []
            if rss_slope is not None and rss_slope * 60 > limits.rss_slope_mb_per_min:
                over.append(f"RSS grows {rss_slope * 60:.2f} MB/min")
            if half and half[-1]["fds"] - half[0]["fds"] > limits.fd_growth:
                over.append(f"descriptors {half[0]['fds']} -> {half[-1]['fds']}")
            info["over"] = over
        out[node]["lives"].append(info)
    return dict(out)


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of y over x (None with fewer than 3 points or no spread in x)."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in points) / sxx



def _hostile(
    events: Mapping[str, Sequence[VersionEvent]], trainers: Sequence[str], inference: Sequence[str], hostile: Mapping[str, str]
) -> tuple[bool, dict[str, Any]]:
    """The trainers refused batches of every hostile node that sends touched rows (all but
    ``withhold``, whose batches are honest: it only leaves some out; ``reward-one`` is refused for
    its rewards, ``reward_mismatch``),
    by replay or at intake, and none of an honest node's. From the trainers' version events
    (``rejected:NODE:REASON`` totals, per life: each life's last count, summed)."""
    reasons = set(STRIKE_REASONS) | set(ANSWER_REASONS)
    refused: dict[str, int] = defaultdict(int)
    for t in trainers:
        life: dict[str, float] = {}
        for e in events.get(t, ()):
            for key, n in e.totals.items():
                parts = key.split(":")
                if len(parts) != 3 or parts[0] != "rejected" or parts[2] not in reasons:
                    continue
                if n < life.get(key, 0):  # a new life: its counts start again
                    refused[parts[1]] += int(life[key])
                life[key] = n
        for key, n in life.items():
            refused[key.split(":")[1]] += int(n)
    wrong = [
        f"{n} ({hostile[n]}): no batch refused"
        for n in hostile
        if not hostile[n].startswith("withhold") and not refused.get(n)
    ]
    wrong += [f"{n} (honest): {refused[n]} batches refused" for n in inference if n not in hostile and refused.get(n)]
    return not wrong, {"refused": dict(refused), "hostile": dict(hostile), "wrong": wrong}
