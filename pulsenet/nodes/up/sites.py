"""Where ``pulsenet up``'s nodes live: the store (the embedded SeaweedFS, or ``--s3-endpoint``),
its per-site credentials and buckets, and each node's planned config file, command and port."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pulsenet.errors import ConfigError, PulsenetError
from pulsenet.nodes.events import EVENTS_FILE
from pulsenet.nodes.plan import Site, inference_ids, plan_network, trainer_ids
from pulsenet.nodes.up.node import Node
from pulsenet.settings import to_toml_table, write_toml

if TYPE_CHECKING:
    from pulsenet.nodes.config import TrainerConfig
    from pulsenet.nodes.up.config import UpConfig
    from pulsenet.nodes.up.supervisor import Injector

LOCO_SITE = "loco"
"""The bucket the trainers of a PULSELoCo run share (each writes only its own keys in it)."""
LONE_ROUND_DEADLINE_S = 300.0
"""The default round deadline of a lone trainer (a version per GRPO step)."""


@dataclass(frozen=True)
class Creds:
    """Per-site AWS_* variables and bucket names for one store."""

    env: dict[str, dict[str, str]]
    buckets: dict[str, str]


@contextlib.contextmanager
def open_store(c: UpConfig, workdir: Path, sites: list[str]) -> Iterator[tuple[Creds, Any]]:
    """The store's credentials per site, and the embedded ``SeaweedServer`` (None with ``--s3-endpoint``)."""
    trainers = [s for s in sites if s.startswith("t")]
    shared = {LOCO_SITE: trainers} if len(trainers) > 1 else {}
    buckets = {s: f"{c.bucket_prefix}{s}" for s in (*sites, *shared)}
    if c.s3_endpoint:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = c.s3_endpoint
        if not env.get("AWS_ACCESS_KEY_ID") or not env.get("AWS_SECRET_ACCESS_KEY"):
            raise ConfigError("pulsenet up --s3-endpoint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        _create_buckets(env, list(buckets.values()))
        yield Creds({s: env for s in sites}, buckets), None
        return
    from pulsenet.store.seaweed import SeaweedServer

    with SeaweedServer(workdir / "s3", sites=sites, shared=shared, bucket_prefix=c.bucket_prefix) as server:
        server.create_buckets()
        env = {}
        for s in sites:
            cfg = server.config(server.writer(s))  # writes only this site's bucket, reads all
            env[s] = {
                "AWS_ENDPOINT_URL": cfg.endpoint_url or "",
                "AWS_ACCESS_KEY_ID": cfg.access_key_id or "",
                "AWS_SECRET_ACCESS_KEY": cfg.secret_access_key or "",
                "AWS_REGION": cfg.region or "",
            }
        yield Creds(env, buckets), server


def _create_buckets(env: dict[str, str], names: list[str]) -> None:
    import boto3
    import botocore.exceptions as bex

    client = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
    )
    for name in names:
        try:
            client.create_bucket(Bucket=name)
        except bex.ClientError as e:
            if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise PulsenetError(f"cannot create bucket {name!r} on {env['AWS_ENDPOINT_URL']}: {e}") from e


@dataclass(frozen=True)
class Plan:
    """The planned network: its nodes, and the round deadline taken from the planned trainer settings."""

    nodes: list[Node]
    round_deadline_s: float
    trainers: list[TrainerConfig]
    """The trainers' planned settings, as written to their config files (the warm-up takes the
    model, its cache and its steps from them)."""
    threads: int
    """Torch threads per node process (``node_threads``: every node's OMP_NUM_THREADS)."""


def round_deadline(trainers: list[TrainerConfig]) -> float:
    """The default round deadline: twice the trainers' PULSELoCo ``deadline_s`` as planned, or
    ``LONE_ROUND_DEADLINE_S`` for a lone trainer."""
    if len(trainers) < 2:
        return LONE_ROUND_DEADLINE_S
    return 2.0 * float(trainers[0].loco.deadline_s)


def plan_nodes(c: UpConfig, workdir: Path, run_id: str, creds: Creds, injector: Injector | None = None) -> Plan:
    """Each node's config file (``nodes/plan.py``), command, environment, status port and log.
    ``injector``: may change the planned settings (it returns new ones) and give each node its own
    store endpoint."""
    keys = workdir / "keys"
    ids = trainer_ids(c) + inference_ids(c)
    sites = {
        s: Site(f"s3://{creds.buckets[s]}/{run_id}", keys / f"{s}.key", workdir / "state" / s) for s in ids
    }
    loco = f"s3://{creds.buckets[LOCO_SITE]}/{run_id}" if c.trainers > 1 else ""  # every trainer may write it
    trainers, inference = plan_network(
        c, run=run_id, sites=sites, public_keys=keys, loco_store=loco, cache_dir=workdir / "cache"
    )
    if injector is not None:
        trainers, inference = injector.adjust(trainers, inference)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PULSENET_"))}
    threads = node_threads(c, len(ids))
    base["OMP_NUM_THREADS"] = str(threads)
    # glibc raises its mmap threshold after each large free (up to 32 MiB), so the weight tensors
    # of a version (MiBs each) then come from the heap, whose holes are not given back: a node's
    # resident memory crept up by version (measured at 0.35B). A fixed threshold keeps every such
    # tensor mmapped, returned to the system when freed. Only the allocator changes, no value.
    base.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    nodes = []
    for role, configs in (("trainer", trainers), ("inference", inference)):
        for planned in configs:
            nc = replace(planned, status_port=_free_port())
            env = base | creds.env[nc.id]
            if injector is not None and env.get("AWS_ENDPOINT_URL"):
                env["AWS_ENDPOINT_URL"] = injector.endpoint(nc.id, env["AWS_ENDPOINT_URL"])
            nodes.append(_node(workdir, nc.id, role, {role: to_toml_table(nc)}, env, nc.status_port))
    return Plan(nodes, c.supervise.round_deadline_s or round_deadline(trainers), trainers, threads)


def node_threads(c: UpConfig, nodes: int) -> int:
    """Torch threads each node process gets (``UpConfig.node_threads``): as set, else
    OMP_NUM_THREADS as set, else this machine's cores shared among ``nodes`` processes, at least 1."""
    if c.node_threads:
        return c.node_threads
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS has no affinity
    return max(1, cores // max(1, nodes))


def _node(workdir: Path, name: str, role: str, table: dict[str, Any], env: dict[str, str], port: int) -> Node:
    path = write_toml(workdir / "config" / f"{name}.toml", table)
    cmd = [sys.executable, "-m", "pulsenet", "--log-format", "json", "-v", role, "--config", str(path)]
    events = workdir / "state" / name / EVENTS_FILE
    return Node(name, role, cmd, env, workdir / "logs" / f"{name}.log", events, f"http://127.0.0.1:{port}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

