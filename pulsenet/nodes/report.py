"""The end-of-run report of a local network: ``summary.json`` and PNG plots (matplotlib, Agg).

Input is the per-round history ``nodes/summary.py`` made of the nodes' version events (reward,
bytes moved per channel, sparsity) plus each node's final state; nothing here talks to a node.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pulsenet.fsutil import atomic_write_bytes
from pulsenet.nodes.summary import CHANNELS


def write_report(
    directory: Path,
    *,
    rounds: Sequence[Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    evals: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Write ``summary.json``, ``reward.png``, ``bytes.png`` and ``sparsity.png``; returns the summary.
    ``evals``: ``{version, reward, n}`` of the trainers' greedy evals (``summary.json`` ``eval``; a
    second curve in ``reward.png``).

    ``rounds``: one mapping per round with ``round``, ``reward``, ``bytes`` (channel -> bytes that
    round) and optionally ``sparsity`` (fraction of BF16 weights unchanged by that round's update).
    ``nodes``: node id -> at least ``role``, ``version``, ``digest``.
    """
    directory.mkdir(parents=True, exist_ok=True)
    totals = {c: sum(int(r.get("bytes", {}).get(c, 0)) for r in rounds) for c in CHANNELS}
    summary = {
        "nodes": {n: {"role": s["role"], "version": s["version"], "digest": s["digest"]} for n, s in nodes.items()},
        "reward": [r.get("reward") for r in rounds],
        "staleness": max((int(r.get("staleness") or 0) for r in rounds), default=0),
        "bytes": totals,
        "ratios": {
            "full_sync_over_pulsesync": _ratio(totals["full_sync"], totals["pulsesync"]),
            "diloco_over_pulseloco": _ratio(totals["diloco"], totals["pulseloco"]),
            "ddp_over_pulseloco": _ratio(totals["ddp"], totals["pulseloco"]),
        },
        "sparsity": [r.get("sparsity") for r in rounds],
        "rounds": list(rounds),
        "eval": list(evals),
        **(extra or {}),
    }
    atomic_write_bytes(directory / "summary.json", (json.dumps(summary, indent=1, default=str) + "\n").encode())
    _plots(directory, rounds, evals)
    return summary


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 2) if b else None


def _plots(directory: Path, rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["round"] for r in rounds]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(directory / name, dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [r.get("reward") for r in rounds], marker="o")
    if evals:
        ax.plot([e["version"] for e in evals], [e["reward"] for e in evals], marker="s", label="greedy eval (held out)")
        ax.lines[0].set_label("sampled (trained on)")
        ax.legend(fontsize=8)
    ax.set(xlabel="round", ylabel="mean reward", title="Reward per round")
    ax.grid(alpha=0.3)
    save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for channel in CHANNELS:
        ys = [r.get("bytes", {}).get(channel, 0) for r in rounds]
        if any(ys):
            ax.plot(xs, ys, marker=".", label=channel)
    ax.set(xlabel="round", ylabel="bytes (log)", title="Bytes per round per channel", yscale="log")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, "bytes.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(xs, [r.get("sparsity") for r in rounds], marker="o")
    ax.set(xlabel="round", ylabel="unchanged BF16 weights", title="Sparsity of each update")
    ax.grid(alpha=0.3)
    save(fig, "sparsity.png")


def headline(directories: Sequence[Path]) -> str:
    """The runs of ``directories`` (each a ``pulsenet up --report`` directory) side by side, each
    labelled with its model: reward first -> last tenth, sparsity, and bytes against the dense
    alternatives (what ``scripts/demo.sh`` ends with)."""
    lines = [f"{'run':<34} {'reward (first->last tenth)':>27} {'sparsity':>9} {'PULSESync':>11} {'PULSELoCo':>11}"]
    for d in directories:
        s = json.loads((Path(d) / "summary.json").read_text())
        run = s.get("run", {})
        rewards = [r for r in s.get("reward", []) if r is not None]
        n = max(1, len(rewards) // 10)
        reward = f"{sum(rewards[:n]) / n:.3f} -> {sum(rewards[-n:]) / n:.3f}" if rewards else "-"
        sp = [x for x in s.get("sparsity", []) if x is not None]
        ratios = s.get("ratios", {})
        sync = ratios.get("full_sync_over_pulsesync")
        loco = ratios.get("diloco_over_pulseloco")
        label = f"{Path(str(run.get('model', '?'))).name} x{run.get('rounds', '?')} ({run.get('trainers', '?')} trainer)"
        lines.append(
            f"{label:<34} {reward:>27} {(f'{sum(sp) / len(sp):.4f}' if sp else '-'):>9} "
            f"{(f'{sync:.1f}x' if sync else 'n.a.'):>11} {(f'{loco:.1f}x' if loco else 'n.a.'):>11}"
        )
    lines.append("PULSESync: full BF16 checkpoints over patches sent; PULSELoCo: DiLoCo's dense FP32 payloads over "
                 "PULSELoCo's, per worker per round; sparsity: BF16 weights unchanged per version.")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(headline([Path(a) for a in sys.argv[1:]]))
