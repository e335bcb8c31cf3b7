"""The prefix hasher keeps hash states at block boundaries, bounded, for a cheap re-hash."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import pytest

from modeld.download.prefixhash import HASH_WINDOW, MAX_STATES, PrefixHasher, _coalesce


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
