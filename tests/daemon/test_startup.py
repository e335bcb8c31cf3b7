"""Start-up hardening: an unusable database, the umask, the socket's directory and mode, and
the events table's bound."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from modeld.config import load_settings
from modeld.daemon import daemon as daemon_mod
from modeld.errors import Conflict, SettingsError
from modeld.store.store import Store
from tests.support.daemon import (
    DaemonProcess,
    daemon_env,
    serve_to_exit,
    spawn_daemon,
    stop_process,
    wait_log,
)
from tests.support.unix import unix_http

OTHER_UID = 12345
# The events table's stated bound (modeld.store.store.EVENTS_KEPT).
EVENTS_KEPT = 10_000


def _make_db(home: Path) -> Path:
    """A real state database with a few rows, as a daemon leaves it."""

    async def go() -> None:
        store = Store(home)
        await store.open()
        for i in range(20):
            await store.event("test", i=i)
        await store.close()

    asyncio.run(go())
    return home / "modeld.db"


def _snapshot(path: Path) -> tuple[bytes, int, int]:
    st = path.stat()
    return path.read_bytes(), st.st_mtime_ns, stat.S_IMODE(st.st_mode)


def _garbage(db: Path) -> None:
    db.write_bytes(os.urandom(16384))


def _damaged_pages(db: Path) -> None:
    data = bytearray(db.read_bytes())
    data[4096:8192] = os.urandom(4096)
    db.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [(_garbage, "is not an SQLite database"), (_damaged_pages, "is damaged")],
)
def test_corrupt_database_stops_start_untouched(
    short_tmp: Path, damage: object, needle: str
) -> None:
    """A corrupt modeld.db: one line on stderr, exit 1, and the file as it was."""
    home = short_tmp / "home"
    db = _make_db(home)
    assert callable(damage)
    damage(db)
    before = _snapshot(db)
    result = serve_to_exit(daemon_env(home))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"modeld: the state database {db} {needle}")
    assert "move it away" in lines[0]
    assert _snapshot(db) == before


_KILLED_MID_TRANSACTION = """
import os, sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)  # rollback journal: not WAL yet
db.execute("CREATE TABLE kept (x)")
db.execute("INSERT INTO kept VALUES (1), (2), (3)")
db.execute("PRAGMA cache_size = 1")  # spill pages to the file before the commit
db.execute("BEGIN")
for _ in range(5000):
    db.execute("INSERT INTO kept VALUES (?)", (os.urandom(200),))
