"""Waiting on a state with a deadline, instead of sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(cond: Callable[[], Awaitable[Any]], limit: float = 10.0) -> None:
    """Poll the async ``cond`` until it is true; fail after ``limit`` seconds."""
    started = time.monotonic()
    while not await cond():
        if time.monotonic() - started > limit:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def wait_until(cond: Callable[[], bool], limit: float = 10.0) -> None:
    """Let the event loop run until the plain ``cond`` is true; fail after ``limit`` seconds."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > limit:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)
