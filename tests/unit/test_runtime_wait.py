"""The one way a daemon loop waits (``runtime.wait``, ``runtime.every``, ``runtime.unless_stopped``):
a stop wins over the timeout, a timeout says False, a failed step is handed to ``on_error`` and the
loop goes on, cancellation always propagates, the jitter stays within its bounds."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pulsenet import runtime


async def _set_later(event: asyncio.Event, after: float) -> None:
    await asyncio.sleep(after)
    event.set()


async def test_a_stop_ends_the_wait_before_its_timeout() -> None:
    stop = asyncio.Event()
    setter = asyncio.create_task(_set_later(stop, 0.05))
    t0 = time.monotonic()
    assert await runtime.wait(stop, 30.0) is True
    assert time.monotonic() - t0 < 5.0
    await setter


async def test_a_timeout_returns_false_after_the_timeout() -> None:
    stop = asyncio.Event()
    t0 = time.monotonic()
    assert await runtime.wait(stop, 0.1) is False
    assert time.monotonic() - t0 >= 0.09
    assert await runtime.wait(stop, 0.0) is False and await runtime.wait(stop, -1.0) is False


async def test_a_stop_already_set_returns_at_once_and_a_wake_returns_false() -> None:
    stop, wake = asyncio.Event(), asyncio.Event()
    setter = asyncio.create_task(_set_later(wake, 0.05))
    t0 = time.monotonic()
    assert await runtime.wait(stop, 30.0, wake=wake) is False  # woken, not stopped
    assert time.monotonic() - t0 < 5.0
    await setter
    stop.set()
    assert await runtime.wait(stop, 30.0) is True


async def test_every_hands_a_failed_step_to_on_error_and_goes_on() -> None:
    stop, calls, errors = asyncio.Event(), [], []

    async def step() -> None:
        calls.append(len(calls))
        if len(calls) <= 2:
            raise ValueError(f"failure {len(calls)}")
        stop.set()

    await asyncio.wait_for(runtime.every(0.01, stop, step, on_error=errors.append), 10)
    assert len(calls) == 3
    assert [str(e) for e in errors] == ["failure 1", "failure 2"]


async def test_every_without_on_error_ends_on_a_failed_step() -> None:
    async def step() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await asyncio.wait_for(runtime.every(0.01, asyncio.Event(), step), 10)


async def test_on_error_that_re_raises_ends_the_loop() -> None:
    def fatal(e: Exception) -> None:
        if not isinstance(e, TimeoutError):
            raise e

    async def step() -> None:
        raise KeyError("not ours to retry")

    with pytest.raises(KeyError):
        await asyncio.wait_for(runtime.every(0.01, asyncio.Event(), step, on_error=fatal), 10)


async def test_a_step_over_its_timeout_is_a_timeout_error_for_on_error() -> None:
    stop, errors = asyncio.Event(), []

    async def step() -> None:
        if errors:
            stop.set()
            return
        await asyncio.sleep(30)

    await asyncio.wait_for(runtime.every(0.01, stop, step, timeout=0.05, on_error=errors.append), 10)
    assert len(errors) == 1 and isinstance(errors[0], TimeoutError)


async def test_cancellation_propagates_and_is_never_an_error() -> None:
    errors: list[Exception] = []

    async def cancelled_step() -> None:
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await runtime.every(0.01, asyncio.Event(), cancelled_step, on_error=errors.append)

    started = asyncio.Event()

    async def slow_step() -> None:
        started.set()
        await asyncio.sleep(30)

    task = asyncio.create_task(runtime.every(0.01, asyncio.Event(), slow_step, on_error=errors.append))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert errors == []


def test_jitter_stays_within_its_bounds() -> None:
    rng = random.Random(7)
    draws = [runtime.jittered(2.0, 0.25, rng) for _ in range(5000)]
    assert all(1.5 <= d <= 2.5 for d in draws)
    assert min(draws) < 1.55 and max(draws) > 2.45  # it does spread over the whole range
    assert runtime.jittered(2.0, 0.0, rng) == 2.0
    assert all(runtime.jittered(1.0, 3.0, rng) >= 0.0 for _ in range(1000))  # never a negative wait


async def test_unless_stopped_returns_the_result_or_none_at_a_stop() -> None:
    async def quick() -> int:
        return 7

    assert await runtime.unless_stopped(quick(), asyncio.Event()) == 7
    stop, cancelled = asyncio.Event(), asyncio.Event()

    async def forever() -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    setter = asyncio.create_task(_set_later(stop, 0.05))
    assert await asyncio.wait_for(runtime.unless_stopped(forever(), stop), 10) is None
    assert cancelled.is_set()
    await setter
