"""``pulsenet patch encode|apply|inspect`` and ``pulsenet digest``: the codec on local files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("patch", help="encode, apply and inspect PULSESync patches")
    psub = p.add_subparsers(dest="patch_command", required=True, metavar="ACTION")

    enc = psub.add_parser("encode", help="write the patch that turns OLD into NEW")
    enc.add_argument("old", type=Path, help="base model: .safetensors file or HF directory")
    enc.add_argument("new", type=Path, help="target model: .safetensors file or HF directory")
    enc.add_argument("-o", "--output", type=Path, required=True, help="patch file to write")
    enc.add_argument("--zones", type=int, default=None, help="context zones per tensor (1 = fastest, default 12)")
    enc.add_argument("--level", type=int, default=3, help="zstd level (default 3)")
    enc.add_argument("--threads", type=int, default=0,
                     help="codec threads (default 0: this process's cores, capped by OMP_NUM_THREADS)")
    enc.add_argument("--base-digest", default=None,
                     help="OLD's model digest when already known (a publisher knows its last version's): skips hashing OLD")
    enc.set_defaults(func=_encode)

    app = psub.add_parser("apply", help="rebuild the target from BASE and PATCH, verified bit for bit")
    app.add_argument("base", type=Path, help="base model: .safetensors file or HF directory")
    app.add_argument("patch", type=Path)
    app.add_argument("-o", "--output", type=Path, required=True,
                     help="output .safetensors file (or directory when BASE is a directory)")
    app.add_argument("--threads", type=int, default=0,
                     help="codec threads (default 0: this process's cores, capped by OMP_NUM_THREADS)")
    app.add_argument("--max-output-bytes", type=int, default=None,
                     help="refuse a patch that rebuilds more bytes than this (default: twice BASE, at least 1 GiB)")
    app.add_argument("--base-digest", default=None,
                     help="BASE's verified model digest when already known (a subscriber knows the version it serves): "
                          "skips hashing BASE; every rebuilt tensor is still checked")
    app.set_defaults(func=_apply)

    ins = psub.add_parser("inspect", help="tensors, changes, sizes and digests of a patch")
    ins.add_argument("patch", type=Path)
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.set_defaults(func=_inspect)

    dig = sub.add_parser("digest", help="print the model digest (SHA-256 over sorted tensor values)")
    dig.add_argument("model", type=Path, help=".safetensors file or HF directory")
    dig.add_argument("--threads", type=int, default=0,
                     help="codec threads (default 0: this process's cores, capped by OMP_NUM_THREADS)")
    dig.set_defaults(func=_digest)


def _progress(total_bytes: int, label: str):
    """A progress callback printing to stderr when it is a terminal; silent otherwise."""
    if not sys.stderr.isatty():
        return None
    done = [0]
    start = time.perf_counter()

    def tick(name: str, nbytes: int) -> None:
        done[0] += nbytes
        rate = done[0] / max(time.perf_counter() - start, 1e-9) / 1e6
        print(f"\r{label}: {100 * done[0] / max(total_bytes, 1):5.1f}%  {rate:7.0f} MB/s  {name[:48]:48s}",
              end="", file=sys.stderr, flush=True)

    return tick


def _encode(args: argparse.Namespace) -> int:
    from pulsenet.checkpoint import Checkpoint
    from pulsenet.codec.mask import MAX_ZONES
    from pulsenet.codec.patch import PatchEncoder, parse_patch

    old, new = Checkpoint(args.old), Checkpoint(args.new)
    total = new.nbytes
    t0 = time.perf_counter()
    enc = PatchEncoder(level=args.level, threads=args.threads, max_zones=args.zones or MAX_ZONES)
    data = enc.encode(old, new, base_digest=args.base_digest, progress=_progress(total, "encode"))
    from pulsenet.fsutil import atomic_write_bytes

    atomic_write_bytes(args.output, data)
    dt = time.perf_counter() - t0
    p = parse_patch(data)
    changed = sum(e.nnz for e in p.tensors if e.op == "sparse")
    print(f"\nwrote {args.output}: {len(data):,} bytes ({total / max(len(data), 1):.1f}x smaller than NEW), "
          f"{changed:,} changed entries, {dt:.1f}s")
    print(f"base   {p.base_digest}\ntarget {p.target_digest}")
    return 0


def _apply(args: argparse.Namespace) -> int:
    from pulsenet.checkpoint import SINGLE_NAME, Checkpoint, copy_model_files, write_safetensors
    from pulsenet.codec.patch import (
        check_output_size,
        iter_apply,
        output_cap,
        parse_patch,
        table_cap,
    )

    base = Checkpoint(args.base)
    patch = parse_patch(args.patch.read_bytes(), max_table_raw=table_cap(len(base)))
    limit = args.max_output_bytes if args.max_output_bytes is not None else output_cap(base.nbytes)
    check_output_size(patch, limit)  # before any output file or directory is made
    meta = {e.name: (e.dtype, e.shape) for e in patch.tensors}
    out = args.output
    if base.is_dir and out.suffix != ".safetensors":
        copy_model_files(args.base, out)
        out = out / SINGLE_NAME
    t0 = time.perf_counter()
    rebuilt = iter_apply(base, patch, base_digest=args.base_digest, threads=args.threads, max_output_bytes=limit)
    write_safetensors(out, meta, rebuilt)
    print(f"wrote {out}: digest {patch.target_digest} verified ({time.perf_counter() - t0:.1f}s)")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from pulsenet.codec.patch import parse_patch

    p = parse_patch(args.patch.read_bytes())
    rows = []
    for e in p.tensors:
        sizes = {k: v[1] for k, v in e.sections.items()}
        rows.append({"name": e.name, "dtype": e.dtype, "shape": list(e.shape), "op": e.op, "nnz": e.nnz,
                     "numel": e.numel, "zones": len(e.zones), "bytes": sum(sizes.values()), "sha256": e.sha256})
    if args.json:
        print(json.dumps({"size": p.size, "base_digest": p.base_digest, "target_digest": p.target_digest,
                          "removed": p.removed, "tensors": rows}, indent=1))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{args.patch} ({p.size:,} bytes)")
    for col in ("tensor", "dtype", "shape", "op", "changed", "zones", "bytes", "sha256"):
        table.add_column(col, justify="right" if col in ("changed", "zones", "bytes") else "left")
    for r in rows:
        pct = f"{r['nnz']:,} ({100 * r['nnz'] / max(r['numel'], 1):.2f}%)" if r["op"] == "sparse" else "-"
        table.add_row(r["name"], r["dtype"], "x".join(map(str, r["shape"])), r["op"], pct, str(r["zones"]),
                      f"{r['bytes']:,}", r["sha256"][:12])
    console = Console()
    console.print(table)
    total_nnz = sum(r["nnz"] for r in rows)
    total_n = sum(r["numel"] for r in rows)
    console.print(f"changed {total_nnz:,} of {total_n:,} entries ({100 * total_nnz / max(total_n, 1):.3f}%)")
    console.print(f"removed: {p.removed or 'none'}\nbase   {p.base_digest}\ntarget {p.target_digest}")
    return 0


def _digest(args: argparse.Namespace) -> int:
    from pulsenet.checkpoint import Checkpoint
    from pulsenet.codec.digest import model_digest

    print(model_digest(Checkpoint(args.model), threads=args.threads))
    return 0
