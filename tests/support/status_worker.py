"""A node's status server in its own process, for tests that flood its port and count its fds.

Runs ``StatusServer`` (default limits) on the event loop a node uses (``nodes/run.py``: uvloop),
under the usual 1024-descriptor soft limit, next to a task that opens a file every 20 ms the way a
node's own work does (state files, caches); a failed open is a node error (``/status`` ``errors``).
Prints ``{"port": N}`` once serving; exits when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys

from pulsenet.nodes.status import NodeState, StatusServer

NOFILE = 1024


async def _own_files(state: NodeState) -> None:
    while True:
        try:
            with open(os.devnull, "rb"):
                pass
        except OSError as e:
            state.error(e)
        state.beat()
        await asyncio.sleep(0.02)


async def main() -> None:
    state = NodeState(role="inference", node_id="flooded")
    async with StatusServer(state) as server:
        print(json.dumps({"port": server.port}), flush=True)
        files = asyncio.create_task(_own_files(state))
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        files.cancel()


if __name__ == "__main__":
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE, hard), hard))
    try:
        from uvloop import run
    except ImportError:  # what nodes/run.py falls back to
        run = asyncio.run
    run(main())
