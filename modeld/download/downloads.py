"""Downloads as jobs in the daemon, and ``import`` of local files.

``Downloads`` is ``services.parts["downloads"]``: one ``DownloadJob`` per model at a time
(concurrent pulls join it), jobs outlive the client that started them, cancelling keeps
the partial, and the stop hook cancels every job after its journal is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modeld import logs
from modeld.config import Settings
from modeld.download.job import DownloadJob, DownloadState, DownloadTarget, Installer, Tuning
from modeld.download.journal import Journal
from modeld.errors import (
    BadRequest,
    Conflict,
    CorruptModel,
    DigestConflict,
    DiskFull,
    DownloadNotFound,
    IntegrityError,
    ModelNotFound,
    ShuttingDown,
    disk_full,
)
from modeld.metrics import Metrics
from modeld.store.vouches import MemoryVouches, VouchBook

Resolve = Callable[[str], DownloadTarget]
# FICLONE from <linux/fs.h>: a copy-on-write clone of a whole file (btrfs, XFS, ...).
_FICLONE = 0x40049409
_COPY_CHUNK = 8 * 1024 * 1024


def result_dict(result: Any) -> Any:
    to_dict = getattr(result, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(result, dict):
        return {k: str(v) if isinstance(v, Path) else v for k, v in result.items()}
    return result


class Downloads:
    """Every download of the daemon, by model id (the download id is the model id)."""

    def __init__(
        self,
        settings: Settings,
        *,
        resolve: Resolve,
        journal: Journal,
        installer: Installer,
        metrics: Metrics | None = None,
        is_current: Callable[[str], Any] | None = None,
        header_check: Callable[[Path, str], Any] | None = None,
        find_by_file_name: Callable[[str], DownloadTarget | None] | None = None,
        vouches: VouchBook | None = None,
    ) -> None:
        self.settings = settings
        self.resolve = resolve
        self.journal = journal
        self.installer = installer
        self.metrics = metrics
        # async (model_id) -> dict | None: the install that already matches the entry, if any.
        self.is_current = is_current
        self.header_check = header_check
        self.find_by_file_name = find_by_file_name
        # What hubs vouched for once, per (entry, pinned revision): the store in the daemon.
        self.vouches: VouchBook = vouches if vouches is not None else MemoryVouches()
        self.jobs: dict[str, DownloadJob] = {}
        self.recent: deque[DownloadJob] = deque(maxlen=10)
        self._stopping = False

    # --- jobs ----------------------------------------------------------------------

    def pull(self, model_id: str) -> DownloadJob:
        """Start the model's download, or join the one running."""
        job = self.jobs.get(model_id)
        if job is not None and not job.finished:
            return job
        if self._stopping:
            raise ShuttingDown("the daemon is stopping; pull again once it is back", 5.0)
        target = self.resolve(model_id)
        job = DownloadJob(
            target=target,
            partial=self.settings.state_dir.partial_for(target.model_id),
            journal=self.journal,
            installer=self.installer,
            tuning=Tuning.from_settings(self.settings),
            metrics=self.metrics,
            vouches=self.vouches,
        )
        self.jobs[model_id] = job
        job.start()
        assert job.task is not None
        job.task.add_done_callback(functools.partial(self._finished, job))
        if self.metrics is not None:
            self.metrics.downloads_active.set(len(self.jobs))
        logs.event("download_started", model=model_id, mirrors=len(target.urls))
        return job

    def _finished(self, job: DownloadJob, _task: object = None) -> None:
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]
        self.recent.append(job)
        if self.metrics is not None:
            self.metrics.downloads_active.set(len(self.jobs))

    def get(self, model_id: str) -> DownloadJob:
        job = self.jobs.get(model_id)
        if job is None:
            raise DownloadNotFound(
                f"no download of {model_id!r} is running; see `modeld pull {model_id}`"
            )
        return job

    def list(self) -> list[dict[str, Any]]:
        return [job.snapshot() for job in self.jobs.values()]

    async def cancel(self, model_id: str) -> dict[str, Any]:
        """Cancel a running download; the partial file and its journal stay for a resume."""
        job = self.get(model_id)
        job.cancel()
        if job.task is not None:
            await asyncio.wait([job.task])
        return job.snapshot()

    async def stop(self) -> None:
        """Stop hook: cancel every job; each writes its journal before it ends."""
        self._stopping = True
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        for job in list(self.jobs.values()):
            job.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout)

    def status(self) -> dict[str, Any]:
        active = self.list()
        problems = [
            f"{j.id}: {j.error.message}"
            for j in self.recent
            if j.error is not None and j.state is DownloadState.FAILED
        ]
        if active:
            parts = [
                f"{a['id']} {100 * a['completed'] // max(1, a['size'])}%"
                f" ({a['speed'] / 1e6:.0f} MB/s)"
                for a in active
            ]
            summary = f"{len(active)} running: " + ", ".join(parts)
        else:
            summary = "none running"
        return {"summary": summary, "problems": problems[-3:], "active": active}

    # --- import --------------------------------------------------------------------

    async def import_file(self, path: Path, model_id: str | None) -> dict[str, Any]:
        """Adopt a local ``.litertlm`` (cloned or copied into blobs/), checked like a download.

        Without an id, the id is the catalog entry whose ``file_name`` is the file's name,
        else the file's stem. An id without a catalog entry is refused: the entry carries
        the limits and backends an install needs (add it to a registry dir first).
        """
        path = Path(path)
        if not path.is_absolute():
            raise BadRequest(f"{path}: give an absolute path (the CLI does this for you)")
        if not await asyncio.to_thread(path.is_file):
            raise BadRequest(f"{path} is not a readable file; check the path")
        target = self._import_target(path, model_id)
        running = self.jobs.get(target.model_id)
        if running is not None and not running.finished:
            raise Conflict(
                f"{target.model_id} is being downloaded; cancel it first "
                f"(`modeld pull {target.model_id} --cancel`)"
            )
        size = path.stat().st_size
        if size != target.size:
            raise IntegrityError(
                f"{path} has {size} bytes but entry {target.model_id} says {target.size}; "
                "it is another file or another revision"
            )
        if self.header_check is not None:
            await asyncio.to_thread(self.header_check, path, target.model_id)
        self.settings.partial_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.settings.partial_dir / f"{target.model_id}.import-{os.getpid()}-{time.time_ns()}"
        try:
            try:
                digest, linked = await asyncio.to_thread(_link_or_copy, path, tmp)
            except OSError as e:
                if disk_full(e) is None:
                    raise
                raise DiskFull(
                    f"no space left in {self.settings.partial_dir} to import {path} "
                    f"({size} bytes); free space (`modeld prune`) and import it again"
                ) from e
            by = await self._import_vouched_by(target, path, digest)
            result = await self.installer(target.model_id, tmp, digest, size, by)
        finally:
            tmp.unlink(missing_ok=True)
        logs.event("imported", model=target.model_id, digest=digest, linked=linked)
        out = result_dict(result)
        if isinstance(out, dict):
            out = {**out, "linked": linked, "source": str(path)}
        return {"id": target.model_id, "installed": out}

    async def _import_vouched_by(
        self, target: DownloadTarget, path: Path, digest: str
    ) -> str | None:
        """Who vouches for an imported file's ``digest``: the entry's sha256, else the digest
        a hub vouched for earlier for the entry's pinned revision; a mismatch refuses it."""
        if target.sha256 is not None:
            if digest != target.sha256:
                raise IntegrityError(
                    f"{path} has sha256 {digest}, entry {target.model_id} expects "
                    f"{target.sha256}; it was not imported"
                )
            return "registry sha256"
        rev = target.revision
        kept = await self.vouches.vouched(target.model_id, rev) if rev else None
        if kept is None:
            return None
        if digest != kept.sha256:
            raise DigestConflict(
                f"{path} has sha256 {digest}, but {kept.source} vouched for {kept.sha256} "
                f"for {rev} (entry {target.model_id}) on {kept.day}; it is another file "
                "and was not imported",
                sources={"file": digest, f"{kept.source} (kept X-Linked-Etag)": kept.sha256},
            )
        return kept.verified_by

    def _import_target(self, path: Path, model_id: str | None) -> DownloadTarget:
        if model_id is not None:
            return self.resolve(model_id)
        if self.find_by_file_name is not None:
            found = self.find_by_file_name(path.name)
            if found is not None:
                return found
        try:
            return self.resolve(path.name.removesuffix(".litertlm"))
        except ModelNotFound:
            raise ModelNotFound(
                f"no catalog entry for {path.name}; pass its id (`modeld import {path} ID`) "
                "or add a registry entry for it first"
            ) from None


