"""The download journal: which blocks of a partial file are written, with their checksum.

A block (``BLOCK_SIZE``, 1 MiB) is journaled once every byte of it is written, and the
blocks in flight are journaled in part as they go (marks: the first bytes of a block and
their CRC-32); on restart each journaled block or mark is re-read and its CRC-32 checked
before it is trusted, so a kill -9 or a power loss costs at most what came since the last
marks (a resumed journal keeps the block size it was started with). CRC-32 rather than
sha256, the faster of the two (docs/benchmarks.md#hashing-and-checksums), because it is
computed for every byte beside the whole-file sha256, which is what makes a download
*verified*.

``record`` is called on the event loop as each block finishes and hands the block to the
writer at once, without waiting for a turn of the loop (a busy loop's turn is long, and a
kill -9 lost every block finished meanwhile: docs/benchmarks.md#journal-writes); ``flush``
waits for it.

``Journal`` is a protocol so the downloader does not need the store: tests use
``MemoryJournal``; the daemon uses ``SqliteJournal`` on the store's single writer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

BLOCK_SIZE = 1024 * 1024

T = TypeVar("T")


@dataclass(frozen=True)
class Block:
    """A journaled block: its index, CRC-32 of its bytes, and the mirror host that sent them.

    ``length``: a partial block (a mark of a piece in flight), the first ``length`` bytes of
    it, which ``crc`` covers; None for the whole block. A later row for the same block
    replaces it (the whole block, once it is finished).
    """

    index: int
    crc: int
    mirror: str
    length: int | None = None


@dataclass
class JournalState:
    """What a journal remembers about one partial download."""

    size: int
    block_size: int
    expected: str | None  # the sha256 the download aims at, when known
    etags: dict[str, str] = field(default_factory=dict)  # mirror URL → strong ETag
    blocks: dict[int, Block] = field(default_factory=dict)


class Journal(Protocol):
    async def load(self, key: str) -> JournalState | None: ...
    async def begin(self, key: str, state: JournalState) -> None: ...
    def record(self, key: str, blocks: list[Block]) -> None:
        """Journal finished blocks soon, in order, without waiting (``flush`` waits)."""

    async def flush(self, key: str) -> None:
        """Wait until every block recorded so far is written; raise a failed write's error."""

    async def forget(self, key: str, indexes: list[int]) -> None: ...
    async def clear(self, key: str) -> None: ...


class MemoryJournal:
    """A journal kept in memory (tests, and downloads outside a daemon)."""

    def __init__(self) -> None:
        self.states: dict[str, JournalState] = {}

    async def load(self, key: str) -> JournalState | None:
        state = self.states.get(key)
        if state is None:
            return None
        return JournalState(
            state.size, state.block_size, state.expected, dict(state.etags), dict(state.blocks)
        )

    async def begin(self, key: str, state: JournalState) -> None:
        self.states[key] = JournalState(
            state.size, state.block_size, state.expected, dict(state.etags), dict(state.blocks)
        )

    def record(self, key: str, blocks: list[Block]) -> None:
        for b in blocks:
            self.states[key].blocks[b.index] = b

    async def flush(self, key: str) -> None:
        return

    async def forget(self, key: str, indexes: list[int]) -> None:
        for i in indexes:
            self.states[key].blocks.pop(i, None)

    async def clear(self, key: str) -> None:
        self.states.pop(key, None)


def journal_keys(conn: sqlite3.Connection) -> set[str]:
    """The models with a journaled download, read inside the caller's transaction (``prune``
    reads them with the ``installed`` rows, as one snapshot)."""
    # The tables come with the schema migrations; a database not yet migrated has none.
    exists = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'download_journal'"
    ).fetchone()
    if exists is None:
        return set()
    return {str(r[0]) for r in conn.execute("SELECT key FROM download_journal")}


class _Store(Protocol):
    def write(
        self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True
    ) -> Awaitable[T]: ...
    def submit(
        self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True
    ) -> asyncio.Future[T]: ...
    def read(self, fn: Callable[[sqlite3.Connection], T]) -> Awaitable[T]: ...


