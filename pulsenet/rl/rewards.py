"""Rewards: built-in verifiers, your own functions, weighted sums, and a deadline on every call.

A reward function has TRL's signature (``GRPOTrainer(reward_funcs=...)``, standard text format)::

    def my_reward(completions: list[str], *, prompts: list[str], answers: list[str], **columns) -> list[float | None]

- ``completions``: the completion texts (decoded, cut before the first stop string);
- ``prompts``: the problems' prompt texts, before any chat template;
- ``answers``: the gold answers as the task extracted them (after GSM8K's ``####``, inside a MATH
  solution's last ``\\boxed{}``, else the answer column as it is);
- ``columns``: every column of the dataset row by its own name (``solution=[...]``, ``level=[...]``),
  as TRL passes them; none for generated tasks (arith, chain);
- returns one value per completion: a finite number, or None ("does not apply": counts as 0).

pulsenet calls it with one completion at a time (lists of length 1), so a call that raises or hangs
costs that completion only. An optional attribute ``my_reward.reward_range = (lo, hi)`` declares its
range: a value outside it is an error, and the task's declared range (what a trainer's intake
accepts in a rollout's reward column) is computed from it.

Built in (``BUILTIN``), each in [0, 1]: ``math`` (HF ``math-verify`` as in open-r1: parse the gold
answer and the completion's final answer, ``\\boxed{}`` first, and verify them symbolically),
``exact`` (the first line equals the answer), ``numeric`` (the last ``\\boxed{}`` or else last number
equals the answer as a number), ``format`` (the completion holds a balanced ``\\boxed{...}``).

Several rewards combine as TRL's ``reward_weights``: total = sum(w_i * r_i), None counting 0.

Isolation. Only ``exact`` and ``format`` run in-process: each is one pass over the completion
(strip/splitlines, rfind and a brace count), linear in its length, which the completion limit
bounds. Everything else runs in one worker process (``python -m pulsenet.rl.rewards``) with a
per-call deadline: ``numeric`` (it parses numbers with ``Fraction``, and ``Fraction("1e999999999")``
computes 10**999999999 in C holding the GIL: in-process it froze a trainer's event loop and
/healthz for minutes; ``_as_number`` now refuses such exponents too), ``math`` (sympy can take
unbounded time) and every custom function. A thread cannot be killed, nor can it run while C code
holds the GIL; a process can be killed, and the parent waits for it without holding the GIL. A call
past ``timeout_s`` kills the worker, scores 0 for that completion and is counted; the
worker restarts on the next call (about half a second). A call that raises scores 0, is counted
and logged with its row's tag. ``max_timeouts`` timeouts of one reward in one batch skip that
reward for the rest of the batch (scored 0, counted), so a reward that always hangs costs a few
deadlines per batch, not one per completion. The worker dies with its parent (PR_SET_PDEATHSIG).

This module imports neither torch nor transformers: the worker starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
import logging
import math
import numbers
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from multiprocessing.connection import Connection
from typing import Any, Protocol, cast

from pulsenet.errors import ConfigError

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]

# --- answer extraction (shared with rl/tasks.py) ---------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unbalanced: the completion was cut off


def extract_answer(completion: str) -> str | None:
    """A completion's answer: its last ``\\boxed{}`` or else its last number (commas dropped)."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers_ = _NUMBER.findall(completion)
    return numbers_[-1].replace(",", "") if numbers_ else None


