"""Tests for modeld.store.store: layout, the single writer, installs, scans, verify, records."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modeld.errors import BadRequest, IntegrityError, ModelNotInstalled
from modeld.store.store import Store, sha256_file
from modeld.store.vouches import Vouch
from tests.support.state import MODELS, install_fixture

TINY = MODELS / "tiny-text.litertlm"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = Store(tmp_path / "home")
    await s.open()
    yield s
    await s.close()


def _stage(store: Store, data: bytes, name: str = "dl") -> tuple[Path, str, int]:
    src = store.partial_dir / name
    src.write_bytes(data)
    return src, hashlib.sha256(data).hexdigest(), len(data)


async def test_open_creates_layout_and_wal_db(store: Store) -> None:
    """``open`` makes blobs/, partial/, cache/ and a WAL-mode db with every table."""
    for d in ("blobs", "partial", "cache"):
        assert (store.home / d).is_dir()
    conn = sqlite3.connect(store.db_path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"installed", "memory", "probes", "image_probes", "events"} <= tables
    conn.close()


async def test_image_probes_table_is_added_to_an_older_state_dir(tmp_path: Path) -> None:
    """A db from before the image probes opens, gains the table, and keeps one row per plan."""
    home = tmp_path / "home"
    first = Store(home)
    await first.open()
    await first.close()
    with sqlite3.connect(home / "modeld.db") as conn:
        conn.execute("DROP TABLE image_probes")
        conn.execute("PRAGMA user_version = 1")  # as the version before the table
    store = Store(home)
    await store.open()
    try:
        digest = "ab" * 32
        await store.record_image_probe(
            digest,
            "main=cpu,vision=cpu,audio=none",
            ok=False,
            stage="image",
            reason="Embedding Lookup: index out of bounds",
            signal=None,
            seconds=0.3,
        )
        await store.record_image_probe(
            digest,
            "main=gpu,vision=gpu,audio=none",
            ok=True,
            stage=None,
            reason=None,
            signal=None,
            seconds=0.8,
        )
        rows = await store.image_probes(digest)
    finally:
        await store.close()
    assert set(rows) == {"main=cpu,vision=cpu,audio=none", "main=gpu,vision=gpu,audio=none"}
    failed = rows["main=cpu,vision=cpu,audio=none"]
    assert (failed["ok"], failed["stage"], failed["seconds"]) == (False, "image", 0.3)
    assert failed["reason"] == "Embedding Lookup: index out of bounds"
    assert rows["main=gpu,vision=gpu,audio=none"]["ok"] is True


async def test_install_moves_file_into_blobs_read_only(store: Store) -> None:
    """A new blob is renamed to blobs/sha256-<hex>, made read-only, and indexed."""
    src, digest, size = _stage(store, b"hello model")
    inst = await store.install("m", src, digest, size, "registry sha256")
    assert inst.path == store.blobs_dir / f"sha256-{digest}"
    assert inst.path.read_bytes() == b"hello model"
    assert not src.exists()
    assert stat.S_IMODE(inst.path.stat().st_mode) == 0o444
    again = await store.installed("m")
    assert again is not None
    assert (again.digest, again.size, again.verified) == (digest, size, True)
    assert [i.model_id for i in await store.list_installed()] == ["m"]


async def test_install_copies_from_another_place(store: Store, tmp_path: Path) -> None:
    """A source outside partial/ is still installed (renamed or copied), never half."""
    src = tmp_path / "elsewhere.bin"
    src.write_bytes(b"x" * 1000)
    inst = await store.install("m", src, hashlib.sha256(b"x" * 1000).hexdigest(), 1000, None)
    assert inst.path.stat().st_size == 1000
    assert not inst.verified


async def test_install_with_wrong_size_leaves_no_row(store: Store) -> None:
    """A size mismatch raises IntegrityError; nothing is installed and the source stays."""
    src, digest, _ = _stage(store, b"abc")
    with pytest.raises(IntegrityError):
        await store.install("m", src, digest, 4, None)
    assert await store.installed("m") is None
    assert src.exists()
    assert list(store.blobs_dir.iterdir()) == []


async def test_reinstall_drops_the_unused_old_blob(store: Store) -> None:
    """Installing a new file for an id removes the old blob unless another id uses it."""
    src, d1, n1 = _stage(store, b"one")
    await store.install("a", src, d1, n1, None)
    src, _, _ = _stage(store, b"one")
    await store.install("b", src, d1, n1, None)
    src, d2, n2 = _stage(store, b"two")
    await store.install("a", src, d2, n2, None)
    assert store.blob_path(d1).exists()  # still b's
    src, d3, n3 = _stage(store, b"three")
    await store.install("b", src, d3, n3, None)
    assert not store.blob_path(d1).exists()
    assert store.blob_path(d2).exists()


async def test_remove_deletes_row_blob_and_cache(store: Store) -> None:
    """``remove`` drops the row, the blob and its cache dir; unknown ids raise."""
    src, digest, size = _stage(store, b"data")
    await store.install("m", src, digest, size, None)
    cache = store.cache_dir_for(digest)
    cache.mkdir()
    (cache / "x.bin").write_bytes(b"c")
    await store.remove("m")
    assert await store.installed("m") is None
    assert not store.blob_path(digest).exists()
    assert not cache.exists()
    with pytest.raises(ModelNotInstalled):
        await store.remove("m")


@pytest.mark.parametrize("bad", ["../etc", "A" * 64, "a" * 63, "a" * 64 + "/x", ""])
async def test_blob_path_refuses_non_digests(store: Store, bad: str) -> None:
    """A string that is not 64 lowercase hex digits never becomes a path."""
    with pytest.raises(BadRequest):
        store.blob_path(bad)
    with pytest.raises(BadRequest):
        store.cache_dir_for(bad)


async def test_writes_are_serialized(store: Store) -> None:
    """Concurrent read-modify-write transactions never lose an update (one writer)."""
    await store.write(lambda c: c.execute("CREATE TABLE n (v INTEGER)"))
    await store.write(lambda c: c.execute("INSERT INTO n VALUES (0)"))

    def bump(c: sqlite3.Connection) -> None:
        v = c.execute("SELECT v FROM n").fetchone()[0]
        time.sleep(0.001)  # widens the read-modify-write window a second writer would hit
        c.execute("UPDATE n SET v = ?", (v + 1,))

    await asyncio.gather(*(store.write(bump) for _ in range(50)))
    assert await store.read(lambda c: c.execute("SELECT v FROM n").fetchone()[0]) == 50


async def test_failed_write_rolls_back(store: Store) -> None:
    """An exception inside ``write`` rolls the whole transaction back and is raised."""

    def half(c: sqlite3.Connection) -> None:
        c.execute("INSERT INTO events (at, kind, fields) VALUES (1, 'x', '{}')")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await store.write(half)
    assert await store.events() == []


async def test_write_waits_for_another_connections_lock(store: Store) -> None:
    """A write while another process holds the write lock waits (busy timeout), not fails."""
    other = sqlite3.connect(store.db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.3, lambda: other.execute("COMMIT"))
    release.start()
    await store.event("after_lock")
    release.join()
    other.close()
    assert [e["kind"] for e in await store.events()] == ["after_lock"]


async def test_scan_finds_orphans_missing_and_partials(tmp_path: Path) -> None:
    """Start-up reports files without rows, rows without files, partials, stale caches."""
    home = tmp_path / "home"
    inst = install_fixture(home, "tiny", TINY)
    orphan = home / "blobs" / f"sha256-{'e' * 64}"
    orphan.write_bytes(b"orphan")
    (home / "partial" / "x.part").write_bytes(b"12345")
    (home / "cache" / ("f" * 64)).mkdir(parents=True)
    store = Store(home)
    await store.open()
    try:
        scan = store.last_scan
        assert scan is not None
        assert [o["path"] for o in scan.orphan_blobs] == [str(orphan)]
        assert [p["size"] for p in scan.partials] == [5]
        assert scan.orphan_caches == [str(home / "cache" / ("f" * 64))]
        assert scan.missing == []
        status = await store.status()
        assert len(status["problems"]) == 3
        assert any("prune --orphans" in p for p in status["problems"])
    finally:
        await store.close()

    inst.path.rename(tmp_path / "away")
    store = Store(home)
    await store.open()
    try:
        assert await store.installed("tiny") is None
        assert "tiny" in await store.missing()
        assert any("tiny" in p for p in (await store.status())["problems"])
        # The file comes back (a remounted disk): the model is installed again.
        (tmp_path / "away").rename(inst.path)
        await store.scan()
        assert await store.installed("tiny") is not None
        assert await store.missing() == {}
    finally:
        await store.close()


async def test_scan_leaves_out_work_in_progress(store: Store) -> None:
    """A running download's partial and this daemon's own staging files are no leftovers;
    a dead daemon's staging file is."""
    running = store.partial_dir / "m1.partial"
    running.write_bytes(b"12345")
    own = store.partial_dir / f"m2.import-{os.getpid()}-1"
    own.write_bytes(b"1")
    placing = store.blobs_dir / f".sha256-{'a' * 64}.install-{os.getpid()}"
    placing.write_bytes(b"1")
    dead = store.partial_dir / "m3.import-999999999-1"
    dead.write_bytes(b"1")
    scan = await store.scan(in_use=[running])
    assert [p["path"] for p in scan.partials] == [str(dead)]
    assert scan.orphan_blobs == []
    assert (await store.status(in_use=[running, dead]))["problems"] == []


