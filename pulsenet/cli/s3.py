"""``pulsenet s3 serve``: a local S3 endpoint (SeaweedFS) with per-site buckets and keys."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pulsenet.store.seaweed import SeaweedServer


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("s3", help="embedded S3 server (SeaweedFS)")
    sub = group.add_subparsers(dest="s3_command", required=True, metavar="ACTION")
    serve = sub.add_parser(
        "serve",
        help="run SeaweedFS on 127.0.0.1 with site buckets and keys until Ctrl-C",
        description="Start `weed mini` on 127.0.0.1, create one bucket per site, print the endpoint and "
        "the keys (admin, a writer per site, a read-only reader) as shell lines, and run until "
        "Ctrl-C or SIGTERM. Keys are kept in the data directory and reused on the next start. Only the "
        "S3 port takes requests from other processes (see docs/store.md); the server dies with this "
        "command, even if it is killed.",
    )
    serve.add_argument(
        "--dir",
        help="data directory, made private (mode 0700) (default: a temporary one, deleted on exit)",
    )
    serve.add_argument("--port", type=int, default=None, help="S3 port (default: a free one)")
    serve.add_argument(
        "--sites", default="", help="comma-separated site names, e.g. a,b: one bucket and writer each"
    )
    serve.add_argument(
        "--bucket-prefix", default="pulsenet-", help="site bucket = PREFIX + site (default: %(default)s)"
    )
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pulsenet.store.seaweed import SeaweedServer

    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    server = SeaweedServer(args.dir, port=args.port, sites=sites, bucket_prefix=args.bucket_prefix)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with server:
            server.create_buckets()
            _print_keys(server, sites)
            while not stop.wait(0.5):
                if not server.running:
                    print(f"pulsenet: weed mini exited unexpectedly:\n{server.log_tail()}", file=sys.stderr)
                    return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("# stopped", flush=True)
    return 0


def _print_keys(server: SeaweedServer, sites: list[str]) -> None:
    out = [
        f"# SeaweedFS S3 at {server.endpoint_url}, data in {server.data_dir}",
        "# admin (creates buckets, full access):",
        *server.env_lines("admin"),
        "# reader (read and list only):",
        *server.env_lines("reader"),
    ]
    for site in sites:
        out += [
            f"# writer for site {site}: writes only s3://{server.bucket(site)}/, reads everything:",
            *server.env_lines(server.writer(site)),
        ]
    out.append("# ready; Ctrl-C to stop")
    print("\n".join(out), flush=True)
