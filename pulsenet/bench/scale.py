"""``pulsenet bench scale``: what the store sees and bills as the network grows (docs/scale.md).

Two parts:

1. **Measure** (real parts): an embedded SeaweedFS, a real ``Publisher`` publishing real training
   states of the tiny model, and a real ``Subscriber`` following it on its own ``S3Store`` (reader
   credentials). Every request each side sends is counted inside the store layer
   (``store.requests``): per idle poll, per new version for a following node, per version for the
   publisher, and the first sync of a joining node. ``--rl-json`` takes the per-node counts from a
   ``pulsenet bench rl`` JSON instead, when it carries them (``requests.idle_poll`` and
   ``requests.per_version_per_inference_node``, issue 23's names).
2. **Project** (arithmetic, no I/O): from those counts, a 7B model (the paper's 108 MB per sync and
   1.77 GB per PULSELoCo round), a version every ``version_interval_s`` and a poll every
   ``poll_interval_s``, for 10 .. 10,000 inference nodes: the request rates on the channel's prefix
   (mean, and the burst when every node fetches a version within one poll interval) against S3's
   per-prefix limits, the egress per version and per month, and the monthly bill at published S3
   and R2 prices (``PRICES``, with their sources and dates).

The patch of a 7B version is fetched with the same requests as the tiny one's: a following node
streams a one-patch path in one GET whatever its size (``ObjectStore.get_stream``, decoded as it
lands); the publisher's uploads and PULSELoCo's downloads are per ``S3Config.multipart_chunk``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import platform
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pulsenet.bench import BenchSettings, config_of
from pulsenet.bench import workdir as bench_workdir
from pulsenet.errors import ConfigError

SCHEMA = "pulsenet.bench.scale/1"
MONTH_S = 30 * 86400
"""A billing month: 30 days (R2 bills per 30 days; S3's monthly tiers fit it)."""
KINDS = ("get", "get_not_modified", "head", "list", "put", "delete")
PATCH_GETS = 1  # a following node streams a version's patch in one GET (chain.rebuild), whatever its size
S3_PREFIX_GET_PER_S = 5500
"""S3: GET/HEAD requests per second per partitioned prefix (docs, "Best practices design patterns:
optimizing Amazon S3 performance"); above it S3 answers 503 SlowDown until it repartitions."""
S3_PREFIX_PUT_PER_S = 3500
"""S3: PUT/COPY/POST/DELETE (and LIST) requests per second per partitioned prefix (same page)."""


@dataclass(frozen=True, slots=True)
class Prices:
    """One provider's list prices (USD), and where and when they were read."""

    name: str
    get_per_1k: float
    """GET-class requests (S3: GET, SELECT, HEAD and other; R2: Class B: GetObject, HeadObject)."""
    put_list_per_1k: float
    """PUT-class requests (S3: PUT, COPY, POST, LIST; R2: Class A: PutObject, ListObjects,
    CreateMultipartUpload, UploadPart, CompleteMultipartUpload). DELETE is free on both."""
    storage_per_gb_month: float
    egress_tiers: tuple[tuple[float, float], ...]
    """(GB in this tier, USD per GB), in order; the last tier's size is infinite."""
    free_get: float = 0.0
    """Requests of each class included per month (R2's free tier)."""
    free_put_list: float = 0.0
    source: str = ""


PRICES = (
    Prices(
        name="s3",
        get_per_1k=0.0004,
        put_list_per_1k=0.005,
        storage_per_gb_month=0.023,
        # Data transfer out to the internet: 100 GB free per month (aggregated over AWS), then
        # $0.09 up to 10 TB, $0.085 the next 40 TB, $0.07 the next 100 TB, $0.05 above 150 TB.
        egress_tiers=((100, 0.0), (10_240 - 100, 0.09), (40_960, 0.085), (102_400, 0.07), (math.inf, 0.05)),
        source=(
            "https://aws.amazon.com/s3/pricing/ (S3 Standard, us-east-1, data transfer out to the "
            "internet); the page renders its tables in JavaScript, figures as transcribed in several "
            "public sources, checked 2026-12-03"
        ),
    ),
    Prices(
        name="r2",
        get_per_1k=0.00036,
        put_list_per_1k=0.0045,
        storage_per_gb_month=0.015,
        egress_tiers=((math.inf, 0.0),),
        free_get=10_000_000,
        free_put_list=1_000_000,
        source=(
            "https://developers.cloudflare.com/r2/pricing/ (Standard storage; Class A $4.50/M incl. "
            "ListObjects, Class B $0.36/M, egress free, free tier 1M A + 10M B + 10 GB-month), "
            "cloudflare/cloudflare-docs src/content/docs/r2/pricing.mdx at 07ec87d, read 2026-12-03"
        ),
    ),
)


@dataclass(kw_only=True)
class ScaleBenchSettings(BenchSettings):
    """Request rates per prefix, egress and the monthly S3/R2 bill for 10..10,000 inference nodes
    and a 7B model, from request counts measured on SeaweedFS (docs/scale.md)."""

    versions: int = 6
    """Versions measured after the first (one AdamW step of the tiny model each)."""
    idle_polls: int = 20
    """Idle polls measured (nothing published in between)."""
    anchor_every: int = 10
    """The publisher's anchor interval (as the trainer's default)."""
    nodes: tuple[int, ...] = (10, 100, 1000, 10_000)
    """Inference node counts to project."""
    trainers: int = 4
    """Trainers (PULSELoCo workers, the paper's 4); each publishes a channel, nodes follow one."""
    version_interval_s: float = 60.0
    """A new policy version (and PULSELoCo round) every this many seconds."""
    poll_interval_s: float = 2.0
    """Each inference node polls its channel this often (SubscriberConfig.interval_s)."""
    patch_bytes: float = 108e6
    """Bytes per sync of a 7B model (the paper's mean patch)."""
    anchor_bytes: float = 14e9
    """Bytes of one anchor (a 7B model's BF16 weights, an upper bound on the compressed anchor)."""
    loco_payload_bytes: float = 1.77e9
    """Bytes one trainer uploads per PULSELoCo round (the paper, 7B, H=8)."""
    range_bytes: int = 8 << 20
    """Ranged-GET size of a download (S3Config.multipart_chunk), also the multipart part size."""
    rl_json: Path | None = None
    """Take the per-node request counts from this ``pulsenet bench rl`` JSON instead of measuring."""
    workdir: Path | None = None
    """Keep the tiny checkpoints here (None: a temporary directory)."""


# --- measuring ---------------------------------------------------------------------------------


def run(args: ScaleBenchSettings) -> dict[str, Any]:
    from rich.console import Console

    console = Console(stderr=True)
    if args.versions < 1 or args.idle_polls < 1 or not args.nodes or args.trainers < 1:
        raise ConfigError("versions, idle_polls and trainers must be >= 1 and nodes non-empty")
    if args.rl_json is not None:
        measured = _from_rl_json(args.rl_json)
        console.print(f"[bold]bench scale[/]: per-node request counts from {args.rl_json}")
    else:
        console.print(
            f"[bold]bench scale[/]: measuring {args.idle_polls} idle polls and {args.versions} versions on SeaweedFS"
        )
        measured = _measure_on_seaweed(args, console)
    result = {
        "schema": SCHEMA,
        "config": config_of(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "measured": measured,
        "requests": {
            "idle_poll": _pick(measured["idle_poll"], ("get", "get_not_modified", "list")),
            "per_version_per_inference_node": _pick(measured["per_version_per_inference_node"], ("get", "list", "put")),
        },
        "prices": [dataclasses.asdict(p) | {"egress_tiers": [list(t) for t in p.egress_tiers]} for p in PRICES],
        "scale": [project(measured, args, n) for n in args.nodes],
    }
    _print_table(result, console)
    return json.loads(json.dumps(result, default=_inf))  # math.inf -> "inf": strict JSON


def _measure_on_seaweed(args: ScaleBenchSettings, console: Any) -> dict[str, Any]:
    from pulsenet.bench.sync import Training, make_checkpoints
    from pulsenet.checkpoint import Checkpoint
    from pulsenet.store.seaweed import SeaweedServer

    with bench_workdir(args.workdir, "scale") as workdir:
        paths = [workdir / f"step{k}.safetensors" for k in range(args.versions + 1)]
        if not all(p.is_file() for p in paths):
            paths, _, _ = make_checkpoints(Training(model="tiny"), args.versions, 1e-4, workdir, console.print)
        states = [dict(Checkpoint(p).items()) for p in paths]
        with tempfile.TemporaryDirectory(prefix="seaweed-", dir=workdir) as data, SeaweedServer(data) as server:
            server.create_buckets("pulsenet-t0")
            return asyncio.run(_measure(server, states, args))


async def _measure(server: Any, states: list[dict], args: ScaleBenchSettings) -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsenet.signing import key_id
    from pulsenet.store import S3Store
    from pulsenet.sync import Publisher, PublisherConfig, Subscriber, SubscriberConfig

    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    # The layout of `pulsenet up`: the trainer's bucket, the run as prefix, the channel inside.
    pub_store = S3Store("pulsenet-t0", "run", server.config(multipart_chunk=args.range_bytes))
    sub_store = S3Store("pulsenet-t0", "run", server.config("reader", multipart_chunk=args.range_bytes))
    config = SubscriberConfig(interval_s=args.poll_interval_s, threads=1)
    async with (
        pub_store,
        sub_store,
        Publisher(pub_store, key, PublisherConfig(anchor_every=args.anchor_every, threads=1)) as pub,
        Subscriber(sub_store, trusted, config) as sub,
    ):
        before = pub_store.requests.snapshot()
        first = await pub.publish_now(states[0])
        publish_first = _delta(pub_store, before)
        before = sub_store.requests.snapshot()
        if await sub.sync_once() != first.version:
            raise RuntimeError("the subscriber did not take the first version")
        join = _delta(sub_store, before)
        idle = []
        for _ in range(args.idle_polls):
            before = sub_store.requests.snapshot()
            if await sub.sync_once() is not None:
                raise RuntimeError("an idle poll found a version")
            idle.append(_delta(sub_store, before))
        rows = []
        for state in states[1:]:
            before = pub_store.requests.snapshot()
            rec = await pub.publish_now(state)
            published = _delta(pub_store, before)
            before = sub_store.requests.snapshot()
            if await sub.sync_once() != rec.version:
                raise RuntimeError(f"the subscriber did not take v{rec.version}")
            rows.append(
                {
                    "version": rec.version,
                    "kind": rec.kind,
                    "payload_bytes": rec.payload_bytes,
                    "inference_node": _delta(sub_store, before),
                    "publisher": published,
                }
            )
        before = sub_store.requests.snapshot()
        await sub.announced()  # what a failover watch costs on a channel that does not move
        announced_idle = _delta(sub_store, before)
    patch_sizes = [r["payload_bytes"]["patch"] for r in rows]
    node_rows = [r["inference_node"] for r in rows]
    # The patch itself: one streamed GET whatever its size (PATCH_GETS).
    fixed = _mean([{**d, "get": d["get"] - PATCH_GETS} for d in node_rows])
    return {
        "store": f"SeaweedFS ({server.weed.name} mini) on 127.0.0.1, bucket pulsenet-t0, prefix run/policy/",
        "source": "measured",
        "idle_poll": _mean(idle),
        "idle_polls_all_equal": all(d == idle[0] for d in idle),
        "per_version_per_inference_node": _mean(node_rows),
        "per_version_per_inference_node_without_ranges": fixed,
        "per_version_publisher": _mean([r["publisher"] for r in rows]),
        # Each payload of the tiny run is one PutObject; a 7B one is a multipart upload (project()).
        "per_version_publisher_without_payloads": _mean(
            [{**r["publisher"], "put": r["publisher"]["put"] - len(r["payload_bytes"])} for r in rows]
        ),
        "publish_first": publish_first,
        "join": join,
        "announced_idle": announced_idle,
        "patch_bytes_mean": statistics.fmean(patch_sizes),
        "versions": rows,
    }


def _from_rl_json(path: Path) -> dict[str, Any]:
    """The per-node counts of a ``pulsenet bench rl`` JSON (top level or its ``summary``)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--rl-json {path}: {e}") from e
    req = doc.get("requests") or doc.get("summary", {}).get("requests")
    if not isinstance(req, dict) or not {"idle_poll", "per_version_per_inference_node"} <= set(req):
        raise ConfigError(
            f"--rl-json {path} has no requests.idle_poll / requests.per_version_per_inference_node "
            "(issue 23's names); run bench scale without it to measure them"
        )
    per_version = {k: float(req["per_version_per_inference_node"].get(k, 0)) for k in KINDS}
    fixed = {**per_version, "get": max(per_version["get"] - PATCH_GETS, 0.0)}
    return {
        "source": str(path),
        "idle_poll": {k: float(req["idle_poll"].get(k, 0)) for k in KINDS} | {"bytes_down": 0.0},
        "per_version_per_inference_node": per_version,
        "per_version_per_inference_node_without_ranges": fixed,
        "per_version_publisher": None,
        "per_version_publisher_without_payloads": None,
    }


def _delta(store: Any, before: Any) -> dict[str, int]:
    return (store.requests - before).as_dict()


def _mean(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def _pick(d: dict[str, float], keys: tuple[str, ...]) -> dict[str, float]:
    return {k: d.get(k, 0) for k in keys}


def _inf(x: object) -> object:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


# --- projecting ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Month:
    """Requests by kind and bytes out, for one month."""

    requests: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    egress_bytes: float = 0.0

    def add(self, counts: dict[str, float], times: float) -> None:
        for k in KINDS:
            self.requests[k] += counts.get(k, 0) * times


def per_version_node_counts(measured: dict[str, Any]) -> dict[str, float]:
    """A following node's requests for one version, whatever its patch's size (streamed: one GET)."""
    fixed = measured["per_version_per_inference_node_without_ranges"]
    return {**{k: fixed.get(k, 0) for k in KINDS}, "get": fixed["get"] + PATCH_GETS}


def project(measured: dict[str, Any], args: ScaleBenchSettings, nodes: int) -> dict[str, Any]:
    """Rates on one channel's prefix, egress and the monthly bill for ``nodes`` inference nodes."""
    versions = MONTH_S / args.version_interval_s
    polls = MONTH_S / args.poll_interval_s
    idle = measured["idle_poll"]
    per_version = per_version_node_counts(measured)
    # Nodes spread evenly over the trainers' channels (each trainer publishes every version).
    per_channel = math.ceil(nodes / args.trainers)

    sync = _Month()
    sync.add(idle, nodes * max(polls - versions, 0))
    sync.add(per_version, nodes * versions)
    sync.egress_bytes = nodes * versions * args.patch_bytes

    # Publishers: each trainer writes every version on its own channel: the measured requests
    # without the payloads (manifest, head, retention), plus the 7B patch as a multipart upload
    # and, every anchor_every versions, the anchor.
    pub = measured.get("per_version_publisher_without_payloads") or {"put": 2.0}  # manifest + head
    payload_puts = _multipart_puts(args.patch_bytes, args.range_bytes) + (
        _multipart_puts(args.anchor_bytes, args.range_bytes) / args.anchor_every
    )
    publish = _Month()
    publish.add({**pub, "put": pub.get("put", 0) + payload_puts}, args.trainers * versions)

    # PULSELoCo: each trainer uploads its payload (multipart) and downloads every other one (HEAD +
    # ranges); documents and listings are a handful per round (estimated: 2 PUT, 2 GET, 2 LIST).
    loco = _Month()
    up = _multipart_puts(args.loco_payload_bytes, args.range_bytes)
    down = 1 + math.ceil(args.loco_payload_bytes / args.range_bytes)
    t = args.trainers
    loco.add({"put": up + 2, "get": (t - 1) * (down + 1) + 2, "list": 2}, t * versions)
    loco.egress_bytes = t * (t - 1) * args.loco_payload_bytes * versions

    # The design before conditional polling: every poll a head GET and a LIST (issue 23).
    before = _Month()
    before.add({"get": 1, "list": 1}, nodes * max(polls - versions, 0))
    before.add({**per_version, "get_not_modified": 0}, nodes * versions)
    before.egress_bytes = sync.egress_bytes

    stored_gb = (
        args.trainers * (2 * args.anchor_bytes + 2 * args.anchor_every * args.patch_bytes)  # keep_anchors=2
        + 2 * t * args.loco_payload_bytes  # the current and the previous round
    ) / 1e9
    rates = {
        "get_head_per_s_mean": per_channel * (
            get_head(idle) * (1 / args.poll_interval_s) + get_head(per_version) / args.version_interval_s
        ),
        # Every node of the channel fetches a new version within one poll interval.
        "get_head_per_s_burst": per_channel * get_head(per_version) / args.poll_interval_s,
        "list_per_s_mean": per_channel * (idle["list"] / args.poll_interval_s + per_version["list"] / args.version_interval_s),
        "list_per_s_burst": per_channel * per_version["list"] / args.poll_interval_s,
        "list_per_s_before": per_channel / args.poll_interval_s,
        "egress_gbit_per_s_mean": per_channel * args.patch_bytes * 8 / args.version_interval_s / 1e9,
        "egress_gbit_per_s_burst": per_channel * args.patch_bytes * 8 / args.poll_interval_s / 1e9,
    }
    limits_ok = (
        rates["get_head_per_s_burst"] <= S3_PREFIX_GET_PER_S and rates["list_per_s_burst"] <= S3_PREFIX_PUT_PER_S
    )
    return {
        "inference_nodes": nodes,
        "nodes_per_channel": per_channel,
        "per_node_per_month": {
            "requests": {k: v / nodes for k, v in sync.requests.items()},
            "egress_bytes": sync.egress_bytes / nodes,
        },
        "per_channel_prefix": rates,
        "within_s3_prefix_limits": limits_ok,
        "egress_per_version_bytes": {
            "pulsesync": nodes * args.patch_bytes,
            "pulseloco": t * (t - 1) * args.loco_payload_bytes,
        },
        "egress_per_month_bytes": sync.egress_bytes + loco.egress_bytes,
        "stored_gb": stored_gb,
        # Each part alone at list price; "total" (and "before_...") bill everything together, so
        # egress tiers and free allowances apply once: the parts need not add up to it exactly.
        "monthly_usd": {
            p.name: {
                "pulsesync": _bill(p, sync, 0.0, free=False),
                "publishers": _bill(p, publish, 0.0, free=False),
                "pulseloco": _bill(p, loco, 0.0, free=False),
                "storage": stored_gb * p.storage_per_gb_month,
                "total": _bill(p, _sum(sync, publish, loco), stored_gb),
                "before_conditional_polling": _bill(p, _sum(before, publish, loco), stored_gb),
            }
            for p in PRICES
        },
        "requests_per_month": {
            "pulsesync": sync.requests,
            "publishers": publish.requests,
            "pulseloco": loco.requests,
            "pulsesync_before_conditional_polling": before.requests,
        },
    }


def _multipart_puts(nbytes: float, part: int) -> float:
    """PUT-class requests to upload ``nbytes``: one PutObject below the multipart threshold (16
    MiB), else create + one per part + complete."""
    return 1 if nbytes < 2 * part else 2 + math.ceil(nbytes / part)


def _sum(*months: _Month) -> _Month:
    out = _Month()
    for m in months:
        out.add(m.requests, 1)
        out.egress_bytes += m.egress_bytes
    return out


def _bill(p: Prices, m: _Month, stored_gb: float, *, free: bool = True) -> float:
    """USD for one month of ``m`` at ``p``; ``free``: with the free allowances (request free tiers,
    S3's first 100 GB out)."""
    r = m.requests
    gets = max(get_head(r) - (p.free_get if free else 0), 0)
    puts = max(r["put"] + r["list"] - (p.free_put_list if free else 0), 0)
    requests = gets / 1000 * p.get_per_1k + puts / 1000 * p.put_list_per_1k
    return requests + _egress(p, m.egress_bytes / 1e9, free=free) + stored_gb * p.storage_per_gb_month


def get_head(counts: dict[str, float]) -> float:
    """GET-class requests: GETs with a body, 304s, HEADs (S3's per-prefix GET/HEAD limit, R2 Class B)."""
    return counts.get("get", 0) + counts.get("get_not_modified", 0) + counts.get("head", 0)


def _egress(p: Prices, gb: float, *, free: bool = True) -> float:
    """Tiered egress; without ``free`` a free tier is billed at the next tier's rate."""
    cost, left = 0.0, gb
    for i, (size, listed) in enumerate(p.egress_tiers):
        rate = listed if free or listed or i + 1 == len(p.egress_tiers) else p.egress_tiers[i + 1][1]
        take = min(left, size)
        cost += take * rate
        left -= take
        if left <= 0:
            break
    return cost


# --- output --------------------------------------------------------------------------------------


def _print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    m = result["measured"]
    console.print(
        f"idle poll: {_fmt_counts(m['idle_poll'])}; per version per inference node: "
        f"{_fmt_counts(m['per_version_per_inference_node'])} ({m['source']})"
    )
    table = Table(title="per month, 7B model (S3 us-east-1 / R2)")
    for col in (
        "nodes", "GET/s burst", "LIST/s", "LIST/s before", "sync egress/version", "S3 $", "S3 $ before", "R2 $", "R2 $ before"
    ):
        table.add_column(col, justify="right")
    for row in result["scale"]:
        rates, usd = row["per_channel_prefix"], row["monthly_usd"]
        table.add_row(
            f"{row['inference_nodes']:,}",
            f"{rates['get_head_per_s_burst']:,.0f}",
            f"{rates['list_per_s_mean']:,.2f}",
            f"{rates['list_per_s_before']:,.0f}",
            f"{row['egress_per_version_bytes']['pulsesync'] / 1e9:,.1f} GB",
            f"{usd['s3']['total']:,.0f}",
            f"{usd['s3']['before_conditional_polling']:,.0f}",
            f"{usd['r2']['total']:,.0f}",
            f"{usd['r2']['before_conditional_polling']:,.0f}",
        )
    console.print(table)


def _fmt_counts(c: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in c.items() if v and k in KINDS) or "nothing"
