"""The prefix hasher keeps hash states at block boundaries, bounded, for a cheap re-hash."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from modeld.download import prefixhash
from modeld.download.prefixhash import (
    HASH_WINDOW,
    MAX_STATES,
    PrefixHasher,
    Writeback,
    _coalesce,
)
from tests.support.wait import wait_until


async def test_rehash_from_a_changed_block_matches_a_full_hash(short_tmp: Path) -> None:
    """States are kept every ``stride`` bytes (at most MAX_STATES+1 of them, whatever the
    file's block count); after a byte changes, ``rehash`` from its offset gives the whole
    file's new sha256, and again after a second change further back. (A window of one
    block, so the block count, not the window, sets the stride.)"""
    block = 16
    size = 100_000 + 7  # 6251 blocks of 16 bytes: more than MAX_STATES
    data = bytearray(random.Random(3).randbytes(size))
    path = short_tmp / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        hasher = PrefixHasher(fd, size, block, window=block)
        assert hasher.stride % block == 0 and hasher.stride > block
        assert await hasher.digest() == hashlib.sha256(data).hexdigest()
        assert len(hasher.states) <= MAX_STATES + 1
        assert all(offset % hasher.stride == 0 for offset in hasher.states)
        for offset in (70_001, 5):  # later first: the states past 5 were replaced since
            data[offset] ^= 0xFF
            os.pwrite(fd, bytes(data[offset : offset + 1]), offset)
            assert hasher.rehash(offset) == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


async def test_one_state_per_window_for_a_small_file(short_tmp: Path) -> None:
    """Up to MAX_STATES windows, a state is kept at every window boundary (the window
    rounded up to whole blocks), and the default window is HASH_WINDOW."""
    size = 10 * 1024 + 3
    data = random.Random(4).randbytes(size)
    path = short_tmp / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher = PrefixHasher(fd, size, 1024, window=2000)
        assert await hasher.digest() == hashlib.sha256(data).hexdigest()
        assert sorted(hasher.states) == [i * 2048 for i in range(6)]
        for block, stride in ((1024, HASH_WINDOW), (3 * 1024 * 1024, 33 * 1024 * 1024)):
            other = PrefixHasher(fd, size, block)
            other.stop()
            assert other.stride == stride
    finally:
        os.close(fd)


if TYPE_CHECKING:
    from hashlib import _Hash


def test_touching_writeback_ranges_are_merged_into_one_call() -> None:
    """Blocks that finished together start their writeback in one call per run of them."""
    assert _coalesce([(0, 4), (4, 4), (12, 4), (16, 2), (30, 1)]) == [(0, 8), (12, 6), (30, 1)]
    assert _coalesce([]) == []


async def test_a_file_shorter_than_the_hash_window_fails_with_an_error_not_a_fault(
    short_tmp: Path,
) -> None:
    """The hasher maps each window read-only; a window past the file's end (the file cut
    short under it) is read with ``pread`` instead, which fails with an error the pull
    reports: a mapping would have faulted (SIGBUS) and killed the daemon."""
    data = random.Random(5).randbytes(3 * 4096 + 11)
    path = short_tmp / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        assert await PrefixHasher(fd, len(data), 4096).digest() == hashlib.sha256(data).hexdigest()
        os.ftruncate(fd, 4096)
        with pytest.raises(OSError, match="short read"):
            await PrefixHasher(fd, len(data), 4096).digest()
    finally:
        os.close(fd)


def _random_file(short_tmp: Path, seed: int, size: int) -> tuple[bytes, int]:
    """``size`` random bytes in a file, and a read-only descriptor of it."""
    data = random.Random(seed).randbytes(size)
    path = short_tmp / "f"
    path.write_bytes(data)
    return data, os.open(path, os.O_RDONLY)


def _slow_windows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each window the hasher feeds takes 20 ms longer; returns the windows' starts."""
    starts: list[int] = []
    update = PrefixHasher._update

    def slow_update(self: PrefixHasher, h: _Hash, start: int, length: int) -> None:
        starts.append(start)
        time.sleep(0.02)
        update(self, h, start, length)

    monkeypatch.setattr(PrefixHasher, "_update", slow_update)
    return starts


