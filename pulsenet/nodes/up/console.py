"""What ``pulsenet up`` prints: the live table (or one line per change), and at the end the
summary (``summarize_up``, ``print_summary``, ``report_outcome``).

Every table fits the width it is given: under ``COMPACT_BELOW`` columns (an 80-column terminal)
it keeps the same rows with short headers, byte counts in k/M/G and digests without an ellipsis,
so no header or number is cut (rich cuts a cell that does not fit to ``hea…``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pulsenet.nodes.summary import efficiency, requests, summarize
from pulsenet.nodes.up.node import Node, Outcome, node_version

if TYPE_CHECKING:
    from pulsenet.nodes.up.config import UpConfig

COMPACT_BELOW = 100
"""Console widths below this get the compact tables."""


WIDE = (
    "node", "health", "restarts", "version", "reward", "staleness", "rollouts", "pulsesync B", "pulseloco B", "rollout B",
    "errors",
)
COMPACT = ("node", "health", "rst", "ver", "reward", "stale", "rolls", "sync B", "loco B", "roll B", "err")
"""The live table's headers: in full where they fit, short where they do not (same columns)."""


def status_table(nodes: list[Node], caption: str, width: int) -> Any:
    """The live table: each node's health, restarts, version, reward, staleness, rollouts, bytes
    and errors. With every number in full (``1,234,567`` B) where that fits ``width``, else short
    headers, byte counts in k/M/G and one space between columns: nothing is cut in 80 columns."""
    from rich import box
    from rich.table import Table

    rows = _rows(nodes, lambda v: _fmt(v, "{:,}"))
    if width >= COMPACT_BELOW and _width(WIDE, rows) <= width:
        t = Table(title="pulsenet up", caption=caption, expand=False)
        cols = WIDE
    else:
        t = Table(title="pulsenet up", caption=caption, box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, expand=False)
        cols, rows = COMPACT, _rows(nodes, _bytes)
    for col in cols:  # health wraps at its spaces; the other columns keep their headers and numbers whole
        t.add_column(col, justify="right", no_wrap=col != "health", min_width=None if col == "health" else len(col))
    for row in rows:
        t.add_row(*row)
    return t


def _rows(nodes: list[Node], size: Callable[[Any], str]) -> list[tuple[str, ...]]:
    rows = []
    for n in nodes:
        s = n.status
        b = s.get("bytes", {})
        r = s.get("rollouts", {})
        v = node_version(n)
        rows.append((
            n.name,
            n.health,
            str(n.restarts.count),
            _fmt(v if v >= 0 else None),
            _fmt(s.get("reward"), "{:.3f}"),
            _fmt(s.get("staleness")),
            _fmt(r.get("consumed") if n.role == "trainer" else r.get("produced")),
            size(b.get("pulsesync")),
            size(b.get("pulseloco")),
            size(b.get("rollouts")),
            _fmt(s.get("errors")),
        ))  # fmt: skip
    return rows


def _width(cols: tuple[str, ...], rows: list[tuple[str, ...]]) -> int:
    """The width of a boxed rich table of these cells: each column's widest cell, 1 space of
    padding either side and a line between columns and at both edges."""
    return sum(max(len(c), *(len(r[k]) for r in rows)) + 3 for k, c in enumerate(cols)) + 1


def line_key(version: int, holdup: str, nodes: list[Node]) -> tuple[Any, ...]:
    """What a new line is printed for without the live table: versions, health, restarts, stuck."""
    holdup = re.sub(r"\d+", "#", holdup)  # its idle seconds tick: a new line only when its words change
    return (version, holdup, *((n.health, n.restarts.count) for n in nodes))


def status_line(nodes: list[Node], holdup: str) -> str:
    """One line for the whole network (``--no-live``)."""
    line = "  ".join(
        f"{n.name}: v{_fmt(node_version(n) if node_version(n) >= 0 else None)} "
        f"r={_fmt(n.status.get('reward'), '{:.3f}')} {n.health}"
        + (f" ({n.restarts.count} restarts)" if n.restarts.count else "")
        for n in nodes
    )
    return line + ("  STUCK: " + holdup if holdup else "")


def report_outcome(out: Any, config: UpConfig, outcome: Outcome, summary: dict[str, Any]) -> None:
    """The end of ``pulsenet up``'s output: the failure, or the summary (and the report files)."""
    if outcome.code not in (0, 130) and not summary["rounds"]:
        out.print(f"[bold red]pulsenet up failed[/]: {outcome.reason} (logs in {config.workdir.absolute() / 'logs'})")
        return
    print_summary(out, config, outcome, summary)
    if config.report is not None:
        from pulsenet.nodes.report import write_report

        write_report(
            config.report, rounds=summary["rounds"], nodes=summary["nodes"], extra=summary["extra"], evals=summary["eval"]
        )
        out.print(f"report: {config.report.absolute()}/summary.json, reward.png, bytes.png, sparsity.png")


