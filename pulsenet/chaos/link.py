"""One node's link to the store, as a TCP relay the chaos schedule can throttle or cut.

``pulsenet chaos`` gives each node that a link fault targets its own relay (its ``AWS_ENDPOINT_URL``
points here instead of at the store), run in the launcher's event loop. Everything the node says to
the store, and hears back, passes through it, so the fault is in the network path and nowhere else:
the node's process, code and settings are untouched and it finds out only through its own store
calls, as over a real link.

- ``throttle(mbps)``: each direction is paced to ``mbps`` Mbit/s (one budget per direction shared
  by the node's connections: a link, not a per-connection cap);
- ``cut()``: the relay stops moving bytes in both directions. Connections stay open (new ones are
  still accepted by the kernel) and hang until the node's own deadlines fire: what a dead route
  looks like to TCP, not the quick "connection refused" of a stopped server;
- ``restore()``: full speed again; bytes held during a cut then flow (to connections the node may
  have given up on, which then see them or a reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from pulsenet.logs import suppressed

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


@dataclass(slots=True)
class LinkStats:
    """Bytes relayed each way and connections accepted."""

    up: int = 0
    down: int = 0
    connections: int = 0


class LinkProxy:
    """A relay from a local port to ``upstream`` (an ``http://host:port`` URL); bound at construction
    so the node's endpoint is known before the event loop runs, serving from ``start()``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        if not parts.hostname or not parts.port:
            raise ValueError(f"link upstream must be http://host:port, got {upstream!r}")
        self.host, self.port_up, self.scheme = parts.hostname, parts.port, parts.scheme
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)  # connections made before start() wait in the backlog
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.mbps: float | None = None
        self.stats = LinkStats()
        self._open = asyncio.Event()
        self._open.set()
        self._next = {"up": 0.0, "down": 0.0}
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def state(self) -> str:
        if not self._open.is_set():
            return "cut"
        return f"{self.mbps:g} Mbit/s" if self.mbps else "open"

    async def start(self) -> None:
        self._open = asyncio.Event()  # bound to this loop
        self._open.set()
        self._server = await asyncio.start_server(self._accept, sock=self.sock)

    def throttle(self, mbps: float) -> None:
        if not mbps > 0:
            raise ValueError(f"mbps must be > 0, got {mbps}")
        self.mbps = mbps

    def cut(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self.mbps = None
        self._open.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError), suppressed(log, f"link :{self.port}: closing a connection"):
                await t
        if self._server is not None:
            with suppressed(log, f"link :{self.port}: closing its server"):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None
        self.sock.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.host, self.port_up)
            except OSError:  # the store is down: the node sees its connection closed
                return
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._pump(reader, up_writer, "up"))
                    tg.create_task(self._pump(up_reader, writer, "down"))
            except* (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        while True:
            await self._open.wait()
            data = await src.read(CHUNK)
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            await self._open.wait()  # cut while reading: hold the bytes
            if self.mbps:
                await self._pace(direction, len(data))
            dst.write(data)
            await dst.drain()
            if direction == "up":
                self.stats.up += len(data)
            else:
                self.stats.down += len(data)

    async def _pace(self, direction: str, n: int) -> None:
        """Hold ``n`` bytes until a link of ``mbps`` would have carried them (after what it carries already)."""
        assert self.mbps
        now = time.monotonic()
        done = max(now, self._next[direction]) + n * 8 / (self.mbps * 1e6)
        self._next[direction] = done
        await asyncio.sleep(done - now)
