"""The project's S3 server (SeaweedFS, ``pulsenet.store.seaweed``) standing in for MinIO in a
container: docker/compose.seaweed.yaml runs it where MinIO's image cannot be had.

Same users and secrets as the MinIO bootstrap: user ``site-<s>`` with secret ``PN_SECRET_<s>``
writes only bucket ``pulsenet-<s>`` and reads every bucket; the trainers' users also write
``pulsenet-loco``; ``pulsenet-admin`` (``MINIO_ROOT_PASSWORD``) may do anything. SeaweedFS binds to
127.0.0.1 inside this container (its hardening: docs/store.md); only the S3 port is relayed to the
container's network, on ``--listen`` (pulsenet/chaos/link.py, no delay, no rate: the sites' links shape).

    python docker/s3_store.py --dir /data --listen 0.0.0.0:9000     # env: SITES, TRAINERS, secrets
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from pulsenet.chaos.link import LinkProxy, address, serve


def identities(sites: list[str], trainers: list[str]) -> list[dict]:
    """The identities file's entries, named as ``SeaweedServer`` names its roles (``admin``,
    ``writer-<s>``), with the MinIO users' access keys and secrets. SeaweedServer keeps these keys
    and sets each role's actions itself (``seaweed_security.load_identities``)."""

    def entry(name: str, access: str, secret: str) -> dict:
        if len(secret) < 8:
            raise SystemExit(f"s3_store: the secret of {access} is unset or shorter than 8 characters")
        return {"name": name, "credentials": [{"accessKey": access, "secretKey": secret}], "actions": []}

    out = [entry("admin", "pulsenet-admin", os.environ.get("MINIO_ROOT_PASSWORD", ""))]
    out += [entry(f"writer-{s}", f"site-{s}", os.environ.get(f"PN_SECRET_{s}", "")) for s in sites]
    unknown = set(trainers) - set(sites)
    if unknown:
        raise SystemExit(f"s3_store: TRAINERS {sorted(unknown)} are not in SITES")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--listen", default="0.0.0.0:9000")
    a = p.parse_args()
    sites = os.environ.get("SITES", "").split()
    trainers = os.environ.get("TRAINERS", "").split()
    a.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(a.dir, 0o700)
    (a.dir / "s3-identities.json").write_text(json.dumps({"identities": identities(sites, trainers)}))
    os.chmod(a.dir / "s3-identities.json", 0o600)

    from pulsenet.store.seaweed import SeaweedServer

    server = SeaweedServer(a.dir, sites=sites, shared={"loco": tuple(trainers)})
    with server:
        server.create_buckets()
        print(f"s3_store: SeaweedFS at {server.endpoint_url}; buckets {', '.join(server.create_buckets())}", flush=True)
        return asyncio.run(_serve(server, address(a.listen)))


async def _serve(server, listen: tuple[str, int]) -> int:
    """Relay S3 until SIGTERM (0) or until weed exits (1: the restart policy starts the store again)."""
    relay = asyncio.create_task(serve(LinkProxy(f"http://127.0.0.1:{server.port}", listen=listen)))
    while not relay.done():
        if not server.running:
            print(f"s3_store: weed mini exited:\n{server.log_tail()}", file=sys.stderr, flush=True)
            relay.cancel()
            return 1
        await asyncio.wait([relay], timeout=1.0)
    await relay
    return 0


if __name__ == "__main__":
    sys.exit(main())
