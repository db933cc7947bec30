"""``pulsenet chaos``: ``pulsenet up``'s network under a seeded fault schedule, then the audit.

The network is the launcher's (``nodes/up.run_network``), supervised as in ``pulsenet up``; the
schedule is ``chaos/faults.py``'s injector; the audit is ``chaos/check.py`` over the run's own
records. The verdict is printed and everything goes to ``--out`` (JSON); the exit code is 0 only
when every check holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import tomllib
from pathlib import Path
from typing import Any

from pulsenet import procs
from pulsenet.chaos.check import Limits, audit
from pulsenet.chaos.faults import Chaos, ChaosConfig
from pulsenet.fsutil import atomic_write_bytes
from pulsenet.nodes.supervisor import JOURNAL_FILE, read_journal
from pulsenet.nodes.up import run_network
from pulsenet.nodes.up.console import print_summary
from pulsenet.nodes.up.node import Outcome


def run_chaos(config: ChaosConfig) -> int:
    """The run, the audit, the verdict (printed and written to ``config.out``); 0 if it passes."""
    from rich.console import Console

    out = Console()
    chaos = Chaos(config)
    out.print(
        f"[bold]pulsenet chaos[/]: seed {config.chaos_seed}, {len(chaos.schedule)} faults: "
        + ", ".join(f"{f.kind} {f.target}" for f in chaos.schedule)
    )
    outcome, summary = run_network(config, chaos)
    if summary["rounds"]:
        print_summary(out, config, outcome, summary)
    result = audit_run(config, chaos, outcome)
    result["summary"] = {k: summary[k] for k in ("checks", "extra") if k in summary}
    atomic_write_bytes(config.out, (json.dumps(result, indent=1, default=str) + "\n").encode())
    print_verdict(out, result)
    out.print(f"written: {config.out.absolute()}")
    return 0 if result["verdict"] == "pass" else 1


def audit_run(c: ChaosConfig, chaos: Chaos, outcome: Outcome) -> dict[str, Any]:
    """``check.audit`` over what the run left: events, journal, faults, samples, listing, settings, processes."""
    workdir = c.workdir.absolute()
    settings = {}
    for path in sorted((workdir / "config").glob("*.toml")):
        table = tomllib.loads(path.read_text())
        settings[path.stem] = table.get("trainer") or table.get("inference") or {}
    if "loco" in chaos.stores:
        settings["loco"] = {}
    pids = [pid for n in outcome.nodes for pid in n.pids]
    result = audit(
        events=outcome.events,
        roles={n.name: n.role for n in outcome.nodes},
        journal=read_journal(workdir / "state" / JOURNAL_FILE),
        faults=chaos.records,
        samples=[dataclasses.asdict(s) for s in chaos.samples],
        listing=chaos.listing or None,
        stores=chaos.stores,
        settings=settings,
        orphans=orphans(workdir, pids),
        exit_code=outcome.code,
        reason=outcome.reason,
        limits=Limits(c.rss_slope_mb_per_min, c.fd_growth, c.resource_min_life_s),
    )
    result["config"] = {
        "chaos_seed": c.chaos_seed,
        "schedule": [dataclasses.asdict(f) for f in chaos.schedule],
        "rounds": c.rounds,
        "trainers": c.trainers,
        "inference": c.inference,
        "model": c.model,
        "wall_s": round(outcome.wall_s, 1),
        "links": {n: dataclasses.asdict(link.stats) for n, link in chaos.links.items()},
    }
    return result


def orphans(workdir: Path, pids: list[int], wait_s: float = 5.0) -> list[str]:
    """Processes of the run still alive: any of its nodes' pids (every life), and any process whose
    command line names the work directory (nodes name their config there, the store its data)."""
    ours = procs.ancestors()  # this process and whatever started it (a shell, a timeout) name it too
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in ours:
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if procs.alive(int(entry)) and (int(entry) in pids or str(workdir) in cmdline):
                found.append(f"{entry}: {cmdline[:160]}")
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def print_verdict(out: Any, result: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title="chaos: faults")
    for col in ("#", "fault", "target", "at v", "into version", "recovery"):
        t.add_column(col)
    for f in result["faults"]:
        if not f.get("injected"):
            t.add_row(str(f["index"]), f["kind"], f["target"], "-", "-", f"skipped: {f.get('skipped', '')}")
            continue
        into = f"{f['into_version_s']:.1f} s" if f.get("into_version_s") is not None else "-"
        rec = f"{f['recovery_s']:.1f} s" if f.get("recovery_s") is not None else "[red]NOT RECOVERED[/]"
        t.add_row(str(f["index"]), f["kind"], f["target"], f"v{f.get('version')}", into, rec)
    out.print(t)
    fig = result["figures"]
    out.print(
        f"faults {fig['faults_injected']}, recovered {fig['recovered']}, max recovery {fig['max_recovery_s']} s, "
        f"served {fig['served']} ({fig['unverified_served']} unverified), forks {fig['forks']}, "
        f"restarts {fig['restarts']}"
    )
    for o in fig.get("trainer_outages", ()):
        out.print(
            f"  {o['target']} down {o['down_s']} s: the others published {o['versions_while_down']} versions "
            f"meanwhile, longest wait between versions {o['max_gap_s']} s"
        )
    res = Table(title="chaos: RSS and descriptors per node life (second half slope)")
    for col in ("node", "pid", "life", "RSS MB start->end", "MB/min", "fds start->end (max)", "fds/min"):
        res.add_column(col)
    for node, info in result["resources"].items():
        for life in info["lives"]:
            res.add_row(
                node,
                str(life["pid"]),
                f"{life['life_s']:.0f} s",
                f"{life['rss_mb'][0]} -> {life['rss_mb'][1]}",
                str(life["rss_slope_mb_per_min"]),
                f"{life['fds'][0]} -> {life['fds'][1]} ({life['fds_max']})",
                str(life["fd_slope_per_min"]),
            )
    out.print(res)
    for name, chk in result["checks"].items():
        mark = "[green]ok[/]" if chk["ok"] else "[bold red]FAILED[/]"
        detail = chk["detail"] if not chk["ok"] else ""
        out.print(f"  {name}: {mark} {detail}")
    colour = "green" if result["verdict"] == "pass" else "red"
    out.print(f"[bold {colour}]chaos verdict: {result['verdict']}[/]")
