"""A PULSESync subscriber in its own process, for tests that SIGKILL it and start it again.

Prints one JSON object per line on stdout (flushed)::

    {"event": "started", "resumed": <version or null>}
    {"event": "building", "version": target, "current": v}  (a round starts fetching a chain)
    {"event": "saved", "version": v, "digest": "...", "downloaded": [keys fetched since the last event]}
    {"event": "done", "version": v, "digest": "..."}       (after reaching --until)

The S3 endpoint and keys come from the standard AWS variables (this process is the edge).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from pulsenet.signing import trusted_keys
from pulsenet.store import S3Config, S3Store
from pulsenet.sync import Manifest, Subscriber, SubscriberConfig


def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


class TracedSubscriber(Subscriber):
    """Announces each chain it starts building, so a test can kill it mid-chain."""

    async def _update_to(self, target: Manifest) -> None:
        emit(event="building", version=target.version, current=self.version)
        await super()._update_to(target)


async def main(args: argparse.Namespace) -> None:
    config = S3Config.from_env(timeout_s=10.0)  # AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...
    sub_config = SubscriberConfig(
        channel=args.channel,
        interval_s=args.interval,
        jitter=0.2,
        state_dir=args.state_dir,
        cache_dir=args.state_dir / "cache",
        threads=1,
    )
    done = asyncio.Event()
    async with S3Store(args.bucket, args.prefix, config) as store:
        sub: TracedSubscriber

        def saved(version: int, digest: str) -> None:
            emit(event="saved", version=version, digest=digest, downloaded=list(sub.cache.downloaded))
            sub.cache.downloaded.clear()
            if version >= args.until:
                done.set()

        sub = TracedSubscriber(store, trusted_keys([args.trust]), sub_config, on_saved=saved)
        async with sub:
            emit(event="started", resumed=sub.resumed_from)
            if sub.version is not None and sub.version >= args.until:
                done.set()
            await sub.run(done)
            emit(event="done", version=sub.version, digest=sub.digest)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--bucket", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--channel", default="policy")
    p.add_argument("--trust", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--until", type=int, required=True, help="exit once this version is saved")
    p.add_argument("--interval", type=float, default=0.1)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main(args))