def reference_answer(answer: str) -> str:
    """The gold answer of a dataset row: after GSM8K's ``####``, or a MATH solution's last box, else as is."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = last_boxed(answer)
    return (boxed if boxed is not None else answer).strip()


def _normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip().rstrip(".")
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\!", "")):
        s = s.replace(a, b)
    return "".join(s.split())


MAX_NUMBER_CHARS = 256
"""Longest text ``_as_number`` reads as a number (int parsing is quadratic in the digits)."""
MAX_EXPONENT = 400
"""Largest |exponent| ``_as_number`` reads (``Fraction`` computes ``10**exponent`` exactly)."""
_EXPONENT = re.compile(r"[eE]\s*([+-]?[\d_]+)")


def _as_number(s: str) -> Fraction | None:
    """``s`` as an exact number, or None: also for a number too long or too far out of range to be
    an answer (``MAX_NUMBER_CHARS``, ``MAX_EXPONENT``), which ``Fraction`` would spend unbounded
    time and memory on; such texts are compared as strings."""
    s = s.replace(",", "")
    if len(s) > MAX_NUMBER_CHARS:
        return None
    for exp in _EXPONENT.findall(s):
        digits = exp.lstrip("+-").replace("_", "")
        if len(digits) > 4 or int(digits or 0) > MAX_EXPONENT:
            return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    """Equal as numbers (``"1,000"`` = ``"1000.0"``, ``"0.5"`` = ``"1/2"``), else as whitespace-free strings.

    Not a full MATH equivalence checker (no symbolic algebra): ``\\frac{1}{2}`` and ``0.5`` differ
    here; the ``math`` reward (math-verify) is.
    """
    if predicted is None:
        return False
    p, r = _normalize(predicted), _normalize(reference)
    pn, rn = _as_number(p), _as_number(r)
    if pn is not None and rn is not None:
        return pn == rn
    return p == r


def first_line_matches(completion: str, answer: str) -> bool:
    """The completion's first line is exactly the answer (surrounding spaces ignored)."""
    lines = completion.strip().splitlines()
    return bool(lines) and lines[0].strip() == answer


# --- built-in rewards (the documented signature) ---------------------------------------------------


def exact_reward(completions: list[str], *, answers: list[str], **_: Any) -> list[float]:
    """1 if the first line of the completion is exactly the answer: the format is part of the task."""
    return [1.0 if first_line_matches(c, a) else 0.0 for c, a in zip(completions, answers, strict=True)]


def numeric_reward(completions: list[str], *, answers: list[str], **_: Any) -> list[float]:
    """1 if the last ``\\boxed{}`` (or else the last number) equals the answer as a number or string."""
    return [1.0 if answers_match(extract_answer(c), a) else 0.0 for c, a in zip(completions, answers, strict=True)]


def format_reward(completions: list[str], **_: Any) -> list[float]:
    """1 if the completion states a final answer in a balanced ``\\boxed{...}``."""
    return [1.0 if last_boxed(c) is not None else 0.0 for c in completions]


def math_reward(completions: list[str], *, answers: list[str], **_: Any) -> list[float | None]:
    """open-r1's accuracy reward on HF math-verify: 1 if the completion's final answer (``\\boxed{}``
    first, else the last LaTeX or plain expression) verifies against the gold answer, else 0; None
    when the gold answer itself does not parse (the row cannot be judged)."""
    from math_verify import parse, verify

    out: list[float | None] = []
    for completion, answer in zip(completions, answers, strict=True):
        gold = parse(f"\\boxed{{{answer}}}") or parse(answer)
        if not gold:
            out.append(None)
            continue
        out.append(1.0 if verify(gold, parse(completion)) else 0.0)
    return out


class DeclaresRange(Protocol):
    """A reward function that declares the range of what it returns (``declared_range`` reads it)."""

    reward_range: tuple[float, float]

    def __call__(self, completions: list[str], **kw: Any) -> Sequence[float | None]: ...


for _fn in (exact_reward, numeric_reward, format_reward, math_reward):
    cast(DeclaresRange, _fn).reward_range = (0.0, 1.0)  # a function takes attributes; its type says only Callable

BUILTIN: dict[str, RewardFn] = {
    "math": math_reward,
    "exact": exact_reward,
    "numeric": numeric_reward,
    "format": format_reward,
}
IN_PROCESS = frozenset({"exact", "format"})
"""Built-ins provably linear in the completion's length: they run without the worker's deadline.
``numeric`` is not among them (``Fraction``: module docstring)."""


