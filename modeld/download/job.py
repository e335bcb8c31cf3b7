"""One verified, resumable download of a model file over all its mirrors.

A ``DownloadJob`` goes: check free space → re-check journaled blocks (CRC-32) → probe each
mirror (size, ETag, ``X-Linked-Etag``) → fetch the missing blocks (``fetch.Fetcher``) from
the first mirror that answers, later answers joining, while a thread hashes the contiguous
prefix → once every probe has ended, settle the expected sha256 (the entry's, what a source
vouched for on its redirect (``source.Claim``: a hub's ``X-Linked-Etag``), or what one vouched
for earlier for this pinned revision; sources that disagree fail the pull as soon as the
second one answers) → compare the sha256 → on a
mismatch, repair (re-fetch elsewhere the blocks of one suspect mirror at a time, re-hash
from each fixed block on, stop once the file matches, ban the mirror that lied) → install
(fsync, rename, fsync dir, row). The journal, the kept digests and the installer are
injected, so the downloader runs without the store (tests, the benchmark);
``modeld.download.downloads`` wires it into the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import shutil
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from yarl import URL

from modeld import logs
from modeld.catalog.catalog import Entry, how_to_edit_entry
from modeld.config import Settings, format_size
from modeld.download.fetch import CHUNK, Fetcher, PrefixHasher, Writer, crc32
from modeld.download.journal import BLOCK_SIZE, Block, Journal, JournalState, MemoryJournal
from modeld.download.mirrors import (
    NOT_FOUND,
    WRONG_SIZE,
    Mirror,
    MirrorFailure,
    MirrorState,
    open_range,
    os_error_to_modeld,
    probe,
    request,
)
from modeld.download.ratelimit import TokenBucket
from modeld.download.source import Claim, SourceSet
from modeld.errors import (
    BadRequest,
    CorruptModel,
    DigestConflict,
    DiskFull,
    DownloadError,
    IntegrityError,
    ModeldError,
)
from modeld.layout import MODEL_ID_RE, StateDir, blob_name
from modeld.metrics import Metrics
from modeld.store.store import place_blob
from modeld.store.vouches import MemoryVouches, Vouch, VouchBook

# Head-room kept free beyond the file itself (SQLite, logs, the rest of the system).
DISK_MARGIN = 64 * 1024 * 1024

Installer = Callable[[str, Path, str, int, str | None], Awaitable[Any]]
# The header check of a verified file before it is installed: (file, model id); raises
# CorruptModel for a file that is not a LiteRT-LM model (``downloads.pull_header_check``).
HeaderCheck = Callable[[Path, str], None]
# What a pull whose file the header check refused does once the partial is gone, before it
# fails (a hub pull removes the entry it wrote): returns the error the pull ends with.
OnRefused = Callable[[CorruptModel], Awaitable[ModeldError]]


class DownloadState(enum.StrEnum):
    """Where a download is; the API and the log show the value (a plain string)."""

    STARTING = "starting"  # created, its task not yet running
    PROBING = "probing"  # free space, journaled blocks re-checked, mirrors probed
    DOWNLOADING = "downloading"  # fetching the missing blocks
    VERIFYING = "verifying"  # hashing the tail, comparing the sha256
    REPAIRING = "repairing"  # re-fetching the blocks one lying mirror served
    INSTALLING = "installing"  # fsync, rename into blobs/, the row
    INSTALLED = "installed"  # done (final)
    FAILED = "failed"  # ``error`` says why (final)
    CANCELLED = "cancelled"  # the partial is kept for a resume (final)


FINISHED = frozenset({DownloadState.INSTALLED, DownloadState.FAILED, DownloadState.CANCELLED})


@dataclass(frozen=True)
class DownloadTarget:
    """What to download: the catalog entry's fields the downloader needs."""

    model_id: str
    urls: list[str]
    size: int
    sha256: str | None = None

    @classmethod
    def from_entry(cls, entry: Entry) -> DownloadTarget:
        return cls(entry.id, list(entry.urls), int(entry.size), entry.sha256)


@dataclass
class Tuning:
    """Downloader settings: MODELD_DOWNLOAD_CONNECTIONS, _PIECE_SIZE, _STALL_TIMEOUT,
    _PROBE_HEADER_TIMEOUT, _PROBE_FIRST_BYTE_TIMEOUT."""

    connections: int = 8
    piece_size: int = 16 * 1024 * 1024
    stall_timeout: float = 20.0
    connect_timeout: float = 15.0
    # A probe's answer headers, then its first body byte, must each come within these: a
    # mirror that trickles header lines resets every read timeout and would hold its probe.
    probe_header_timeout: float = 10.0
    probe_first_byte_timeout: float = 10.0
    # Whose hosts get credentials and vouch for a file (none: every URL is a plain mirror).
    sources: SourceSet = field(default_factory=SourceSet)

    @classmethod
    def from_settings(cls, settings: Settings, sources: SourceSet | None = None) -> Tuning:
        return cls(
            connections=settings.download_connections,
            piece_size=settings.piece_size,
            stall_timeout=settings.stall_timeout,
            probe_header_timeout=settings.probe_header_timeout,
            probe_first_byte_timeout=settings.probe_first_byte_timeout,
            sources=sources if sources is not None else SourceSet(),
        )