def _fake_writeback(
    monkeypatch: pytest.MonkeyPatch, *held: int
) -> tuple[list[tuple[int, int]], dict[int, threading.Event]]:
    """``start_writeback`` replaced: each call is recorded, and a call at a ``held`` offset
    blocks until that offset's event is set (as the real one blocks on a full disk queue)."""
    calls: list[tuple[int, int]] = []
    events = {offset: threading.Event() for offset in held}

    def fake(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        if offset in events:
            events[offset].wait(30)

    monkeypatch.setattr(prefixhash, "start_writeback", fake)
    return calls, events


async def test_the_hash_goes_on_while_a_writeback_call_blocks(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sync_file_range`` blocks while the disk's queue is full: the hash is not held
    back by it (the writeback has its own thread), and the digest waits for the call in
    flight before it returns, so no call is ever made on a descriptor closed after it."""
    calls, held = _fake_writeback(monkeypatch, 0)
    block = 4096
    data, fd = _random_file(short_tmp, 6, 8 * block)
    try:
        hasher = PrefixHasher(fd, len(data), block)
        for i in range(8):
            hasher.block_done(i * block, block)
            hasher.advance((i + 1) * block)
        await wait_until(lambda: bool(calls))  # the first call is in flight, and blocks
        waiting = asyncio.ensure_future(hasher.digest())
        await wait_until(lambda: hasher.hashed == len(data))
        assert hasher.hashed == len(data)  # all hashed while the first call still blocks
        assert calls[0][0] == 0
        assert not waiting.done()  # the digest waits for that call
        held[0].set()
        assert await waiting == hashlib.sha256(data).hexdigest()
        assert not hasher.writeback.thread.is_alive()
    finally:
        os.close(fd)


async def test_writeback_merges_what_waits_and_drops_it_when_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ranges that wait while a call is in flight go in the next one, merged where they
    touch; what still waits when the thread is stopped is dropped (the fsync writes it)."""
    calls, held = _fake_writeback(monkeypatch, 0, 50)
    wb = Writeback(-1)
    wb.add(0, 10)
    await wait_until(lambda: len(calls) == 1)
    wb.add(20, 10)
    wb.add(10, 10)
    wb.add(40, 5)
    held[0].set()
    await wait_until(lambda: len(calls) == 3)
    assert calls == [(0, 10), (10, 20), (40, 5)]
    wb.add(50, 5)
    await wait_until(lambda: len(calls) == 4)
    wb.add(60, 5)  # waits behind the blocked call, then is dropped
    wb.stop()
    held[50].set()
    await asyncio.to_thread(wb.close)
    assert calls == [(0, 10), (10, 20), (40, 5), (50, 5)]


def test_close_ends_the_hash_mid_backlog(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed pull closes the hasher before its descriptor: the hashing thread stops
    after the window it is in, not after everything the prefix had released."""
    block = 4096
    data, fd = _random_file(short_tmp, 7, 64 * block)
    _slow_windows(monkeypatch)
    try:
        hasher = PrefixHasher(fd, len(data), block, window=block)
        hasher.advance(len(data))
        deadline = time.monotonic() + 5
        while hasher.hashed == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        hasher.close()
        assert 0 < hasher.hashed < len(data) // 2
        assert not hasher.thread.is_alive() and not hasher.writeback.thread.is_alive()
    finally:
        os.close(fd)


async def test_close_waits_for_a_rehash_and_ends_it(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repair's re-hash runs in a thread of its own: closing the hasher (the pull
    ended) stops it after its window and waits for it, and it says why it stopped."""
    block = 4096
    data, fd = _random_file(short_tmp, 8, 64 * block)
    try:
        hasher = PrefixHasher(fd, len(data), block, window=block)
        assert await hasher.digest() == hashlib.sha256(data).hexdigest()
        windows = _slow_windows(monkeypatch)
        rehash = asyncio.ensure_future(asyncio.to_thread(hasher.rehash, 0))
        await wait_until(lambda: bool(windows))
        await asyncio.to_thread(hasher.close)
        seen = len(windows)
        with pytest.raises(OSError, match="pull ended"):
            await rehash
        assert 0 < seen < 32 and len(windows) == seen  # nothing after close returned
    finally:
        os.close(fd)
