"""The state dir's SQLite index: its schema and migrations, connections, and the rows it
hands out.

The schema is a list of migrations keyed by ``PRAGMA user_version``: opening a file applies
the steps it has not had yet, in order; a file from a newer modeld is refused untouched.

Used by :mod:`modeld.store.store` (which re-exports ``Installed`` and ``VerifyReport``); nothing
here touches blobs or runs a transaction of its own.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils

from modeld.errors import DatabaseUnusable, StateTooNew

__all__ = [
    "BUSY_TIMEOUT_MS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "Installed",
    "VerifyReport",
    "check_database",
    "connect_db",
    "installed_from",
    "migrate",
    "user_version",
]

BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class Installed:
    """One installed model: a row of ``installed`` and the blob it names."""

    model_id: str
    digest: str
    size: int
    # How the bytes were vouched for, e.g. "registry sha256" or
    # "x-linked-etag (huggingface.co)"; None means nobody did (unverified).
    verified_by: str | None
    installed_at: float
    last_used: float | None
    path: Path

    @property
    def verified(self) -> bool:
        return self.verified_by is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "digest": self.digest,
            "size": self.size,
            "verified": self.verified,
            "verified_by": self.verified_by,
            "installed_at": self.installed_at,
            "last_used": self.last_used,
            "path": str(self.path),
        }


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of re-hashing one installed blob."""

    model_id: str
    ok: bool
    digest: str
    actual: str | None
    size: int
    actual_size: int
    seconds: float
    quarantined: Path | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.model_id,
            "ok": self.ok,
            "digest": self.digest,
            "actual_digest": self.actual,
            "size": self.size,
            "actual_size": self.actual_size,
            "seconds": round(self.seconds, 3),
            "quarantined": str(self.quarantined) if self.quarantined else None,
            "message": self.message,
        }


def connect_db(path: Path) -> sqlite3.Connection:
    # isolation_level=None: no implicit BEGIN; the writer issues BEGIN IMMEDIATE itself.
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.row_factory = sqlite3.Row
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


_SQLITE_MAGIC = b"SQLite format 3\x00"


# SQLite's primary result code for "needs a writer" (extended: ..._ROLLBACK, _RECOVERY, ...).
_SQLITE_READONLY = 8


def _quick_check(uri: str) -> tuple[str] | None:
    conn = sqlite3.connect(uri, uri=True)
    try:
        row: tuple[str] | None = conn.execute("PRAGMA quick_check(1)").fetchone()
    finally:
        conn.close()
    return row


