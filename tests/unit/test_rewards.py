"""Rewards: the built-ins, custom module:function rewards with TRL's signature, weights and the
declared range, and what a raising, lying, dying or hanging reward costs (a counted 0, never a stall)."""

from __future__ import annotations

import math
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pulsenet.errors import ConfigError
from pulsenet.rl.rewards import Completion, RewardConfig, RewardSet, load_reward

USER_REWARDS = '''
import os, time

def by_level(completions, *, answers, prompts, level, **columns):
    return [float(l) for l in level]

def moody(completions, **kw):
    out = []
    for c in completions:
        if "raise" in c:
            raise RuntimeError("boom on " + c)
        if "hang" in c:
            time.sleep(600)
        if "exit" in c:
            os._exit(3)
        if "nan" in c:
            out.append(float("nan"))
        elif "str" in c:
            out.append("1")
        elif "big" in c:
            out.append(7.0)
        else:
            out.append(0.5)
    return out
moody.reward_range = (0, 1)

def not_applicable(completions, **kw):
    return [None for _ in completions]
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_rewards_mod.py").write_text(textwrap.dedent(USER_REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_rewards_mod", None)
    return "user_rewards_mod"


def items(*texts: str, answer: str = "46", **columns: object) -> list[Completion]:
    return [Completion(t, "12+34=", answer, dict(columns), tag=f"g{i}") for i, t in enumerate(texts)]


def test_builtins() -> None:
    with RewardSet(RewardConfig(rewards=["exact", "numeric", "format", "math"])) as rs:
        s = rs.score(items("46\nmore", "the answer is 46.", "$\\boxed{46}$", "45", "\\boxed{\\frac{92}{2}}"))
        assert s.by_reward["exact"] == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert s.by_reward["numeric"] == [1.0, 1.0, 1.0, 0.0, 0.0]  # no symbolic algebra
        assert s.by_reward["format"] == [0.0, 0.0, 1.0, 0.0, 1.0]
        assert s.by_reward["math"] == [1.0, 1.0, 1.0, 0.0, 1.0]  # math-verify: 92/2 = 46
        assert s.total == [3.0, 2.0, 3.0, 0.0, 2.0] and not s.failures and rs.range == (0.0, 4.0)
        frac = rs.score(items("so it is \\boxed{0.5}", answer="\\frac{1}{2}"))
        assert frac.by_reward["math"] == [1.0] and frac.by_reward["numeric"] == [0.0]


def test_custom_rewards_get_columns_and_are_weighted(user_module: str) -> None:
    cfg = RewardConfig(rewards=["exact", f"{user_module}:by_level", f"{user_module}:not_applicable"], weights=[2.0, 0.5, 1.0])
    with RewardSet(cfg) as rs:
        s = rs.score(items("46", "7", level=3))
        assert s.by_reward[f"{user_module}:by_level"] == [3.0, 3.0]
        assert s.by_reward[f"{user_module}:not_applicable"] == [None, None]  # None counts 0
        assert s.total == [2.0 + 1.5, 1.5] and not s.failures
        assert rs.range == (-math.inf, math.inf)  # by_level declares no range


def test_bad_reward_names_fail_at_config_time(user_module: str) -> None:
    for name, why in [("mathh", "not one of"), ("no_such_mod:f", "cannot import"), (f"{user_module}:nope", "has no 'nope'")]:
        with pytest.raises(ConfigError, match=why):
            load_reward(name)
    with pytest.raises(ConfigError, match="2 weights for 1 rewards"):
        RewardConfig(rewards=["math"], weights=[1.0, 2.0])


def test_a_raising_or_lying_reward_scores_0_counted_with_its_row(user_module: str) -> None:
    name = f"{user_module}:moody"
    with RewardSet(RewardConfig(rewards=[name, "exact"], weights=[2.0, 1.0])) as rs:
        assert rs.range == (0.0, 3.0)
        s = rs.score(items("46", "raise 46", "nan", "str", "big", "46"))
        assert s.by_reward[name] == [0.5, None, None, None, None, 0.5]
        assert s.total == [2.0, 0.0, 0.0, 0.0, 0.0, 2.0]  # exact still scores: "46" only
        assert [(f.tag, f.kind) for f in s.failures] == [("g1", "error"), ("g2", "error"), ("g3", "error"), ("g4", "error")]
        assert "RuntimeError: boom on raise 46" in s.failures[0].message
        assert "not a finite" in s.failures[1].message and "not a number" in s.failures[2].message
        assert "outside its declared reward_range" in s.failures[3].message
        assert rs.stats.errors == {name: 4} and rs.stats.worker_starts == 1  # errors do not restart it


def test_a_hanging_or_dying_reward_is_cut_off(user_module: str) -> None:
    name = f"{user_module}:moody"
    with RewardSet(RewardConfig(rewards=[name], timeout_s=1.0, max_timeouts=2)) as rs:
        rs.score(items("warm"))  # start the worker outside the timed part
        t0 = time.monotonic()
        s = rs.score(items("ok", "hang", "ok", "exit", "ok"))
        assert time.monotonic() - t0 < 10
        assert s.by_reward[name] == [0.5, None, 0.5, None, 0.5]  # the rows after each failure still score
        assert [(f.tag, f.kind) for f in s.failures] == [("g1", "timeout"), ("g3", "error")]
        assert "worker died" in s.failures[1].message
        s = rs.score(items("hang", "hang", "ok", "ok"))  # 2 timeouts: the rest of the batch is skipped
        assert [f.kind for f in s.failures] == ["timeout", "timeout", "skipped", "skipped"] and s.total == [0.0] * 4
        assert rs.stats.timeouts == {name: 3} and rs.stats.skipped == {name: 2} and rs.stats.errors == {name: 1}
        assert rs.score(items("ok")).total == [0.5]  # and the next batch runs again


# --- issue 29 item 3: no reward that is not provably linear runs where it can hold the GIL ----------

GIL_SCENARIO = r"""
import asyncio, json, sys, time
from pulsenet.rl.rewards import Completion, RewardConfig, RewardSet

def items(*texts):
    return [Completion(t, "1+0=", "1", {}, tag=f"g{i}") for i, t in enumerate(texts)]

async def main(names):
    gaps, stop = [], asyncio.Event()
    async def tick():  # what /healthz needs: the event loop turning
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.02)
            now = time.monotonic(); gaps.append(now - last); last = now
    with RewardSet(RewardConfig(rewards=names, timeout_s=2.0)) as rs:
        rs.score(items("warm"))  # the worker's start is not what is timed
        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        s = await asyncio.to_thread(rs.score, items(r"\boxed{1e999999999}", r"\boxed{1E-99_999_999}", "1"))
        wall = time.monotonic() - t0
        stop.set(); await ticker
    print(json.dumps({"wall": wall, "gap": max(gaps), "total": s.total,
                      "kinds": [(f.reward, f.kind) for f in s.failures],
                      "isolated": {n: rs.isolated(n) for n in names}}))

asyncio.run(main(sys.argv[1:]))
"""

GIL_REWARD = '''
from fractions import Fraction

