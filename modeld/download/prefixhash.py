"""The whole-file sha256 of a download, computed in a thread over its contiguous written prefix.

A second thread starts the writeback of each finished block (``sync_file_range``), so that
syscall is off the event loop and the final fsync is short. It is not the hashing thread:
``sync_file_range`` can block while the disk's queue is full, and a pull that ends when
its hash does would wait that long too (see ``Writeback``). The hashing thread keeps a
copy of the hash state every ``stride`` bytes (a multiple of the block size, at least
``HASH_WINDOW``; at most ``MAX_STATES`` of them: about 250 bytes each, so at most about
250 KiB per download), so a repair that rewrites a block re-hashes only from the state
before it (``rehash``), not the whole file.

The hashing thread works in large windows because each call that releases the GIL (the
mapping, ``sha256.update``, the unmapping) must take it back from the event loop, which
can keep it for up to the interpreter's switch interval while it is busy in Python: with a
window per block the hash ran far slower beside a busy loop than alone, with large windows
as fast (docs/benchmarks.md#hashing-and-checksums).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Callable
from hashlib import sha256
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hashlib import _Hash

# The hashing thread maps (or, where it cannot, reads) the prefix in windows of at most this
# size, each fed to sha256 in one call.
HASH_WINDOW = 32 * 1024 * 1024
# Hash states kept at most (one every ``stride`` bytes): the stride is HASH_WINDOW rounded
# up to whole blocks, up to MAX_STATES of them (32 GiB), and a multiple of the block beyond.
MAX_STATES = 1024

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range back now, without waiting for it."""
    with contextlib.suppress(AttributeError, OSError):
        _libc.sync_file_range(
            fd, ctypes.c_longlong(offset), ctypes.c_longlong(length), _SYNC_FILE_RANGE_WRITE
        )


class _Worker:
    """A daemon thread that waits on ``cond`` for work until ``stop``."""

    def __init__(self, name: str, run: Callable[[], None]) -> None:
        self.cond = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=run, name=name, daemon=True)

    def stop(self) -> None:
        """End the thread after what it is doing now, without waiting."""
        with self.cond:
            self.stopped = True
            self.cond.notify()

    def close(self) -> None:
        """``stop`` and wait for the thread: call before the descriptor is closed."""
        self.stop()
        self.thread.join()


class Writeback(_Worker):
    """A thread that starts the writeback of finished ranges of one file (``sync_file_range``).

    Apart from the hashing thread because that call blocks while the disk's queue is full:
    made by the hashing thread, those calls held the hash back, and a pull bound by its hash
    ends that much later (docs/benchmarks.md#hashing-and-checksums).
    Ranges that wait when the thread is stopped are dropped: the install's fsync writes them.
    """

    def __init__(self, fd: int) -> None:
        super().__init__("modeld-writeback", self._run)
        self.fd = fd
        self._jobs: list[tuple[int, int]] = []
        self.thread.start()

    def add(self, start: int, length: int) -> None:
        with self.cond:
            self._jobs.append((start, length))
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._jobs and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                jobs, self._jobs = sorted(self._jobs), []
            for start, length in _coalesce(jobs):
                if self.stopped:
                    return
                start_writeback(self.fd, start, length)