def _link_or_copy(src: Path, dest: Path) -> tuple[str, bool]:
    """Clone ``src`` to ``dest`` (copy-on-write reflink where the file system has it), else
    copy; return (sha256, cloned).

    Never a hard link: the blob is made read-only and must not share an inode with the
    user's file, which the user may later chmod and edit under a row that says verified.
    The hash is taken from ``dest`` (or from the bytes copied), never from ``src`` after
    the fact, so what is installed is what was hashed.
    """
    h = hashlib.sha256()
    cloned = False
    with src.open("rb") as fin, dest.open("wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            cloned = True
        except OSError:
            pass
        if not cloned:
            while chunk := fin.read(_COPY_CHUNK):
                h.update(chunk)
                fout.write(chunk)
            return h.hexdigest(), False
    with dest.open("rb") as f:
        while chunk := f.read(_COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest(), True


def header_check(path: Path, model_id: str) -> None:
    """The file must be a readable ``.litertlm`` (``modeld.litertlm.read_header``)."""
    try:
        from modeld.modelfile.header import read_header
    except ImportError:  # the header reader is optional for the downloader
        return
    try:
        read_header(path, model_id=model_id)
    except CorruptModel:
        raise
    except Exception as e:
        raise CorruptModel(
            f"{path} is not a valid .litertlm file ({e}); it was not imported"
        ) from e


async def current_install(store: Any, catalog: Any, model_id: str) -> dict[str, Any] | None:
    """The model's install when it still matches its entry (so a pull has nothing to do).

    An unverified install whose bytes differ from what a hub vouched for for the entry's
    pinned revision is not current either: a pull fetches the vouched file.
    """
    from modeld.catalog.catalog import outdated

    inst = await store.installed(model_id)
    if inst is None:
        return None
    entry = catalog.find(model_id)
    with contextlib.suppress(ModelNotFound):
        if outdated(entry, inst.digest, inst.size):
            return None
    if entry is not None and not inst.verified and entry.sha256 is None:
        rev = DownloadTarget.from_entry(entry).revision
        kept = await store.vouched(model_id, rev) if rev else None
        if kept is not None and kept.sha256 != inst.digest:
            return None
    return inst.to_dict()  # type: ignore[no-any-return]


def register(services: Any) -> Downloads:
    """Create the daemon's ``Downloads`` on its catalog and store, and register its hooks."""
    from modeld.download.journal import SqliteJournal

    catalog, store = services.parts["catalog"], services.parts["store"]

    def resolve(model_id: str) -> DownloadTarget:
        return DownloadTarget.from_entry(catalog.get(model_id))

    def by_file_name(name: str) -> DownloadTarget | None:
        for entry in catalog.entries():
            if entry.file_name == name:
                return DownloadTarget.from_entry(entry)
        return None

    async def is_current(model_id: str) -> dict[str, Any] | None:
        return await current_install(store, catalog, model_id)

    downloads = Downloads(
        services.settings,
        resolve=resolve,
        journal=SqliteJournal(store),
        installer=store.install,
        metrics=services.metrics,
        is_current=is_current,
        header_check=header_check,
        find_by_file_name=by_file_name,
        vouches=store,
    )
    services.parts["downloads"] = downloads
    services.status_sections["downloads"] = downloads.status
    services.stop_hooks.append(downloads.stop)
    return downloads