def load_reward(name: str) -> RewardFn:
    """A built-in by name, or ``module:function`` imported from the Python path (ConfigError if not)."""
    if name in BUILTIN:
        return BUILTIN[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"reward {name!r}: not one of {sorted(BUILTIN)} and not module:function")
    try:
        fn = importlib.import_module(module)
        for part in attr.split("."):
            fn = getattr(fn, part)
    except ImportError as e:
        raise ConfigError(f"reward {name!r}: cannot import {module!r} from the Python path: {e}") from None
    except AttributeError:
        raise ConfigError(f"reward {name!r}: module {module!r} has no {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"reward {name!r} is not callable")
    return fn


def declared_range(fn: RewardFn, name: str) -> tuple[float, float]:
    """``fn.reward_range`` as (lo, hi), or (-inf, inf) when it declares none."""
    r = getattr(fn, "reward_range", None)
    if r is None:
        return (-math.inf, math.inf)
    try:
        lo, hi = (float(x) for x in r)
    except (TypeError, ValueError):
        raise ConfigError(f"reward {name!r}: reward_range must be (lo, hi), got {r!r}") from None
    if not lo <= hi:
        raise ConfigError(f"reward {name!r}: reward_range {r!r} has lo > hi")
    return lo, hi


# --- one call, checked ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion:
    """What every reward sees of one completion."""

    completion: str
    prompt: str
    answer: str
    columns: Mapping[str, Any] = field(default_factory=dict)
    """The dataset row's columns (passed by name); empty for generated tasks."""
    tag: str = ""
    """Names the row in logs and failure records (e.g. its rollout group)."""


_RESERVED = ("completions", "prompts", "answers")


def _call_one(fn: RewardFn, item: Completion, lo: float, hi: float) -> float | None:
    """``fn`` on one completion; its value, checked: a number in [lo, hi] or None (ValueError if not)."""
    columns = {k: [v] for k, v in item.columns.items() if k not in _RESERVED}
    out = fn(completions=[item.completion], prompts=[item.prompt], answers=[item.answer], **columns)
    if isinstance(out, str | bytes) or not isinstance(out, Sequence) or len(out) != 1:
        raise ValueError(f"must return a list with one value per completion, got {type(out).__name__}")
    v = out[0]
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"returned {type(v).__name__} {v!r}, not a number or None")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"returned {v}, not a finite number")
    if not lo <= v <= hi:
        raise ValueError(f"returned {v}, outside its declared reward_range [{lo}, {hi}]")
    return v


# --- the worker process --------------------------------------------------------------------------


def _load_all(names: Sequence[str]) -> tuple[dict[str, tuple[RewardFn, float, float]], dict[str, str]]:
    """Import every reward and run each built-in once (math-verify compiles its grammars on first use)."""
    fns: dict[str, tuple[RewardFn, float, float]] = {}
    errors: dict[str, str] = {}
    for name in names:
        try:
            fn = load_reward(name)
            fns[name] = (fn, *declared_range(fn, name))
            if name in BUILTIN:
                fn(["1"], answers=["1"], prompts=[""])
        except Exception as e:  # reported to the parent, which counts it per completion
            errors[name] = f"{type(e).__name__}: {e}"[:500]
    return fns, errors