class PrefixHasher(_Worker):
    """sha256 of the file's contiguous written prefix, computed in a thread while downloading.

    Its ``writeback`` thread starts the writeback of each finished block (``block_done``),
    so that syscall is off the event loop and the final fsync is short. ``sha256.update``
    releases the GIL on large buffers, so hashing runs on the other core beside the loop;
    the prefix is hashed in place from read-only mappings of the page cache (``_update``),
    a window of up to ``window`` bytes at a time.
    """

    def __init__(
        self, fd: int, size: int, block_size: int = 1024 * 1024, window: int = HASH_WINDOW
    ) -> None:
        super().__init__("modeld-hash", self._run)
        self.fd, self.size, self.window = fd, size, window
        blocks = -(-size // block_size)
        self.stride = block_size * max(-(-window // block_size), -(-blocks // MAX_STATES))
        # offset (a multiple of ``stride``) -> the hash state of the file's bytes before it
        self.states: dict[int, _Hash] = {0: sha256()}
        self.hashed = 0
        # Bytes still to hash when the last byte arrived (``last_byte``): the hash tail.
        self.tail_bytes = 0
        # CPU seconds the hashing thread used (set when it ends): for the benchmark.
        self.cpu = 0.0
        self._target = 0
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._hash = sha256()
        self._buf: memoryview | None = None  # for ``_read``, made on first use
        self._map = True  # hash from read-only mappings (``_update``) while they work
        # Held by ``rehash`` (run in a thread of the caller's) so that ``close`` waits for it.
        self._rehashing = threading.Lock()
        self.writeback = Writeback(fd)
        self.thread.start()

    def advance(self, prefix: int) -> None:
        with self.cond:
            if prefix > self._target:
                self._target = prefix
                self.cond.notify()

    def last_byte(self) -> None:
        """The download's last byte is written: note how much is left to hash."""
        with self.cond:
            self.tail_bytes = self.size - self.hashed

    def block_done(self, start: int, length: int) -> None:
        """``[start, start + length)`` is wholly written: start its writeback."""
        self.writeback.add(start, length)

    def _read(self, start: int, length: int) -> memoryview:
        if self._buf is None:  # ``length`` is at most one window
            self._buf = memoryview(bytearray(self.window))
        view = self._buf[:length]
        got = 0
        while got < length:
            n = os.preadv(self.fd, [view[got:]], start + got)
            if n <= 0:
                raise OSError(f"short read at {start + got}")
            got += n
        return view

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    while self.hashed >= self._target and not self.stopped:
                        self.cond.wait()
                    target, stop = self._target, self.stopped
                if stop:
                    return
                while self.hashed < target and not self.stopped:
                    self.hashed = self._hash_range(self._hash, self.hashed, target)
                if self.hashed >= self.size:
                    self._digest = self._hash.hexdigest()
                    return
        except BaseException as e:  # reported to the waiter in digest()
            self._error = e
        finally:
            self.cpu = time.thread_time()

    def _update(self, h: _Hash, start: int, length: int) -> None:
        """Feed ``[start, start + length)`` into ``h`` from a read-only mapping of just that
        window: sha256 reads the page cache in place, with no copy into a buffer (less CPU
        than ``pread`` + hash: docs/benchmarks.md#hashing-and-checksums).
        The window is unmapped at once, so the mapped pages never pile up in the daemon's
        RSS (one window of page-cache pages at most is mapped at a time). Where the file
        cannot be mapped, or is shorter than the window (a mapping past the end would
        fault), ``pread`` into the reused buffer."""
        if self._map:
            base = start - start % mmap.ALLOCATIONGRANULARITY
            try:
                if os.fstat(self.fd).st_size >= start + length:
                    span = start + length - base
                    with (
                        mmap.mmap(self.fd, span, offset=base, access=mmap.ACCESS_READ) as mm,
                        memoryview(mm)[start - base :] as view,
                    ):
                        h.update(view)
                    return
            except (OSError, ValueError):
                self._map = False
        h.update(self._read(start, length))

    def _hash_range(self, h: _Hash, pos: int, end: int) -> int:
        """Feed ``[pos, end)`` into ``h`` (up to the next state boundary or ``window`` bytes,
        whichever is first), keep the state at a boundary; return the new position."""
        n = min(self.window, end - pos, self.stride - pos % self.stride)
        self._update(h, pos, n)
        pos += n
        if pos % self.stride == 0 and pos < self.size:
            self.states[pos] = h.copy()
        return pos

    def rehash(self, offset: int) -> str:
        """The digest again after bytes from ``offset`` on changed: from the state kept at or
        before it (call after ``digest``; the states past ``offset`` are replaced)."""
        with self._rehashing:
            start = offset // self.stride * self.stride
            h = self.states[start].copy()
            pos = start
            while pos < self.size:
                if self.stopped:
                    raise OSError("the pull ended while its file was re-hashed")
                pos = self._hash_range(h, pos, self.size)
            return str(h.hexdigest())

    async def digest(self) -> str:
        """Wait for the whole file's digest (call after advancing to ``size``); then the
        writeback thread ends (the install's fsync writes what it left)."""
        self.advance(self.size)
        await asyncio.to_thread(self._digested)
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest

    def _digested(self) -> None:
        """Wait for the hashing thread to end, then end the writeback thread."""
        self.thread.join()
        self.writeback.close()

    def stop(self) -> None:
        """End both threads (after the window or call each is in), without waiting."""
        self.writeback.stop()
        super().stop()

    def close(self) -> None:
        """``stop`` and wait for both threads and a ``rehash`` in flight: call before the
        descriptor is closed (each ends after the window or call it is in)."""
        super().close()
        self.writeback.close()
        with self._rehashing:
            pass


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``(start, length)`` ranges with the touching ones merged: one writeback call
    for a run of blocks that finished together, not one per block."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out
