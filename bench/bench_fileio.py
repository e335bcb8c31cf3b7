"""File I/O from asyncio: the downloader's ``pwrite`` from the loop against aiofiles and threads.

(1) Writes ``--size`` at offsets in 1 MiB slices from 8 concurrent tasks, as the piece engine
does: ``os.pwrite`` straight from the event loop (what ``modeld.download.fetch`` does);
``asyncio.to_thread(os.pwrite)`` on the same buffer; the same on a copy (what the fetcher would
need, since its receive buffer is reused once the sink returns); and aiofiles' seek+write with
one handle per task (aiofiles has no pwrite, and a shared handle's seek+write would race).
(2) Re-hashes the file with sha256 (what ``verify`` does): one thread reading 1 MiB at a time,
against aiofiles' reads with the hash on the loop.

Prints the median wall time and the process's CPU seconds (all threads) per way. Put the file
on tmpfs (the default, /dev/shm) to leave the disk's writeback out of it.

    python bench/bench_fileio.py [--size-mib 512] [--runs 5] [--path /dev/shm/x]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiofiles

CHUNK = 1024 * 1024
TASKS = 8


async def _tasks(size: int, write: Callable[[int], Awaitable[None]]) -> None:
    per = size // TASKS

    async def one(k: int) -> None:
        for off in range(k * per, (k + 1) * per, CHUNK):
            await write(off)

    await asyncio.gather(*(one(k) for k in range(TASKS)))


async def loop_pwrite(path: Path, size: int, buf: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:

        async def w(off: int) -> None:
            os.pwrite(fd, buf, off)
            await asyncio.sleep(0)  # let the other tasks in, as a socket read would

        await _tasks(size, w)
    finally:
        os.close(fd)


async def thread_pwrite(path: Path, size: int, buf: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:

        async def w(off: int) -> None:
            await asyncio.to_thread(os.pwrite, fd, buf, off)

        await _tasks(size, w)
    finally:
        os.close(fd)


async def thread_pwrite_copy(path: Path, size: int, buf: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    view = memoryview(bytearray(buf))
    try:

        async def w(off: int) -> None:
            await asyncio.to_thread(os.pwrite, fd, bytes(view), off)

        await _tasks(size, w)
    finally:
        os.close(fd)


async def aiofiles_seek_write(path: Path, size: int, buf: bytes) -> None:
    per = size // TASKS

    async def one(k: int) -> None:
        async with aiofiles.open(path, "r+b") as f:
            for off in range(k * per, (k + 1) * per, CHUNK):
                await f.seek(off)
                await f.write(buf)

    await asyncio.gather(*(one(k) for k in range(TASKS)))


def _rehash_thread(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


async def rehash_thread(path: Path, _size: int, _buf: bytes) -> None:
    await asyncio.to_thread(_rehash_thread, path)


async def rehash_aiofiles(path: Path, _size: int, _buf: bytes) -> None:
    h = hashlib.sha256()
    async with aiofiles.open(path, "rb", buffering=0) as f:
        while b := await f.read(CHUNK):
            h.update(b)


WAYS: dict[str, Callable[[Path, int, bytes], Awaitable[None]]] = {
    "write: pwrite from the loop (modeld)": loop_pwrite,
    "write: to_thread(pwrite), same buffer": thread_pwrite,
    "write: to_thread(pwrite) of a copy": thread_pwrite_copy,
    "write: aiofiles seek+write": aiofiles_seek_write,
    "re-hash: one thread (modeld)": rehash_thread,
    "re-hash: aiofiles reads, sha256 on the loop": rehash_aiofiles,
}


async def run(path: Path, size: int, runs: int) -> None:
    buf = os.urandom(CHUNK)
    took: dict[str, list[tuple[float, float]]] = {name: [] for name in WAYS}
    with path.open("wb") as f:
        f.truncate(size)
    for _ in range(runs):  # interleaved, so the load of a shared machine hits every way alike
        for name, way in WAYS.items():
            wall, cpu = time.perf_counter(), time.process_time()
            await way(path, size, buf)
            took[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{size // CHUNK} MiB in 1 MiB slices, {TASKS} tasks, {runs} interleaved runs, medians")
    for name, rows in took.items():
        wall_s = statistics.median(r[0] for r in rows)
        cpu_s = statistics.median(r[1] for r in rows)
        print(f"  {name:45s} {wall_s:6.3f} s   {cpu_s:5.2f} CPU-s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--path", type=Path, default=Path("/dev/shm") / f"modeld-fileio-{os.getpid()}")
    a = ap.parse_args()
    try:
        asyncio.run(run(a.path, a.size_mib * CHUNK, a.runs))
    finally:
        a.path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
