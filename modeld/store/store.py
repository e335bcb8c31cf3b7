"""The state dir: content-addressed blobs on disk and the SQLite index that names them.

The layout of ``MODELD_HOME`` is ``modeld.layout.StateDir``. A digest is checked against
``DIGEST_RE`` before it becomes a path; a model id never becomes a path at all.

SQLite runs in WAL mode with a busy timeout. Every write goes through one writer thread,
one transaction at a time, each opened with ``BEGIN IMMEDIATE``: a deferred transaction
that later upgrades to a write can fail with SQLITE_BUSY despite the busy timeout.

A new blob is committed in this order: fsync the file, rename it into ``blobs/``, fsync
the dir, then write the row. A crash at any point leaves at worst a file without a row
(an orphan, reported by the scan), never a row that points at a missing file.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from modeld import logs
from modeld.config import format_size
from modeld.errors import (
    BadRequest,
    DatabaseUnusable,
    ModelNotInstalled,
    ReplacesVerified,
    disk_full,
)
from modeld.hostinfo import PROBE_METHOD, runtime_version
from modeld.layout import DIGEST_RE, MODEL_ID_RE, StateDir
from modeld.store.fsutil import fsync_dir, fsync_path, place_blob
from modeld.store.scan import ScanReport, scan_state_dir, sha256_file
from modeld.store.schema import (
    BUSY_TIMEOUT_MS,
    SCHEMA_VERSION,
    Installed,
    VerifyReport,
    connect_db,
    installed_from,
    migrate,
)
from modeld.store.vouches import Vouch

# Re-exported: callers import all of these from modeld.store.
__all__ = [
    "BUSY_TIMEOUT_MS",
    "DIGEST_RE",
    "SCHEMA_VERSION",
    "Installed",
    "ScanReport",
    "Store",
    "VerifyReport",
    "fsync_dir",
    "fsync_path",
    "place_blob",
    "sha256_file",
]

T = TypeVar("T")

_FAILED = ".FAILED"
# The events table keeps this many rows, the newest; older ones are deleted as new ones come.
EVENTS_KEPT = 10_000

# (transaction, its future, the caller's loop, whether its COMMIT waits for an fsync)
_Job = tuple[
    Callable[[sqlite3.Connection], Any], asyncio.Future[Any], asyncio.AbstractEventLoop, bool
]


class Store:
    """Blobs, partials and caches under ``home``, indexed in ``home/modeld.db``."""

    def __init__(self, home: Path) -> None:
        self.home = Path(home)
        self.layout = StateDir(self.home)
        self.db_path = self.layout.db
        self.blobs_dir = self.layout.blobs
        self.partial_dir = self.layout.partial
        self.cache_dir = self.layout.cache
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        # Placing a blob and writing its row, and counting a blob's rows and unlinking it,
        # each happen under this lock: an install of the same bytes racing an `rm` can never
        # leave a row pointing at a blob just unlinked.
        self._blob_lock = asyncio.Lock()
        self.last_scan: ScanReport | None = None
        # A new value as every write transaction is queued and again (on the writer thread)
        # after it commits or rolls back, so a cache of reads (engines.py keeps installed
        # rows) can tell whether a write came between. next() on a count is atomic.
        self._generations = itertools.count(1)
        self.generation = 0

    # --- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Create the dirs and the db, start the writer, and scan for leftovers."""
        if self._writer is not None:
            return
        for d in (self.home, self.blobs_dir, self.partial_dir, self.cache_dir):
            d.mkdir(parents=True, exist_ok=True)
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._writer = threading.Thread(
            target=self._write_loop,
            args=(started, asyncio.get_running_loop()),
            name="modeld-db-writer",
            daemon=True,
        )
        self._writer.start()
        try:
            await started
            self._reader = connect_db(self.db_path)
            await self.scan()
        except sqlite3.DatabaseError as e:
            await self.close()
            raise DatabaseUnusable(
                f"the state database {self.db_path} cannot be used ({e}); check its "
                "permissions and its disk, or set MODELD_HOME elsewhere"
            ) from e

    async def close(self) -> None:
        """Finish queued writes and close the db (idempotent)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(None)
            await asyncio.to_thread(writer.join)
        reader, self._reader = self._reader, None
        if reader is not None:
            with self._read_lock:
                reader.close()

    def _write_loop(self, started: asyncio.Future[None], loop: asyncio.AbstractEventLoop) -> None:
        try:
            conn = connect_db(self.db_path)
            try:
                found, now = migrate(conn, self.db_path)
            except BaseException:
                conn.close()
                raise
        except Exception as e:
            loop.call_soon_threadsafe(started.set_exception, e)
            return
        if found != now:
            logs.event(
                "store_schema_migrated", path=str(self.db_path), from_version=found, to_version=now
            )
        loop.call_soon_threadsafe(started.set_result, None)
        durable = True  # migrate() set synchronous = FULL
        try:
            while (job := self._queue.get()) is not None:
                fn, fut, job_loop, want = job
                try:
                    if want != durable:
                        # Only between transactions: SQLite refuses it inside one.
                        conn.execute(f"PRAGMA synchronous = {'FULL' if want else 'NORMAL'}")
                        durable = want
                    conn.execute("BEGIN IMMEDIATE")
                    result = fn(conn)
                    # executescript() commits on its own (fine for idempotent DDL).
                    if conn.in_transaction:
                        conn.execute("COMMIT")
                except BaseException as e:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    self.generation = next(self._generations)
                    self._settle(job_loop, fut, None, e)
                else:
                    self.generation = next(self._generations)
                    self._settle(job_loop, fut, result, None)
        finally:
            conn.close()

    @staticmethod
    def _settle(
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[Any],
        result: Any,
        error: BaseException | None,
    ) -> None:
        def settle() -> None:
            if fut.done():  # the caller was cancelled; the write itself still happened
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        # The loop may already be closed when a caller gave up during shutdown.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle)

    # --- transactions ----------------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True) -> T:
        """Run ``fn`` in one ``BEGIN IMMEDIATE`` transaction on the single writer thread.

        ``durable=False``: the COMMIT does not wait for an fsync (``synchronous = NORMAL``).
        Such a transaction survives a crash of the process (kill -9) but may be rolled back
        by a power cut; the next durable COMMIT makes it durable too. For rows that are
        re-checked anyway (the download journal's blocks, each CRC-checked on resume).
        """
        return await self.submit(fn, durable=durable)

    def submit(
        self, fn: Callable[[sqlite3.Connection], T], *, durable: bool = True
    ) -> asyncio.Future[T]:
        """``write``, queued at once (no await before the writer thread sees it): a caller
        on the event loop hands it work without waiting for the loop's next turn."""
        if self._writer is None:
            raise RuntimeError("Store.write before Store.open")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self.generation = next(self._generations)
        self._queue.put((fn, fut, loop, durable))
        return fut

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` on the read connection in a thread (WAL: never blocked by the writer)."""
        return await asyncio.to_thread(self._read_now, fn)

    def _read_now(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``read`` in the calling thread (a worker thread, never the event loop)."""
        reader = self._reader
        if reader is None:
            raise RuntimeError("Store.read before Store.open")
        with self._read_lock:
            reader.execute("BEGIN")
            try:
                return fn(reader)
            finally:
                reader.execute("COMMIT")

    # --- paths -----------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        if not DIGEST_RE.fullmatch(digest):
            raise BadRequest(f"{digest!r} is not a sha256 digest (64 lowercase hex digits)")
        return self.layout.blob(digest)

    def cache_dir_for(self, digest: str) -> Path:
        """``cache/<digest>/``: the runtime's cache_dir for this blob."""
        self.blob_path(digest)
        return self.layout.cache_for(digest)

    # --- installed models ------------------------------------------------------------

    async def install(
        self, model_id: str, src: Path, digest: str, size: int, verified_by: str | None
    ) -> Installed:
        """Move ``src`` into ``blobs/`` and record it as ``model_id`` (replacing its old row).

        ``src`` should be on the state dir's file system (``partial/``); if not, it is
        copied first. The caller vouches for ``digest``; only the size is checked here.
        """
        if not MODEL_ID_RE.fullmatch(model_id):
            raise BadRequest(f"{model_id!r} is not a valid model id")
        dest = self.blob_path(digest)
        now = time.time()

        def tx(conn: sqlite3.Connection) -> str | None:
            old = conn.execute("SELECT digest FROM installed WHERE id = ?", (model_id,)).fetchone()
            conn.execute(
                "INSERT OR REPLACE INTO installed"
                " (id, digest, size, verified_by, installed_at, last_used, missing_since)"
                " VALUES (?, ?, ?, ?, ?, NULL, NULL)",
                (model_id, digest, size, verified_by, now),
            )
            return old["digest"] if old is not None and old["digest"] != digest else None

        async with self._blob_lock:
            if verified_by is None:
                verified_by = await self._keep_verification(model_id, digest)
            await asyncio.to_thread(place_blob, Path(src), dest, size)
            replaced = await self.write(tx)
        if replaced is not None:
            await self._drop_blob_if_unused(replaced)
        await self.event(
            "installed", model=model_id, digest=digest, size=size, verified_by=verified_by
        )
        return Installed(model_id, digest, size, verified_by, now, None, dest)

    async def _keep_verification(self, model_id: str, digest: str) -> str | None:
        """What vouches for an unverified ``digest`` about to be installed as ``model_id``:
        the old row's source when it is the same file; a verified install of another file
        is never replaced by an unverified one (``ReplacesVerified``)."""
        old = await self.read(
            lambda c: c.execute(
                "SELECT digest, verified_by FROM installed WHERE id = ?", (model_id,)
            ).fetchone()
        )
        if old is None or old["verified_by"] is None:
            return None
        if old["digest"] == digest:
            kept: str = old["verified_by"]
            return kept
        raise ReplacesVerified(
            f"model {model_id} is installed verified (by {old['verified_by']}); a file no "
            "source vouches for never replaces it. Import a file matching the verified "
            f"digest, or `modeld rm {model_id}` first if you mean to drop the verified one"
        )

    async def installed(self, model_id: str) -> Installed | None:
        """The model's install, or None: never installed, removed, or missing (its blob is
        gone: found so now, by a scan, or by a load)."""

        def q(conn: sqlite3.Connection) -> list[sqlite3.Row]:
            rows: list[sqlite3.Row] = conn.execute(
                "SELECT * FROM installed WHERE id = ? AND missing_since IS NULL", (model_id,)
            ).fetchall()
            return rows

        found = await self._present(q)
        return found[0] if found else None

    async def list_installed(self) -> list[Installed]:
        """Every install whose blob is there (one whose blob is gone is marked missing)."""
        return await self._present(
            lambda c: c.execute(
                "SELECT * FROM installed WHERE missing_since IS NULL ORDER BY id"
            ).fetchall()
        )

    async def _present(
        self, query: Callable[[sqlite3.Connection], list[sqlite3.Row]]
    ) -> list[Installed]:
        """The installs ``query`` reads whose blob is on disk (one ``stat`` each, in the read's
        thread); those whose blob is gone are marked missing, so no caller (``pull``, ``list``,
        a load) takes a row for a file that is not there."""

        def read() -> tuple[list[Installed], list[Installed]]:
            here: list[Installed] = []
            gone: list[Installed] = []
            for row in self._read_now(query):
                inst = installed_from(row, self.blobs_dir)
                (here if inst.path.exists() else gone).append(inst)
            return here, gone

        here, gone = await asyncio.to_thread(read)
        if gone:
            await self._set_missing([(i.model_id, i.digest) for i in gone])
        return here

    async def mark_missing(self, model_id: str, digest: str) -> bool:
        """Record that the blob of ``model_id`` (``digest``) is gone, as a load found it: the
        model counts as missing until its file is back or it is pulled again. False when
        the row changed meanwhile or the file is there after all."""
        return bool(await self._set_missing([(model_id, digest)]))

    async def missing(self) -> dict[str, float]:
        """Models whose row survives but whose blob was found gone: id -> since when."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT id, missing_since FROM installed WHERE missing_since IS NOT NULL"
            ).fetchall()
        )
        return {r["id"]: r["missing_since"] for r in rows}

    async def remove(self, model_id: str) -> None:
        """Remove the row, and the blob and its cache if no other row uses them."""

        def tx(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT digest FROM installed WHERE id = ?", (model_id,)).fetchone()
            if row is None:
                return None
            conn.execute("DELETE FROM installed WHERE id = ?", (model_id,))
            digest: str = row["digest"]
            # rm forgets what engines of the file were measured to take.
            conn.execute("DELETE FROM memory WHERE digest = ?", (digest,))
            return digest

        digest = await self.write(tx)
        if digest is None:
            raise ModelNotInstalled(f"model {model_id} is not installed; nothing to remove")
        await self._drop_blob_if_unused(digest)
        await self.event("removed", model=model_id, digest=digest)

    async def _drop_blob_if_unused(self, digest: str) -> None:
        def drop() -> None:
            self.blob_path(digest).unlink(missing_ok=True)
            shutil.rmtree(self.cache_dir_for(digest), ignore_errors=True)

        async with self._blob_lock:
            users = await self.read(
                lambda c: c.execute(
                    "SELECT count(*) FROM installed WHERE digest = ?", (digest,)
                ).fetchone()[0]
            )
            if not users:
                await asyncio.to_thread(drop)

    async def touch(self, model_id: str) -> None:
        now = time.time()
        await self.write(
            lambda c: c.execute("UPDATE installed SET last_used = ? WHERE id = ?", (now, model_id))
        )

    async def set_verified(self, model_id: str, verified_by: str) -> None:
        """Record that the installed bytes were vouched for after the fact."""
        await self.write(
            lambda c: c.execute(
                "UPDATE installed SET verified_by = ? WHERE id = ?", (verified_by, model_id)
            )
        )
        await self.event("verified", model=model_id, verified_by=verified_by)

    # --- verification ----------------------------------------------------------------

    async def verify(self, model_id: str) -> VerifyReport:
        """Re-hash the model's blob; a mismatching blob is quarantined and the row removed.

        The bad file is renamed to ``blobs/sha256-<hex>.FAILED`` (apt's convention) so it
        can be inspected, and it no longer counts as installed: ``modeld pull`` fetches a
        good copy; ``modeld prune --orphans`` deletes the quarantined file.
        """
        inst = await self.installed(model_id)
        if inst is None:
            raise ModelNotInstalled.of(model_id)
        started = time.monotonic()
        try:
            actual, actual_size = await asyncio.to_thread(sha256_file, inst.path)
        except FileNotFoundError:
            await self.mark_missing(model_id, inst.digest)
            raise ModelNotInstalled(
                f"model {model_id}: its file {inst.path} is gone; run `modeld pull {model_id}`"
            ) from None
        seconds = time.monotonic() - started
        if actual == inst.digest and actual_size == inst.size:
            await self.event("verify_ok", model=model_id, digest=actual, seconds=seconds)
            return VerifyReport(
                model_id,
                True,
                inst.digest,
                actual,
                inst.size,
                actual_size,
                seconds,
                None,
                f"model {model_id}: sha256 {actual} matches ({actual_size} bytes)",
            )
        moved = await self._quarantine(inst.digest)
        await self.event(
            "verify_failed",
            model=model_id,
            digest=inst.digest,
            actual=actual,
            actual_size=actual_size,
            quarantined=str(moved),
        )
        return VerifyReport(
            model_id,
            False,
            inst.digest,
            actual,
            inst.size,
            actual_size,
            seconds,
            moved,
            f"model {model_id}: the file's sha256 is {actual} ({actual_size} bytes), expected "
            f"{inst.digest} ({inst.size} bytes); it was moved to {moved} and the model is no "
            f"longer installed. Run `modeld pull {model_id}` to fetch a good copy",
        )

    async def _quarantine(self, digest: str) -> Path:
        src = self.blob_path(digest)

        def move() -> Path:
            dest = src.with_name(src.name + _FAILED)
            if dest.exists():
                dest = src.with_name(f"{src.name}{_FAILED}.{int(time.time())}")
            src.replace(dest)
            fsync_dir(self.blobs_dir)
            shutil.rmtree(self.cache_dir_for(digest), ignore_errors=True)
            return dest

        # File first, then the rows: a crash in between leaves rows that the next
        # start-up scan marks missing, never a row that calls a bad file good.
        dest = await asyncio.to_thread(move)
        await self.write(lambda c: c.execute("DELETE FROM installed WHERE digest = ?", (digest,)))
        return dest

    # --- the scan: files against rows ------------------------------------------------

    async def scan(self, *, in_use: Collection[Path] = ()) -> ScanReport:
        """Compare the state dir's files with the index: files without rows, rows without
        files, wrong sizes, quarantined files, leftover partials, stray caches.

        Runs at start-up and for each ``status``, so what it reports is the state dir as it
        is now. A row whose file is gone is marked missing (and unmarked once the file is
        back). ``in_use``: partials of the downloads running now, which are no leftovers.
        """
        report, _ = await self._scan(in_use)
        return report

    async def _scan(self, in_use: Collection[Path]) -> tuple[ScanReport, list[Installed]]:
        """``scan``, and the installs whose blob it found (one thread hop for both)."""
        paths = {str(p) for p in in_use}

        def look() -> tuple[list[sqlite3.Row], ScanReport]:
            rows = self._read_now(lambda c: c.execute("SELECT * FROM installed").fetchall())
            by_id = {r["id"]: (r["digest"], r["size"], r["missing_since"]) for r in rows}
            report = scan_state_dir(
                self.blobs_dir,
                self.partial_dir,
                self.cache_dir,
                by_id,
                in_use=paths,
                pid=os.getpid(),
            )
            # An install of another file for the id may have come between the rows read and
            # the listing (its new blob placed, then its row): only a blob still gone is.
            report.missing = [m for m in report.missing if not self.blob_path(by_id[m][0]).exists()]
            return rows, report

        rows, report = await asyncio.to_thread(look)
        gone = [
            (r["id"], r["digest"])
            for r in rows
            if r["id"] in report.missing and r["missing_since"] is None
        ]
        back = [
            (r["id"], r["digest"])
            for r in rows
            if r["missing_since"] is not None and r["id"] not in report.missing
        ]
        if gone or back:
            await self._set_missing(gone, back)
        seen = set(self.last_scan.problems()) if self.last_scan is not None else set()
        self.last_scan = report
        # Logged once each, not at every status that still finds it.
        for problem in report.problems():
            if problem not in seen:
                logs.event("store_problem", problem=problem)
        here = [installed_from(r, self.blobs_dir) for r in rows if r["id"] not in report.missing]
        return report, sorted(here, key=lambda i: i.model_id)

    async def _set_missing(
        self,
        gone: list[tuple[str, str]],
        back: list[tuple[str, str]] | None = None,
    ) -> list[tuple[str, str]]:
        """Mark the (id, digest) rows of ``gone`` missing and unmark those of ``back``, each
        only while its row still names that digest and its file is (not) there; return the
        rows marked."""
        now = time.time()

        def tx(conn: sqlite3.Connection) -> list[tuple[str, str]]:
            marked = []
            for model_id, digest in gone:
                if self.blob_path(digest).exists():
                    continue
                cur = conn.execute(
                    "UPDATE installed SET missing_since = ?"
                    " WHERE id = ? AND digest = ? AND missing_since IS NULL",
                    (now, model_id, digest),
                )
                if cur.rowcount:
                    marked.append((model_id, digest))
            for model_id, digest in back or []:
                if self.blob_path(digest).exists():
                    conn.execute(
                        "UPDATE installed SET missing_since = NULL WHERE id = ? AND digest = ?",
                        (model_id, digest),
                    )
            return marked

        marked = await self.write(tx)
        for model_id, digest in marked:
            await self.event("blob_missing", model=model_id, digest=digest)
        return marked

    async def status(self, *, in_use: Collection[Path] = ()) -> dict[str, Any]:
        """The ``store`` section of ``/api/status``, from a scan made now (``in_use``: the
        partials of running downloads)."""
        scan, installed = await self._scan(in_use)
        total = sum(i.size for i in installed)
        doc: dict[str, Any] = {
            "home": str(self.home),
            "installed": len(installed),
            "installed_bytes": total,
            "unverified": sorted(i.model_id for i in installed if not i.verified),
            "scan": scan.to_dict(),
            "problems": scan.problems(),
        }
        doc["summary"] = (
            f"{len(installed)} installed model(s), {format_size(total)} in {self.blobs_dir}"
        )
        return doc

    # --- records: measured memory, backend probes, kept digests, events ---------------
    # These rows obey the same rules as ``installed``: every write goes through ``write``.

    async def record_memory(self, digest: str, plan_key: str, max_tokens: int, pss: int) -> None:
        now = time.time()
        await self.write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO memory VALUES (?, ?, ?, ?, ?)",
                (digest, plan_key, max_tokens, pss, now),
            )
        )

    async def measured_memory(self, digest: str, plan_key: str, max_tokens: int) -> int | None:
        row = await self.read(
            lambda c: c.execute(
                "SELECT pss FROM memory WHERE digest = ? AND plan_key = ? AND max_tokens = ?",
                (digest, plan_key, max_tokens),
            ).fetchone()
        )
        return int(row["pss"]) if row is not None else None

    async def forget_memory(self, digest: str) -> int:
        """Drop every measured peak of ``digest``; the next load starts from the estimate."""
        cur = await self.write(
            lambda c: c.execute("DELETE FROM memory WHERE digest = ?", (digest,))
        )
        return int(cur.rowcount)

    async def record_probe(
        self,
        digest: str,
        backend: str,
        ok: bool,
        reason: str | None,
        *,
        adapter: str | None = None,
        log: str | None = None,
        runtime: str | None = None,
        method: int = PROBE_METHOD,
    ) -> None:
        """Keep a probe's result; ``runtime`` defaults to the installed runtime's version."""
        now = time.time()
        runtime = runtime or runtime_version()
        await self.write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO probes (digest, backend, ok, reason, at, adapter, "
                "runtime, method, log) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (digest, backend, int(ok), reason, now, adapter, runtime, method, log),
            )
        )

    async def probes(self, digest: str, *, with_log: bool = False) -> dict[str, dict[str, Any]]:
        """backend -> {"ok", "reason", "at", "adapter", "runtime", "current"} for this blob.

        ``current`` is False for a result of an older probe method or another runtime
        version: it is shown, but the file is probed again before it decides a plan.
        ``with_log`` adds each probe child's stderr (``log``).
        """
        rows = await self.read(
            lambda c: c.execute(
                "SELECT * FROM probes WHERE digest = ? ORDER BY backend", (digest,)
            ).fetchall()
        )
        return {r["backend"]: _probe_row(r, with_log) for r in rows}

    async def latest_adapter(self) -> dict[str, Any] | None:
        """The host's GPU as the probes saw it: the newest current GPU probe that passed.

        A file can fail on a GPU that works (float32 weights abort the runtime), so a
        failure only stands for the host when no current GPU probe passed; then the
        newest failure is returned (its reason says why). None if none ran.
        """
        rows = await self.read(
            lambda c: c.execute(
                "SELECT * FROM probes WHERE backend = 'gpu' ORDER BY ok DESC, at DESC"
            ).fetchall()
        )
        return next((row for r in rows if (row := _probe_row(r, False))["current"]), None)

    async def record_image_probe(
        self,
        digest: str,
        plan_key: str,
        *,
        ok: bool,
        stage: str | None,
        reason: str | None,
        signal: str | None,
        seconds: float,
    ) -> None:
        now = time.time()
        await self.write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO image_probes "
                "(digest, plan_key, ok, stage, reason, signal, seconds, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (digest, plan_key, int(ok), stage, reason, signal, seconds, now),
            )
        )

    async def image_probes(self, digest: str) -> dict[str, dict[str, Any]]:
        """plan key -> {"ok", "stage", "reason", "signal", "seconds", "at"} for this blob."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT plan_key, ok, stage, reason, signal, seconds, at FROM image_probes "
                "WHERE digest = ? ORDER BY plan_key",
                (digest,),
            ).fetchall()
        )
        return {
            r["plan_key"]: {
                "ok": bool(r["ok"]),
                "stage": r["stage"],
                "reason": r["reason"],
                "signal": r["signal"],
                "seconds": r["seconds"],
                "at": r["at"],
            }
            for r in rows
        }

    async def probe_status(self) -> dict[str, Any]:
        """The ``probes`` section of ``/api/status``: every backend probe result, by blob."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT p.*, group_concat(i.id) AS ids FROM probes p "
                "LEFT JOIN installed i ON i.digest = p.digest "
                "GROUP BY p.digest, p.backend ORDER BY p.digest, p.backend"
            ).fetchall()
        )
        results = [
            {
                "digest": r["digest"],
                "models": sorted(r["ids"].split(",")) if r["ids"] else [],
                **_probe_row(r, False),
            }
            for r in rows
        ]
        failed = sum(1 for r in results if not r["ok"])
        summary = (
            f"{len(results)} result(s), {failed} failed" if results else "no backend probed yet"
        )
        return {"summary": summary, "results": results, "problems": []}

    async def vouched(self, model_id: str, revision: str) -> Vouch | None:
        """The sha256 a hub vouched for once for this entry's pinned revision, if any."""
        row = await self.read(
            lambda c: c.execute(
                "SELECT sha256, size, source, at FROM vouched WHERE model_id = ? AND revision = ?",
                (model_id, revision),
            ).fetchone()
        )
        if row is None:
            return None
        return Vouch(row["sha256"], row["size"], row["source"], row["at"])

    async def vouch(self, model_id: str, revision: str, vouch: Vouch) -> None:
        """Keep a hub's answer; the first one stays (a different one later is a conflict)."""
        await self.write(
            lambda c: c.execute(
                "INSERT OR IGNORE INTO vouched VALUES (?, ?, ?, ?, ?, ?)",
                (model_id, revision, vouch.sha256, vouch.size, vouch.source, vouch.at),
            )
        )

    async def event(self, kind: str, **fields: Any) -> None:
        """Append one event to the ``events`` table (and the log); keep the last ``EVENTS_KEPT``.

        An event is a record of something already done: a full disk loses the row (the log
        line stays), never the outcome of the work it records.
        """
        logs.event(kind, **fields)
        payload = json.dumps({k: v for k, v in fields.items() if v is not None}, default=str)
        now = time.time()

        def append(c: sqlite3.Connection) -> None:
            seq = c.execute(
                "INSERT INTO events (at, kind, fields) VALUES (?, ?, ?)", (now, kind, payload)
            ).lastrowid
            if seq is not None and seq > EVENTS_KEPT:
                c.execute("DELETE FROM events WHERE seq <= ?", (seq - EVENTS_KEPT,))

        try:
            await self.write(append)
        except sqlite3.OperationalError as e:
            if disk_full(e) is None:
                raise
            logs.event("event_not_recorded", logging.WARNING, kind=kind, error=str(e))

    async def events(self, limit: int = 100) -> list[dict[str, Any]]:
        """The latest events, newest first."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT seq, at, kind, fields FROM events ORDER BY seq DESC LIMIT ?", (limit,)
            ).fetchall()
        )
        return [
            {"seq": r["seq"], "at": r["at"], "kind": r["kind"], "fields": json.loads(r["fields"])}
            for r in rows
        ]


def _probe_row(r: sqlite3.Row, with_log: bool) -> dict[str, Any]:
    row: dict[str, Any] = {
        "backend": r["backend"],
        "ok": bool(r["ok"]),
        "reason": r["reason"],
        "at": r["at"],
        "adapter": r["adapter"],
        "runtime": r["runtime"],
        "current": r["method"] == PROBE_METHOD and r["runtime"] == runtime_version(),
    }
    if with_log:
        row["log"] = r["log"]
    return row
