"""``pulsenet bench memory``: the peak resident memory of every node of a ``pulsenet up`` run,
measured from outside, against its budget (issue 37; ``nodes/memory.py``).

The benchmark runs ``pulsenet up`` as a new user would (its own process, a fresh work directory)
and samples ``/proc/<pid>/status`` of every node process it starts every ``interval_s``: ``VmHWM``
(the kernel's high-water mark of the process's resident memory, so a spike between two samples
is not missed) and ``VmRSS``. vLLM's engine core (a child of an inference node) is sampled too and
reported beside its node, outside the node's own budget. Per node: the peak, its budget
(``bytes_per_param`` x P + overhead, P the model's parameters with tied weights once), whether
the peak is within it, and the bytes per parameter the peak is above the overhead. The node's own
account of its weights, by holder (its last ``/status`` ``memory``), and the run's end (digests,
checks) come from ``pulsenet up``'s ``summary.json``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsenet.bench import BenchSettings, config_of, workdir
from pulsenet.nodes.memory import GiB, budget_for, meminfo, proc_memory

SCHEMA = "pulsenet.bench.memory/1"


@dataclass(kw_only=True)
class MemoryBenchSettings(BenchSettings):
    """Peak memory per node of a ``pulsenet up`` run against the issue-37 budgets."""

    model: str = "smollm2"
    """smollm2, tiny, or a Hugging Face model directory (a random one needs a dense --reward)."""
    trainers: int = 1
    inference: int = 2
    rounds: int = 3
    engine: str = "torch"
    """The inference nodes' engine: torch or vllm."""
    task: str = ""
    """``pulsenet up --task`` ("": the preset's)."""
    reward: list[str] = field(default_factory=list)
    """``pulsenet up --reward`` (empty: the task's)."""
    rows_per_step: int = 16
    prompts: int = 4
    group_size: int = 4
    max_new_tokens: int = 16
    interval_s: float = 0.25
    """Seconds between two samples of the nodes' /proc status."""
    timeout_s: float = 1500.0
    """``pulsenet up --timeout-s``."""
    workdir: Path | None = None
    """``pulsenet up``'s work directory (None: a temporary one)."""
    memory_check: bool = True
    """``pulsenet up``'s preflight against the available memory (off: measure even when other
    processes hold enough memory that the budgets would not fit beside them)."""


def run(s: MemoryBenchSettings) -> dict[str, Any]:
    with workdir(s.workdir, "memory") as wd:
        report = wd / "report"
        cmd = [
            sys.executable, "-m", "pulsenet", "up", "--model", s.model, "--trainers", str(s.trainers),
            "--inference", str(s.inference), "--rounds", str(s.rounds), "--engine", s.engine,
            "--rows-per-step", str(s.rows_per_step), "--prompts", str(s.prompts), "--group-size", str(s.group_size),
            "--max-new-tokens", str(s.max_new_tokens), "--no-live", "--workdir", str(wd / "up"), "--report", str(report),
            "--timeout-s", str(s.timeout_s),
        ]  # fmt: skip
        if s.task:
            cmd += ["--task", s.task]
        if s.reward:
            cmd += ["--reward", *s.reward]
        if not s.memory_check:
            cmd.append("--no-memory-check")
        t0 = time.perf_counter()
        with open(wd / "up.log", "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            sampler = Sampler(proc.pid, s.interval_s)
            thread = threading.Thread(target=sampler.run, daemon=True)
            thread.start()
            code = proc.wait()
            sampler.stop.set()
            thread.join()
        wall = time.perf_counter() - t0
        summary_path = report / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        tail = (wd / "up.log").read_text(errors="replace")[-3000:]
    result = {
        "schema": SCHEMA,
        "config": config_of(s),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "memory_total": meminfo("MemTotal")},
        "command": cmd,
        "exit": code,
        "wall_s": round(wall, 1),
        "nodes": judge(sampler.peaks, summary, s.engine),
        "end": None if summary is None else {k: summary.get(k) for k in ("run", "checks", "nodes")},
    }
    if code != 0 or summary is None:
        result["log_tail"] = tail
    _print(result)
    return result


class Sampler:
    """The peak ``VmHWM`` and ``VmRSS`` of every child of ``pid`` that is a node (its command names
    ``--config <node>.toml``), and of each node's own children (vLLM's engine core), by name."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peaks: dict[str, dict[str, int]] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval_s)

    def sample(self) -> None:
        nodes = {pid: name for pid, name in _children(self.pid) if name}
        found = list(nodes.items())
        for pid, name in nodes.items():
            found += [(child, f"{name}/{cmd or 'child'}") for child, cmd in _children(pid, named=False)]
        for pid, name in found:
            mem = proc_memory(pid)
            if mem is None:
                continue
            peak = self.peaks.setdefault(name, {"peak_rss": 0, "max_rss_sampled": 0})
            peak["peak_rss"] = max(peak["peak_rss"], mem["peak_rss"])
            peak["max_rss_sampled"] = max(peak["max_rss_sampled"], mem["rss"])


def _children(pid: int, *, named: bool = True) -> list[tuple[int, str]]:
    """``(pid, name)`` of ``pid``'s children: a node's name from its ``--config`` (named), else the
    child's command name; "" where there is none."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if named:
            name = Path(argv[argv.index(b"--config") + 1].decode()).stem if b"--config" in argv else ""
        else:
            name = Path(f"/proc/{entry}/comm").read_text().strip() if Path(f"/proc/{entry}/comm").exists() else ""
        out.append((int(entry), name))
    return out


def judge(peaks: dict[str, dict[str, int]], summary: dict[str, Any] | None, engine: str) -> dict[str, Any]:
    """Per node: the peak measured from outside, its budget, within or not, bytes per parameter
    above the overhead, and the node's own account (its last ``/status`` ``memory``)."""
    detail = (summary or {}).get("nodes_detail") or {}
    out: dict[str, Any] = {}
    for name, peak in sorted(peaks.items()):
        node = name.split("/", 1)[0]
        d = detail.get(node, {})
        role = d.get("role") or ("trainer" if node.startswith("t") else "inference")
        own = d.get("memory") or {}
        params = own.get("params")
        entry: dict[str, Any] = {"role": role, **peak, "peak_rss_gib": round(peak["peak_rss"] / GiB, 3)}
        if "/" in name:  # a node's child (vLLM's engine core): reported, outside the node's budget
            out[name] = entry
            continue
        b = budget_for(role, engine)
        if params:
            limit = b.limit(params)
            entry |= {
                "params": params,
                "budget": limit,
                "budget_gib": round(limit / GiB, 3),
                "budget_formula": f"{b.bytes_per_param:g} B/param + {b.overhead / GiB:g} GiB",
                "within_budget": peak["peak_rss"] <= limit,
                "bytes_per_param_above_overhead": round((peak["peak_rss"] - b.overhead) / params, 2),
            }
        entry["holders"] = own.get("holders")
        if "engine_update_bytes" in own:
            entry["engine_update_bytes"] = own["engine_update_bytes"]
        out[name] = entry
    return out


def _print(r: dict[str, Any]) -> None:
    print(f"pulsenet up exit {r['exit']} in {r['wall_s']} s")
    for name, e in r["nodes"].items():
        verdict = "" if "within_budget" not in e else f" budget {e['budget_gib']} GiB ({e['budget_formula']}): " + (
            "ok" if e["within_budget"] else "OVER")
        print(f"  {name:<16} peak {e['peak_rss_gib']:.2f} GiB{verdict}")