def summarize_up(config: UpConfig, outcome: Outcome) -> dict[str, Any]:
    """Rounds, nodes and checks from the nodes' version events (``nodes/summary.py``), plus the run."""
    roles = {n.name: n.role for n in outcome.nodes}
    summary = summarize(outcome.events, roles, max_staleness=config.max_staleness)
    for n in outcome.nodes:
        summary["nodes"][n.name] |= {
            "pid": n.pid,
            "pids": list(n.pids),
            "restarts": n.restarts.count,
            "exits": [dataclasses.asdict(e) for e in n.restarts.exits],
            "memory": n.status.get("memory"),  # its last /status: weight bytes by holder, peak RSS, budget
        }
    summary["efficiency"], summary["requests"] = efficiency(outcome.events, roles), requests(outcome.events, roles)
    summary["extra"] = {
        "efficiency": summary["efficiency"],
        "requests": summary["requests"],
        "run": {
            "model": config.model,
            "rounds": config.rounds,
            "trainers": config.trainers,
            "inference": config.inference,
            "max_staleness": config.max_staleness,
            "node_threads": int(outcome.nodes[0].env["OMP_NUM_THREADS"]) if outcome.nodes else None,
            "wall_s": round(outcome.wall_s, 1),
            "exit": outcome.code,
            "reason": outcome.reason,
        },
        "checks": summary["checks"],
        "nodes_detail": summary["nodes"],
        "restarts": {n.name: n.restarts.count for n in outcome.nodes} | {"store": outcome.store_restarts},
    }
    return summary


def print_summary(out: Any, config: UpConfig, outcome: Outcome, summary: dict[str, Any]) -> None:
    from rich.table import Table

    rounds = summary["rounds"]
    out.print(f"\n[bold]pulsenet up[/]: {outcome.reason or 'stopped'} after {outcome.wall_s:.0f} s")
    if rounds:
        curve = " ".join(f"{r['reward']:.2f}" if r["reward"] is not None else "-" for r in rounds)
        out.print(f"reward per round: {curve}")
        rewards = [r["reward"] for r in rounds if r["reward"] is not None]
        if len(rewards) >= 10:
            n = len(rewards) // 10
            first, last = sum(rewards[:n]) / n, sum(rewards[-n:]) / n
            out.print(f"reward, first tenth -> last tenth of the rounds: {first:.3f} -> {last:.3f}")
        sp = [r["sparsity"] for r in rounds if r["sparsity"] is not None]
        if sp:
            out.print(f"sparsity (BF16 weights unchanged per version): mean {sum(sp) / len(sp):.4f}, min {min(sp):.4f}")
        total = {ch: sum(r["bytes"][ch] for r in rounds) for ch in rounds[0]["bytes"]}
        out.print(
            f"PULSESync: {total['pulsesync']:,} B to {config.inference} inference node(s) vs {total['full_sync']:,} B "
            f"of full checkpoints ({_ratio(total['full_sync'], total['pulsesync'])})"
        )
        if config.trainers == 1:
            out.print("PULSELoCo: n.a. (one trainer: no rounds between trainers, 0 B; DiLoCo and DDP 0 B too)")
        elif not total["pulseloco"]:
            out.print("PULSELoCo: not reported (the trainers' logs carry no loco_bytes per round)")
        else:
            out.print(
                f"PULSELoCo: {total['pulseloco']:,} B vs DiLoCo {total['diloco']:,} B "
                f"({_ratio(total['diloco'], total['pulseloco'])}) and DDP {total['ddp']:,} B "
                f"({_ratio(total['ddp'], total['pulseloco'])})"
            )
        out.print(f"rollouts: {total['rollouts']:,} B")
        if summary["eval"]:
            out.print(
                "greedy eval on held-out problems: " + " ".join(f"v{e['version']} {e['reward']:.3f}" for e in summary["eval"])
            )
        e = summary["efficiency"]
        replay = e.get("replay_cost") or {}  # summaries written before replay's cost was kept have none
        out.print(
            f"efficiency: {_pct(e['trained_fraction'])} of generated rollouts trained on, "
            f"{_pct(e['dropped_fraction'])} dropped stale, mean staleness {_fmt(e['staleness_mean'], '{:.2f}')}; "
            f"engines busy {_pct(e['engine_busy'])}, trainers busy {_pct(e['trainer_busy'])}; "
            f"replay {_pct(replay.get('of_train'))} of GRPO time, {_pct(replay.get('of_rounds'))} of trainer time; "
            f"update latency p95 {_fmt(e['update_latency_s']['p95'], '{:.2f}')} s of a "
            f"{_fmt(e['round_s'], '{:.1f}')} s round"
        )
    compact = out.width < COMPACT_BELOW
    t = Table(title="verified versions and digests")
    cols = (
        ("node", "role", "rst", "ver", "digest", "checks")
        if compact
        else ("node", "role", "restarts", "version", "digest", "checks")
    )
    for col in cols:  # checks wraps at spaces; the rest keep whole headers, names and numbers
        t.add_column(col, no_wrap=col != "checks", min_width=len(col) if col != "checks" else None)
    for name, d in summary["nodes"].items():
        ok = ""
        if d["role"] == "inference":
            ok = "served verified" if d["served_verified"] else "UNVERIFIED" if d["served"] else "served nothing"
            if d["weights_digest"] is None:
                ok += ", own weights not rehashed"
            else:
                ok += ", own weights match" if d["weights_digest"] == d["digest"] else ", OWN WEIGHTS DIFFER"
        digest = (d["digest"] or "-")[:12] if compact else (d["digest"] or "-")[:16] + "…"
        t.add_row(name, d["role"], str(d.get("restarts", 0)), _fmt(d["version"]), digest, ok)
    out.print(t)
    if outcome.store_restarts:
        out.print(f"store restarts: {outcome.store_restarts}")
    checks = summary["checks"]
    out.print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))




def _fmt(v: Any, spec: str = "{}") -> str:
    return "-" if v is None else spec.format(v)



def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.1f}x smaller" if b else "n.a."


def _bytes(v: int | None) -> str:
    """A byte count in at most 6 characters (``812``, ``12.3k``, ``4.56M``): whole in a narrow column."""
    if v is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            x = v / scale
            return (f"{x:.1f}" if abs(x) < 99.95 else f"{x:.0f}") + unit
    return str(v)