def check_database(path: Path) -> None:
    """Refuse a state database the daemon could not use, without writing to it.

    Raises ``DatabaseUnusable`` for a file that cannot be opened for writing (read-only, a
    read-only mount), is not SQLite, or fails SQLite's quick check. A missing file is fine:
    the store creates it. Opening read-only never changes the file. A file that a crash left
    with a hot journal (SIGKILL in the first start, before the file was in WAL mode) cannot
    be read read-only (SQLITE_READONLY_ROLLBACK); it is checked read-write then, which lets
    SQLite roll the unfinished transaction back, as any writer would at its first read.
    """
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise DatabaseUnusable(
            f"the state dir {path.parent} is not writable by uid {os.geteuid()} (SQLite keeps "
            "its journal beside the database); fix its owner or mode, or set MODELD_HOME"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as e:
        raise DatabaseUnusable(
            f"the state database {path} cannot be opened for writing ({e.strerror}); make it "
            f"and its directory writable by uid {os.geteuid()}, or set MODELD_HOME elsewhere"
        ) from None
    try:
        head = os.pread(fd, len(_SQLITE_MAGIC), 0)
        empty = os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    why = None
    if not empty and head != _SQLITE_MAGIC:
        why = "is not an SQLite database"
    else:
        try:
            try:
                row = _quick_check(f"{path.resolve().as_uri()}?mode=ro")
            except sqlite3.OperationalError as e:
                if getattr(e, "sqlite_errorcode", 0) & 0xFF != _SQLITE_READONLY:
                    raise
                row = _quick_check(path.resolve().as_uri())  # recovery needs a writer
        except sqlite3.DatabaseError as e:
            why = "cannot be read ({})".format(" ".join(str(e).split()))
        else:
            if row is None or row[0] != "ok":
                # quick_check's report spans lines: keep the message on one.
                why = "is damaged ({})".format(" ".join(str(row[0] if row else "?").split()))
    if why is not None:
        raise DatabaseUnusable(
            f"the state database {path} {why}; modeld left it as it is. Restore it from a "
            "backup, or move it away to start with an empty index (the model files stay in "
            "blobs/ and show as orphans)"
        )


def user_version(conn: sqlite3.Connection) -> int:
    """The schema version the file records (0 for a new, empty file)."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


# --- migrations: MIGRATIONS[n] takes a file from version n to n + 1 ---------------------------
#
# Each step is idempotent (tables created where missing, columns added where missing): state
# dirs exist whose tables ran ahead of their recorded version, because tables used to be
# created where missing without a version bump. Never edit a step that has shipped; append one.


def _v1_base(db: Any) -> None:
    """The index as first released: installed models, measured memory, GPU probes, events."""
    db.table("installed").create(
        {
            "id": str,
            "digest": str,
            "size": int,
            "verified_by": str,
            "installed_at": float,
            "last_used": float,
            # Set when start-up found the blob gone: the model counts as not installed.
            "missing_since": float,
        },
        pk="id",
        not_null={"digest", "size", "installed_at"},
        if_not_exists=True,
    )
    db.table("memory").create(
        {"digest": str, "plan_key": str, "max_tokens": int, "pss": int, "measured_at": float},
        pk=("digest", "plan_key", "max_tokens"),
        not_null={"pss", "measured_at"},
        if_not_exists=True,
    )
    db.table("probes").create(
        {"digest": str, "backend": str, "ok": int, "reason": str, "at": float},
        pk=("digest", "backend"),
        not_null={"ok", "at"},
        if_not_exists=True,
    )
    db.table("events").create(
        {"seq": int, "at": float, "kind": str, "fields": str},
        pk="seq",
        not_null={"at", "kind"},
        if_not_exists=True,
    )


def _v2_probe_details(db: Any) -> None:
    """What a bug report needs of a probe, and the image probe of vision plans.

    A probe row gains the GPU adapter, the runtime version and probe method it ran with, and
    the child's stderr. A version 1 row has no method: it is shown but not trusted, so the
    file is probed again (see modeld.modelfile.probe). ``image_probes``: one small image run
    through a vision plan, per file and plan.
    """
    probes = db.table("probes")
    for column, kind in (("adapter", str), ("runtime", str), ("method", int), ("log", str)):
        if column not in probes.columns_dict:
            probes.add_column(column, kind)
    db.table("image_probes").create(
        {
            "digest": str,
            "plan_key": str,
            "ok": int,
            "stage": str,
            "reason": str,
            "signal": str,
            "seconds": float,
            "at": float,
        },
        pk=("digest", "plan_key"),
        not_null={"ok", "at"},
        if_not_exists=True,
    )


def _v3_vouches_and_journal(db: Any) -> None:
    """What a hub vouched for once, and the download journal (created here, not on first use).

    ``vouched``: per (entry, pinned revision), see modeld.store.vouches. The journal's two
    tables keep each download's finished blocks (modeld.download.journal); their DDL is plain
    SQL because sqlite-utils' ``create()`` cannot say ``WITHOUT ROWID`` or ``ON DELETE
    CASCADE``.
    """
    db.table("vouched").create(
        {
            "model_id": str,
            "revision": str,
            "sha256": str,
            "size": int,
            "source": str,
            "at": float,
        },
        pk=("model_id", "revision"),
        not_null={"sha256", "source", "at"},
        if_not_exists=True,
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS download_journal ("
        " key TEXT PRIMARY KEY, size INTEGER NOT NULL, block_size INTEGER NOT NULL,"
        " expected TEXT, etags TEXT NOT NULL DEFAULT '{}')"
    )
    db.execute(
        "CREATE TABLE IF NOT EXISTS download_blocks ("
        " key TEXT NOT NULL REFERENCES download_journal(key) ON DELETE CASCADE,"
        " idx INTEGER NOT NULL, crc INTEGER NOT NULL, mirror TEXT NOT NULL,"
        " PRIMARY KEY (key, idx)) WITHOUT ROWID"
    )


def _v4_partial_blocks(db: Any) -> None:
    """A journaled block may be partial: ``length`` bytes from its start, with their CRC-32
    (NULL: the whole block). A kill -9 then loses only what came since a piece's last mark,
    not the whole block in flight."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(download_blocks)")}
    if "length" not in columns:  # idempotent, like the steps before it
        db.execute("ALTER TABLE download_blocks ADD COLUMN length INTEGER")


MIGRATIONS: tuple[Callable[[Any], None], ...] = (
    _v1_base,
    _v2_probe_details,
    _v3_vouches_and_journal,
    _v4_partial_blocks,
)
SCHEMA_VERSION = len(MIGRATIONS)


def migrate(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """Bring the file at ``path`` to ``SCHEMA_VERSION``; return (version found, version now).

    Each step runs in its own ``BEGIN IMMEDIATE`` transaction together with its
    ``user_version`` bump, so a crash leaves the file at a whole version. A file from a newer
    modeld is refused before anything is written to it.
    """
    found = user_version(conn)
    _check_known(found, path)
    conn.execute("PRAGMA journal_mode = WAL")
    # FULL: a committed row survives power loss, so it never outlives its fsynced blob.
    conn.execute("PRAGMA synchronous = FULL")
    db = sqlite_utils.Database(conn)
    for version in range(found, SCHEMA_VERSION):
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Another process may have migrated while this one waited for the lock.
            current = user_version(conn)
            _check_known(current, path)
            if current == version:
                MIGRATIONS[version](db)
                conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    return found, user_version(conn)


def _check_known(version: int, path: Path) -> None:
    if version > SCHEMA_VERSION:
        raise StateTooNew(
            f"{path} has schema version {version}, and this modeld knows versions up to "
            f"{SCHEMA_VERSION}: a newer modeld wrote it. Run that newer modeld, or point "
            "MODELD_HOME at another directory; the file was left unchanged.",
            path=str(path),
            version=version,
            known=SCHEMA_VERSION,
        )


def installed_from(row: sqlite3.Row, blobs: Path) -> Installed:
    return Installed(
        model_id=row["id"],
        digest=row["digest"],
        size=row["size"],
        verified_by=row["verified_by"],
        installed_at=row["installed_at"],
        last_used=row["last_used"],
        path=blobs / f"sha256-{row['digest']}",
    )
