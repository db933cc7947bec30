"""``pulsenet bench e2e``: time from ``publish()`` until every subscriber holds verified weights,
through a real S3 server (embedded SeaweedFS) on an emulated link, patch versus full checkpoint.

Checkpoints come from real training (``bench.sync.make_checkpoints``: AdamW, BF16 autocast,
SmolLM2-135M at lr 3e-6 by default, one version per optimizer step). Version 0 is published as an
anchor (the full BF16 weights, zstd): that is the full-checkpoint sync on the same link. Versions
1..N are per-step patches. The publisher and every subscriber have their own link of
``--link-mbps`` each way (the store's token bucket), as separate machines would; the subscribers
poll every ``--interval`` seconds. Everything runs in one process on this machine's cores, so the
CPU work (encode, decode, SHA-256 verification) is included, not just the transfer.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import tyro

from pulsenet.bench import BenchSettings, config_of
from pulsenet.bench import workdir as bench_workdir
from pulsenet.bench.sync import Training

SCHEMA = "pulsenet.bench.e2e/1"


@dataclass(kw_only=True)
class E2EBenchSettings(BenchSettings):
    """Time from publish() until every subscriber holds verified weights, through a real S3 server
    (embedded SeaweedFS) on an emulated link: patches versus the full checkpoint (docs/sync.md)."""

    link_mbps: float = 100.0
    """Emulated link, each way, per node (Mbit/s)."""
    subscribers: int = 2
    """Subscribers, each with its own link."""
    versions: int = 3
    """Patch versions after the anchor (one AdamW step each)."""
    lr: float | None = None
    """AdamW learning rate (None: 3e-6 smollm2, 1e-4 tiny)."""
    interval: float = 0.05
    """Subscriber poll interval (s)."""
    zones: int = 12
    """Patch context zones (12, the publisher's default: smallest patches; 1: no context model, ~2x
    the bytes)."""
    threads: int | None = None
    """Codec threads of the publisher (None: all cores); the subscribers split the cores."""
    workdir: Path | None = None
    """Keep the checkpoints here, and reuse them when already there (None: a temporary directory)."""
    training: Annotated[Training, tyro.conf.arg(name="")] = field(default_factory=Training)


def run(args: E2EBenchSettings) -> dict:
    import torch
    from rich.console import Console

    from pulsenet.bench.sync import make_checkpoints
    from pulsenet.checkpoint import Checkpoint
    from pulsenet.store.seaweed import SeaweedServer

    console = Console(stderr=True)
    load0 = os.getloadavg()[0]  # other work on the machine skews the CPU-bound parts: record it
    lr = args.lr if args.lr is not None else (3e-6 if args.training.model == "smollm2" else 1e-4)
    with bench_workdir(args.workdir, "e2e") as workdir:
        console.print(
            f"[bold]bench e2e[/]: {args.training.model}, {args.versions} AdamW steps at lr {lr:g}, "
            f"{args.subscribers} subscribers, {args.link_mbps:g} Mbit/s links"
        )
        paths = [workdir / f"step{k}.safetensors" for k in range(args.versions + 1)]
        if args.workdir is not None and all(p.is_file() for p in paths):
            console.print(f"reusing the checkpoints in {workdir}")
            losses, s_per_step = [], None
        else:
            paths, losses, s_per_step = make_checkpoints(args.training, args.versions, lr, workdir, console.print)
        states = [{k: v for k, v in Checkpoint(p).items()} for p in paths]
        # A fresh server each run (a reused one would hold the last run's chain to resume from).
        with (
            tempfile.TemporaryDirectory(prefix="seaweed-", dir=workdir) as data,
            SeaweedServer(data) as server,
        ):
            server.create_buckets("bench")
            console.print(f"SeaweedFS at {server.endpoint_url}")
            timing = asyncio.run(_measure(server, states, args, console))

    anchor = timing["versions"][0]
    patches = timing["versions"][1:]
    patch_s = [v["all_verified_s"] for v in patches]
    patch_bytes = [v["payload_bytes"]["patch"] for v in patches]
    full_bytes = anchor["full_bytes"]
    summary = {
        "full_checkpoint_bytes": full_bytes,
        "anchor_bytes": anchor["payload_bytes"]["anchor"],
        "anchor_all_verified_s": anchor["all_verified_s"],
        "patch_bytes_mean": statistics.fmean(patch_bytes),
        "patch_all_verified_s_mean": statistics.fmean(patch_s),
        "patch_all_verified_s_median": statistics.median(patch_s),
        "patch_all_verified_s_max": max(patch_s),
        "bytes_ratio_full_over_patch": full_bytes / statistics.fmean(patch_bytes),
        "speedup_anchor_over_patch_mean": anchor["all_verified_s"] / statistics.fmean(patch_s),
        "speedup_anchor_over_patch_worst": anchor["all_verified_s"] / max(patch_s),
        "link_time_full_checkpoint_s": 2 * full_bytes * 8 / (args.link_mbps * 1e6),
        "changed_fraction_mean": statistics.fmean(v["changed_fraction"] for v in patches),
        "all_digests_match": timing["all_digests_match"],
    }
    result = {
        "schema": SCHEMA,
        "config": config_of(args) | {"lr": lr},
        "machine": {
            "load_average_1m_start_end": [load0, os.getloadavg()[0]],
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "train": {"losses": losses, "seconds_per_step": s_per_step},
        "codec_threads": timing["threads"],
        "versions": timing["versions"],
        "summary": summary,
    }
    _print_table(result)
    return result


async def _measure(server, states: list[dict], args: E2EBenchSettings, console) -> dict:
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsenet.codec.bf16 import bits
    from pulsenet.signing import key_id
    from pulsenet.store import S3Store
    from pulsenet.sync import Publisher, PublisherConfig, Subscriber, SubscriberConfig

    cpus = os.cpu_count() or 2
    pub_threads = args.threads or cpus
    sub_threads = max(1, cpus // max(args.subscribers, 1))  # the subscribers apply at the same time
    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    link = {"link_mbps": args.link_mbps, "timeout_s": 120.0}
    verified: dict[tuple[int, int], float] = {}  # (subscriber, version) -> perf_counter
    digests: dict[tuple[int, int], str] = {}
    changed = asyncio.Condition()

    phases: dict[tuple[int, int], tuple[float, float]] = {}  # (subscriber, version) -> download, apply

    def on_update_for(i: int):
        async def on_update(version: int, state, digest: str) -> None:
            verified[(i, version)] = time.perf_counter()
            digests[(i, version)] = digest
            phases[(i, version)] = (subs[i].stats.last_download_s, subs[i].stats.last_apply_s)
            async with changed:
                changed.notify_all()

        return on_update

    pub_store = S3Store("bench", "e2e", server.config(**link))
    sub_stores = [S3Store("bench", "e2e", server.config("reader", **link)) for _ in range(args.subscribers)]
    pub = Publisher(
        pub_store,
        key,
        PublisherConfig(anchor_every=10**9, keep_anchors=None, threads=pub_threads, max_zones=args.zones),
    )
    subs = [
        Subscriber(
            s,
            trusted,
            SubscriberConfig(interval_s=args.interval, jitter=0.2, threads=sub_threads),
            on_update=on_update_for(i),
        )
        for i, s in enumerate(sub_stores)
    ]
    rows = []
    stop = asyncio.Event()
    await asyncio.to_thread(_warm_up_codec)
    try:
        async with pub, asyncio.TaskGroup() as tg:
            for s in subs:
                tg.create_task(s.run(stop))
            for version, state in enumerate(states):
                t0 = time.perf_counter()
                pub.publish(state, step=version)
                async with changed:
                    await changed.wait_for(
                        lambda v=version: all((i, v) in verified for i in range(len(subs)))
                    )
                rec = pub.records[-1]
                done = [verified[(i, version)] - t0 for i in range(len(subs))]
                prev = states[version - 1] if version else None
                frac = (
                    (
                        sum(int(np.count_nonzero(bits(prev[k]) != bits(state[k]))) for k in state)
                        / sum(t.numel() for t in state.values())
                    )
                    if prev is not None
                    else 1.0
                )
                rows.append(
                    {
                        "version": version,
                        "kind": rec.kind,
                        "payload_bytes": rec.payload_bytes,
                        "full_bytes": rec.full_bytes,
                        "changed_fraction": frac,
                        "encode_s": rec.encode_s,
                        "upload_s": rec.upload_s,
                        "published_s": rec.latency_s,
                        "subscriber_verified_s": done,
                        "all_verified_s": max(done),
                        "subscriber_download_s": [phases[(i, version)][0] for i in range(len(subs))],
                        "subscriber_apply_s": [phases[(i, version)][1] for i in range(len(subs))],
                    }
                )
                console.print(
                    f"v{version} ({rec.kind}): {sum(rec.payload_bytes.values()) / 1e6:.2f} MB, "
                    f"published {rec.latency_s:.2f}s, all verified {max(done):.2f}s"
                )
            stop.set()
    finally:
        stop.set()
        for s in [pub_store, *sub_stores]:
            await s.close()
    match = all(
        digests[(i, v)] == pub.records[v].digest for i in range(len(subs)) for v in range(len(states))
    )
    return {
        "versions": rows,
        "all_digests_match": match,
        "threads": {"publisher": pub_threads, "per_subscriber": sub_threads},
    }


def _warm_up_codec() -> None:
    """Load the codec's compiled kernels once, as a long-running node would have long before."""
    import torch

    from pulsenet.codec.patch import PatchEncoder, apply_patch

    a = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    b = {"w": a["w"].clone()}
    b["w"][::7] = b["w"][::7] * 1.01
    apply_patch(a, PatchEncoder().encode(a, b))


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    t = Table(
        title=f"PULSESync end to end: {c['model']}, {c['subscribers']} subscribers, "
        f"{c['link_mbps']:g} Mbit/s links, lr {c['lr']:g}"
    )
    for col in (
        "version",
        "kind",
        "changed",
        "payload",
        "ratio",
        "encode",
        "upload",
        "published",
        "download",
        "apply+verify",
        "all verified",
    ):
        t.add_column(col, justify="right")
    for v in result["versions"]:
        size = sum(v["payload_bytes"].values())
        follow = v["payload_bytes"].get("patch", v["payload_bytes"].get("anchor"))
        t.add_row(
            str(v["version"]),
            v["kind"],
            f"{100 * v['changed_fraction']:.2f}%",
            f"{size / 1e6:.2f} MB",
            f"{v['full_bytes'] / follow:.0f}x",
            f"{v['encode_s']:.2f}s",
            f"{v['upload_s']:.2f}s",
            f"{v['published_s']:.2f}s",
            f"{max(v['subscriber_download_s']):.2f}s",
            f"{max(v['subscriber_apply_s']):.2f}s",
            f"{v['all_verified_s']:.2f}s",
        )
    console = Console(width=max(Console().width, 130))
    console.print(t)
    s = result["summary"]
    console.print(
        f"full checkpoint {s['full_checkpoint_bytes'] / 1e6:.1f} MB (anchor {s['anchor_bytes'] / 1e6:.1f} MB): "
        f"all verified in {s['anchor_all_verified_s']:.2f}s; per-step patch {s['patch_bytes_mean'] / 1e6:.2f} MB "
        f"({s['bytes_ratio_full_over_patch']:.0f}x smaller): all verified in {s['patch_all_verified_s_mean']:.2f}s mean, "
        f"{s['patch_all_verified_s_max']:.2f}s worst -> [bold]{s['speedup_anchor_over_patch_mean']:.0f}x faster[/] "
        f"({s['speedup_anchor_over_patch_worst']:.0f}x worst case); digests match: {s['all_digests_match']}"
    )
