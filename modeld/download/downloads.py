"""Downloads as jobs in the daemon, and ``import`` of local files.

``Downloads`` is the daemon's ``downloads`` part: one ``DownloadJob`` per model at a time
(concurrent pulls join it), jobs outlive the client that started them, cancelling keeps
the partial, and stopping it cancels every job after its journal is written.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import functools
import hashlib
import os
import re
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import aiofiles.os

from modeld import logs
from modeld.catalog.catalog import Catalog, Entry
from modeld.config import Settings, format_size
from modeld.download.job import (
    DownloadJob,
    DownloadState,
    DownloadTarget,
    HeaderCheck,
    Installer,
    OnRefused,
    Tuning,
)
from modeld.download.journal import Journal
from modeld.download.mirrors import Mirror, MirrorState
from modeld.download.source import SourceSet
from modeld.errors import (
    BadRequest,
    Conflict,
    CorruptModel,
    DigestConflict,
    DiskFull,
    DownloadError,
    DownloadNotFound,
    IntegrityError,
    LocalEntry,
    ModeldError,
    ModelNotFound,
    Offline,
    ShuttingDown,
)
from modeld.layout import MODEL_ID_RE, file_name_problem, model_id_from
from modeld.metrics import Metrics
from modeld.store.store import Store
from modeld.store.vouches import MemoryVouches, VouchBook

Resolve = Callable[[str], DownloadTarget]
# (model id, the staged copy, the file's name, size, sha256): the entry of an imported file.
LocalEntryWriter = Callable[[str, Path, str, int, str], Awaitable[None]]
# How an install checked against the local entry made from it at import is marked.
LOCAL_VOUCH = "local entry (sha256 taken at import)"
# FICLONE from <linux/fs.h>: a copy-on-write clone of a whole file (btrfs, XFS, ...).
_FICLONE = 0x40049409
_COPY_CHUNK = 8 * 1024 * 1024
# Room an import leaves free beyond the file itself (the database, logs, journals).
_IMPORT_RESERVE = 64 * 1024 * 1024


def result_dict(result: Any) -> Any:
    to_dict = getattr(result, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if isinstance(result, dict):
        return {k: str(v) if isinstance(v, Path) else v for k, v in result.items()}
    return result


def failure_line(model_id: str, message: str) -> str:
    """A failed pull as one ``status`` line: the message, led by the model's id unless its
    head (before the first colon) names it already ("download of m1 failed: ...")."""
    if model_id in message.split(":", 1)[0].split():
        return message
    return f"{model_id}: {message}"


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
        header_check: Callable[[Path, str, str], None] | None = None,
        find_by_file_name: Callable[[str], DownloadTarget | None] | None = None,
        vouches: VouchBook | None = None,
        local_entry: LocalEntryWriter | None = None,
        pull_check: HeaderCheck | None = None,
        sources: SourceSet | None = None,
    ) -> None:
        self.settings = settings
        # Whose hosts get credentials and vouch (the Hub); none: every URL is a plain mirror.
        self.sources = sources if sources is not None else SourceSet()
        self.resolve = resolve
        self.journal = journal
        self.installer = installer
        self.metrics = metrics
        self.header_check = header_check
        # The same check on a pull's verified file, worded for a pull (``pull_header_check``).
        self.pull_check = pull_check
        self.find_by_file_name = find_by_file_name
        # Writes the local entry of an imported file no entry names (the daemon's catalog).
        self.local_entry = local_entry
        # What sources vouched for once, per (entry, pinned revision): the store in the daemon.
        self.vouches: VouchBook = vouches if vouches is not None else MemoryVouches()
        self.jobs: dict[str, DownloadJob] = {}
        self.recent: deque[DownloadJob] = deque(maxlen=10)
        # Imports copy at once but commit (decide again, entry, install) one at a time: two
        # imports of different files to one new id end as one after the other would.
        self._import_commit = asyncio.Lock()
        self._stopping = False

    # --- jobs ----------------------------------------------------------------------

    def pull(
        self, model_id: str, *, limit_rate: int | None = None, on_refused: OnRefused | None = None
    ) -> DownloadJob:
        """Start the model's download, or join the one running; ``limit_rate`` (bytes/s)
        caps the job from now on, whoever started it. ``on_refused`` runs when the file the
        job started here verified is not a LiteRT-LM model (see ``DownloadJob``)."""
        job = self.jobs.get(model_id)
        if job is not None and not job.finished:
            job.limit_rate(limit_rate)
            return job
        if self._stopping:
            raise ShuttingDown("the daemon is stopping; pull again once it is back", 5.0)
        target = self.resolve(model_id)
        if not target.urls:
            raise LocalEntry(
                f"{model_id} is a local entry (made by `modeld import` from a file): it has no "
                f"URL to pull it from; import the file again (`modeld import PATH {model_id}`)"
            )
        if self.settings.hf_hub_offline:
            raise Offline(
                f"{model_id} is not installed, and HF_HUB_OFFLINE is set: modeld does not touch "
                "the network. Unset HF_HUB_OFFLINE to download it, or import the file "
                f"(`modeld import PATH {model_id}`)"
            )
        job = DownloadJob(
            target=target,
            partial=self.settings.state_dir.partial_for(target.model_id),
            journal=self.journal,
            installer=self.installer,
            tuning=Tuning.from_settings(self.settings, self.sources),
            metrics=self.metrics,
            vouches=self.vouches,
            check=self.pull_check,
            on_refused=on_refused,
        )
        job.limit_rate(limit_rate)
        self.jobs[model_id] = job
        job.start()
        assert job.task is not None
        job.task.add_done_callback(functools.partial(self._finished, job))
        if self.metrics is not None:
            self.metrics.downloads_active.set(len(self.jobs))
        logs.event("download_started", model=model_id, mirrors=len(target.urls))
        return job

    async def drop_stale(self, model_id: str) -> None:
        """Cancel a running pull of ``model_id`` whose entry changed since it started (its
        ``size``, ``sha256`` or ``urls``) or is gone, so that a pull now does not join a
        download of a file the catalog no longer names. Its waiters are told why; the pull
        that follows starts on the entry as it is (a partial of another size or sha256 is
        started again), or, for a removed entry, is refused as one not in the catalog."""
        job = self.jobs.get(model_id)
        if job is None or job.finished:
            return
        try:
            now: DownloadTarget | None = self.resolve(model_id)
        except ModelNotFound:
            now = None
        if now == job.target:
            return
        why = "was removed from the catalog" if now is None else "changed (size, sha256 or urls)"
        logs.event("download_stale", model=model_id, why=why)
        told = "nothing more is fetched for it"
        if now is not None:
            told = f"`modeld pull {model_id}` fetches the file the entry names now"
        await self.cancel(
            model_id,
            DownloadError(
                f"download of {model_id} stopped: its catalog entry {why} during the pull; {told}"
            ),
        )
        if self.jobs.get(model_id) is job:
            del self.jobs[model_id]  # now, not at its done callback: the pull goes on at once

    def _finished(self, job: DownloadJob, _task: object = None) -> None:
        if self.jobs.get(job.id) is job:
            del self.jobs[job.id]
        self.recent.append(job)
        if self.metrics is not None:
            self.metrics.downloads_active.set(len(self.jobs))
            if job.finished:
                self.metrics.pulls.labels(job.state.value).inc()

    def get(self, model_id: str) -> DownloadJob:
        job = self.jobs.get(model_id)
        if job is None:
            # Not "see `modeld pull ID`": that would start the download.
            raise DownloadNotFound(
                f"no pull of {model_id!r} is running, so there is none to cancel; "
                "`modeld status` lists the pulls that are"
            )
        return job

    def list(self) -> list[dict[str, Any]]:
        return [job.snapshot() for job in self.jobs.values()]

    def partials(self) -> tuple[Path, ...]:
        """The partial files of the downloads running now (not leftovers to report)."""
        return tuple(job.partial for job in self.jobs.values() if not job.finished)

    async def cancel(self, model_id: str, why: ModeldError | None = None) -> dict[str, Any]:
        """Cancel a running download; the partial file and its journal stay for a resume.
        ``why`` is what the pull's clients are told instead, when the caller removes them."""
        job = self.get(model_id)
        job.cancel(why)
        if job.task is not None:
            await asyncio.wait([job.task])
        return job.snapshot()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Cancel every job; each writes its journal before it ends (idempotent)."""
        self._stopping = True
        tasks = [j.task for j in self.jobs.values() if j.task is not None]
        for job in list(self.jobs.values()):
            job.cancel(
                DownloadError(
                    f"the daemon stopped during the pull of {job.id}; the partial is kept: "
                    f"start it again, and `modeld pull {job.id}` resumes"
                )
            )
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.shutdown_timeout)

    def status(self) -> dict[str, Any]:
        active = self.list()
        # A model's latest pull speaks for it: a failure is no problem once a later pull of
        # the model installed it, nor while one runs.
        latest: dict[str, DownloadJob] = {}
        for j in reversed(self.recent):
            latest.setdefault(j.id, j)
        problems = [
            failure_line(j.id, j.error.message)
            for j in reversed(latest.values())
            if j.error is not None and j.state is DownloadState.FAILED and j.id not in self.jobs
        ]
        # A mirror (a site cache) that sent wrong bytes is worth fixing even though the
        # repair saved the pull.
        problems += [
            _lied(j.id, m)
            for j in reversed(latest.values())
            if j.state is DownloadState.INSTALLED and j.id not in self.jobs
            for m in j.mirrors
            if m.state is MirrorState.BANNED
        ]
        if active:
            parts = [
                f"{a['id']} {100 * a['arrived'] // max(1, a['size'])}%"
                f" ({format_size(a['speed'])}/s)"
                for a in active
            ]
            summary = f"{len(active)} running: " + ", ".join(parts)
        else:
            summary = "none running"
        return {"summary": summary, "problems": problems[-3:], "active": active}

    # --- import --------------------------------------------------------------------

    async def import_file(self, path: Path, model_id: str | None) -> dict[str, Any]:
        """Adopt the file at ``path``, opened once by the daemon itself.

        Only for peers who could open the file themselves anyway (root, the daemon's own
        uid): the API decides that. The path is opened with ``O_NOFOLLOW|O_NONBLOCK`` (a
        symbolic link or a FIFO swapped in never blocks or redirects the open), and every
        failure reads the same, so the answer says nothing about the file.
        """
        path = Path(path)
        if not path.is_absolute():
            raise BadRequest(f"{path}: give an absolute path (the CLI does this for you)")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = await asyncio.to_thread(os.open, path, flags)
        except OSError:
            raise BadRequest(
                f"{path} could not be opened for import (missing, not readable, or a "
                "symbolic link); give the real file's path, or let `modeld import` pass it"
            ) from None
        try:
            return await self.import_fd(fd, path.name, model_id, shown=str(path))
        finally:
            os.close(fd)

    async def import_fd(
        self, fd: int, name: str, model_id: str | None, *, shown: str | None = None
    ) -> dict[str, Any]:
        """Adopt a local ``.litertlm`` read from the open descriptor ``fd`` (cloned or
        copied into blobs/), checked like a download.

        ``name`` is the file's name (for the id); ``shown`` how messages name the file. Only
        a regular file is read, from that descriptor, after a free-space check, and only
        when its size is the entry's. Without an id, the id is the catalog entry whose
        ``file_name`` is ``name``, else its stem. A file no entry names gets a local entry
        (``local = true``, its size and sha256, no URL) written by ``local_entry``.
        """
        shown = shown or name
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"{shown} is not a regular file; import reads model files only")
        found, target = self._import_decide(name, model_id, st.st_size, shown)
        await aiofiles.os.makedirs(self.settings.partial_dir, exist_ok=True)
        # A sparse or cloned source says nothing about what a copy takes: count the copy.
        free = await asyncio.to_thread(free_bytes, self.settings.partial_dir)
        if free < target.size + _IMPORT_RESERVE:
            raise DiskFull(
                f"importing {target.model_id} needs {format_size(target.size)}, and modeld "
                f"keeps {format_size(_IMPORT_RESERVE)} free beside it, but only "
                f"{format_size(free)} is free under {self.settings.partial_dir}; free some "
                "space (`modeld prune`) and import again"
            )
        tmp = self.settings.partial_dir / f"{target.model_id}.import-{os.getpid()}-{time.time_ns()}"
        try:
            digest, linked = await asyncio.to_thread(_link_or_copy, fd, tmp, target.size, shown)
            if self.header_check is not None:
                await asyncio.to_thread(self.header_check, tmp, target.model_id, shown)
            async with self._import_commit:
                # Decided again: an import that committed meanwhile may have written the
                # entry of this id (then this file is checked against it, as after it).
                found, target = self._import_decide(name, model_id, st.st_size, shown)
                by: str | None = LOCAL_VOUCH
                if found is None:
                    await self._write_local_entry(target.model_id, tmp, name, target.size, digest)
                else:
                    by = await self._import_vouched_by(target, shown, digest)
                    if not target.urls:  # the local entry an earlier import made
                        by = LOCAL_VOUCH
                result = await self.installer(target.model_id, tmp, digest, target.size, by)
        finally:
            tmp.unlink(missing_ok=True)
        logs.event("imported", model=target.model_id, digest=digest, linked=linked)
        out = result_dict(result)
        if isinstance(out, dict):
            out = {**out, "linked": linked, "source": shown}
        return {"id": target.model_id, "installed": out}

    def _import_decide(
        self, name: str, model_id: str | None, size: int, shown: str
    ) -> tuple[DownloadTarget | None, DownloadTarget]:
        """(the entry's target or None, the target) of an import of a file of ``size``
        bytes; refused while the id is being downloaded or when the entry's size differs."""
        found = self._import_target(Path(name), model_id)
        target = found or self._local_target(Path(name), model_id, size)
        running = self.jobs.get(target.model_id)
        if running is not None and not running.finished:
            raise Conflict(
                f"{target.model_id} is being downloaded; cancel it first "
                f"(`modeld pull {target.model_id} --cancel`)"
            )
        if size != target.size:
            raise IntegrityError(
                f"{shown} has {size} bytes but entry {target.model_id} says "
                f"{target.size}; it is another file or another revision"
            )
        return found, target

    async def _import_vouched_by(
        self, target: DownloadTarget, path: str, digest: str
    ) -> str | None:
        """Who vouches for an imported file's ``digest``: the entry's sha256, else the digest
        a source vouched for earlier for the entry's pinned revision; a mismatch refuses it."""
        if target.sha256 is not None:
            if digest != target.sha256:
                raise IntegrityError(
                    f"{path} has sha256 {digest}, entry {target.model_id} expects "
                    f"{target.sha256}; it was not imported"
                )
            return "registry sha256"
        rev = self.sources.pinned(target.urls)
        kept = await self.vouches.vouched(target.model_id, rev) if rev else None
        if kept is None:
            return None
        if digest != kept.sha256:
            raise DigestConflict(
                f"{path} has sha256 {digest}, but {kept.source} vouched for {kept.sha256} "
                f"for {rev} (entry {target.model_id}) on {kept.day}; it is another file "
                "and was not imported",
                sources={"file": digest, f"{kept.source} (kept {kept.via})": kept.sha256},
            )
        return kept.verified_by

    def _import_target(self, path: Path, model_id: str | None) -> DownloadTarget | None:
        """The entry's target for an import, or None when no entry names the file."""
        if model_id is None and self.find_by_file_name is not None:
            found = self.find_by_file_name(path.name)
            if found is not None:
                return found
        try:
            return self.resolve(model_id or path.name.removesuffix(".litertlm"))
        except ModelNotFound:
            if self.local_entry is None:
                raise ModelNotFound(
                    f"no catalog entry for {path.name}; pass its id (`modeld import {path} ID`)"
                    " or add a registry entry for it first"
                ) from None
            return None

    def _local_target(self, path: Path, model_id: str | None, size: int) -> DownloadTarget:
        """The target of a file no entry names: its own size, no URL, an id from its name."""
        problem = file_name_problem(path.name)
        if problem is not None:
            # Its local entry keeps the name (``file_name``): refused before a byte is copied.
            raise BadRequest(
                f"the file name {path.name!r} {problem}, so no entry can hold it; rename the "
                "file, or import it under the id of an entry that names it"
            )
        stem = path.name.removesuffix(".litertlm")
        made = model_id or model_id_from(stem)
        if made is None or not MODEL_ID_RE.fullmatch(made):
            raise BadRequest(
                f"no model id can be made from {path.name}; pass one (`modeld import PATH ID`)"
            )
        if size <= 0:
            raise BadRequest(f"{path.name} is empty; import reads model files only")
        return DownloadTarget(made, [], size)

    async def _write_local_entry(
        self, model_id: str, staged: Path, name: str, size: int, digest: str
    ) -> None:
        assert self.local_entry is not None
        await self.local_entry(model_id, staged, name, size, digest)
        logs.event("local_entry_written", model=model_id, digest=digest)


def _lied(model_id: str, m: Mirror) -> str:
    """What ``status`` says of a mirror a pull banned for wrong bytes, and what to do."""
    if m.via is not None:
        what, fix = f"the site cache {m.label}", "purge the file from that cache"
    else:
        what, fix = f"the mirror {m.label}", "fix that mirror or remove it from the entry"
    return (
        f"{model_id}: {what} {m.reason or 'sent wrong bytes'}; it was banned for that pull, "
        f"which was repaired from the other URLs and verified: {fix}"
    )


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _link_or_copy(src: int, dest: Path, size: int, shown: str) -> tuple[str, bool]:
    """Clone the open file ``src`` to ``dest`` (copy-on-write reflink where the file system
    has it), else copy exactly ``size`` bytes; return (sha256, cloned).

    Reads with ``pread``: the descriptor may be shared with the peer that passed it, whose
    file offset must neither matter nor move. Never a hard link: the blob is made read-only
    and must not share an inode with the user's file, which the user may later chmod and
    edit under a row that says verified. The hash is taken from ``dest`` (or from the bytes
    copied), never from ``src`` after the fact, so what is installed is what was hashed. A
    file that shrinks or grows while it is read is refused.
    """
    h = hashlib.sha256()
    cloned = False
    try:
        with dest.open("xb") as fout:
            try:
                fcntl.ioctl(fout.fileno(), _FICLONE, src)
                cloned = True
            except OSError:
                pass
            if not cloned:
                done = 0
                while done < size:
                    chunk = os.pread(src, min(_COPY_CHUNK, size - done), done)
                    if not chunk:
                        break
                    h.update(chunk)
                    fout.write(chunk)
                    done += len(chunk)
                if done != size or os.pread(src, 1, size):
                    raise IntegrityError(
                        f"{shown} changed size while it was read; import it again once it "
                        "is complete"
                    )
                return h.hexdigest(), False
        copied = 0
        with dest.open("rb") as f:
            while chunk := f.read(_COPY_CHUNK):
                h.update(chunk)
                copied += len(chunk)
        if copied != size:
            raise IntegrityError(
                f"{shown} changed size while it was read; import it again once it is complete"
            )
        return h.hexdigest(), True
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"the disk filled up while {shown} was copied; free some space "
                "(`modeld prune`) and import again"
            ) from e
        raise


