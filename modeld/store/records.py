"""The store's record tables: measured memory, backend probes, kept digests and events.

A mixin for :class:`modeld.store.store.Store`: every method runs through the store's ``read`` and
``write`` (one writer thread, ``BEGIN IMMEDIATE``), so these rows obey the same rules as
``installed``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from modeld import logs
from modeld.errors import disk_full
from modeld.hostinfo import PROBE_METHOD, runtime_version
from modeld.store.vouches import Vouch

__all__ = ["StoreRecords"]

T = TypeVar("T")

# The events table keeps this many rows, the newest; older ones are deleted as new ones come.
EVENTS_KEPT = 10_000


class _Db(Protocol):
    """What the mixin needs from its host: the store's two transaction runners."""

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...


class StoreRecords:
    """Memory measurements, probe results and events, kept beside the ``installed`` rows."""

    async def record_memory(
        self: _Db, digest: str, plan_key: str, max_tokens: int, pss: int
    ) -> None:
        now = time.time()
        await self.write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO memory VALUES (?, ?, ?, ?, ?)",
                (digest, plan_key, max_tokens, pss, now),
            )
        )

    async def measured_memory(self: _Db, digest: str, plan_key: str, max_tokens: int) -> int | None:
        row = await self.read(
            lambda c: c.execute(
                "SELECT pss FROM memory WHERE digest = ? AND plan_key = ? AND max_tokens = ?",
                (digest, plan_key, max_tokens),
            ).fetchone()
        )
        return int(row["pss"]) if row is not None else None

    async def forget_memory(self: _Db, digest: str) -> int:
        """Drop every measured peak of ``digest``; the next load starts from the estimate."""
        cur = await self.write(
            lambda c: c.execute("DELETE FROM memory WHERE digest = ?", (digest,))
        )
        return int(cur.rowcount)

    async def record_probe(
        self: _Db,
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

    async def probes(
        self: _Db, digest: str, *, with_log: bool = False
    ) -> dict[str, dict[str, Any]]:
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

    async def latest_adapter(self: _Db) -> dict[str, Any] | None:
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
        self: _Db,
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

    async def image_probes(self: _Db, digest: str) -> dict[str, dict[str, Any]]:
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

    async def probe_status(self: _Db) -> dict[str, Any]:
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

    async def vouched(self: _Db, model_id: str, revision: str) -> Vouch | None:
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

    async def vouch(self: _Db, model_id: str, revision: str, vouch: Vouch) -> None:
        """Keep a hub's answer; the first one stays (a different one later is a conflict)."""
        await self.write(
            lambda c: c.execute(
                "INSERT OR IGNORE INTO vouched VALUES (?, ?, ?, ?, ?, ?)",
                (model_id, revision, vouch.sha256, vouch.size, vouch.source, vouch.at),
            )
        )

    async def event(self: _Db, kind: str, **fields: Any) -> None:
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

    async def events(self: _Db, limit: int = 100) -> list[dict[str, Any]]:
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
