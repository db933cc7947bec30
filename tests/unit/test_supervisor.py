"""The supervisor's decisions (nodes/supervisor.py), without processes: restart backoff and crash
loops, a node's last *error* (not its last line), who holds a stuck network up, the journal and the
incremental event reader."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from pulsenet.errors import ConfigError
from pulsenet.nodes.events import EventLog, VersionEvent
from pulsenet.nodes.supervisor import (
    End,
    EventTail,
    Exit,
    Journal,
    Restarts,
    RunView,
    SuperviseConfig,
    TrainerView,
    describe_exit,
    end_of_run,
    holdup,
    last_error,
    read_journal,
)


def _exit(code: int = -9) -> Exit:
    return Exit(at=0.0, code=code, why=describe_exit(code), error="")


def test_restart_delays_grow_with_recent_restarts_and_a_crash_loop_is_the_next_exit_past_the_limit() -> None:
    policy = SuperviseConfig(max_restarts=3, window_s=60.0, backoff_s=1.0, backoff_cap_s=4.0)
    r, rng, now = Restarts(), random.Random(7), 1000.0
    bounds = []
    for k in range(3):
        delay = r.exited(_exit(), now, policy, rng)
        assert delay is not None and r.due == now + delay
        bounds.append(min(4.0, 1.0 * 2**k))
        assert 0.0 <= delay <= bounds[-1]  # full jitter below the doubling bound, capped
        now += delay
        r.restarted(now)
        assert r.due is None and r.count == k + 1
        now += 1.0
    assert r.exited(Exit(now, 2, "exit code 2", "ConfigError: bad key"), now, policy, rng) is None  # the 4th exit
    reason = r.crash_loop("i1", policy)
    assert reason.startswith("i1 is in a crash loop: 4 exits within 60 s (3 restarts in all;")
    assert "killed by SIGKILL" in reason and "exit code 2" in reason and "ConfigError: bad key" in reason


def test_restarts_older_than_the_window_are_forgotten() -> None:
    policy = SuperviseConfig(max_restarts=2, window_s=10.0, backoff_s=0.0, backoff_cap_s=0.0)
    r, now = Restarts(), 0.0
    for _ in range(20):  # one exit every 6 s: never 3 within 10 s
        assert r.exited(_exit(), now, policy) == 0.0
        r.restarted(now)
        now += 6.0
    assert r.count == 20
    r.exited(_exit(), now, policy)
    r.restarted(now)
    assert r.exited(_exit(), now + 1, policy) is None  # 3 exits within 10 s now


def test_supervise_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="supervise"):
        SuperviseConfig(backoff_s=10.0, backoff_cap_s=1.0)
    with pytest.raises(ConfigError, match="supervise"):
        SuperviseConfig(window_s=0)


def test_describe_exit() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(2) == "exit code 2"
    assert describe_exit(None) == "running"


def _json(level: str, msg: str, **extra: object) -> str:
    return json.dumps({"ts": "t", "level": level, "logger": "x", "msg": msg, **extra})


def test_last_error_quotes_an_error_never_an_unrelated_last_line(tmp_path: Path) -> None:
    log = tmp_path / "n.log"
    log.write_text(
        "\n".join(
            [
                _json("INFO", "start"),
                _json("ERROR", "i1: batch failed: StoreUnavailable: 9 tries", exc="Traceback...\nStoreUnavailable: 9 tries"),
                _json("INFO", "i1: v7 batch 3, 32 rows"),  # the last line: what the old launcher quoted
                _json("WARNING", "sync round failed"),
            ]
        )
        + "\n"
    )
    assert last_error(log) == "i1: batch failed: StoreUnavailable: 9 tries (StoreUnavailable: 9 tries)"
    size = log.stat().st_size
    with log.open("a") as f:  # a new life: its own errors only
        f.write(_json("INFO", "resumed v7") + "\n")
    assert last_error(log, since=size) == ""
    with log.open("a") as f:
        f.write("pulsenet: error: ConfigError: trainer: set store\n")
    assert last_error(log, since=size) == "pulsenet: error: ConfigError: trainer: set store"


def test_last_error_finds_an_uncaught_traceback_and_text_records(tmp_path: Path) -> None:
    log = tmp_path / "n.log"
    log.write_text(
        "2026-12-01 10:00:00,000 ERROR pulsenet.loco: round 3 failed\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "    boom()\n"
        "RuntimeError: CUDA out of memory\n"
        "2026-12-01 10:00:01,000 INFO pulsenet: bye\n"
    )
    assert last_error(log) == "RuntimeError: CUDA out of memory"
    log.write_text("2026-12-01 10:00:00,000 ERROR pulsenet.loco: round 3 failed\nRuntimeError: not under a traceback\n")
    assert last_error(log) == "2026-12-01 10:00:00,000 ERROR pulsenet.loco: round 3 failed"
    assert last_error(tmp_path / "missing.log") == ""


def _t(name: str, version: int | None = 5, *, state: str = "running", health: str = "ok", **kw: object) -> TrainerView:
    return TrainerView(name, state, health, version, **kw)  # type: ignore[arg-type]


def test_holdup_names_the_trainer_that_holds_the_network_up() -> None:
    assert holdup([_t("t0"), _t("t1")], store="down (killed by SIGKILL)") == "the store: down (killed by SIGKILL)"
    down = holdup([_t("t0"), _t("t1", state="restarting", health="down: killed by SIGKILL", exit="killed by SIGKILL")])
    assert down == "t1 is down (killed by SIGKILL), restarting"
    assert holdup([_t("t0"), _t("t1", health="no answer")]) == "t1 does not answer /status (no answer)"
    assert holdup([_t("t0", 7), _t("t1", 6)]) == "t1 is behind at v6 (newest v7)"
    assert holdup([_t("t0", 7), _t("t1", None)]) == "t1 is behind at v- (newest v7)"
    degraded = holdup([_t("t0"), _t("t1", health="degraded", reasons=("loco: 5 failed requests in a row",))])
    assert degraded == "t1 is degraded: loco: 5 failed requests in a row"
    waiting = holdup([_t("t0", round=6, idle_s=3.0), _t("t1", round=6, idle_s=250.0)])
    assert waiting == "no trainer reports a fault: t0 v5 round 6 idle 3 s, t1 v5 round 6 idle 250 s"


def test_journal_appends_lines_a_reader_gets_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "supervisor.jsonl"
    j = Journal(path)
    j.write("exit", node="i0", code=-9)
    j.write("restart", node="i0", count=1)
    with path.open("a") as f:
        f.write('{"at": 1, "kind": "tor')  # a torn last line
    records = read_journal(path)
    assert [r["kind"] for r in records] == ["exit", "restart"] and records[0]["code"] == -9
    assert [r["kind"] for r in j.records] == ["exit", "restart"]


def test_event_tail_reads_whole_new_lines_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    tail = EventTail(path)
    assert tail.read() == []
    log.emit(VersionEvent(kind="published", node="t0", role="trainer", version=0, digest="a" * 64))
    assert [e.version for e in tail.read()] == [0]
    with path.open("a") as f:
        f.write('{"kind": "published", "node": "t0"')  # being written
    assert tail.read() == []
    with path.open("a") as f:
        f.write(', "role": "trainer", "version": 1, "digest": "b"}\n')
    log.emit(VersionEvent(kind="published", node="t0", role="trainer", version=2, digest="c" * 64))
    assert [e.version for e in tail.read()] == [1, 2]
    assert tail.last("published").version == 2 and len(tail.events) == 3


# --- the end of a run ----------------------------------------------------------------------------


def _run(**kw: Any) -> RunView:
    return dataclasses.replace(
        RunView(serving=(("i0", -1), ("i1", -1)), serve_timeout_s=120.0, deadline=1000.0, timeout_s=1800.0), **kw
    )


def test_a_run_goes_on_until_every_inference_node_serves_the_final_version() -> None:
    assert end_of_run(_run(), now=10.0) is None  # trainers still training
    assert end_of_run(_run(final=3, serving=(("i0", 3), ("i1", 2)), serve_deadline=200.0), now=100.0) is None
    assert end_of_run(_run(final=3, serving=(("i0", 3), ("i1", 4)), serve_deadline=200.0), now=100.0) == End(
        0, "done: every node at v3"
    )


def test_inference_nodes_late_to_serve_the_final_version_fail_the_run_naming_them() -> None:
    view = _run(final=3, serving=(("i0", 3), ("i1", 2)), serve_deadline=200.0)
    assert end_of_run(view, now=200.0) is None  # the deadline itself is still in time
    assert end_of_run(view, now=200.5) == End(1, "i1 did not serve v3 within 120 s")


def test_the_run_times_out_with_who_holds_it_up() -> None:
    assert end_of_run(_run(), now=1000.5) == End(1, "timed out after 1800 s")
    assert end_of_run(_run(holdup="t1 down"), now=1000.5) == End(1, "timed out after 1800 s; stuck: t1 down")


def test_failures_and_stops_come_before_what_the_versions_say() -> None:
    done = dict(final=3, serving=(("i0", 3), ("i1", 3)), serve_deadline=200.0)
    crash = "t0 exited 6 times within 600 s (crash loop)"
    assert end_of_run(_run(**done, failure=crash, stopped=True), now=1.0) == End(1, crash)
    assert end_of_run(_run(**done, stopped=True, stop_reason="stopped by SIGINT"), now=1.0) == End(130, "stopped by SIGINT")
    assert end_of_run(_run(**done, injector_error="ValueError: boom"), now=1.0) == End(1, "chaos failed: ValueError: boom")
    assert end_of_run(_run(stopped=True, stop_reason="stopped by SIGTERM"), now=5000.0) == End(130, "stopped by SIGTERM")
