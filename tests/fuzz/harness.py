"""Mutation fuzzing of every decoder of bytes from a store or a file (issue 12).

Targets live in ``targets_*.py`` next to this file, each defining ``TARGETS: list[dict]`` (the
shared interface: ``name``, ``seeds``, ``decode``, optional ``exact``, ``equal``, ``mutators``);
this module finds them all, mutates their seeds (generic byte-level mutations plus each target's
structure-aware ones, stacked 1-3 deep) and checks the invariant:

    every case ends in a ``PulsenetError``, or (``exact`` targets) in the output of one of the
    seeds; no other exception, ever.

(One of the seeds, not its own: a splice followed by a re-encoding can rebuild another seed's
signed document byte for byte but for whitespace, and that must verify as that seed.)

Runs are deterministic for a given (target, seed, case count). Standard library + pulsenet only,
so ``tests/fuzz/run.py`` works without pytest.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pulsenet.errors import PulsenetError

HERE = Path(__file__).resolve().parent
Mutator = Callable[[bytes, random.Random], bytes]
INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF,
               1 << 62, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000, 0xFFFFFFFFFFFFFFFF]


# --------------------------------------------------------------------------- generic mutations


def bit_flip(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 2, 4, 8))):
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    return bytes(b)


def byte_set(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    b = bytearray(data)
    i = rng.randrange(len(b))
    b[i] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)))
    return bytes(b)


def int_set(data: bytes, rng: random.Random) -> bytes:
    """Overwrite 1, 2, 4 or 8 bytes with an interesting little-endian integer (a size, a count)."""
    w = rng.choice((1, 2, 4, 8))
    if len(data) < w:
        return data
    i = rng.randrange(len(data) - w + 1)
    v = rng.choice(INTERESTING) & ((1 << (8 * w)) - 1)
    return data[:i] + v.to_bytes(w, "little") + data[i + w :]


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data) + 1)] if data else data


def delete_chunk(data: bytes, rng: random.Random) -> bytes:
    if len(data) < 2:
        return data
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, min(64, len(data) - i)) :]


def duplicate_chunk(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    chunk = data[i : i + rng.randint(1, 256)]
    j = rng.randrange(len(data) + 1)
    return data[:j] + chunk * rng.choice((1, 1, 2, 16)) + data[j:]


def insert_random(data: bytes, rng: random.Random) -> bytes:
    j = rng.randrange(len(data) + 1)
    return data[:j] + rng.randbytes(rng.choice((1, 4, 8, 64))) + data[j:]


def append_bytes(data: bytes, rng: random.Random) -> bytes:
    return data + rng.choice((b"\0", b"\xff", rng.randbytes(rng.randint(1, 32))))


def random_bytes(data: bytes, rng: random.Random) -> bytes:
    """Noise of a similar length, with the first bytes (magic, version) kept half of the time."""
    noise = rng.randbytes(rng.randint(0, max(1, 2 * len(data))))
    keep = rng.choice((0, 8, 10, 12, 16, 24))
    return data[:keep] + noise if rng.random() < 0.5 else noise


GENERIC: list[Mutator] = [bit_flip, byte_set, int_set, truncate, delete_chunk, duplicate_chunk, insert_random,
                          append_bytes, random_bytes]


def splice(data: bytes, other: bytes, rng: random.Random) -> bytes:
    """The head of one seed on the tail of another (generic, needs a second input)."""
    i, j = rng.randrange(len(data) + 1), rng.randrange(len(other) + 1)
    return data[:i] + other[j:]


# --------------------------------------------------------------------------- targets


def load_targets(names: list[str] | None = None) -> list[dict]:
    """Every ``TARGETS`` entry of every ``targets_*.py`` here (``names``: keep those whose name
    equals or starts with one of them, e.g. ``codec`` or ``codec.patch``)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # targets files may import helpers that sit next to them
    targets: list[dict] = []
    for path in sorted(HERE.glob("targets_*.py")):
        spec = importlib.util.spec_from_file_location(f"pulsenet_fuzz_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        for t in module.TARGETS:
            missing = {"name", "seeds", "decode"} - set(t)
            if missing:
                raise ValueError(f"{path.name}: target {t.get('name')!r} lacks {sorted(missing)}")
            targets.append(t)
    seen = [t["name"] for t in targets]
    if len(seen) != len(set(seen)):
        raise ValueError(f"duplicate fuzz target names: {sorted(n for n in seen if seen.count(n) > 1)}")
    if names:
        targets = [t for t in targets if any(t["name"] == n or t["name"].startswith(n + ".") for n in names)]
    return targets


# --------------------------------------------------------------------------- running


@dataclass
class Crash:
    target: str
    case: int
    mutators: list[str]
    error: str
    data: bytes
    trace: str


@dataclass
class Stats:
    target: str
    cases: int = 0
    rejected: int = 0
    """Cases that raised a ``PulsenetError``."""
    exact: int = 0
    """Exact targets: cases decoded to their seed's output."""
    accepted: int = 0
    """Non-exact targets: cases that decoded (to something the decoder's own checks accept)."""
    crashes: list[Crash] = field(default_factory=list)
    seconds: float = 0.0
    slowest: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    """Typed rejections by error class."""
    mutator_errors: list[str] = field(default_factory=list)
    """Exceptions raised by the mutators themselves (bugs in a targets file, not findings)."""

    def row(self) -> str:
        return (f"{self.target:<24} {self.cases:>8} {self.rejected:>9} {self.exact:>7} {self.accepted:>9} "
                f"{len(self.crashes):>8} {self.seconds:>7.1f} {1000 * self.slowest:>9.1f}")

    HEADER = (f"{'target':<24} {'cases':>8} {'rejected':>9} {'exact':>7} {'accepted':>9} {'crashes':>8} "
              f"{'time_s':>7} {'slowest_ms':>9}")


def run_target(target: dict, cases: int, seed: int = 0, *, keep_crashes: int = 20) -> Stats:
    """Fuzz one target for ``cases`` cases; deterministic for a given seed."""
    name = target["name"]
    decode = target["decode"]
    exact = bool(target.get("exact", False))
    equal = target.get("equal") or (lambda x, y: x == y)
    specific: list[Mutator] = list(target.get("mutators", []))
    seeds = list(target["seeds"]())
    if not seeds:
        raise ValueError(f"{name}: no seeds")
    expected = [decode(s) for s in seeds]  # seeds must decode: a broken seed is a broken target
    rng = random.Random(seed ^ zlib.crc32(name.encode()))
    stats = Stats(name)
    t_start = time.perf_counter()
    for case in range(cases):
        k = rng.randrange(len(seeds))
        data, used = seeds[k], []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if specific and rng.random() < 0.6:
                m = rng.choice(specific)
            elif rng.random() < 0.1 and len(seeds) > 1:
                m = splice
            else:
                m = rng.choice(GENERIC)
            try:
                data = splice(data, rng.choice(seeds), rng) if m is splice else m(data, rng)
            except Exception as e:  # a bug in a mutator, not in the decoder: counted apart
                stats.mutator_errors.append(f"{m.__name__}: {type(e).__name__}: {str(e)[:200]}")
            used.append(m.__name__)
        stats.cases += 1
        t0 = time.perf_counter()
        try:
            out = decode(data)
        except PulsenetError as e:
            stats.rejected += 1
            stats.errors[type(e).__name__] = stats.errors.get(type(e).__name__, 0) + 1
            continue
        except Exception as e:  # the harness's whole point: any other type is a finding
            if len(stats.crashes) < keep_crashes:
                stats.crashes.append(Crash(name, case, used, f"{type(e).__name__}: {str(e)[:300]}", data,
                                           traceback.format_exc(limit=-6)))
            else:
                stats.crashes.append(Crash(name, case, used, f"{type(e).__name__}", b"", ""))
            continue
        finally:
            stats.slowest = max(stats.slowest, time.perf_counter() - t0)
        if not exact:
            stats.accepted += 1
            continue
        if any(equal(out, e) for e in expected):
            stats.exact += 1
        else:
            stats.crashes.append(Crash(name, case, used, "decoded without error to an output that differs from its seed's",
                                       data, ""))
    stats.seconds = time.perf_counter() - t_start
    return stats


def run(cases: int, names: list[str] | None = None, seed: int = 0, out=None) -> list[Stats]:
    """Fuzz every selected target, printing one row each to ``out`` (default stdout)."""
    out = out or sys.stdout
    results = []
    print(Stats.HEADER, file=out, flush=True)
    for t in load_targets(names):
        s = run_target(t, cases, seed)
        results.append(s)
        print(s.row(), file=out, flush=True)
    return results