async def test_an_install_whose_blob_is_gone_is_marked_missing_when_read(tmp_path: Path) -> None:
    """``installed`` and ``list_installed`` never return a row whose blob is gone: they mark
    it missing (once), and an install of the file makes it installed again."""
    home = tmp_path / "home"
    inst = install_fixture(home, "tiny", TINY)
    store = Store(home)
    await store.open()
    try:
        inst.path.rename(tmp_path / "away")
        assert await store.list_installed() == []
        assert await store.installed("tiny") is None
        assert list(await store.missing()) == ["tiny"]
        assert [e["kind"] for e in await store.events()].count("blob_missing") == 1
        src = store.partial_dir / "again"
        (tmp_path / "away").rename(src)
        await store.install("tiny", src, inst.digest, inst.size, "registry sha256")
        assert await store.installed("tiny") is not None
        assert await store.missing() == {}
    finally:
        await store.close()


async def test_verify_ok_and_mismatch_quarantines(tmp_path: Path) -> None:
    """``verify`` re-hashes; a changed file is renamed *.FAILED and no longer installed."""
    home = tmp_path / "home"
    inst = install_fixture(home, "tiny", TINY)
    store = Store(home)
    await store.open()
    try:
        ok = await store.verify("tiny")
        assert ok.ok
        assert ok.actual == inst.digest
        inst.path.chmod(0o644)
        with inst.path.open("r+b") as f:
            f.seek(1000)
            f.write(b"\xff")
        bad = await store.verify("tiny")
        assert not bad.ok
        assert bad.quarantined == inst.path.with_name(inst.path.name + ".FAILED")
        assert bad.quarantined is not None and bad.quarantined.exists()
        assert not inst.path.exists()
        assert "modeld pull tiny" in bad.message
        assert await store.installed("tiny") is None
        with pytest.raises(ModelNotInstalled):
            await store.verify("tiny")
        await store.scan()
        assert store.last_scan is not None
        assert len(store.last_scan.quarantined) == 1
        assert store.last_scan.orphan_blobs == []
        kinds = [e["kind"] for e in await store.events()]
        assert kinds[:2] == ["verify_failed", "verify_ok"]
    finally:
        await store.close()


