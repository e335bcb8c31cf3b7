"""The store's record tables: measured memory, backend probes and the event log.

A mixin for :class:`modeld.store.Store`: every method runs through the store's ``read`` and
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

    async def record_probe(
        self: _Db, digest: str, backend: str, ok: bool, reason: str | None
    ) -> None:
        now = time.time()
        await self.write(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO probes VALUES (?, ?, ?, ?, ?)",
                (digest, backend, int(ok), reason, now),
            )
        )

    async def probes(self: _Db, digest: str) -> dict[str, dict[str, Any]]:
        """backend -> {"ok", "reason", "at"} for this blob."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT backend, ok, reason, at FROM probes WHERE digest = ? ORDER BY backend",
                (digest,),
            ).fetchall()
        )
        return {
            r["backend"]: {"ok": bool(r["ok"]), "reason": r["reason"], "at": r["at"]} for r in rows
        }

    async def probe_status(self: _Db) -> dict[str, Any]:
        """The ``probes`` section of ``/api/status``: every backend probe result, by blob."""
        rows = await self.read(
            lambda c: c.execute(
                "SELECT p.digest, p.backend, p.ok, p.reason, p.at, "
                "group_concat(i.id) AS ids FROM probes p "
                "LEFT JOIN installed i ON i.digest = p.digest "
                "GROUP BY p.digest, p.backend ORDER BY p.digest, p.backend"
            ).fetchall()
        )
        results = [
            {
                "digest": r["digest"],
                "models": sorted(r["ids"].split(",")) if r["ids"] else [],
                "backend": r["backend"],
                "ok": bool(r["ok"]),
                "reason": r["reason"],
                "at": r["at"],
            }
            for r in rows
        ]
        failed = sum(1 for r in results if not r["ok"])
        summary = (
            f"{len(results)} result(s), {failed} failed" if results else "no backend probed yet"
        )
        return {"summary": summary, "results": results, "problems": []}

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