def hold_gil(completions, **kw):
    return [float(Fraction("1e999999999") > 0) for _ in completions]  # 10**999999999, in C, GIL held
hold_gil.reward_range = (0, 1)
'''


def _gil_scenario(*names: str, tmp_path: Path) -> dict:
    import json
    import os
    import subprocess

    (tmp_path / "gil_rewards_mod.py").write_text(GIL_REWARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", GIL_SCENARIO, *names], capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path
    )  # on 7876ec8 numeric ran in-process: this froze past the timeout
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_numeric_on_a_huge_exponent_never_freezes_the_event_loop(tmp_path: Path) -> None:
    r = _gil_scenario("numeric", tmp_path=tmp_path)
    assert r["isolated"] == {"numeric": True}  # in the worker, under the deadline
    assert r["wall"] < 10 and r["gap"] < 1.0, r  # the loop kept turning
    assert r["total"] == [0.0, 0.0, 1.0]  # read as text, not as 10**999999999; the honest row still scores


def test_a_reward_holding_the_gil_is_a_counted_timeout_within_the_deadline(tmp_path: Path) -> None:
    r = _gil_scenario("gil_rewards_mod:hold_gil", tmp_path=tmp_path)
    assert r["wall"] < 3 * 2.0 + 10 and r["gap"] < 1.0, r  # max_timeouts deadlines at most, loop alive
    assert ("gil_rewards_mod:hold_gil", "timeout") in [tuple(k) for k in r["kinds"]]


@pytest.mark.timeout(30)
def test_answers_match_reads_no_unbounded_number() -> None:
    from pulsenet.rl.rewards import answers_match

    t0 = time.monotonic()
    assert not answers_match("1e999999999", "1") and not answers_match("1" * 100_000, "1")
    assert answers_match("1e999999999", "1e999999999")  # equal as text
    assert answers_match("2.5e2", "250") and answers_match("1_000", "1000")
    assert time.monotonic() - t0 < 1.0
