"""Carrying out ``rm ID`` and ``prune`` in the daemon, against the live pool and downloads.

The work runs in a task the request only waits on (``asyncio.shield``): a client that goes
away (Ctrl-C in the CLI) never stops a removal half way. One removal runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from modeld import logs
from modeld.catalog.catalog import did_you_mean
from modeld.config import Settings
from modeld.download.downloads import Downloads
from modeld.download.journal import SqliteJournal, journal_keys
from modeld.engine.pool import Pool, Target
from modeld.errors import (
    BadRequest,
    DownloadError,
    DownloadNotFound,
    EngineNotFound,
    ModeldError,
    ModelInUse,
    ModelNotInstalled,
    Refused,
    RemoveFailed,
)
from modeld.metrics import Metrics
from modeld.services import prune
from modeld.services.prune import (
    Activity,
    Inventory,
    Item,
    PrunePlan,
    Row,
    Selection,
    plan_prune,
    scan_files,
    valid_model_id,
)
from modeld.store.store import Store

T = TypeVar("T")


def activity_of(pool: Pool | None, downloads: Downloads | None) -> Activity:
    """Engines and downloads of the daemon right now (``pool.views()``, ``downloads.jobs``)."""
    loaded: set[str] = set()
    digests: set[str] = set()
    pinned: set[str] = set()
    if pool is not None:
        for view in pool.views():
            loaded.add(view.model)
            digests.add(view.digest)
            if view.pinned:
                pinned.add(view.model)
    downloading: set[str] = set()
    paths: set[str] = set()
    if downloads is not None:
        for model_id, job in dict(downloads.jobs).items():
            if getattr(job, "finished", False):
                continue
            downloading.add(str(model_id))
            partial = getattr(job, "partial", None)
            if partial is not None:
                paths.add(str(partial))
    return Activity(
        frozenset(loaded),
        frozenset(digests),
        frozenset(pinned),
        frozenset(downloading),
        frozenset(paths),
    )


def _rows(conn: sqlite3.Connection) -> list[Row]:
    return [
        Row(
            r["id"],
            r["digest"],
            int(r["size"]),
            float(r["installed_at"]),
            r["last_used"],
            r["missing_since"] is not None,
        )
        for r in conn.execute("SELECT * FROM installed ORDER BY id")
    ]


def _delete_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Remover:
    """``rm`` and ``prune`` for one daemon, against its store, pool and downloads.

    Without a pool or downloads (a remover on a bare store) nothing counts as loaded or
    being downloaded.
    """

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        store: Store,
        pool: Pool | None = None,
        downloads: Downloads | None = None,
        *,
        flush_uses: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.pool = pool
        self.downloads = downloads
        # Writes the uses not yet in SQLite (``Engines.flush_uses``): a plan reads
        # ``last_used`` from there, and a use minutes old must not look unused.
        self.flush_uses = flush_uses
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.drain()

    async def drain(self) -> None:
        """Let a removal in flight finish (before the pool and the store stop)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.settings.shutdown_timeout)

    def activity(self) -> Activity:
        return activity_of(self.pool, self.downloads)

    async def _shielded(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` to its end even if the waiting request is cancelled."""
        task: asyncio.Task[T] = asyncio.ensure_future(fn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    # --- the snapshot ----------------------------------------------------------------

    async def inventory(self) -> Inventory:
        store = self.store

        def read(conn: sqlite3.Connection) -> tuple[list[Row], set[str]]:
            return _rows(conn), journal_keys(conn)

        rows, keys = await store.read(read)
        inv = Inventory(
            now=time.time(),
            rows=rows,
            journal_keys=keys,
            disk_budget=self.settings.disk_budget,
        )
        await asyncio.to_thread(
            scan_files, inv, store.blobs_dir, store.partial_dir, store.cache_dir
        )
        return inv

    async def plan(self, sel: Selection) -> PrunePlan:
        if self.flush_uses is not None:
            await self.flush_uses()
        if sel.to_budget and self.settings.disk_budget is None:
            raise Refused(
                'prune --to-budget needs a disk budget: set disk_budget (e.g. "20GB") in '
                "the config file and reload the daemon (`systemctl reload modeld` or SIGHUP), "
                "or MODELD_DISK_BUDGET and restart it; or use --unused-for D"
            )
        # Read at call time, so a test can shorten the grace for its own daemon.
        grace = prune.ORPHAN_GRACE
        return plan_prune(await self.inventory(), sel, self.activity(), orphan_grace=grace)

    # --- prune -----------------------------------------------------------------------

    async def prune(self, sel: Selection, *, dry_run: bool) -> dict[str, Any]:
        """Plan (and unless ``dry_run`` carry out) a prune; one document with every item."""
        if dry_run:
            plan = await self.plan(sel)
            return self._doc(sel, plan, plan.items, plan.kept, [], dry_run=True)

        async def run() -> dict[str, Any]:
            async with self._lock:
                plan = await self.plan(sel)
                removed, kept, errors = await self._execute(plan.items)
                if removed:
                    await self.store.scan()
                return self._doc(sel, plan, removed, plan.kept + kept, errors, dry_run=False)

        return await self._shielded(run)

    @staticmethod
    def _doc(
        sel: Selection,
        plan: PrunePlan,
        items: list[Item],
        kept: list[Item],
        errors: list[dict[str, Any]],
        *,
        dry_run: bool,
    ) -> dict[str, Any]:
        doc = plan.to_dict()
        total = sum(i.size for i in items)
        doc.update(
            dry_run=dry_run,
            selection=sel.to_dict(),
            items=[i.to_dict() for i in items],
            kept=[i.to_dict() for i in kept],
            total=total,
            freed=0 if dry_run else total,
            errors=errors,
        )
        return doc

    def _late_busy(self, item: Item) -> str | None:
        """Why ``item`` may not go after all: something started using it since the plan."""
        act = self.activity()
        if item.kind == "model" and item.id is not None:
            # Only this id's own engines and download count: a blob that another loaded id
            # shares stays on disk anyway (the blob goes only with its last row).
            return act.model_busy(item.id)
        if item.kind in ("partial", "journal") and (
            item.id in act.downloading or item.path in act.download_paths
        ):
            return "downloading"
        if item.digest is not None and item.digest in act.loaded_digests:
            return "loaded"
        return None

    async def _execute(
        self, items: list[Item]
    ) -> tuple[list[Item], list[Item], list[dict[str, Any]]]:
        removed: list[Item] = []
        kept: list[Item] = []
        errors: list[dict[str, Any]] = []
        for item in items:
            why = self._late_busy(item)
            if why is not None:
                kept.append(replace(item, reason=why))
                continue
            try:
                why = await self._remove_item(item)
            except (OSError, ModeldError) as e:
                message = (
                    e.message if isinstance(e, ModeldError) else f"{item.path}: {e.strerror or e}"
                )
                errors.append({"item": item.to_dict(), "message": message})
                logs.event("prune_failed", kind=item.kind, path=item.path, error=message)
                continue
            if why is not None:
                kept.append(replace(item, reason=why))
                continue
            removed.append(item)
            self.metrics.removed_bytes.labels(item.kind).inc(item.size)
            self.metrics.removed_items.labels(item.kind).inc()
        return removed, kept, errors

    async def _digest_used(self, digest: str) -> bool:
        row = await self.store.read(
            lambda c: c.execute("SELECT 1 FROM installed WHERE digest = ?", (digest,)).fetchone()
        )
        return row is not None

    async def _remove_item(self, item: Item) -> str | None:
        """Remove one item; return why it was kept instead, or None when it is gone."""
        store = self.store
        if item.kind == "model":
            assert item.id is not None
            await store.remove(item.id)  # row first, then the blob if unused, then its cache
            return None
        if item.kind in ("partial", "journal"):
            if item.id is not None:
                # Rows before the file: a partial without rows is restarted by the downloader.
                await SqliteJournal(store).clear(item.id)
            if item.path is not None:
                # Checked again after the await, with no await before the unlink.
                if self._late_busy(item) is not None:
                    return "downloading"
                await asyncio.to_thread(_delete_path, Path(item.path))
        elif item.kind in ("quarantined", "orphan_blob", "orphan_cache"):
            assert item.path is not None
            if item.digest is not None and await self._digest_used(item.digest):
                return "installed again since the plan"
            await asyncio.to_thread(_delete_path, Path(item.path))
        else:
            raise AssertionError(item.kind)
        await store.event("pruned", item=item.kind, model=item.id, path=item.path, size=item.size)
        return None

    # --- rm --------------------------------------------------------------------------

    async def remove_model(self, model_id: str, *, force: bool) -> dict[str, Any]:
        """Remove an installed model (row, blob if unused, cache) and its partial download."""
        if not valid_model_id(model_id):
            raise BadRequest(
                f"{model_id[:140]!r} is not a valid model id (letters, digits, '.', '_', '-'); "
                "`modeld list --installed` shows the installed ids"
            )
        return await self._shielded(lambda: self._remove_model(model_id, force))

    async def _targets(self, model_id: str) -> list[Item]:
        """Everything of ``model_id`` on disk: its install, its partial, its journal rows."""
        inv = await self.inventory()
        items: list[Item] = []
        row = next((r for r in inv.rows if r.id == model_id), None)
        if row is not None:
            shared = any(r.digest == row.digest for r in inv.rows if r.id != model_id)
            blob = inv.blobs.get(row.digest)
            cache = inv.caches.get(row.digest)
            size = 0 if shared or blob is None else blob.size + (cache.size if cache else 0)
            why = "removed on request" + (
                "; its file stays (another model uses it)" if shared else ""
            )
            items.append(
                Item("model", size, why, str(blob.path) if blob else None, model_id, row.digest)
            )
        partial = next((f for f in inv.partials if f.path.name == f"{model_id}.partial"), None)
        if partial is not None:
            items.append(
                Item("partial", partial.size, "its partial download", str(partial.path), model_id)
            )
        elif model_id in inv.journal_keys:
            items.append(Item("journal", 0, "journal rows of its download", None, model_id))
        return items

    def _in_use(self, model_id: str) -> list[str]:
        reasons: list[str] = []
        pool = self.pool
        views = [v for v in (pool.views() if pool is not None else []) if v.model == model_id]
        if views:
            engines = ", ".join(v.id for v in views)
            pinned = " (pinned)" if any(v.pinned for v in views) else ""
            reasons.append(f"loaded in engine {engines}{pinned}")
        if model_id in self.activity().downloading:
            reasons.append("being downloaded")
        return reasons

    async def _remove_model(self, model_id: str, force: bool) -> dict[str, Any]:
        async with self._lock:
            reasons = self._in_use(model_id)
            targets = await self._targets(model_id)
            if not targets and not reasons:
                installed = [r.id for r in (await self.inventory()).rows]
                raise ModelNotInstalled(
                    f"model {model_id} is not installed and has no partial download; nothing to "
                    f"remove{did_you_mean(model_id, installed)}; `modeld list --installed` "
                    "shows what is"
                )
            unloaded: list[str] = []
            cancelled = False
            if reasons and not force:
                raise ModelInUse(
                    f"model {model_id} is {' and '.join(reasons)}; run `modeld rm {model_id} "
                    "--force` to unload or cancel it first and then remove it"
                    + (
                        f", or `modeld unload {model_id}` first"
                        if "being downloaded" not in reasons
                        else ""
                    ),
                    reasons=reasons,
                )
            if reasons:
                cancelled = await self._cancel_download(model_id)
                unloaded = await self._unload(model_id)
                targets = await self._targets(model_id)
                again = self._in_use(model_id)
                if again:
                    raise ModelInUse(
                        f"model {model_id} is {' and '.join(again)} again (another client "
                        f"started it while it was being removed); try `modeld rm {model_id} "
                        "--force` again"
                    )
            removed, kept, errors = await self._execute(targets)
            if kept:
                why = "; ".join(f"{i.kind}: {i.reason}" for i in kept)
                raise ModelInUse(f"model {model_id} was not removed completely ({why}); try again")
            if errors:
                why = "; ".join(e["message"] for e in errors)
                raise RemoveFailed(
                    f"model {model_id} was not removed completely: {why}; fix the file's "
                    "permissions and run `modeld rm` again"
                )
            return {
                "id": model_id,
                "removed": [i.to_dict() for i in removed],
                "freed": sum(i.size for i in removed),
                "unloaded": unloaded,
                "cancelled_download": cancelled,
            }

    async def _cancel_download(self, model_id: str) -> bool:
        downloads = self.downloads
        if downloads is None or model_id not in self.activity().downloading:
            return False
        removed = DownloadError(
            f"download of {model_id} stopped: `modeld rm --force` removed the model and its "
            f"partial; nothing was kept, `modeld pull {model_id}` starts it again"
        )
        with contextlib.suppress(DownloadNotFound):
            await downloads.cancel(model_id, removed)
            logs.event("rm_cancelled_download", model=model_id)
            return True
        return False

    async def _unload(self, model_id: str) -> list[str]:
        pool = self.pool
        if pool is None:
            return []
        try:
            views = await pool.unload(model_id, refusal=_removed, final=True)
        except EngineNotFound:
            return []
        logs.event("rm_unloaded", model=model_id, engines=len(views))
        return [str(v["id"]) for v in views]


def _removed(target: Target) -> ModelNotInstalled:
    """The error of a request for a model that ``rm --force`` removed before serving it."""
    model = target.model_id
    return ModelNotInstalled(
        f"model {model} was removed (`modeld rm {model} --force`) before this request was "
        f"served; install it again (`modeld pull {model}`, or `modeld import` for a local "
        "file) to use it"
    )
