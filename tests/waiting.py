"""Waiting for a condition in tests: poll it until it holds or a deadline passes, never sleep a guessed time.

`wait_until(condition)` calls `condition()` until it returns something truthy and returns that value, so a
test can wait for a result and use it: `row = wait_until(lambda: fetch_row(id), what="the usage row")`.
At the deadline it raises `TimeoutError` naming what it waited for (`what` may be a callable, called
then, to show the state that never came right). `ignoring`: exception types that mean "not yet" (a server
still starting refuses connections). `async_wait_until` is the same on an event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Description = str | Callable[[], object]


def _timeout(what: Description, timeout_s: float) -> TimeoutError:
    described = what() if callable(what) else what
    return TimeoutError(f"still waiting after {timeout_s:g} s for {described}")


def wait_until(condition: Callable[[], T], *, timeout_s: float = 30.0, interval_s: float = 0.02,
               what: Description = "the condition", ignoring: tuple[type[Exception], ...] = ()) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
        except ignoring:
            result = None  # type: ignore[assignment]
        if result:
            return result
        if time.monotonic() > deadline:
            raise _timeout(what, timeout_s)
        time.sleep(interval_s)


async def async_wait_until(condition: Callable[[], T | Awaitable[T]], *, timeout_s: float = 30.0,
                           interval_s: float = 0.02, what: Description = "the condition",
                           ignoring: tuple[type[Exception], ...] = ()) -> T:
    """`condition` may be a plain function or a coroutine function."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = condition()
            if asyncio.iscoroutine(result):
                result = await result
        except ignoring:
            result = None
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise _timeout(what, timeout_s)
        await asyncio.sleep(interval_s)


RATE_WINDOW_S = 60  # platform/ratelimit/limiter.py counts requests and tokens in fixed one-minute windows


def wait_for_fresh_rate_window(margin_s: float = 20.0) -> None:
    """Wait, when needed, until the current rate-limit window has at least `margin_s` left, so that the
    requests a test counts on all fall in one window (one crossing a boundary starts from zero again)."""
    wait_until(lambda: RATE_WINDOW_S - time.time() % RATE_WINDOW_S >= margin_s, timeout_s=RATE_WINDOW_S + 1,
               interval_s=0.25, what=f"a rate-limit window with {margin_s:g} s left")