async def test_memory_probes_touch_and_reopen(tmp_path: Path) -> None:
    """Measurements, probe results and last-used survive a close and reopen."""
    home = tmp_path / "home"
    install_fixture(home, "tiny", TINY)
    d = sha256_file(TINY)[0]
    store = Store(home)
    await store.open()
    await store.record_memory(d, "main=cpu,vision=none,audio=none", 256, 123_456)
    await store.record_probe(d, "gpu", False, "no GPU")
    await store.record_probe(d, "cpu", True, None)
    await store.touch("tiny")
    await store.set_verified("tiny", "registry sha256")
    await store.close()
    await store.close()  # idempotent

    store = Store(home)
    await store.open()
    try:
        key = "main=cpu,vision=none,audio=none"
        assert await store.measured_memory(d, key, 256) == 123_456
        assert await store.measured_memory(d, key, 512) is None
        probes = await store.probes(d)
        assert probes["gpu"]["ok"] is False
        assert probes["gpu"]["reason"] == "no GPU"
        assert probes["cpu"]["ok"] is True
        inst = await store.installed("tiny")
        assert inst is not None
        assert inst.last_used is not None
        assert inst.verified_by == "registry sha256"
    finally:
        await store.close()


def test_sha256_file_matches_hashlib(tmp_path: Path) -> None:
    """The chunked hash equals hashlib's over the whole file, across chunk edges."""
    data = bytes(range(256)) * 9000
    p = tmp_path / "f"
    p.write_bytes(data)
    assert sha256_file(p, chunk=4096) == (hashlib.sha256(data).hexdigest(), len(data))