def _worker_main(fd: int) -> int:
    """``("load", names)`` -> ``("ready", errors)``; then ``("score", name, rows)`` -> one
    ``("row", i, ok, value_or_error)`` per row, in order; ``("stop",)`` or EOF ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when this process ends
    conn = Connection(fd)
    fns: dict[str, tuple[RewardFn, float, float]] = {}
    errors: dict[str, str] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return 0
        if msg[0] == "stop":
            return 0
        if msg[0] == "load":
            fns, errors = _load_all(msg[1])
            conn.send(("ready", errors))
            continue
        _, name, rows = msg
        for i, row in enumerate(rows):
            if name not in fns:
                conn.send(("row", i, False, errors.get(name, f"reward {name!r} was not loaded")))
                continue
            fn, lo, hi = fns[name]
            try:
                reply = ("row", i, True, _call_one(fn, Completion(*row), lo, hi))
            except Exception as e:  # a user's function: any error scores 0 for this row
                reply = ("row", i, False, f"{type(e).__name__}: {e}"[:500])
            conn.send(reply)


class _Worker:
    """One worker process with ``names`` loaded; ``kill`` ends it at once."""

    def __init__(self, names: Sequence[str], start_timeout_s: float) -> None:
        from pulsenet.runtime import spawn_tied

        parent, child = socket.socketpair()
        # The worker imports user modules exactly as this process would.
        path = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env = {**os.environ, "PYTHONPATH": path}
        try:
            self.proc = spawn_tied(
                [sys.executable, "-m", "pulsenet.rl.rewards", str(child.fileno())],
                "pulsenet-reward-worker",
                pass_fds=(child.fileno(),),
                env=env,
            )
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        try:
            self.conn.send(("load", list(names)))
            if not self.conn.poll(start_timeout_s):
                raise TimeoutError(f"the reward worker did not load {list(names)} within {start_timeout_s} s")
            _, self.load_errors = self.conn.recv()
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        from pulsenet.runtime import signal_group

        signal_group(self.proc, signal.SIGKILL)  # and whatever a reward function started
        self.proc.wait()
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


# --- a weighted set of rewards -------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    rewards: list[str] = field(default_factory=lambda: ["exact"])
    """Reward functions: built-ins (math, exact, numeric, format) or module:function."""
    weights: list[float] = field(default_factory=list)
    """One weight per reward (TRL's reward_weights); empty: all 1."""
    timeout_s: float = 10.0
    """Deadline of one call of an isolated reward (numeric, math, custom) on one completion."""
    max_timeouts: int = 3
    """Timeouts of one reward in one batch after which it is skipped (0) for the rest of the batch."""
    start_timeout_s: float = 120.0
    """Deadline of starting the worker and importing the isolated rewards (not counted per call)."""

    def __post_init__(self) -> None:
        if not self.rewards:
            raise ConfigError("rewards: name at least one reward function")
        if self.weights and len(self.weights) != len(self.rewards):
            raise ConfigError(f"reward_weights: {len(self.weights)} weights for {len(self.rewards)} rewards")
        if any(not math.isfinite(w) for w in self.weights):
            raise ConfigError(f"reward_weights must be finite, got {self.weights}")
        if not self.timeout_s > 0 or self.max_timeouts < 1:
            raise ConfigError("reward timeout_s must be > 0 and max_timeouts >= 1")
        if len(set(self.rewards)) != len(self.rewards):
            raise ConfigError(f"rewards are named twice: {self.rewards}")


@dataclass(frozen=True, slots=True)
class RewardFailure:
    reward: str
    tag: str
    kind: str
    """``error`` (raised or returned a bad value), ``timeout``, or ``skipped`` (after max_timeouts)."""
    message: str


@dataclass(slots=True)
class RewardStats:
    """Counters per reward name, over the life of a RewardSet (plain data for /status and /metrics)."""

    calls: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    worker_starts: int = 0
    recent: deque[RewardFailure] = field(default_factory=lambda: deque(maxlen=50))
    """The newest failures, with the row's tag."""

    def count(self, failure: RewardFailure) -> None:
        counter = {"error": self.errors, "timeout": self.timeouts, "skipped": self.skipped}[failure.kind]
        counter[failure.reward] = counter.get(failure.reward, 0) + 1
        self.recent.append(failure)

    @property
    def failed(self) -> int:
        return sum(self.errors.values()) + sum(self.timeouts.values()) + sum(self.skipped.values())


@dataclass(frozen=True, slots=True)
class Scores:
    total: list[float]
    """Weighted sum per completion (failures and None count 0)."""
    by_reward: dict[str, list[float | None]]
    """Each reward's own value per completion (None: did not apply or failed)."""
    failures: list[RewardFailure]


class _StartFailed(Exception):
    pass


class RewardSet:
    """The rewards of one task: ``score(items)`` -> ``Scores``; ``range`` is the declared range."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.names = list(config.rewards)
        self.weights = list(config.weights) or [1.0] * len(self.names)
        self.fns = {n: load_reward(n) for n in self.names}  # a bad name fails here, in this process
        self.ranges = {n: declared_range(f, n) for n, f in self.fns.items()}
        self.stats = RewardStats()
        self._worker: _Worker | None = None
        self._lock = threading.Lock()

    @property
    def range(self) -> tuple[float, float]:
        """[lo, hi] every total lies in: each weighted range, widened to 0 (failures score 0)."""
        lo = hi = 0.0
        for n, w in zip(self.names, self.weights, strict=True):
            a, b = self.ranges[n]
            ends = [0.0 if math.isinf(x) and w == 0 else w * x for x in (a, b)]
            lo += min(0.0, *ends)
            hi += max(0.0, *ends)
        return lo, hi

    def isolated(self, name: str) -> bool:
        return name not in IN_PROCESS

    def score(self, items: Sequence[Completion]) -> Scores:
        """Every reward on every completion; never raises for what a reward function does."""
        by_reward: dict[str, list[float | None]] = {}
        failures: list[RewardFailure] = []
        with self._lock:
            for name in self.names:
                self.stats.calls[name] = self.stats.calls.get(name, 0) + len(items)
                if self.isolated(name):
                    values, failed = self._score_isolated(name, items)
                else:
                    values, failed = self._score_here(name, items)
                by_reward[name] = values
                failures += failed
        for f in failures:
            self.stats.count(f)
        for f in failures[:5]:
            log.warning("reward %s %s on %s: %s", f.reward, f.kind, f.tag or "a completion", f.message)
        if len(failures) > 5:
            log.warning("%d more reward failures in this batch", len(failures) - 5)
        total = [
            sum(w * (by_reward[n][i] or 0.0) for n, w in zip(self.names, self.weights, strict=True))
            for i in range(len(items))
        ]
        return Scores(total=total, by_reward=by_reward, failures=failures)

    def _score_here(self, name: str, items: Sequence[Completion]) -> tuple[list[float | None], list[RewardFailure]]:
        fn, (lo, hi) = self.fns[name], self.ranges[name]
        values: list[float | None] = []
        failed = []
        for item in items:
            try:
                values.append(_call_one(fn, item, lo, hi))
            except Exception as e:  # same contract as the worker's
                values.append(None)
                failed.append(RewardFailure(name, item.tag, "error", f"{type(e).__name__}: {e}"[:500]))
        return values, failed

    def _score_isolated(
        self, name: str, items: Sequence[Completion]
    ) -> tuple[list[float | None], list[RewardFailure]]:
        """In the worker, one deadline per completion; a timeout kills the worker and goes on after it."""
        values: list[float | None] = [None] * len(items)
        failed: list[RewardFailure] = []
        start, timeouts = 0, 0
        while start < len(items):
            if timeouts >= self.config.max_timeouts:
                failed += [
                    RewardFailure(name, it.tag, "skipped", f"skipped after {timeouts} timeouts in this batch")
                    for it in items[start:]
                ]
                break
            done = start
            try:
                worker = self._get_worker()
                rows = [(c.completion, c.prompt, c.answer, dict(c.columns), c.tag) for c in items[start:]]
                worker.conn.send(("score", name, rows))
                while done < len(items):
                    if not worker.conn.poll(self.config.timeout_s):
                        raise TimeoutError
                    _, i, ok, payload = worker.conn.recv()
                    k = start + i
                    if ok:
                        values[k] = payload
                    else:
                        failed.append(RewardFailure(name, items[k].tag, "error", payload))
                    done = k + 1
            except TimeoutError:
                timeouts += 1
                failed.append(RewardFailure(name, items[done].tag, "timeout", f"no result within {self.config.timeout_s} s"))
                self._kill_worker()
                done += 1
            except (EOFError, OSError) as e:  # the worker died (crash, os._exit in user code)
                failed.append(RewardFailure(name, items[done].tag, "error", f"reward worker died: {e!r}"))
                self._kill_worker()
                done += 1
            except _StartFailed as e:  # cannot run this reward at all now: the batch scores 0, counted
                failed += [RewardFailure(name, it.tag, "error", str(e)) for it in items[start:]]
                break
            start = done
        return values, failed

    def _get_worker(self) -> _Worker:
        if self._worker is None:
            t0 = time.perf_counter()
            names = [n for n in self.names if self.isolated(n)]
            try:
                self._worker = _Worker(names, self.config.start_timeout_s)
            except (TimeoutError, EOFError, OSError) as e:
                raise _StartFailed(f"reward worker did not start: {e}") from e
            self.stats.worker_starts += 1
            log.debug("reward worker started in %.2f s", time.perf_counter() - t0)
        return self._worker

    def _kill_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def close(self) -> None:
        """Stop the worker process, if one runs."""
        with self._lock:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None

    def __enter__(self) -> RewardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    sys.exit(_worker_main(int(sys.argv[1])))
