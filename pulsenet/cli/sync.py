"""``pulsenet publish|pull|ls``: PULSESync from the shell.

S3 endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), read here, at the edge.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import tyro

from pulsenet.cli import add_settings_command, command_settings
from pulsenet.deadlines import SMALL_CALL_S
from pulsenet.settings import require


@dataclass(kw_only=True)
class StoreSettings:
    """Where a channel lives (shared by publish, pull and ls)."""

    store: str = ""
    """s3://bucket[/prefix] or file:///path (required)."""
    channel: str = "policy"
    """Policy stream inside the store."""
    run: str = "default"
    """Run name, part of what manifests are signed for: publisher and readers must agree."""
    timeout: float = SMALL_CALL_S
    """Deadline of each small store call, seconds."""


@dataclass(kw_only=True)
class PublishSettings(StoreSettings):
    """Rebuild the newest published version from the store, encode MODEL as a patch against it
    (plus an anchor when due), upload, and write the signed manifest last."""

    model: Annotated[Path | None, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL")] = None
    """.safetensors file or HF directory (required)."""
    key: Path | None = None
    """Ed25519 private key (pulsenet keygen) (required)."""
    allow_open_key: bool = False
    """Accept a private key file that group or others may read (refused otherwise: chmod 600 it)."""
    anchor_every: int = 10
    """A full anchor every this many versions."""
    keep_anchors: int = 2
    """Retention: keep the newest this many anchors and their chains (0: keep everything)."""
    dtype: Literal["bf16", "keep"] = "bf16"
    """Publish floating tensors as BF16, or as stored (keep)."""
    step: int | None = None
    """Your label for this state (kept in the manifest)."""
    zones: int | None = None
    """Context zones per tensor (None: 12, the smallest; 1: no context model, ~2x the bytes)."""
    threads: int | None = None
    """Codec threads (None: every core)."""


@dataclass(kw_only=True)
class PullSettings(StoreSettings):
    """Fetch and verify the newest version (signature, payload SHA-256, model digest) and write
    OUT/model.safetensors atomically; prints 'v<version> <digest>'. A failed verification of the
    newest version exits non-zero and leaves OUT as it was. With --follow, keep polling and update
    OUT (failed rounds are logged and retried; the last verified weights stay)."""

    trust: list[Path] = field(default_factory=list)
    """Trusted publisher public keys (required; --trust A.pub B.pub, or --trust repeated)."""
    out: Path | None = None
    """Directory of the verified model (required)."""
    follow: bool = False
    """Keep polling until Ctrl-C / SIGTERM."""
    interval: float = 2.0
    """Seconds between polls."""
    cache: Path | None = None
    """Payload cache (None: ~/.cache/pulsenet/sync/<hash of store, channel, out>)."""
    threads: int | None = None
    """Codec threads (None: every core)."""


@dataclass(kw_only=True)
class LsSettings(StoreSettings):
    """List a channel's versions: kind, sizes, ratio to a full checkpoint, signature."""

    trust: list[Path] = field(default_factory=list)
    """Verify signatures against these keys (none: show unverified)."""
    json: bool = False
    """Machine-readable output."""


def register(sub: argparse._SubParsersAction) -> None:
    add_settings_command(sub, "publish", "publish a checkpoint as the next version of a channel", "publish", _publish)
    add_settings_command(sub, "pull", "rebuild the newest verified version into a directory", "pull", _pull)
    add_settings_command(
        sub, "ls", "list a channel's versions: kind, sizes, ratio to a full checkpoint", "ls", _ls
    )


def _open(s: StoreSettings):
    from pulsenet.store import S3Config, open_store

    return open_store(s.store, S3Config.from_env(timeout_s=s.timeout))


# --- publish ----------------------------------------------------------------------------------


def _publish(ns: argparse.Namespace) -> int:
    import torch

    from pulsenet.checkpoint import Checkpoint
    from pulsenet.signing import load_private_key
    from pulsenet.sync import Publisher, PublisherConfig

    args = command_settings(ns, PublishSettings)
    require(args, "model", "store", "key", table="publish")
    assert args.model is not None and args.key is not None  # require() stopped a missing one (ConfigError)
    key = load_private_key(args.key, allow_open=args.allow_open_key)
    ckpt = Checkpoint(args.model)
    model_config = _architecture(Path(args.model))
    state = {}
    for name in ckpt:
        t = ckpt[name]
        state[name] = t.to(torch.bfloat16) if args.dtype == "bf16" and t.is_floating_point() else t
    config = PublisherConfig(
        channel=args.channel,
        run=args.run,
        anchor_every=args.anchor_every,
        keep_anchors=args.keep_anchors or None,
        threads=args.threads or os.cpu_count() or 2,
        timeout_s=args.timeout,
        **({"max_zones": args.zones} if args.zones else {}),
    )

    async def go():
        async with _open(args) as store:
            pub = Publisher(store, key, config, model_config=model_config)
            await pub.resume()
            return await pub.publish_now(state, step=args.step)

    rec = asyncio.run(go())
    sizes = ", ".join(f"{role} {n:,} B" for role, n in rec.payload_bytes.items())
    print(
        f"published v{rec.version} ({rec.kind}: {sizes}; {rec.ratio:.1f}x smaller than the "
        f"{rec.full_bytes:,}-byte checkpoint) in {rec.latency_s:.2f}s"
    )
    print(f"v{rec.version} {rec.digest}")
    return 0


def _architecture(model: Path) -> dict | None:
    """The ``config.json`` of a HF model directory, as anchors carry it (so ``pulsenet export``
    needs no ``--model``); None, with a note, for a lone file or a config.json that is not one."""
    from pulsenet.errors import ConfigError
    from pulsenet.sync.manifest import check_model_config, public_model_config

    path = model / "config.json"
    if not path.is_file():
        return None
    try:
        config = public_model_config(json.loads(path.read_text()))
        check_model_config(config, str(path), ConfigError)
    except (ValueError, AttributeError, OSError) as e:  # ConfigError is a ValueError
        print(f"# {path} is not carried into the channel ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return config


# --- pull -------------------------------------------------------------------------------------


def default_cache(store_url: str, channel: str, out: Path) -> Path:
    """One payload cache per (store, channel, output dir): a cache must not be shared by two pulls."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = hashlib.sha256(f"{store_url}\n{channel}\n{out.resolve()}".encode()).hexdigest()[:16]
    return root / "pulsenet" / "sync" / name


def _pull(ns: argparse.Namespace) -> int:
    from pulsenet.errors import ObjectNotFound
    from pulsenet.signing import trusted_keys
    from pulsenet.sync import Subscriber, SubscriberConfig
    from pulsenet.sync.chain import check_cache_dir

    args = command_settings(ns, PullSettings)
    require(args, "store", "trust", "out", table="pull")
    assert args.out is not None  # require() stopped a missing one (ConfigError)
    if args.cache is not None:
        check_cache_dir(args.cache, args.out, cache_flag="--cache", other_flag="--out")
    trusted = trusted_keys(args.trust)
    config = SubscriberConfig(
        channel=args.channel,
        run=args.run,
        interval_s=args.interval,
        state_dir=args.out,
        cache_dir=args.cache or default_cache(args.store, args.channel, args.out),
        timeout_s=args.timeout,
        threads=args.threads or os.cpu_count() or 2,
        # A one-shot pull insists on the newest version: if it fails, say so, don't settle for an older one.
        max_targets=3 if args.follow else 1,
    )

    def saved(version: int, digest: str) -> None:
        print(f"v{version} {digest}", flush=True)

    async def go() -> int:
        async with _open(args) as store, Subscriber(store, trusted, config, on_saved=saved) as sub:
            if sub.resumed_from is not None:
                print(f"# resumed v{sub.resumed_from} from {args.out}", file=sys.stderr, flush=True)
            if not args.follow:
                await sub.sync_once()
                if sub.version is None:
                    raise ObjectNotFound(f"no published versions in {args.store} channel {args.channel!r}")
                if sub.stats.updates == 0:
                    print(f"v{sub.version} {sub.digest}", flush=True)  # already current
                return 0
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await sub.run(stop)
            return 0

    return asyncio.run(go())


# --- ls ---------------------------------------------------------------------------------------


def _ls(ns: argparse.Namespace) -> int:
    from pulsenet.errors import ManifestError, ObjectNotFound
    from pulsenet.signing import trusted_keys
    from pulsenet.sync.chain import ManifestReader
    from pulsenet.sync.layout import Layout

    args = command_settings(ns, LsSettings)
    require(args, "store", table="ls")
    trusted = trusted_keys(args.trust) if args.trust else None

    async def head_row(reader: ManifestReader) -> dict | None:
        try:
            head = await (reader.head() if trusted else reader.peek_head())
        except ObjectNotFound:
            return None
        except ManifestError as e:
            return {"verified": False, "error": f"{type(e).__name__}: {e}"}
        return {"version": head.version, "time_ms": head.time_ms, "verified": bool(trusted)}

    async def go() -> tuple[list[dict], int, int, dict | None]:
        async with _open(args) as store:
            layout = Layout(args.channel, run=args.run, store_url=store.url)
            reader = ManifestReader(store, layout, trusted or {}, args.timeout)
            infos = await store.list(f"{layout.channel}/", timeout=args.timeout)  # every object: the totals
            rows = []
            for v, info in sorted((await reader.list_versions()).items()):
                row: dict = {"version": v, "key": info.key}
                try:
                    m = await (reader.get(v, info=info) if trusted else reader.peek(v, info=info))
                    row["verified"] = bool(trusted)
                except (ManifestError, ObjectNotFound) as e:
                    row.update(verified=False, error=f"{type(e).__name__}: {e}")
                    rows.append(row)
                    continue
                following = m.patch or m.anchor
                row.update(
                    kind=m.kind,
                    base_version=m.base_version,
                    digest=m.model_digest,
                    created=m.created,
                    step=m.step,
                    patch_bytes=m.patch.size if m.patch else None,
                    anchor_bytes=m.anchor.size if m.anchor else None,
                    full_bytes=m.full_bytes,
                    ratio=m.full_bytes / max(following.size, 1) if following else None,
                    publisher=m.publisher,
                )
                rows.append(row)
            return rows, len(infos), sum(i.size for i in infos), await head_row(reader)

    rows, count, total, head = asyncio.run(go())
    if args.json:
        doc = {"channel": args.channel, "run": args.run, "objects": count, "bytes": total, "head": head, "versions": rows}
        print(json.dumps(doc, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"{args.store} channel {args.channel}: {len(rows)} versions, {count} objects, {total:,} bytes"
    )
    for col in (
        "version",
        "kind",
        "base",
        "patch",
        "anchor",
        "full",
        "ratio",
        "digest",
        "created",
        "signature",
    ):
        table.add_column(
            col, justify="right" if col in ("version", "base", "patch", "anchor", "full", "ratio") else "left"
        )
    for r in rows:
        if "error" in r:
            table.add_row(str(r["version"]), "-", "", "", "", "", "", "", "", f"[red]{r['error']}[/]")
            continue
        table.add_row(
            str(r["version"]),
            r["kind"],
            "" if r["base_version"] is None else str(r["base_version"]),
            _size(r["patch_bytes"]),
            _size(r["anchor_bytes"]),
            _size(r["full_bytes"]),
            f"{r['ratio']:.1f}x" if r["ratio"] else "",
            r["digest"][:16],
            r["created"][:19],
            "verified" if r["verified"] else "not checked",
        )
    console = Console(width=max(Console().width, 150))
    console.print(table)
    if head is not None:
        console.print(
            f"head: {head['error']}"
            if "error" in head
            else f"head: v{head['version']} at {head['time_ms']} ms ({'verified' if head['verified'] else 'not checked'})"
        )
    return 0


def _size(n: int | None) -> str:
    if n is None:
        return ""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
