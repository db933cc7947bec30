"""``logs.suppressed``: a teardown step's failure is swallowed (the steps after it still run) but
logged, never silent; cancellation passes through."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from pulsenet.logs import suppressed

log = logging.getLogger("pulsenet.test_logs")


def test_a_suppressed_failure_is_logged_with_its_exception(caplog: pytest.LogCaptureFixture) -> None:
    ran_after = False
    with caplog.at_level(logging.WARNING, logger=log.name):
        with suppressed(log, "up: teardown: the store restart in flight"):
            raise RuntimeError("weed did not start")
        ran_after = True
    assert ran_after
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == "up: teardown: the store restart in flight: RuntimeError: weed did not start"


def test_nothing_is_logged_when_the_step_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=log.name), suppressed(log, "step"):
        pass
    assert caplog.records == []


def test_cancellation_and_interrupts_pass_through(caplog: pytest.LogCaptureFixture) -> None:
    for exc in (asyncio.CancelledError(), KeyboardInterrupt()):
        with caplog.at_level(logging.WARNING, logger=log.name), pytest.raises(type(exc)), suppressed(log, "step"):
            raise exc
    assert caplog.records == []


async def test_an_awaited_task_that_failed_is_logged_one_that_was_cancelled_is_not(caplog: pytest.LogCaptureFixture) -> None:
    """The teardown shape in nodes/up/supervisor.py and chaos/link.py: cancel, then await each task."""

    async def fails() -> None:
        raise OSError("reset")

    failed = asyncio.create_task(fails())
    cancelled = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    cancelled.cancel()
    with caplog.at_level(logging.WARNING, logger=log.name):
        for task in (failed, cancelled):
            with contextlib.suppress(asyncio.CancelledError), suppressed(log, "closing"):
                await task
    assert [r.getMessage() for r in caplog.records] == ["closing: OSError: reset"]