def local_installer(blobs_dir: Path) -> Installer:
    """An installer without the store's db: the store's ``place_blob`` into ``blobs_dir``."""

    async def install(model_id: str, src: Path, digest: str, size: int, by: str | None) -> Any:
        def place() -> Path:
            dest = blobs_dir / blob_name(digest)
            blobs_dir.mkdir(parents=True, exist_ok=True)
            place_blob(src, dest, size)
            return dest

        dest = await asyncio.to_thread(place)
        return {"id": model_id, "digest": digest, "size": size, "verified_by": by, "path": dest}

    return install


def _holds_data(path: Path) -> bool:
    """Whether ``path`` exists with some bytes written (not only its sparse size)."""
    try:
        return path.stat().st_blocks > 0
    except FileNotFoundError:
        return False


def _crc_blocks(fd: int, size: int, block_size: int, blocks: dict[int, Block]) -> list[int]:
    """Indexes of journaled blocks (or marks: their first bytes) whose bytes on disk still
    have the journaled CRC-32."""
    good = []
    for idx in sorted(blocks):
        start = idx * block_size
        length = min(size, start + block_size) - start
        part = blocks[idx].length
        if part is not None:
            length = part if 0 < part < length else 0
        if length <= 0:
            continue
        crc, pos = 0, start
        while pos < start + length:
            data = os.pread(fd, min(8 * CHUNK, start + length - pos), pos)
            if not data:
                break
            crc = crc32(data, crc)
            pos += len(data)
        if pos == start + length and crc == blocks[idx].crc:
            good.append(idx)
    return good


# What a pull that kept nothing advises, by the cause of its mirrors' failures.
_ADVICE = {
    NOT_FOUND: (
        "A 404 (or 410) means the entry's URL is wrong or the file is not on that mirror: fix "
        "the entry's `urls`"
    ),
    WRONG_SIZE: (
        "A file of another size means the mirror has another file than the entry's size "
        "({size} bytes) says: fix the entry (its `size` and `sha256`) or the mirror"
    ),
    None: "Fix or remove a mirror that keeps failing, or add another URL to the entry's `urls`",
    "unreachable": "Check the network (and HTTPS_PROXY) for the mirrors not reached",
}


def _nothing_kept(model_id: str, size: int, mirrors: list[Mirror]) -> str:
    """The message of a pull that no mirror could serve and that kept no byte: each mirror's
    reason, then what to fix for each cause among them."""
    reasons = "; ".join(f"{m.label}: {m.reason or m.state}" for m in mirrors)
    if not any(m.answered for m in mirrors):
        return (
            f"{model_id}: no mirror could be reached ({reasons}); nothing was kept. Check the "
            "network (and HTTPS_PROXY), or add a mirror of your own first in the entry's "
            f"`urls`: {how_to_edit_entry(model_id)}"
        )
    causes = {m.cause if m.answered else "unreachable" for m in mirrors}
    advice = [_ADVICE[c].format(size=size) for c in _ADVICE if c in causes]
    return (
        f"{model_id}: no mirror could serve the file ({reasons}); nothing was kept. "
        + ". ".join(advice)
        + f". To change the entry, {how_to_edit_entry(model_id)}"
    )


