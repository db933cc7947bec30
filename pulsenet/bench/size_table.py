"""The scaling table of docs/scale.md from ``pulsenet bench size`` JSON files: measured rows, and 7B
and 32B projected from per-parameter constants fitted to them (the formulas are printed with it).

Fits (least squares through the origin, over the measured sizes):

- codec seconds = k x parameters (k per operation, all threads of the measuring machine);
- patch bytes = b x changed entries (bytes per changed entry), projected at a changed fraction
  ``projected_changed`` (the paper's ~1% per step at lr 3e-6; the random-init fixtures move more);
- version latency = encode + max(patch bits / link rate, apply) + c: the subscriber decodes the
  patch as it streams in, so the link and the apply overlap; c is the mean measured remainder
  (polling, manifests, the store, the apply's tail after the last byte).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

PROJECT = {"7B": 7.0e9, "32B": 32.0e9}
PAPER_7B = {"full_bytes": 14e9, "patch_bytes": 108e6}


def fit_through_origin(xs: list[float], ys: list[float]) -> float:
    return sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)


def load(paths: list[Path]) -> list[dict]:
    rows = [json.loads(Path(p).read_text()) for p in paths]
    return sorted(rows, key=lambda r: r["fixture"]["pair"]["params"])


def constants(results: list[dict]) -> dict:
    params = [r["fixture"]["pair"]["params"] for r in results]
    out = {
        k: fit_through_origin(params, [r["codec"][k]["all_threads_s"] for r in results])
        for k in ("encode_known_base", "encode_hash_base", "apply_verify")
    }
    out["bytes_per_changed_entry"] = fit_through_origin([r["bytes"]["changed_entries"] for r in results],
                                                        [r["bytes"]["patch"] for r in results])
    rest = []
    for r in results:
        for v in (r.get("e2e") or {}).get("versions", []):
            if v["link_mbps"] is not None and not v.get("warmup"):  # warm-up rows are reported, not judged
                apply_s = r["codec"]["apply_verify"]["all_threads_s"]
                rest.append(v["all_verified_s"] - v["encode_s"] - max(v["link_time_s"], apply_s))
    out["latency_remainder_s"] = statistics.fmean(rest) if rest else 0.0
    out["threads"] = results[-1]["machine"]["threads_used"]
    return out


def _latency(r: dict, mbps: float) -> str:
    """The median version latency at ``mbps`` (older JSON: its one version) against its budget,
    warm-up versions left out as ``budgets`` leaves them out."""
    rows = [v for v in (r.get("e2e") or {}).get("versions", []) if v["link_mbps"] == mbps and not v.get("warmup")]
    if not rows:
        return "-"
    value, limit = (statistics.median(v[k] for v in rows) for k in ("all_verified_s", "budget_s"))
    return f"{value:.1f} ({'pass' if value <= limit else 'FAIL'} <= {limit:.1f})"


def _stolen(machine: dict) -> str:
    """CPU the hypervisor took during the run, where the run recorded it."""
    s = machine.get("cpu_stolen_s")
    return f"; {s:.1f} s stolen" if s is not None else ""


def _fresh(codec: dict) -> str:
    """Apply into fresh memory (a node's first update after a start), where the run measured it."""
    f = codec.get("apply_verify_fresh")
    return f" (fresh memory {f['ratio_to_sha_floor_one_thread']:.2f} / {f['ratio_to_sha_floor_x_threads']:.2f})" if f else ""


def table(results: list[dict], projected_changed: float = 0.01) -> str:
    """Markdown: one row per measured size, then the projections."""
    c = constants(results)
    head = ("| size | params | BF16 | changed | patch | full/patch | encode s (1 thr / all) | apply+verify s (1 thr / all) "
            "| encode; apply / SHA floor (1 thr / all thr x floor) | latency 100 Mbit/s s | latency 1 Gbit/s s "
            "| full ckpt 100M / 1G s "
            "| CLI peak RSS enc / apply | load; CPU stolen |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        p, b, cd = r["fixture"]["pair"], r["bytes"], r["codec"]
        e, a = cd["encode_known_base"], cd["apply_verify"]
        full = b["model_bf16"]
        cli = r.get("cli") or {}
        rss = (f"{cli['encode']['peak_rss_bytes'] / 1e9:.2f} / {cli['apply']['peak_rss_bytes'] / 1e9:.2f} GB"
               if cli else "-")
        lines.append(
            f"| {r['config']['params']} | {p['params'] / 1e9:.3f}B | {full / 1e9:.2f} GB | {100 * p['changed_fraction']:.2f}% "
            f"({p['method']}) | {b['patch'] / 1e6:.1f} MB | {b['ratio']:.0f}x | {e['one_thread_s']:.1f} / "
            f"{e['all_threads_s']:.1f} | {a['one_thread_s']:.1f} / {a['all_threads_s']:.1f} | "
            f"{e['ratio_to_sha_floor_one_thread']:.2f} / {e['ratio_to_sha_floor_x_threads']:.2f}; "
            f"{a['ratio_to_sha_floor_one_thread']:.2f} / {a['ratio_to_sha_floor_x_threads']:.2f}{_fresh(cd)} | "
            f"{_latency(r, 100.0)} | "
            f"{_latency(r, 1000.0)} | {full * 8 / 100e6:.0f} / {full * 8 / 1e9:.0f} | {rss} | "
            f"{r['machine']['load_average_start'][0]:.1f}{_stolen(r['machine'])} |"
        )
    for name, n in PROJECT.items():
        patch = c["bytes_per_changed_entry"] * projected_changed * n
        enc, app = c["encode_known_base"] * n, c["apply_verify"] * n
        lat = [enc + max(patch * 8 / (mbps * 1e6), app) + c["latency_remainder_s"] for mbps in (100.0, 1000.0)]
        lines.append(
            f"| {name} (projected) | {n / 1e9:.0f}B | {2 * n / 1e9:.0f} GB | {100 * projected_changed:.0f}% (assumed) | "
            f"{patch / 1e6:.0f} MB | {2 * n / patch:.0f}x | - / {enc:.0f} | - / {app:.0f} | - | {lat[0]:.0f} | {lat[1]:.0f} | "
            f"{2 * n * 8 / 100e6:.0f} / {2 * n * 8 / 1e9:.0f} | - | - |"
        )
    paper = PAPER_7B
    lines.append(f"| 7B (paper) | 7B | {paper['full_bytes'] / 1e9:.0f} GB | ~1% | {paper['patch_bytes'] / 1e6:.0f} MB | "
                 f"{paper['full_bytes'] / paper['patch_bytes']:.0f}x | - | - | - | - | - | - | - | - |")
    formula = (
        f"Fitted on this machine ({c['threads']} threads): encode = {c['encode_known_base'] * 1e9:.2f} s per 1e9 "
        f"parameters (base digest known; {c['encode_hash_base'] * 1e9:.2f} s hashing the base too), apply+verify = "
        f"{c['apply_verify'] * 1e9:.2f} s per 1e9 parameters, patch = {c['bytes_per_changed_entry']:.2f} bytes per "
        f"changed entry x changed fraction x parameters, latency = encode + max(patch x 8 / link, apply) + "
        f"{c['latency_remainder_s']:.2f} s."
    )
    return "\n".join(lines) + "\n\n" + formula + "\n"
