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