class SqliteJournal:
    """The journal in the store's SQLite database: its tables ``download_journal`` and
    ``download_blocks`` are part of the store's schema (modeld.store.schema).

    Block rows are committed without waiting for an fsync (``durable=False``): during a
    download the WAL's fsync also flushed the partial's dirty pages and took long
    (docs/benchmarks.md#journal-writes). A row
    that a power cut rolls back costs a re-fetch; one that outlives its bytes fails the CRC-32
    re-check (the partial's bytes are not fsynced before the install either).
    """

    def __init__(self, store: _Store) -> None:
        self.store = store
        # Blocks recorded and not yet written, per key. A key is in ``_queued`` while a
        # transaction that will write them is queued: the writer thread takes, when it runs
        # it, everything recorded until then (one transaction for all that came meanwhile).
        self._lock = threading.Lock()
        self._blocks: dict[str, list[Block]] = {}
        self._queued: set[str] = set()
        self._last: dict[str, asyncio.Future[None]] = {}

    async def load(self, key: str) -> JournalState | None:

        def q(c: sqlite3.Connection) -> JournalState | None:
            row = c.execute(
                "SELECT size, block_size, expected, etags FROM download_journal WHERE key = ?",
                (key,),
            ).fetchone()
            if row is None:
                return None
            state = JournalState(int(row[0]), int(row[1]), row[2], json.loads(row[3]))
            for idx, crc, mirror, length in c.execute(
                "SELECT idx, crc, mirror, length FROM download_blocks WHERE key = ?", (key,)
            ):
                part = None if length is None else int(length)
                state.blocks[int(idx)] = Block(int(idx), int(crc), str(mirror), part)
            return state

        return await self.store.read(q)

    async def begin(self, key: str, state: JournalState) -> None:

        def w(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM download_blocks WHERE key = ?", (key,))
            c.execute(
                "INSERT OR REPLACE INTO download_journal (key, size, block_size, expected, etags)"
                " VALUES (?, ?, ?, ?, ?)",
                (key, state.size, state.block_size, state.expected, json.dumps(state.etags)),
            )
            c.executemany(
                "INSERT INTO download_blocks (key, idx, crc, mirror, length) VALUES (?,?,?,?,?)",
                [(key, b.index, b.crc, b.mirror, b.length) for b in state.blocks.values()],
            )

        await self.store.write(w)

    def record(self, key: str, blocks: list[Block]) -> None:
        with self._lock:
            self._blocks.setdefault(key, []).extend(blocks)
            if key in self._queued:
                return  # the transaction queued for this key writes them too
            self._queued.add(key)
        fut = self.store.submit(functools.partial(self._write_blocks, key), durable=False)
        fut.add_done_callback(_seen)
        self._last[key] = fut

    def _write_blocks(self, key: str, c: sqlite3.Connection) -> None:
        """On the writer thread: every block recorded for ``key`` until now."""
        with self._lock:
            self._queued.discard(key)
            blocks = self._blocks.pop(key, [])
        # In the order recorded: a block's mark, then the block once finished.
        c.executemany(
            "INSERT OR REPLACE INTO download_blocks (key, idx, crc, mirror, length)"
            " VALUES (?,?,?,?,?)",
            [(key, b.index, b.crc, b.mirror, b.length) for b in blocks],
        )

    async def flush(self, key: str) -> None:
        while (fut := self._last.get(key)) is not None:
            try:
                await asyncio.shield(fut)  # a cancelled caller must not cancel the write
            finally:
                if self._last.get(key) is fut:
                    del self._last[key]

    async def forget(self, key: str, indexes: list[int]) -> None:
        await self.store.write(
            lambda c: c.executemany(
                "DELETE FROM download_blocks WHERE key = ? AND idx = ?",
                [(key, i) for i in indexes],
            ),
            durable=False,
        )

    async def clear(self, key: str) -> None:

        def w(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM download_blocks WHERE key = ?", (key,))
            c.execute("DELETE FROM download_journal WHERE key = ?", (key,))

        with self._lock:
            self._blocks.pop(key, None)  # recorded after the last flush: not wanted any more
        await self.store.write(w)


def _seen(fut: asyncio.Future[None]) -> None:
    """Mark a write's error as retrieved: ``flush`` raises it, but a job that failed before
    its flush must not log "Future exception was never retrieved"."""
    if not fut.cancelled():
        fut.exception()
