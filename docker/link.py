"""A site's link to the store in docker/compose.yaml: a TCP relay with a one-way delay and a rate.

Each site's node sits on its own network with only this relay, which is also on the store's network:
everything the node says to the store passes here. The delay is userspace (this kernel has `tc`'s
``tbf`` but not ``netem``): every chunk read is written ``--delay-ms`` later, each direction in
order, so a request and its answer each pay the delay once (one round trip: twice). The rate is the
kernel's: ``tc qdisc tbf`` on each of the relay's interfaces, which shapes what leaves it (towards
the store: the site's uplink; towards the site: its downlink). Needs CAP_NET_ADMIN for that; it
exits non-zero when the rate cannot be set, rather than run an unshaped link silently.

    python docker/link.py --listen 0.0.0.0:9000 --upstream minio:9000 --delay-ms 40 --rate 100mbit

No pulsenet imports: the same file runs in the node image and next to the store (docker/s3_store.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

CHUNK = 64 * 1024
QUEUED = 256  # chunks in flight per direction (16 MiB): a full queue stops reading, as TCP would


def interfaces() -> list[str]:
    """The container's network interfaces, loopback left out."""
    return sorted(n for n in os.listdir("/sys/class/net") if n != "lo")


def shape(rate: str, burst: str = "64kb", latency: str = "100ms") -> list[str]:
    """``tbf`` at ``rate`` on every interface (egress: each direction of the link gets its own
    bucket). Returns the commands run; raises CalledProcessError if one failed."""
    done = []
    for dev in interfaces():
        cmd = ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        done.append(" ".join(cmd))
    return done


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float) -> None:
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUED)

    async def read() -> None:
        while data := await src.read(CHUNK):
            await queue.put((time.monotonic() + delay_s, data))
        await queue.put((time.monotonic() + delay_s, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            dst.write(data)
            await dst.drain()

    reader = asyncio.create_task(read())
    try:
        await write()
    finally:
        reader.cancel()


async def _connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: tuple[str, int], delay_s: float
) -> None:
    try:
        up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(*upstream), 10)
    except (OSError, TimeoutError):
        writer.close()
        return
    try:
        await asyncio.gather(_pump(reader, up_writer, delay_s), _pump(up_reader, writer, delay_s))
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        for w in (writer, up_writer):
            w.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "0.0.0.0", int(port)


async def relay(listen: tuple[str, int], upstream: tuple[str, int], delay_s: float) -> None:
    """Serve until SIGTERM/SIGINT."""
    server = await asyncio.start_server(
        lambda r, w: _connection(r, w, upstream, delay_s), listen[0], listen[1], reuse_address=True
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", default="0.0.0.0:9000")
    p.add_argument("--upstream", required=True, help="HOST:PORT of the store")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--rate", default="", help="tc rate, e.g. 100mbit; empty: not shaped")
    a = p.parse_args(argv)
    if a.rate:
        try:
            for cmd in shape(a.rate):
                print(f"link: {cmd}", flush=True)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"link: cannot shape the link to {a.rate}: {getattr(e, 'stderr', '') or e}", file=sys.stderr)
            return 1
    print(f"link: {a.listen} -> {a.upstream}, {a.delay_ms:g} ms each way, rate {a.rate or 'unshaped'}", flush=True)
    asyncio.run(relay(_address(a.listen), _address(a.upstream), a.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
