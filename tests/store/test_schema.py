"""Tests for modeld.store.schema: the migrations keyed by ``PRAGMA user_version``."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import pytest

from modeld.download.journal import SqliteJournal
from modeld.errors import StateTooNew
from modeld.store.schema import MIGRATIONS, SCHEMA_VERSION, connect_db, migrate, user_version
from modeld.store.store import Store

FIXTURES = Path(__file__).parent / "fixtures"
D1, D2 = "a" * 64, "b" * 64


def _state_dir(home: Path, dump: str) -> Path:
    """A state dir whose index is the fixture ``dump`` (an older version's db) with its blobs."""
    (home / "blobs").mkdir(parents=True)
    (home / "blobs" / f"sha256-{D1}").write_bytes(b"x" * 12)
    (home / "blobs" / f"sha256-{D2}").write_bytes(b"y" * 34)
    conn = sqlite3.connect(home / "modeld.db")
    conn.executescript((FIXTURES / dump).read_text())
    conn.close()
    return home / "modeld.db"


def _columns(path: Path) -> dict[str, list[tuple[str, str, int, int]]]:
    """Each table's columns as (name, type, not null, pk): the schema, whatever its DDL text."""
    conn = sqlite3.connect(path)
    try:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"
            )
        ]
        return {
            t: [(r[1], r[2], r[3], r[5]) for r in conn.execute(f"PRAGMA table_info({t})")]
            for t in tables
        }
    finally:
        conn.close()


@pytest.mark.parametrize("dump", ["state-v1.sql", "state-v2.sql"])
async def test_an_older_index_migrates_and_keeps_its_rows(tmp_path: Path, dump: str) -> None:
    """A db written by an earlier schema (version 1 as at the first release, 2 as before the
    migrations) opens, is brought to the current version, and keeps every row."""
    db = _state_dir(tmp_path / "home", dump)
    found = user_version(sqlite3.connect(db))
    assert found < SCHEMA_VERSION
    store = Store(tmp_path / "home")
    await store.open()
    try:
        tiny = await store.installed("tiny")
        assert tiny is not None
        assert (tiny.digest, tiny.size, tiny.verified_by, tiny.last_used) == (
            D1,
            12,
            "registry sha256",
            1.75e9,
        )
        other = await store.installed("other")
        assert other is not None and not other.verified
        assert await store.measured_memory(D1, "main=cpu", 256) == 123456
        # A probe from before the probe details is kept, shown, and not trusted.
        old = (await store.probes(D1))["gpu"]
        assert (old["ok"], old["reason"], old["current"], old["adapter"]) == (
            False,
            "no adapter",
            False,
            None,
        )
        assert [e["kind"] for e in await store.events()] == ["installed"]
        journal = await SqliteJournal(store).load("dl1")
        assert journal is not None and journal.size == 12 and 0 in journal.blocks
        if dump == "state-v2.sql":
            assert list(await store.image_probes(D1)) == ["main=cpu,vision=cpu"]
    finally:
        await store.close()
    assert user_version(sqlite3.connect(db)) == SCHEMA_VERSION


async def test_migrated_and_fresh_indexes_have_one_schema(tmp_path: Path) -> None:
    """Whichever version a db started from, after opening its tables are those of a new db."""
    fresh = Store(tmp_path / "fresh")
    await fresh.open()
    await fresh.close()
    want = _columns(fresh.db_path)
    assert {"installed", "vouched", "download_journal", "download_blocks"} <= set(want)
    for dump in ("state-v1.sql", "state-v2.sql"):
        home = tmp_path / dump
        db = _state_dir(home, dump)
        store = Store(home)
        await store.open()
        await store.close()
        assert _columns(db) == want, dump


def test_each_step_commits_with_its_version(tmp_path: Path) -> None:
    """A step that fails rolls back with its version bump: the file stays at the last whole
    version, and the next open applies the rest."""
    path = _state_dir(tmp_path / "home", "state-v1.sql")
    conn = connect_db(path)
    # An index named like version 3's new table (one namespace in SQLite): step 3 fails.
    conn.execute("CREATE INDEX vouched ON installed (digest)")
    with pytest.raises(sqlite3.OperationalError, match="vouched"):
        migrate(conn, path)
    assert user_version(conn) == 2  # step 2 committed, step 3 did not
    assert "adapter" in [c[0] for c in _columns(path)["probes"]]
    conn.execute("DROP INDEX vouched")
    assert migrate(conn, path) == (2, SCHEMA_VERSION)
    conn.close()
    assert len(MIGRATIONS) == SCHEMA_VERSION


async def test_an_index_from_a_newer_modeld_is_refused_untouched(tmp_path: Path) -> None:
    """A db whose version this code does not know stops the open with a message that says
    what to do, and the file is not written to (not even switched to WAL)."""
    home = tmp_path / "home"
    home.mkdir()
    db = home / "modeld.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE installed (id TEXT PRIMARY KEY, future TEXT)")
    conn.execute("INSERT INTO installed VALUES ('tiny', 'x')")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    conn.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    mtime = db.stat().st_mtime_ns
    store = Store(home)
    with pytest.raises(StateTooNew) as info:
        await store.open()
    await store.close()
    assert f"schema version {SCHEMA_VERSION + 1}" in info.value.message
    assert "newer modeld" in info.value.message
    assert info.value.code == "state_too_new"
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before
    assert db.stat().st_mtime_ns == mtime
    assert not (home / "modeld.db-wal").exists()
