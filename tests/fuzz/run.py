"""Fuzz every decoder from the command line (no pytest needed).

    python tests/fuzz/run.py --cases 20000                  # every target in tests/fuzz/targets_*.py
    python tests/fuzz/run.py --cases 5000 --target codec.patch --seed 7 --save /tmp/crashes

Prints per target: cases, typed rejections, exact outputs, other accepted outputs, crashes (any
exception that is not a ``PulsenetError``, or an exact target decoding to the wrong output), time
and the slowest case; exits 1 if any target crashed, 2 if a mutator failed.
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # the harness, then this checkout's pulsenet

import harness  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=2000, help="cases per target (default 2000)")
    ap.add_argument("--target", action="append", help="a target name or prefix (repeatable; default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", type=Path, help="write each crashing input to this directory")
    ap.add_argument("--list", action="store_true", help="list the targets and exit")
    args = ap.parse_args(argv)
    if args.list:
        for t in harness.load_targets(args.target):
            print(t["name"], "(exact)" if t.get("exact") else "")
        return 0
    results = harness.run(args.cases, args.target, args.seed)
    if not results:
        print("no target matches", args.target, file=sys.stderr)
        return 2
    total = harness.Stats("total")
    for s in results:
        total.cases += s.cases
        total.rejected += s.rejected
        total.exact += s.exact
        total.accepted += s.accepted
        total.crashes += s.crashes
        total.seconds += s.seconds
        total.slowest = max(total.slowest, s.slowest)
    print(total.row())
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
    for s in results:
        if s.errors:
            print(f"{s.target}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())))
    for s in results:
        for m in dict.fromkeys(s.mutator_errors):
            print(f"MUTATOR ERROR {s.target}: {m}", file=sys.stderr)
        for c in s.crashes:
            print(f"CRASH {c.target} case {c.case} via {'+'.join(c.mutators)}: {c.error}\n{c.trace}", file=sys.stderr)
            if args.save and c.data:
                args.save.mkdir(parents=True, exist_ok=True)
                path = args.save / f"{c.target}-{hashlib.sha256(c.data).hexdigest()[:16]}.bin"
                path.write_bytes(c.data)
    if total.crashes:
        return 1
    return 2 if any(s.mutator_errors for s in results) else 0


if __name__ == "__main__":
    sys.exit(main())
