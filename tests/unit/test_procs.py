"""pulsenet/procs.py against real processes: a child and a grandchild are found by parentage, a
reaped or zombie process is not alive, and a vanished pid reads as gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from pulsenet import procs


def test_descendants_finds_children_and_grandchildren_and_drops_the_dead() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"])
    try:
        deadline = time.monotonic() + 30
        while len(procs.descendants(child.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        below_me = procs.descendants(os.getpid())
        assert child.pid in below_me and set(procs.descendants(child.pid)) <= set(below_me)
        assert len(procs.descendants(child.pid)) == 1 and procs.alive(child.pid)
        assert procs.rss_bytes(child.pid) > 0 and os.getpid() in procs.ancestors()
    finally:
        for pid in procs.descendants(child.pid):
            os.kill(pid, 9)
        child.kill()
    deadline = time.monotonic() + 30  # SIGKILL takes effect when the kernel gets to it: poll, never a fixed wait
    while procs.alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs.alive(child.pid)  # a zombie until reaped: not alive
    child.wait()
    assert procs.stat(child.pid) is None and procs.rss_bytes(child.pid) == 0
