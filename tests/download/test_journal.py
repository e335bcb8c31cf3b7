"""The download journal on the store's SQLite writer: blocks reach the db without a loop turn."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from modeld.download.journal import Block, JournalState, SqliteJournal
from modeld.store.store import Store
from tests.support.wait import wait_sync

BS = 64 * 1024


def journaled(db: Path, key: str) -> set[int]:
    with contextlib.closing(sqlite3.connect(db)) as c:
        rows = c.execute("SELECT idx FROM download_blocks WHERE key = ?", (key,))
        return {int(r[0]) for r in rows}


async def test_a_recorded_block_is_written_without_a_turn_of_the_loop(short_tmp: Path) -> None:
    """``record`` hands a finished block to the writer thread at once: the row is in the db
    while the event loop is still blocked (what a kill -9 right after a block relies on),
    and blocks recorded meanwhile go in together; ``flush`` waits for them."""
    async with Store(short_tmp) as store:
        journal = SqliteJournal(store)
        await journal.begin("m1", JournalState(10 * BS, BS, None))
        journal.record("m1", [Block(3, 0xABC, "a")])
        # No await: this blocks the event loop thread while the writer thread works.
        wait_sync(lambda: journaled(store.db_path, "m1") == {3}, what="block 3 journaled")
        journal.record("m1", [Block(4, 1, "a")])
        journal.record("m1", [Block(5, 2, "b")])
        await journal.flush("m1")
        assert journaled(store.db_path, "m1") == {3, 4, 5}
        state = await journal.load("m1")
        assert state is not None and state.blocks[5] == Block(5, 2, "b")
        await journal.clear("m1")
        assert journaled(store.db_path, "m1") == set()


async def test_flush_raises_a_failed_write(short_tmp: Path) -> None:
    """A block row that cannot be written (no journal row for its key) fails the flush."""
    async with Store(short_tmp) as store:
        journal = SqliteJournal(store)
        journal.record("nobody", [Block(0, 1, "a")])
        with pytest.raises(sqlite3.IntegrityError):
            await journal.flush("nobody")
        await journal.flush("nobody")  # the error is reported once


async def test_a_mark_is_kept_with_its_length_until_its_block_is_whole(short_tmp: Path) -> None:
    """A block in flight is journaled in part (its first bytes and their CRC-32); loaded back
    with its length, and replaced by the whole block once that is recorded."""
    async with Store(short_tmp) as store:
        journal = SqliteJournal(store)
        await journal.begin("m1", JournalState(10 * BS, BS, None, blocks={0: Block(0, 7, "a")}))
        journal.record("m1", [Block(1, 0x11, "a", 4096), Block(2, 0x22, "b", 100)])
        journal.record("m1", [Block(1, 0x33, "a")])  # block 1 is whole now
        await journal.flush("m1")
        state = await journal.load("m1")
        assert state is not None
        assert state.blocks == {
            0: Block(0, 7, "a"),
            1: Block(1, 0x33, "a"),
            2: Block(2, 0x22, "b", 100),
        }
        # A resume begins again with what it kept, marks included.
        await journal.begin("m1", state)
        assert await journal.load("m1") == state
