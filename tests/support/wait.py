"""Waiting on a state with a deadline, instead of sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


async def until(
    cond: Callable[[], Awaitable[Any]], limit: float = 10.0, every: float = 0.05
) -> None:
    """Poll the async ``cond`` every ``every`` seconds until it is true; fail after ``limit``
    seconds."""
    started = time.monotonic()
    while not await cond():
        if time.monotonic() - started > limit:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(every)


async def wait_until(cond: Callable[[], bool], limit: float = 10.0) -> None:
    """Let the event loop run until the plain ``cond`` is true; fail after ``limit`` seconds."""
    started = time.monotonic()
    while not cond():
        if time.monotonic() - started > limit:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def wait_sync(cond: Callable[[], bool], limit: float = 10.0, what: str = "condition") -> None:
    """Block until the plain ``cond`` is true; fail after ``limit`` seconds (sync tests)."""
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met in {limit:g} s")
        time.sleep(0.05)


def process_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (gone, or a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # The state follows the command name in parentheses, which may itself hold spaces.
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