async def test_write_accepts_executescript_for_schema(store: Store) -> None:
    """A write that runs executescript (which commits by itself) still succeeds."""
    await store.write(lambda c: c.executescript("CREATE TABLE IF NOT EXISTS j (k TEXT);"))
    await store.write(lambda c: c.execute("INSERT INTO j VALUES ('x')"))
    assert await store.read(lambda c: c.execute("SELECT k FROM j").fetchone()[0]) == "x"


async def test_rm_racing_an_install_of_the_same_bytes_never_orphans_a_row(store: Store) -> None:
    """Removing the last id of a blob while another id installs the same bytes: every row
    afterwards points at an existing blob."""
    data = b"same bytes" * 1000
    for i in range(40):
        src, digest, size = _stage(store, data, f"a{i}")
        await store.install("a", src, digest, size, "registry sha256")
        src_b, _, _ = _stage(store, data, f"b{i}")
        await asyncio.gather(
            store.remove("a"), store.install("b", src_b, digest, size, "registry sha256")
        )
        row = await store.installed("b")
        assert row is not None and row.path.exists(), f"round {i}: row without its blob"
        await store.remove("b")


async def test_version_1_probe_rows_migrate_and_are_not_trusted(tmp_path: Path) -> None:
    """A state dir from before the probe fix opens; its old probe rows show but are stale."""
    home = tmp_path / "home"
    install_fixture(home, "tiny", TINY)
    d = sha256_file(TINY)[0]
    conn = sqlite3.connect(home / "modeld.db")
    with conn:
        conn.execute("DROP TABLE probes")
        conn.execute(
            "CREATE TABLE probes (digest TEXT, backend TEXT, ok INTEGER NOT NULL, reason TEXT, "
            "at FLOAT NOT NULL, PRIMARY KEY (digest, backend))"
        )
        conn.execute(
            "INSERT INTO probes VALUES (?, 'gpu', 0, 'Unsupported or unknown file format', 1.0)",
            (d,),
        )
        conn.execute("PRAGMA user_version = 1")
    conn.close()
    store = Store(home)
    await store.open()
    try:
        old = (await store.probes(d))["gpu"]
        assert (old["ok"], old["current"], old["adapter"], old["runtime"]) == (
            False,
            False,
            None,
            None,
        )
        assert await store.latest_adapter() is None
        await store.record_probe(d, "gpu", True, None, adapter="Some GPU (Vulkan)", log="x")
        new = (await store.probes(d, with_log=True))["gpu"]
        assert (new["ok"], new["current"], new["adapter"], new["log"]) == (
            True,
            True,
            "Some GPU (Vulkan)",
            "x",
        )
        latest = await store.latest_adapter()
        assert latest is not None and latest["adapter"] == "Some GPU (Vulkan)"
        # A later failure of another file (float32 weights abort) does not hide the GPU.
        await store.record_probe("f" * 64, "gpu", False, "killed by SIGABRT")
        latest = await store.latest_adapter()
        assert latest is not None and latest["adapter"] == "Some GPU (Vulkan)"
    finally:
        await store.close()


async def test_kept_digests_survive_reopen_and_an_older_db_gains_their_table(
    tmp_path: Path,
) -> None:
    """A state dir from before the ``vouched`` table gains it on open, its rows intact; a
    kept answer survives a reopen, and a different later answer never replaces it."""
    home = tmp_path / "home"
    install_fixture(home, "tiny", TINY)
    with sqlite3.connect(home / "modeld.db") as conn:
        conn.execute("DROP TABLE vouched")  # as a database written before the table existed
        conn.execute("PRAGMA user_version = 2")
    first = Vouch("a" * 64, 7, "huggingface.co", 1.7e9)
    store = Store(home)
    await store.open()
    try:
        assert await store.installed("tiny") is not None
        assert await store.vouched("m1", "o/r@c/f") is None
        await store.vouch("m1", "o/r@c/f", first)
        await store.vouch("m1", "o/r@c/f", Vouch("b" * 64, 7, "huggingface.co", 1.8e9))
    finally:
        await store.close()
    store = Store(home)
    await store.open()
    try:
        assert await store.vouched("m1", "o/r@c/f") == first
        assert await store.vouched("m1", "o/r@other/f") is None
    finally:
        await store.close()