@dataclass
class DownloadJob:
    """One model's download; several pulls of the same model share it."""

    target: DownloadTarget
    partial: Path
    journal: Journal
    installer: Installer
    tuning: Tuning
    metrics: Metrics | None = None
    writer: Writer = os.pwrite
    vouches: VouchBook = field(default_factory=MemoryVouches)
    check: HeaderCheck | None = None  # run on the verified file before the install
    on_refused: OnRefused | None = None
    state: DownloadState = DownloadState.STARTING
    error: ModeldError | None = None
    result: Any = None
    started_at: float = field(default_factory=time.time)
    mirrors: list[Mirror] = field(default_factory=list)
    fetcher: Fetcher | None = None
    resumed: int = 0
    from_zero: str | None = None  # why a pull with a partial on disk starts from byte 0
    repaired: int = 0
    verified_by: str | None = None
    install_latency: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _crcs: dict[int, Block] = field(default_factory=dict)
    _marks: dict[int, Block] = field(default_factory=dict)  # blocks kept in part on resume
    _digest: str | None = None
    _session: aiohttp.ClientSession | None = None
    _kept: Vouch | None = None  # what a source vouched for earlier for this revision
    limit: TokenBucket | None = None  # --limit-rate: one bucket over all its connections
    _probes: dict[asyncio.Task[None], Mirror] = field(default_factory=dict)
    _ended: set[asyncio.Task[None]] = field(default_factory=set)  # probes looked at
    _fetching: asyncio.Task[None] | None = None
    _cancelled_by: ModeldError | None = None  # what a cancel that keeps nothing says

    @property
    def id(self) -> str:
        return self.target.model_id

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def revision(self) -> str | None:
        """The pinned revision of the primary URL, under which a source's answer is kept."""
        return self.tuning.sources.pinned(self.target.urls)

    def limit_rate(self, rate: int | None) -> None:
        """Cap the job's rate at ``rate`` bytes/s from now on (a later pull may set another);
        None leaves the cap as it is."""
        if rate is None:
            return
        if self.limit is None:
            self.limit = TokenBucket(rate)
        else:
            self.limit.set_rate(rate)
        if self.fetcher is not None:
            self.fetcher.limit = self.limit
        logs.event("download_rate_limited", model=self.id, rate=rate)
        self._notify()

    def start(self) -> None:
        self.task = asyncio.create_task(self._main(), name=f"download-{self.id}")

    def _set(self, state: DownloadState) -> None:
        self.state = state
        logs.event("download_state", model=self.id, state=state.value)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- progress ------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """A progress record: bytes done and verified, per-mirror speed and state, ETA."""
        f = self.fetcher
        done = f.done_bytes if f else 0
        hashed = f.hasher.hashed if f and f.hasher else 0
        mirrors = [m.snapshot() for m in self.mirrors]
        # The bytes as they arrive, as each mirror's own figure: done bytes move by whole
        # blocks, so a speed from them swings between 0 and twice the rate on a slow pull.
        speed = sum(m["speed"] for m in mirrors)
        left = self.target.size - done
        record: dict[str, Any] = {
            "id": self.id,
            "model": self.id,
            "state": self.state.value,
            "size": self.target.size,
            "completed": done,
            # For a progress bar: what is here, the block on its way included (``completed``
            # moves by whole blocks: a file of one block would show nothing until its end).
            "arrived": max(done, min(self.target.size, self.resumed + (f.received if f else 0))),
            "verified": hashed if self.state is not DownloadState.INSTALLED else self.target.size,
            "received": f.received if f else 0,
            "resumed": self.resumed,
            "speed": round(speed),
            "eta": round(left / speed, 1) if speed > 0 and left > 0 else None,
            "mirrors": mirrors,
            "started_at": self.started_at,
            "limit_rate": self.limit.rate if self.limit is not None else None,
        }
        if self.state is DownloadState.INSTALLED:
            record.update(
                digest=self._digest,
                verified_by=self.verified_by,
                repaired=self.repaired,
                install_latency=self.install_latency,
            )
        if self.from_zero is not None:
            record["from_zero"] = self.from_zero
        if self.error is not None:
            record["error"] = self.error.to_dict()["error"]
        return record

    async def events(self, interval: float = 0.25) -> AsyncIterator[dict[str, Any]]:
        """Progress records until the job ends; raises its error if it failed."""
        while not self.finished:
            yield self.snapshot()
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), interval)
        if self.error is not None:
            raise self.error
        yield self.snapshot()

    async def wait(self) -> Any:
        """Wait for the end; return the install result or raise the error."""
        if self.task is not None:
            await asyncio.shield(self.task)
        if self.error is not None:
            raise self.error
        return self.result

    def cancel(self, why: ModeldError | None = None) -> None:
        """Stop the job; ``why`` is what its waiting clients are told (default: cancelled,
        the partial kept for a resume), for a cancel that does not keep the partial."""
        if self.task is not None and not self.task.done():
            self._cancelled_by = why
            self.task.cancel()

    # --- the job -------------------------------------------------------------------

    async def _main(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            self.error = self._cancelled_by or DownloadError(
                f"download of {self.id} cancelled; the partial is kept, pull again to resume"
            )
            self.error.code = "cancelled"  # type: ignore[misc]
            self._set(DownloadState.CANCELLED)
        except ModeldError as e:
            self.error = await self._forget_if_empty(e)
            self._set(DownloadState.FAILED)
        except OSError as e:
            self.error = os_error_to_modeld(e, str(self.partial))
            self._set(DownloadState.FAILED)
        except Exception as e:
            logs.event("download_crashed", model=self.id, error=repr(e))
            self.error = DownloadError(f"download of {self.id} failed: {e!r}; see the log")
            self._set(DownloadState.FAILED)
        if self.error is not None:
            logs.event(
                "download_failed", model=self.id, code=self.error.code, reason=self.error.message
            )

    async def _forget_if_empty(self, error: ModeldError) -> ModeldError:
        """A pull that no mirror could serve and that kept no byte leaves nothing behind: its
        partial would be a sparse file of the whole size, holding nothing to resume, that
        status, ``rm`` and prune report. The error then says why each mirror failed and what
        to fix (the network, the entry's URLs, its size, or the mirror)."""
        mirrors = self.mirrors
        f = self.fetcher
        kept = self._crcs or self._marks or (f is not None and f.received)
        kept = kept or any(m.received for m in mirrors)
        # ``mirrors`` is set once the journaled blocks were checked: before, ``_crcs`` and
        # ``_marks`` say nothing about what the partial holds.
        if (
            not isinstance(error, DownloadError)
            or isinstance(error, DiskFull)
            or kept
            or not mirrors
            or any(m.usable for m in mirrors)
        ):
            return error
        self.partial.unlink(missing_ok=True)
        await self.journal.clear(self.id)
        return DownloadError(_nothing_kept(self.id, self.target.size, mirrors))

    async def _run(self) -> None:
        t = self.target
        if not MODEL_ID_RE.fullmatch(t.model_id):
            raise BadRequest(f"{t.model_id!r} is not a valid model id")
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        state = await self.journal.load(t.model_id)
        if state is not None and (
            state.size != t.size or (t.sha256 and state.expected and state.expected != t.sha256)
        ):
            logs.event("download_restart", model=t.model_id, reason="entry changed")
            await self.journal.clear(t.model_id)
            state = None
            self._from_zero("the entry's size or sha256 changed since the partial was written")
        if state is None:
            if self.from_zero is None and _holds_data(self.partial):
                self._from_zero("the partial on disk has no journal: its blocks cannot be checked")
            self.partial.unlink(missing_ok=True)
        block = state.block_size if state else min(BLOCK_SIZE, self.tuning.piece_size)
        self._check_space()
        fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != t.size:
                os.ftruncate(fd, t.size)
            await self._prepare(fd, state, block)
            await self._fetch_and_install(fd, block)
        finally:
            cancelled = await self._end_hasher()
            try:
                await self._cancel_probes()
            finally:
                os.close(fd)
                if self._session is not None:
                    await self._session.close()
            if cancelled:
                raise asyncio.CancelledError

    async def _end_hasher(self) -> bool:
        """Stop the hasher's threads (a ``rehash`` in flight too) and wait for them, after
        the window or writeback call each is in, through any cancel that comes meanwhile:
        the descriptor they use is closed next. Returns whether a cancel came (the caller
        raises it once the descriptor and the session are closed)."""
        f = self.fetcher
        hasher = f.hasher if f is not None else None
        if hasher is None:
            return False
        hasher.stop()
        ended = asyncio.ensure_future(asyncio.to_thread(hasher.close))
        cancelled = False
        while not ended.done():
            try:
                await asyncio.shield(ended)
            except asyncio.CancelledError:
                cancelled = True
        return cancelled

    def _check_space(self) -> None:
        have = 0
        with contextlib.suppress(FileNotFoundError):
            have = self.partial.stat().st_blocks * 512
        need = max(0, self.target.size - have) + DISK_MARGIN
        free = shutil.disk_usage(self.partial.parent).free
        if free < need:
            raise DiskFull(
                f"{self.id} needs {format_size(need - DISK_MARGIN)} more in "
                f"{self.partial.parent}, and modeld keeps {format_size(DISK_MARGIN)} free "
                f"beside it, but only {format_size(free)} is free; free space "
                "(`modeld prune`) or set MODELD_HOME"
            )

    async def _prepare(self, fd: int, state: JournalState | None, block: int) -> None:
        t = self.target
        nblocks = -(-t.size // block)
        self._set(DownloadState.PROBING)
        if state is not None and state.blocks:
            good = await asyncio.to_thread(_crc_blocks, fd, t.size, block, state.blocks)
            self._crcs = {i: state.blocks[i] for i in good if state.blocks[i].length is None}
            self._marks = {i: state.blocks[i] for i in good if state.blocks[i].length}
        sources = self.tuning.sources
        caches = sources.caches
        primary = URL(t.urls[0])
        self.mirrors = [
            # A site cache stands in front of the entry's primary URL; the entry's URLs are
            # its fallback (``Schedule.in_play``), probed as ever: what they vouch for counts.
            Mirror(c.map(primary), primary=True, via=c, origin=primary, metrics=self.metrics)
            for c in caches
        ] + [
            Mirror(
                URL(u),
                primary=(i == 0),
                fallback=bool(caches),
                metrics=self.metrics,
                sources=sources,
            )
            for i, u in enumerate(t.urls)
        ]
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.tuning.connect_timeout,
            sock_read=self.tuning.stall_timeout,
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            trust_env=False,
            auto_decompress=False,
            read_bufsize=CHUNK,
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        )
        session = self._session
        if self.revision is not None:
            self._kept = await self.vouches.vouched(t.model_id, self.revision)
        self._probes = {
            asyncio.create_task(self._probe(m), name=f"probe-{self.id}-{m.label}"): m
            for m in self.mirrors
        }
        await self._first_answer()
        expected = self._expected()[0]
        etags = state.etags if state else {}
        for m in self.mirrors:
            old = etags.get(str(m.url))
            if old and m.etag and old != m.etag:
                # The file changed on that mirror since the journal: its blocks are suspect.
                self._crcs = {i: b for i, b in self._crcs.items() if b.mirror != m.label}
                self._marks = {i: b for i, b in self._marks.items() if b.mirror != m.label}
                logs.event("mirror_changed", model=self.id, mirror=m.label)
        if state is not None and state.blocks and not self._crcs and not self._marks:
            self._from_zero(
                f"none of the {len(state.blocks)} journaled blocks still holds (its CRC-32 "
                "differs, or its mirror's file changed)"
            )
        self.resumed = sum(min(t.size, (i + 1) * block) - i * block for i in self._crcs)
        self.resumed += sum(b.length or 0 for b in self._marks.values())
        new_state = JournalState(
            t.size,
            block,
            expected,
            {str(m.url): m.etag for m in self.mirrors if m.etag},
            {**self._marks, **self._crcs},
        )
        await self.journal.begin(self.id, new_state)
        done = bytearray(nblocks)
        for i in self._crcs:
            done[i] = 1
        self.fetcher = Fetcher(
            fd=fd,
            path=str(self.partial),
            size=t.size,
            block_size=block,
            piece_size=max(block, self.tuning.piece_size // block * block),
            connections=self.tuning.connections,
            mirrors=self.mirrors,
            session=session,
            done=done,
            on_block=self._on_block,
            on_marks=self._on_marks,
            writer=self.writer,
            on_stream_only=self._ignores_range,
            on_stream=self._streams_from_zero,
            on_refetch=self._refetched,
        )
        self.fetcher.limit = self.limit
        self.fetcher.on_fallback = self._falls_back
        for i, b in self._crcs.items():
            self.fetcher.sources[i] = b.mirror
        self.fetcher.partial = {i: (b.length or 0, b.crc, b.mirror) for i, b in self._marks.items()}

    # --- probes: the pull starts on the first answer, later ones join it ------------------

    async def _probe(self, m: Mirror) -> None:
        """Probe ``m``; its answer joins the schedule, or drops the mirror. A digest that
        contradicts an earlier source stops the fetch at once (``DigestConflict``)."""
        assert self._session is not None
        t = self.tuning
        await probe(
            self._session,
            m,
            self.target.size,
            t.probe_header_timeout,
            t.probe_first_byte_timeout,
        )
        if m.state is MirrorState.DROPPED:
            logs.event("mirror_dropped", model=self.id, mirror=m.label, reason=m.reason)
        elif m.state is MirrorState.STREAM_ONLY:
            self._ignores_range(m)
        elif self.state is not DownloadState.PROBING and m.usable:
            logs.event("mirror_joined", model=self.id, mirror=m.label, state=m.state.value)
        try:
            self._expected()
        except DigestConflict as e:
            if self.fetcher is not None:
                self.fetcher.stop(e)  # not one piece more, from any mirror
            raise
        if self.fetcher is not None:
            self.fetcher.wake()
        self._notify()

    def _falls_back(self, caches: list[Mirror]) -> None:
        """No site cache can serve the pull any more: the origins do, and the log says so."""
        why = "; ".join(f"{m.label}: {m.reason or m.state}" for m in caches)
        logs.event("site_cache_fallback", model=self.id, caches=why, to="origin")
        self._notify()

    def _ignores_range(self, m: Mirror) -> None:
        logs.event("mirror_ignores_range", model=self.id, mirror=m.label, reason=m.reason)
        self._notify()

    def _refetched(self, n: int) -> None:
        """``n`` bytes kept at the resume (a mark's) are fetched again: not resumed."""
        self.resumed = max(0, self.resumed - n)
        self._notify()

    def _streams_from_zero(self, m: Mirror, have: int) -> None:
        """Only ``m`` is left and it ignores Range: a resume must fetch from byte 0, and
        resumes nothing (the blocks already here are skipped, but fetched again)."""
        self.resumed = 0
        if have:
            self._from_zero(
                f"{m.label} ignores Range requests and no other mirror is left, so the file "
                f"is fetched again from byte 0 (the {have} bytes already here are not "
                "written again)"
            )

    def _from_zero(self, reason: str) -> None:
        """This pull starts from byte 0 though a partial was there: the progress and the log
        say why."""
        self.from_zero = reason
        logs.event("download_from_zero", model=self.id, reason=reason)
        self._notify()

    async def _probe_ended(self, task: asyncio.Task[None]) -> None:
        """A probe's end: its error (a ``DigestConflict`` names both sources), else a source's
        claim is kept."""
        self._ended.add(task)
        try:
            task.result()
        except DigestConflict:
            if not self._crcs and not self._marks:  # nothing of value in the partial yet
                await self._cancel_fetch()
                self.partial.unlink(missing_ok=True)
                await self.journal.clear(self.id)
            raise
        await self._keep_claim()

    async def _first_answer(self) -> None:
        """Wait until one mirror answered its probe with the right size, and every mirror
        whose journaled blocks are kept has answered (its ETag says whether they hold);
        or until every probe has ended."""
        keep = {b.mirror for b in [*self._crcs.values(), *self._marks.values()]}
        waiting = set(self._probes)
        while waiting:
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                await self._probe_ended(task)
            answered = any(
                m.state in (MirrorState.OK, MirrorState.STREAM_ONLY) for m in self._probes.values()
            )
            if answered and not any(self._probes[task].label in keep for task in waiting):
                return

    async def _fetch(self, f: Fetcher) -> None:
        """Run the fetcher while the probes still out come in: each answer joins the schedule
        (or drops its mirror), and a source that contradicts another fails the pull. Returns
        once every block is done and every probe has ended, so the sha256 is compared with
        every source there is."""
        # Probes that ended since the first answer, before the fetch starts (no await
        # between this check and the start).
        while ended := [t for t in self._probes if t.done() and t not in self._ended]:
            await self._probe_ended(ended[0])
        fetch = asyncio.create_task(f.run(), name=f"fetch-{self.id}")
        self._fetching = fetch
        waiting: set[asyncio.Task[None]] = {t for t in self._probes if not t.done()} | {fetch}
        try:
            while waiting:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in done - {fetch}:
                    await self._probe_ended(task)
                if fetch in done:
                    fetch.result()  # a failed fetch fails the pull now
                    if self.target.sha256:
                        # The entry's own sha256 is checked next: a probe still out could
                        # only add a claim about bytes that are all here (or, on a
                        # mismatch, join the repair), so the pull does not wait for it.
                        return
        finally:
            await self._cancel_fetch()

    async def _cancel_fetch(self) -> None:
        fetch = self._fetching
        if fetch is not None and not fetch.done():
            fetch.cancel()
            await asyncio.gather(fetch, return_exceptions=True)

    async def _drop_late_probes(self) -> None:
        """The file matched the entry's sha256 while some probes were still out: their
        mirrors are dropped for this pull, saying so, and their probes cancelled."""
        for task, m in self._probes.items():
            if not task.done():
                m.state = MirrorState.DROPPED
                m.reason = "probe: no answer before the file was complete and verified"
                logs.event("mirror_dropped", model=self.id, mirror=m.label, reason=m.reason)
        await self._cancel_probes()

    async def _cancel_probes(self) -> None:
        left = [t for t in self._probes if not t.done()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def _claims(self) -> list[tuple[str, Claim]]:
        """(host, claim) of each source's redirect seen for this file."""
        return [
            (m.label, m.claim)
            for m in self.mirrors
            if m.claim is not None
            # An answer about a file of another size is about another file (the probe drops
            # that mirror for its size): it vouches for nothing here.
            and m.claim.size in (None, self.target.size)
        ]

    def _expected(self) -> tuple[str | None, str | None]:
        """(sha256, who vouches for it), or ``DigestConflict`` when two sources disagree.

        Sources: the entry's sha256 and each source's claim on this pull (a hub's
        X-Linked-Etag); for an entry without sha256, also the digest a source vouched for
        earlier for this pinned revision (kept in the store). An entry's sha256 is the user's
        own word: it stands in for a kept answer, so a wrong kept answer is overcome by
        writing the right one there.
        """
        t = self.target
        sources: list[tuple[str, str]] = []
        if t.sha256:
            sources.append(("the entry's sha256", t.sha256))
        sources += [(f"the {c.via} of {host}", c.sha256) for host, c in self._claims()]
        kept = self._kept if not t.sha256 else None
        if kept is not None:
            sources.append((f"the {kept.via} {kept.source} sent on {kept.day} (kept)", kept.sha256))
        if not sources:
            return None, None
        first_name, first = sources[0]
        for name, sha in sources[1:]:
            if sha != first:
                logs.event("digest_conflict", model=self.id, a=first_name, b=name)
                raise DigestConflict(
                    f"{self.id}: {first_name} is {first}, but {name} is {sha}, for the same "
                    f"file{self._revision_note()}; one of them is wrong, and nothing was "
                    "installed. Check the sha256 its source publishes (a Hub file's page) and "
                    'put the right one in the entry (sha256 = "..."), or fix its URLs if one '
                    f"names another file: to change the entry, {how_to_edit_entry(self.id)}",
                    sources=dict(sources),
                )
        if t.sha256:
            return t.sha256, "registry sha256"
        claims = self._claims()
        if claims:
            host, claim = claims[0]
            return claim.sha256, f"{claim.via.lower()} ({host})"
        assert kept is not None
        return kept.sha256, kept.verified_by

    def _revision_note(self) -> str:
        rev = self.revision
        # An LFS object at a pinned commit never changes: two answers cannot both be right.
        return f" at the pinned revision {rev}" if rev else ""

    async def _keep_claim(self) -> None:
        """Keep a source's claim for (entry, pinned revision), so a later pull from a mirror
        alone is checked against it."""
        rev = self.revision
        claims = self._claims()
        if rev is None or not claims or self._kept is not None:
            return
        host, claim = claims[0]
        self._kept = Vouch(claim.sha256, self.target.size, host, time.time(), claim.via)
        await self.vouches.vouch(self.id, rev, self._kept)
        logs.event("digest_kept", model=self.id, revision=rev, sha256=claim.sha256, source=host)

    def _on_block(self, block: Block) -> None:
        self._crcs[block.index] = block
        # Handed to the journal's writer now: a kill -9 loses only the blocks in flight.
        self.journal.record(self.id, [block])
        if self.metrics is not None and self.fetcher is not None:
            start, end = self.fetcher.block_range(block.index)
            self.metrics.download_bytes.labels(block.mirror).inc(end - start)

    def _on_marks(self, marks: list[Block]) -> None:
        """Blocks in flight, in part: journaled with the finished ones (without an fsync)."""
        self.journal.record(self.id, marks)

    async def _fetch_and_install(self, fd: int, block: int) -> None:
        f = self.fetcher
        assert f is not None
        try:
            f.hasher = PrefixHasher(fd, self.target.size, block)
            f.hasher.advance(min(self.target.size, f.prefix_blocks * block))
            self._set(DownloadState.DOWNLOADING)
            try:
                await self._fetch(f)
            except BaseException:
                f.hasher.stop()  # waited for in ``_end_hasher``, before the fd is closed
                raise
            last_byte = time.monotonic()
            self._set(DownloadState.VERIFYING)
            digest = await f.hasher.digest()
            self.timings["hash_tail"] = round(time.monotonic() - last_byte, 4)
            # Again: a hub may have answered only now (its probe had failed for a while).
            expected, by = self._expected()
            await self._keep_claim()
            if expected is not None and digest != expected:
                digest = await self._repair(fd, expected, digest, by)
            await self._drop_late_probes()
            await self._check_header()
            self._digest, self.verified_by = digest, by
            self._set(DownloadState.INSTALLING)
            self.result = await self.installer(self.id, self.partial, digest, self.target.size, by)
            self.install_latency = round(time.monotonic() - last_byte, 4)
            await self.journal.flush(self.id)  # no journal write may land after the clear
            await self.journal.clear(self.id)
            logs.event(
                "download_installed",
                model=self.id,
                digest=digest,
                verified_by=by,
                latency=self.install_latency,
                repaired=self.repaired,
            )
            self._set(DownloadState.INSTALLED)
        finally:
            # Also on a cancel or a failure: what was recorded is written before the end.
            with contextlib.suppress(Exception):
                await self.journal.flush(self.id)

    async def _check_header(self) -> None:
        """Refuse a verified file that is not a LiteRT-LM model, as ``import`` does: its
        partial and journal go, nothing is installed (a sha256 says which bytes, not what
        they are: an entry may pin any file)."""
        if self.check is None:
            return
        try:
            await asyncio.to_thread(self.check, self.partial, self.id)
        except CorruptModel as e:
            self.partial.unlink(missing_ok=True)
            await self.journal.flush(self.id)
            await self.journal.clear(self.id)
            logs.event("download_refused", model=self.id, reason=e.message)
            raise (await self.on_refused(e) if self.on_refused is not None else e) from None

    # --- repair, not re-download -----------------------------------------------------
    # On a whole-file sha256 mismatch, the blocks of one mirror at a time (the suspect) are
    # re-fetched from another mirror, in file order; a block whose CRC-32 differs is
    # rewritten, and the file is re-hashed from that block on (from the hash state kept at
    # or before it). The repair stops as soon as the file matches: one flipped byte costs
    # the suspects' blocks up to the bad one, not every block of every mirror. The suspect
    # that sent a differing block is banned.

    def _suspects(self) -> list[tuple[str, list[int]]]:
        """(mirror, the blocks it served) in the order they are checked: the mirror that
        served the fewest blocks first (the cheapest to clear; a mirror that lies is as
        likely one as another), a hub that vouched for the expected sha256 last."""
        f = self.fetcher
        assert f is not None
        by_mirror: dict[str, list[int]] = {}
        for idx, label in f.sources.items():
            by_mirror.setdefault(label, []).append(idx)
        vouching = {host for host, _ in self._claims()}
        return sorted(
            ((label, sorted(blocks)) for label, blocks in by_mirror.items()),
            key=lambda kv: (kv[0] in vouching, len(kv[1])),
        )

    async def _repair(self, fd: int, expected: str, digest: str, by: str | None = None) -> str:
        """Find and fix the blocks that make the file's sha256 differ from ``expected``.

        ``by`` names who vouches for ``expected`` (the failure message says so)."""
        f = self.fetcher
        assert f is not None
        self._set(DownloadState.REPAIRING)
        source = f" ({by})" if by else ""
        for label, blocks in self._suspects():
            others = [m for m in self.mirrors if m.usable and m.ranges and m.label != label]
            if not others:
                continue
            fixed: list[int] = []
            try:
                found = await self._search(fd, blocks, others, expected, fixed)
            except DownloadError as e:
                # The partial stays: a pull once another mirror answers can still repair it.
                raise DownloadError(
                    f"{self.id}: the downloaded file's sha256 is {digest}, expected "
                    f"{expected}{source}; {e.message}, so the bad bytes could not be found "
                    "(partial kept). Pull again once another of the entry's URLs answers, or "
                    "add another mirror to the entry"
                ) from e
            if fixed:
                self.repaired += len(fixed)
                if self.metrics is not None:
                    self.metrics.download_repairs.inc(len(fixed))
                for m in self.mirrors:
                    if m.label == label:
                        m.state, m.reason = (
                            MirrorState.BANNED,
                            f"sent {len(fixed)} blocks with wrong bytes",
                        )
                logs.event("mirror_banned", model=self.id, mirror=label, blocks=len(fixed))
            if found is not None:
                digest = found
                if found == expected:
                    return found
        unreached = [
            m.label for m in self.mirrors if m.state is MirrorState.DROPPED and not m.answered
        ]
        if unreached:
            # Given up as unreachable for this pull, not proven wrong: one may answer later.
            raise DownloadError(
                f"{self.id}: the downloaded file's sha256 is {digest}, expected {expected}"
                f"{source}; {', '.join(unreached)} could not be reached, so the bad bytes could "
                "not be found (partial kept). Pull again once another of the entry's URLs "
                "answers, or add another mirror to the entry"
            )
        self.partial.unlink(missing_ok=True)
        await self.journal.clear(self.id)
        raise IntegrityError(
            f"{self.id}: the downloaded file's sha256 is {digest}, expected {expected}{source}, "
            "and no mirror could repair it; the entry or every mirror is wrong (partial "
            "discarded). Pull again once another of the entry's URLs answers, or add another "
            "mirror to the entry"
        )

    async def _search(
        self, fd: int, blocks: list[int], others: list[Mirror], expected: str, fixed: list[int]
    ) -> str | None:
        """Re-fetch ``blocks`` from ``others`` in file order, ``connections`` at a time.

        After a block that differs (rewritten, appended to ``fixed``), no new fetch starts:
        once those in flight are done, the file is re-hashed from the earliest block fixed
        since the last check, and the search stops when it matches. Returns the last digest
        computed (None when no block differed)."""
        f = self.fetcher
        assert f is not None and f.hasher is not None
        hasher = f.hasher
        todo = iter([i for i in blocks if i in self._crcs])
        inflight: set[asyncio.Task[int | None]] = set()
        unchecked: list[int] = []
        digest: str | None = None
        try:
            while True:
                while not unchecked and len(inflight) < self.tuning.connections:
                    idx = next(todo, None)
                    if idx is None:
                        break
                    inflight.add(asyncio.create_task(self._refetch_block(fd, idx, others)))
                if not inflight:
                    return digest
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    idx_fixed = task.result()
                    if idx_fixed is not None:
                        unchecked.append(idx_fixed)
                        fixed.append(idx_fixed)
                if unchecked and not inflight:
                    start = f.block_range(min(unchecked))[0]
                    unchecked.clear()
                    digest = await asyncio.to_thread(hasher.rehash, start)
                    if digest == expected:
                        return digest
        finally:
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)

    async def _refetch_block(self, fd: int, idx: int, others: list[Mirror]) -> int | None:
        """Fetch block ``idx`` from the first of ``others`` that serves it; rewrite it when
        its CRC-32 differs from what was written. Returns ``idx`` when rewritten."""
        f = self.fetcher
        assert f is not None and self._session is not None
        start, end = f.block_range(idx)
        for m in others:
            if not m.usable:
                continue
            try:
                resp = await open_range(self._session, m, start, end, self.target.size)
                try:
                    data = await resp.content.readexactly(end - start)
                finally:
                    resp.close()
                await f.pace(len(data))
            except (MirrorFailure, aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError):
                continue
            crc = zlib.crc32(data)
            if crc == self._crcs[idx].crc:
                return None
            os.pwrite(fd, data, start)
            self._crcs[idx] = Block(idx, crc, m.label)
            f.sources[idx] = m.label
            self.journal.record(self.id, [self._crcs[idx]])
            return idx
        raise DownloadError(f"no other mirror could serve block {idx}")


def memory_job(target: DownloadTarget, home: Path, tuning: Tuning, **kw: Any) -> DownloadJob:
    """A job with an in-memory journal and the store-less installer (tests, the benchmark)."""
    return DownloadJob(
        target=target,
        partial=StateDir(home).partial_for(target.model_id),
        journal=kw.pop("journal", None) or MemoryJournal(),
        installer=kw.pop("installer", None) or local_installer(StateDir(home).blobs),
        tuning=tuning,
        **kw,
    )


async def vouch_now(target: DownloadTarget, tuning: Tuning) -> Vouch | None:
    """Ask the sources that own some of the target's URLs which sha256 they vouch for.

    One ``Range: bytes=0-0`` request per such URL, redirects followed by hand so that the
    redirect's claim (a hub's X-Linked-Etag) is read; no body is fetched. None when no
    source answers.
    """
    hubs = [URL(u) for u in target.urls if tuning.sources.owner(URL(u)) is not None]
    if not hubs:
        return None
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=tuning.connect_timeout, sock_read=tuning.stall_timeout
    )
    async with aiohttp.ClientSession(
        timeout=timeout, trust_env=False, auto_decompress=False
    ) as session:
        for url in hubs:
            mirror = Mirror(url, primary=True, sources=tuning.sources)
            try:
                resp = await request(session, mirror, {"Range": "bytes=0-0"})
                resp.release()
            except (MirrorFailure, aiohttp.ClientError, OSError, TimeoutError) as e:
                logs.event("hub_unreachable", model=target.model_id, hub=mirror.label, error=str(e))
            claim = mirror.claim
            if claim is not None and claim.size in (None, target.size):
                return Vouch(claim.sha256, target.size, mirror.label, time.time(), claim.via)
    return None