os.kill(os.getpid(), 9)
"""


def test_a_hot_journal_left_by_a_kill_is_rolled_back_and_the_daemon_starts(
    short_tmp: Path,
) -> None:
    """A state database that a SIGKILL left mid-transaction with a hot rollback journal (a
    first start killed before the file was in WAL mode) cannot be read read-only; the daemon
    starts anyway: SQLite rolls the unfinished transaction back, the committed rows stay."""
    home = short_tmp / "home"
    home.mkdir()
    db = home / "modeld.db"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_TRANSACTION, str(db)], check=False)
    assert killed.returncode == -9
    journal = home / "modeld.db-journal"
    assert journal.stat().st_size > 0  # hot: the kill left it
    d = DaemonProcess(home=home, env=daemon_env(home))
    d.start()
    try:
        assert unix_http(d.socket)[0] == 200
    finally:
        assert d.stop() == 0
    assert not journal.exists() or journal.stat().st_size == 0
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (3,)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_read_only_database_stops_start_untouched(short_tmp: Path) -> None:
    """A modeld.db on a read-only mount (root cannot write it either): one line, exit 1, the
    file as it was."""
    home = short_tmp / "home"
    db = _make_db(home)
    before = _snapshot(db)
    mounted = subprocess.run(
        ["mount", "--bind", str(db), str(db)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(db)], check=True)
        result = serve_to_exit(daemon_env(home))
    finally:
        subprocess.run(["umount", str(db)], check=False)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "cannot be opened for writing (Read-only file system)" in lines[0], lines[0]
    assert _snapshot(db) == before


def test_state_is_private_under_umask_0(short_tmp: Path) -> None:
    """Started under umask 0, the daemon makes its dirs 0700 and its files 0600; the socket
    stays 0660."""
    home = short_tmp / "home"
    old = os.umask(0)
    try:
        proc = spawn_daemon(daemon_env(home), short_tmp / "daemon.log")
    finally:
        os.umask(old)
    try:
        wait_log(short_tmp / "daemon.log", " ready ", proc=proc)
        assert unix_http(home / "modeld.sock")[0] == 200
        modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [home, *home.iterdir()]}
        for name in ("home", "blobs", "partial", "cache"):
            assert modes[name] == 0o700, (name, oct(modes[name]))
        files = [n for n in modes if n.startswith(("modeld.db", "daemon.lock"))]
        assert "modeld.db" in files
        for name in files:
            assert modes[name] == 0o600, (name, oct(modes[name]))
        assert modes["modeld.sock"] == 0o660
    finally:
        stop_process(proc)


@pytest.mark.parametrize(
    ("owner", "mode", "needle"),
    [
        (OTHER_UID, 0o755, f"belongs to uid {OTHER_UID}"),
        (0, 0o777, "is writable by others (mode 777)"),
        (0, 0o1777, "is writable by others (mode 1777)"),
    ],
)
def test_socket_dir_of_another_user_or_open_to_all_is_refused(
    short_tmp: Path, owner: int, mode: int, needle: str
) -> None:
    """A socket directory owned by another uid, or writable by others (even sticky, like
    /tmp), stops start-up with exit 2 and a line naming the directory; no socket is made."""
    sock_dir = short_tmp / "run"
    sock_dir.mkdir()
    os.chown(sock_dir, owner, owner)
    sock_dir.chmod(mode)
    env = daemon_env(short_tmp / "home", MODELD_SOCKET=str(sock_dir / "modeld.sock"))
    result = serve_to_exit(env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"modeld: the socket's directory {sock_dir} {needle}"), last
    assert "MODELD_SOCKET" in last
    assert not (sock_dir / "modeld.sock").exists()


class _SwappingSocket(socket.socket):
    """A real socket whose file is swapped for a symlink to ``victim`` right after bind()."""

    victim: Path | None = None

    def bind(self, address: object) -> None:
        super().bind(address)  # type: ignore[arg-type]
        assert isinstance(address, str) and self.victim is not None
        os.unlink(address)
        os.symlink(self.victim, address)


def test_socket_mode_is_never_set_through_a_symlink(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the socket file is replaced by a symlink between bind and chmod, the daemon
    refuses to start and the symlink's target keeps its mode (chmod by path followed it)."""
    victim = short_tmp / "victim"
    victim.write_text("secret")
    victim.chmod(0o600)
    _SwappingSocket.victim = victim
    monkeypatch.setattr(socket, "socket", _SwappingSocket)
    with pytest.raises(Conflict, match="was replaced right after it was bound"):
        daemon_mod.bind_socket(short_tmp / "m.sock")
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600


def test_events_table_keeps_the_last_rows(short_tmp: Path) -> None:
    """The events table keeps the newest 10,000 rows: older ones go as new ones come."""
    from modeld.store import store as store_mod

    assert store_mod.EVENTS_KEPT == EVENTS_KEPT
    home = short_tmp / "home"
    db = _make_db(home)
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO events (at, kind, fields) VALUES (?, 'filler', '{}')",
            [(float(i),) for i in range(EVENTS_KEPT + 30)],
        )
    conn.close()

    async def one_more() -> tuple[int, int, int]:
        store = Store(home)
        await store.open()
        try:
            await store.event("last", n=1)
            row = await store.read(
                lambda c: c.execute("SELECT count(*), min(seq), max(seq) FROM events").fetchone()
            )
            return int(row[0]), int(row[1]), int(row[2])
        finally:
            await store.close()

    count, first, last = asyncio.run(one_more())
    assert count == EVENTS_KEPT
    assert last == 20 + EVENTS_KEPT + 30 + 1
    assert first == last - EVENTS_KEPT + 1


def test_body_memory_must_hold_one_body(clean_env: Path) -> None:
    """MODELD_BODY_MEMORY below MODELD_MAX_BODY could never admit a full body: refused."""
    with pytest.raises(SettingsError, match="max_body"):
        load_settings(max_body="2MiB", body_memory="1MiB")
    assert load_settings(max_body="2MiB", body_memory="2MiB").body_memory == 2 * 1024**2