def header_check(path: Path, model_id: str, shown: str | None = None) -> None:
    """The file to import must be a readable ``.litertlm`` (``modelfile.header.read_header``).

    Its message names the file as the importer gave it: no pull can fix a file of one's own.
    """
    try:
        from modeld.modelfile.header import read_header
    except ImportError:  # the header reader is optional for the downloader
        return
    try:
        read_header(
            path,
            subject=f"file {shown or path.name}",
            hint="it was not imported: choose a LiteRT-LM model (a .litertlm file)",
        )
    except CorruptModel:
        raise
    except Exception as e:
        raise CorruptModel(
            f"{shown or path} is not a valid .litertlm file ({e}); it was not imported"
        ) from e


def pull_header_check(catalog: Catalog) -> HeaderCheck:
    """The header check of a pull's verified file: a file that is not a LiteRT-LM model is
    refused as ``import`` refuses it, naming the entry that points at it."""

    def check(path: Path, model_id: str) -> None:
        from modeld.modelfile.header import read_header

        source = catalog.source_of(model_id)
        fix = (
            f"remove it (`modeld rm --entry {model_id}`)"
            if catalog.is_own(model_id)
            else "correct its `urls` and `sha256`"
        )
        read_header(
            path,
            subject=f"{model_id}: the downloaded file",
            hint=(
                f"it was not installed and nothing was kept: the entry {source or model_id} "
                f"points at a file that is not a .litertlm model; {fix}"
            ),
        )

    return check


