"""A process's memory from /proc, and the page cache of files: for real-size tests and benches."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from modeld.client import AsyncClient


def rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup``'s fields (Rss, Pss, Pss_Anon, Pss_File, ...) in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def fadvise_dontneed(paths: list[Path]) -> None:
    """Drop the clean page-cache pages of every file under ``paths`` (files or folders)."""
    for p in paths:
        for f in [p] if p.is_file() else [x for x in p.rglob("*") if x.is_file()]:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@contextlib.asynccontextmanager
async def pss_sampler(c: AsyncClient, every: float = 0.2) -> AsyncIterator[list[int]]:
    """The largest sum of a daemon's runners' PSS (spare included) seen while the block
    runs, sampled from /proc every ``every`` seconds; ``[0]`` of the yielded list."""
    seen = [0]
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            doc = await c.request("GET", "/api/engines")
            pids = [e["pid"] for e in doc["engines"] if e["pid"]]
            if doc["spare"]["pid"]:
                pids.append(doc["spare"]["pid"])
            total = 0
            for pid in pids:
                with contextlib.suppress(OSError):
                    total += rollup(pid)["Pss"]
            seen[0] = max(seen[0], total)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await stop.wait()

    task = asyncio.ensure_future(sample())
    try:
        yield seen
    finally:
        stop.set()
        await task
