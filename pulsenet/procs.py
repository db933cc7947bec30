"""Process facts from Linux's /proc: parent, state, RSS, descendants.

One reader for what benchmarks (memory of an engine and its subprocesses), chaos (the run's
leftover processes) and tests (no orphans after a SIGKILL) ask of the process table. Every
function treats a process that vanished mid-read as gone, never as an error.
"""

from __future__ import annotations

import os
from pathlib import Path


def stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid``; None once it is gone. The command name in /proc/PID/stat
    may hold spaces and parentheses, so the fields are read after its last ``)``."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited process its parent has not reaped)."""
    s = stat(pid)
    return s is not None and s[0] != "Z"


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (0 once it is gone, or for a zombie)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live (non-zombie) process below ``pid``: children, their children, ... Processes that
    rename themselves (vLLM's engine core) are found by parentage, not by command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (s := stat(int(entry))) is not None and s[0] != "Z":
            children.setdefault(s[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def ancestors() -> set[int]:
    """This process and every process above it (a shell, a ``timeout``, pytest)."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        s = stat(pid)
        if s is None:
            break
        pid = s[1]
    return pids