def daemon_downloads(
    settings: Settings, catalog: Catalog, store: Store, metrics: Metrics | None, sources: SourceSet
) -> Downloads:
    """The daemon's ``Downloads``: targets from its catalog, journal and installs in its store."""
    from modeld.download.journal import SqliteJournal

    def resolve(model_id: str) -> DownloadTarget:
        return DownloadTarget.from_entry(catalog.get(model_id))

    def by_file_name(name: str) -> DownloadTarget | None:
        for entry in catalog.entries():
            if entry.file_name == name:
                return DownloadTarget.from_entry(entry)
        return None

    async def local_entry(model_id: str, staged: Path, name: str, size: int, digest: str) -> None:
        kind = await asyncio.to_thread(_model_type, staged, model_id)
        if kind is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", kind):
            kind = None  # the file's own words: only a plain name goes into the entry
        stem = name.removesuffix(".litertlm")
        entry = Entry(
            id=model_id,
            display_name=(f"{stem} ({kind})" if kind else stem)[:200],
            file_name=name,
            local=True,
            size=size,
            sha256=digest,
        )
        comment = (
            f"Written by `modeld import` of {name} on {time.strftime('%Y-%m-%d', time.gmtime())}: "
            "a local file, with no URL to pull it from;\nsize and sha256 are the imported file's. "
            f"`modeld rm --entry {model_id}` removes it."
        )
        catalog.write_entry(entry, comment)

    return Downloads(
        settings,
        resolve=resolve,
        journal=SqliteJournal(store),
        installer=store.install,
        metrics=metrics,
        header_check=header_check,
        find_by_file_name=by_file_name,
        vouches=store,
        local_entry=local_entry,
        pull_check=pull_header_check(catalog),
        sources=sources,
    )


def _model_type(path: Path, model_id: str) -> str | None:
    """The model type the file's header names (for a local entry's display name), if any."""
    try:
        from modeld.modelfile.header import read_header

        info = read_header(path, model_id=model_id)
    except Exception:  # the header was checked already; a name is not worth failing for
        return None
    meta = info.to_dict().get("llm_metadata") or {}
    kind = meta.get("model_type")
    return str(kind) if kind else None
