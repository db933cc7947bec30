"""One node's link to the store, as a TCP relay the chaos schedule can throttle or cut, or that a
container network runs as a site's shaped link (``python -m pulsenet.chaos.link``).

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
  have given up on, which then see them or a reset);
- ``delay_s``: every chunk is delivered that long after it was read, each direction in order, so a
  request and its answer each pay it once (a round trip: twice). This kernel has ``tc``'s ``tbf``
  but not ``netem``: delay has to be userspace.

As a program (docker/compose.yaml's ``link-<site>`` services, docker/s3_store.py): a relay from
``--listen`` to ``--upstream`` with ``--delay-ms``, its rate set by the kernel: ``tc qdisc tbf`` on
each of its interfaces (egress: towards the store, the site's uplink; towards the site, its
downlink). That needs CAP_NET_ADMIN; it exits non-zero when the rate cannot be set rather than run
an unshaped link silently::

    python -m pulsenet.chaos.link --listen 0.0.0.0:9000 --upstream minio:9000 --delay-ms 40 --rate 100mbit

``--mbps`` paces the relay itself instead (``throttle``: no privileges, one process per link), as
``pulsenet bench size`` does for its latency runs. The first line it prints names the address it
listens on (``--listen`` may ask for port 0: any free one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from pulsenet.logs import suppressed

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
PACE_SLACK_S = 0.01
"""A throttled direction may run this far behind its schedule and catch up (``LinkProxy._pace``)."""
QUEUED = 256
"""Chunks in flight per direction of a delayed connection (16 MiB): a full queue stops reading, as TCP would."""


@dataclass(slots=True)
class LinkStats:
    """Bytes relayed each way and connections accepted."""

    up: int = 0
    down: int = 0
    connections: int = 0


class LinkProxy:
    """A relay from a local port to ``upstream`` (an ``http://host:port`` URL); bound at construction
    (``listen``: 127.0.0.1 on a free port by default) so the node's endpoint is known before the
    event loop runs, serving from ``start()``; every chunk delivered ``delay_s`` after it was read."""

    def __init__(self, upstream: str, *, listen: tuple[str, int] = ("127.0.0.1", 0), delay_s: float = 0.0) -> None:
        parts = urlsplit(upstream)
        if not parts.hostname or not parts.port:
            raise ValueError(f"link upstream must be http://host:port, got {upstream!r}")
        self.host, self.port_up, self.scheme = parts.hostname, parts.port, parts.scheme
        self.delay_s = delay_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
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
        """Read chunks as they come and deliver each ``delay_s`` later, in order, paced to ``mbps``:
        the reader runs ahead of the writer (up to ``QUEUED`` chunks), so a delay costs latency,
        not throughput."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED)

        async def read() -> None:
            data = b"?"
            try:
                while data:
                    await self._open.wait()
                    data = await src.read(CHUNK)
                    await queue.put((time.monotonic() + self.delay_s, data))
            except OSError:  # the other end reset: the writer ends this direction
                await queue.put((time.monotonic(), b""))

        reader = asyncio.create_task(read())
        try:
            while True:
                due, data = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
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
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
                await reader

    async def _pace(self, direction: str, n: int) -> None:
        """Hold ``n`` bytes until a link of ``mbps`` would have carried them (after what it carries
        already). Up to ``PACE_SLACK_S`` that the event loop overslept a chunk's wait is made up by
        the next ones, not added to the transfer: a paced transfer takes its bytes over the rate,
        not that plus a millisecond or so per chunk (a bucket that deep, as tc's ``tbf`` has one)."""
        assert self.mbps
        now = time.monotonic()
        done = max(now - PACE_SLACK_S, self._next[direction]) + n * 8 / (self.mbps * 1e6)
        self._next[direction] = done
        if done > now:
            await asyncio.sleep(done - now)


def shape(rate: str, burst: str = "64kb", latency: str = "100ms") -> list[str]:
    """``tc qdisc tbf`` at ``rate`` on every interface but loopback (egress: each direction of the
    link gets its own bucket). Returns the commands run; raises CalledProcessError if one failed."""
    done = []
    for dev in sorted(n for n in os.listdir("/sys/class/net") if n != "lo"):
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        done.append(" ".join(cmd))
    return done


async def serve(link: LinkProxy, stop: asyncio.Event | None = None) -> None:
    """Run ``link`` until ``stop`` is set (None: until SIGTERM or SIGINT)."""
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await link.start()
    try:
        await stop.wait()
    finally:
        await link.close()


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (HOST may be empty: every address) as a socket address."""
    host, _, port = text.rpartition(":")
    return host or "0.0.0.0", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A site's link to the store: a TCP relay with a delay and a rate.")
    p.add_argument("--listen", default="0.0.0.0:9000")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the store")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--rate", default="", help="tc rate, e.g. 100mbit; empty: not shaped")
    p.add_argument("--mbps", type=float, default=None, help="pace the relay itself to this rate (Mbit/s each way)")
    a = p.parse_args(argv)
    if a.mbps is not None and not a.mbps > 0:
        p.error(f"--mbps must be > 0, got {a.mbps}")
    if a.rate:
        try:
            for cmd in shape(a.rate):
                print(f"link: {cmd}", flush=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"link: cannot shape the link to {a.rate}: {getattr(e, 'stderr', '') or e}", file=sys.stderr)
            return 1
    link = LinkProxy(f"http://{a.upstream}", listen=address(a.listen), delay_s=a.delay_ms / 1000)
    if a.mbps is not None:
        link.throttle(a.mbps)
    rate = f"{a.mbps:g} Mbit/s (paced here)" if a.mbps is not None else a.rate or "unshaped"
    host, port = link.sock.getsockname()[:2]
    print(f"link: {host}:{port} -> {a.upstream}, {a.delay_ms:g} ms each way, rate {rate}", flush=True)
    asyncio.run(serve(link))
    return 0


if __name__ == "__main__":
    sys.exit(main())
