"""A node that freezes in C code: its status server answers, then the GIL is held inside one C
call (``re``'s backtracking matcher, which never releases it) so neither its event loop nor its
signal handlers run again. ``pulsenet up``'s supervisor must see "no answer" and restart it.

``python frozen_worker.py PORT MARKER``: serves ``/status`` on PORT; the first life (no MARKER file
yet) creates MARKER after ``FREEZE_AFTER_S`` and freezes; later lives serve until SIGTERM.
SIGTERM goes to the event loop (as in a real node, ``nodes/run.py``), so a frozen life needs SIGKILL.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
from pathlib import Path

from pulsenet.nodes.status import NodeState, StatusServer

FREEZE_AFTER_S = 1.5


def freeze() -> None:
    """Hold the GIL for good: catastrophic backtracking, 2^60 paths, all inside _sre's C loop."""
    re.match(r"(a+)+$", "a" * 60 + "b")


async def main(port: int, marker: Path) -> None:
    state = NodeState(role="inference", node_id="frozen")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with StatusServer(state, port=port):
        first = not marker.exists()
        loop = asyncio.get_running_loop()
        until = loop.time() + FREEZE_AFTER_S
        while not stop.is_set():
            state.beat()
            if first and loop.time() >= until:
                marker.write_text("frozen\n")
                freeze()
            try:
                async with asyncio.timeout(0.1):
                    await stop.wait()
            except TimeoutError:
                pass


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), Path(sys.argv[2])))
