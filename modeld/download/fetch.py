"""The piece engine: Range requests over every healthy mirror at once, into one partial file.

Which mirror fetches which piece is ``schedule.Schedule``'s part (the fastest mirror at the
queue's front, a near-best slower one at its back, the hash front kept off slow mirrors,
the endgame). Piece bodies are read by ``rangeio`` (a lean range reader into preallocated
buffers) unless a mirror needs aiohttp (proxy, redirect, expired signed URL, chunked body).
Bytes are written with ``os.pwrite`` at their offset straight from the event loop
(half the CPU of a copied write in a thread; aiofiles has no pwrite: docs/downloader.md); each
block's CRC-32 is computed as it is written and reported to ``on_block`` (the journal).
``prefixhash.PrefixHasher`` feeds the whole-file sha256 from the contiguous prefix in one
thread and starts each finished block's writeback (``sync_file_range``, so the final fsync
is short) in another.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import urllib.request
from collections.abc import Callable

import aiohttp
from yarl import URL

from modeld.download.journal import Block
from modeld.download.mirrors import (
    Mirror,
    MirrorFailure,
    MirrorState,
    classify_exception,
    classify_status,
    open_range,
    os_error_to_modeld,
    parse_content_range,
    request,
    request_headers,
)
from modeld.download.prefixhash import PrefixHasher
from modeld.download.rangeio import RangeClient, RangeConn, RangeFallback
from modeld.download.ratelimit import TokenBucket
from modeld.download.schedule import Piece, Schedule
from modeld.errors import DownloadError

# ISA-L's CRC-32: zlib's polynomial and values (journals stay valid), and faster
# (docs/benchmarks.md#hashing-and-checksums).
try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover (isal has wheels for the usual platforms)
    from zlib import crc32

__all__ = [
    "CHUNK",
    "RAW_RANGES",
    "Fetcher",
    "Piece",
    "PrefixHasher",
    "Writer",
    "crc32",
]

CHUNK = 1024 * 1024
# Pieces in flight are journaled in part (marks) this often, and at each finished block when
# they moved on by MARK_BYTES since their last mark: what a kill -9 loses per connection.
MARK_EVERY = 0.02
MARK_BYTES = 256 * 1024
Writer = Callable[[int, memoryview, int], int]
# Piece bodies through the lean range reader (``rangeio``) instead of aiohttp's parser; the
# benchmark turns it off to compare the two in one run.
RAW_RANGES = True


class Fetcher(Schedule):
    """Fetch every block not yet ``done`` from ``mirrors`` into ``fd``."""

    def __init__(
        self,
        *,
        fd: int,
        path: str,
        size: int,
        block_size: int,
        piece_size: int,
        connections: int,
        mirrors: list[Mirror],
        session: aiohttp.ClientSession,
        done: bytearray,
        on_block: Callable[[Block], None],
        on_marks: Callable[[list[Block]], None] | None = None,
        writer: Writer = os.pwrite,
        on_stream_only: Callable[[Mirror], None] | None = None,
        on_stream: Callable[[Mirror, int], None] | None = None,
        on_refetch: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(
            size=size,
            block_size=block_size,
            piece_size=piece_size,
            mirrors=mirrors,
            done=done,
            connections=connections,
        )
        self.fd, self.path = fd, path
        self.session = session
        self.on_block = on_block
        self.on_marks = on_marks  # journal the blocks in flight in part (``_mark``)
        self._mark_timer: asyncio.TimerHandle | None = None
        self.writer = writer
        # A mirror found to ignore Range; a stream from byte 0 begun with bytes already done.
        self.on_stream_only, self.on_stream = on_stream_only, on_stream
        # The bytes of a block kept in part at the resume (a mark) are fetched again.
        self.on_refetch = on_refetch
        self.sources: dict[int, str] = {}
        self.received = 0
        self.raw_pieces = 0  # pieces (attempts) read by the raw range reader
        self.fallbacks = 0  # raw attempts handed to aiohttp (redirect, expired URL, chunked)
        timeout = session.timeout
        self.rangeio = RangeClient(
            connect_timeout=timeout.sock_connect or 15.0,
            stall_timeout=timeout.sock_read or 20.0,
        )
        self._no_raw: set[int] = set()  # id() of mirrors the raw reader does not serve
        self._proxies = urllib.request.getproxies()
        self.late_bytes = 0  # bytes the prefix gained with the last block (see _block_finished)
        self.hasher: PrefixHasher | None = None
        self._changed = asyncio.Event()
        self._fatal: BaseException | None = None
        self._advance_prefix()

    # --- --limit-rate ----------------------------------------------------------------

    @property
    def limit(self) -> TokenBucket | None:
        """The job's rate cap, over all its connections (None: uncapped)."""
        return self.rangeio.limit

    @limit.setter
    def limit(self, bucket: TokenBucket | None) -> None:
        self.rangeio.limit = bucket  # the raw reader pauses each connection's reading

    async def pace(self, n: int) -> None:
        """On aiohttp's path: count ``n`` bytes, and wait out the job's debt before reading on."""
        limit = self.limit
        if limit is None:
            return
        delay = limit.take(n)
        while delay > 0:
            await asyncio.sleep(delay)
            delay = limit.wait()

    # --- bookkeeping ---------------------------------------------------------------

    @property
    def done_bytes(self) -> int:
        full = sum(self.done) * self.block_size
        if self.nblocks and self.done[-1]:
            full -= self.nblocks * self.block_size - self.size
        return full

    def _advance_prefix(self) -> None:
        while self.prefix_blocks < self.nblocks and self.done[self.prefix_blocks]:
            self.prefix_blocks += 1
        if self.hasher is not None:
            self.hasher.advance(min(self.size, self.prefix_blocks * self.block_size))

    def _block_finished(self, idx: int, crc: int, mirror: Mirror) -> None:
        start, end = self.block_range(idx)
        self.done[idx] = 1
        self.sources[idx] = mirror.label
        if self.hasher is not None:
            self.hasher.block_done(start, end - start)
        self.on_block(Block(idx, crc, mirror.label))
        before = self.prefix_blocks
        self._advance_prefix()
        if self.prefix_blocks >= self.nblocks:
            # What the last block released to the hasher at once (it could not start
            # earlier): the structural part of the hash tail.
            self.late_bytes = self.size - min(self.size, before * self.block_size)
            if self.hasher is not None:
                self.hasher.last_byte()
            for p in list(self.inflight):
                self._abandon(p)  # e.g. a slow duplicate: the file is complete

    def _mark(self, moved: int) -> None:
        """Journal each piece in flight that moved on by ``moved`` bytes since its last mark
        in part: its block's first bytes (those written so far) and their CRC-32. The bytes
        are in the page cache, which a killed process leaves behind; a mark that outlives
        its bytes (a power cut) fails its CRC-32 check on resume like a block."""
        if self.on_marks is None:
            return
        bs = self.block_size
        marks = []
        for p in self.inflight:
            pos = p.pos
            if p.abandoned or p.stream or p.mirror is None or pos - p.marked < max(moved, 1):
                continue
            p.marked = pos
            idx = pos // bs
            if pos % bs and not self.done[idx]:
                marks.append(Block(idx, p.crc, p.mirror.label, pos % bs))
        if marks:
            self.on_marks(marks)

    def _tick(self) -> None:
        """Every ``MARK_EVERY`` seconds: mark the pieces that moved (slow connections too),
        and move work off connections gone silent (``_rescue``)."""
        self._mark(0)
        self._rescue()
        self._mark_timer = asyncio.get_running_loop().call_later(MARK_EVERY, self._tick)

    # --- the connections -------------------------------------------------------------

    async def run(self) -> None:
        """Fetch until every block is done; raise DownloadError/DiskFull on failure."""
        self._plan()
        workers = [asyncio.create_task(self._worker()) for _ in range(self.connections)]
        self._tick()
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
            if self._mark_timer is not None:
                self._mark_timer.cancel()
            self.rangeio.close()
        if self._fatal is not None:
            raise self._fatal

    def _all_done(self) -> bool:
        return self.prefix_blocks >= self.nblocks or all(self.done)

    def _no_mirror_error(self) -> DownloadError:
        reasons = "; ".join(f"{m.label}: {m.reason or m.state}" for m in self.mirrors)
        return DownloadError(
            f"no mirror can serve the rest of the file ({reasons}); "
            "the partial is kept, pull again to resume or add a mirror"
        )

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def wake(self) -> None:
        """A probe ended: a mirror may have joined (or gone); idle connections look again."""
        self._wake()

    def stop(self, error: BaseException) -> None:
        """Fail the fetch with ``error`` now: no piece more, those in flight closed."""
        self._fatal = error
        for p in list(self.inflight):
            self._abandon(p)
        self._wake()

    def _probing(self) -> bool:
        return any(m.state is MirrorState.PROBING for m in self.mirrors)

    async def _idle(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    async def _worker(self) -> None:
        while self._fatal is None and not self._all_done():
            work = self._next_piece()
            if work is not None:
                await self._run_piece(work[1], work[0])
                continue
            ready = [m for m in self.in_play() if m.usable and m.ranges]
            if self.queue and not ready:
                if self._probing():
                    # A mirror still probing may serve ranges: wait for its answer before
                    # streaming from byte 0, or before giving up.
                    await self._idle(1.0)
                    continue
                if any(m.usable for m in self.in_play()):
                    await self._stream_all()
                    continue
                self._fatal = self._no_mirror_error()
                self._wake()
                return
            if self.queue:
                # Every mirror is backing off, or only probes are in flight: wait for one.
                now = time.monotonic()
                waits = [m.not_before - now for m in ready if m.not_before > now]
                await self._idle(max(0.01, min(waits)) if waits else 0.05)
                continue
            if not self.inflight:
                await self._idle(0.05)
                continue
            stolen = self._steal()
            if stolen is None:
                await self._idle(0.05)
                continue
            await self._run_piece(stolen[1], stolen[0])

    async def _stream_all(self) -> None:
        """Only mirrors without ranges are left: one plain GET from byte 0 (one worker)."""
        if any(p.stream for p in self.inflight):
            await self._idle(0.2)
            return
        self.queue.clear()
        self.kept_marks.clear()  # the stream fetches every byte again
        mirror = next(m for m in self.in_play() if m.usable)
        if self.on_stream is not None:
            self.on_stream(mirror, self.done_bytes)
        await self._run_piece(Piece(0, self.size, 0, stream=True), mirror)
        if not self._all_done():
            self._plan()

    def _refetching(self, piece: Piece) -> None:
        """A piece that starts below the end of a block kept in part at the resume (a mark)
        fetches those bytes again: they are no longer resumed (``on_refetch``)."""
        idx = piece.pos // self.block_size
        kept = self.kept_marks.get(idx)
        if kept is not None and piece.pos < idx * self.block_size + kept and not piece.stream:
            del self.kept_marks[idx]
            if self.on_refetch is not None:
                self.on_refetch(kept)

    async def _run_piece(self, piece: Piece, mirror: Mirror) -> None:
        if piece.pos % self.block_size and piece.src not in (None, mirror.label):
            # Its block's first bytes came from another mirror: fetch the block whole here.
            piece.pos -= piece.pos % self.block_size
            piece.crc, piece.src = 0, None
        self._refetching(piece)
        piece.marked = piece.pos
        piece.mirror, piece.began, piece.got, piece.abandoned = mirror, time.monotonic(), 0, False
        piece.last = piece.began
        piece.window, piece.window_start = 0, piece.began
        self.inflight.add(piece)
        mirror.active += 1
        try:
            if not (self._raw_ok(piece, mirror) and await self._read_raw(piece, mirror)):
                await self._read_aiohttp(piece, mirror)
            mirror.succeed()
            if piece.pos < piece.end and not piece.abandoned and not piece.stream:
                # A short 206 (RFC 9110 §15.3.7) is allowed: queue the rest, no strike.
                rest = Piece(piece.pos, piece.end, piece.pos, crc=piece.crc, src=mirror.label)
                self.queue.appendleft(rest)
        except OSError as e:
            failure = classify_exception(e)
            if piece.abandoned and failure is not None:
                return  # taken over: we closed it; not the mirror's fault
            if failure is None:
                self._fatal = os_error_to_modeld(e, self.path)
                self._wake()
                return
            self._requeue(piece, mirror, failure)
        except (MirrorFailure, aiohttp.ClientError, TimeoutError) as e:
            if piece.abandoned:
                return
            self._requeue(piece, mirror, classify_exception(e) or MirrorFailure("gone", str(e)))
        finally:
            if piece.window:
                measured = not piece.probe or piece.got >= piece.probe
                seconds = time.monotonic() - piece.window_start if measured else 0.0
                mirror.count(piece.window, seconds)  # 0 s: the bytes, no rate
                piece.window = 0
            mirror.active -= 1
            self.inflight.discard(piece)
            if piece.resp is not None:
                piece.resp.close()
                piece.resp = None
            self._wake()

    async def _read_aiohttp(self, piece: Piece, mirror: Mirror) -> None:
        """Fetch the piece through aiohttp (redirects, proxies, streams; ``piece.resp``)."""
        if piece.stream:
            piece.resp = await request(self.session, mirror, {})
            if piece.resp.status != 200:
                raise classify_status(piece.resp.status, piece.resp)
            await self._read_stream(piece, mirror, piece.resp)
            return
        piece.resp = await open_range(self.session, mirror, piece.pos, piece.end, self.size)
        if not piece.abandoned:
            await self._read_into(piece, mirror, piece.resp)

    # --- the raw range reader ----------------------------------------------------------

    def _raw_ok(self, piece: Piece, mirror: Mirror) -> bool:
        """Whether the raw reader may fetch this piece: a range, from a URL without a proxy,
        credentials, or a mirror whose answers it did not take before."""
        if not RAW_RANGES or piece.stream or id(mirror) in self._no_raw:
            return False
        url = mirror.resolved or mirror.url
        if url.scheme not in ("http", "https") or url.user is not None or not url.host:
            return False
        # A proxy that applies to this host (``mirrors.proxy_for``): aiohttp talks to it.
        return url.scheme not in self._proxies or bool(urllib.request.proxy_bypass(url.host))

    async def _read_raw(self, piece: Piece, mirror: Mirror) -> bool:
        """Fetch the piece with the raw reader; False when aiohttp must take it instead."""
        url: URL = mirror.resolved or mirror.url
        extra = {"Connection": "keep-alive"}
        if mirror.etag:
            extra["If-Range"] = mirror.etag
        bs = self.block_size

        def sink(data: memoryview) -> bool:
            if piece.abandoned:
                return False
            self._consume(piece, mirror, data, bs)
            return piece.pos < piece.end and not piece.abandoned

        def on_conn(conn: RangeConn | None) -> None:
            piece.raw = conn

        self.raw_pieces += 1
        try:
            await self.rangeio.fetch(
                url,
                request_headers(url, extra, mirror.sources),
                piece.pos,
                piece.end,
                self.size,
                sink,
                from_cache=mirror.resolved is not None,
                on_conn=on_conn,
            )
        except RangeFallback as e:
            self.fallbacks += 1
            if e.expired:
                mirror.resolved = None  # signed URL expired: aiohttp asks the origin again
            if e.disable:
                self._no_raw.add(id(mirror))
            return False
        return True

    def _requeue(self, piece: Piece, mirror: Mirror, failure: MirrorFailure) -> None:
        ranges = mirror.ranges
        mirror.fail(failure)
        if ranges and not mirror.ranges and self.on_stream_only is not None:
            self.on_stream_only(mirror)
        if piece.abandoned or piece.stream:
            return
        if piece.pos < piece.end:
            rest = Piece(piece.pos, piece.end, piece.pos, crc=piece.crc, src=mirror.label)
            self.queue.appendleft(rest)

    async def _read_into(self, piece: Piece, mirror: Mirror, resp: aiohttp.ClientResponse) -> None:
        """Write the body at the piece's offsets as it comes (aiohttp's path).

        ``readchunk`` hands over the buffers the parser made, without joining them (a copy),
        and each is written with one ``pwrite`` straight from the loop.
        """
        served = parse_content_range(resp.headers.get("Content-Range"))
        stop = min(piece.end, served[1] + 1) if served else piece.end
        content = resp.content
        bs = self.block_size
        while piece.pos < min(stop, piece.end):
            chunk, _ = await content.readchunk()
            if piece.abandoned:
                return
            if not chunk:
                raise MirrorFailure("transient", f"body ended at byte {piece.pos} (short answer)")
            n = min(len(chunk), min(stop, piece.end) - piece.pos)  # the end may have been split
            self._consume(piece, mirror, memoryview(chunk)[:n], bs)
            await self.pace(len(chunk))

    def _consume(self, piece: Piece, mirror: Mirror, data: memoryview, bs: int) -> None:
        """Write ``data`` at ``piece.pos`` (cut to the piece's end); CRC and report blocks."""
        pos = piece.pos
        n = min(len(data), piece.end - pos)  # the end may have been split meanwhile
        if n <= 0:
            return
        if n < len(data):
            data = data[:n]
        written = self.writer(self.fd, data, pos)
        while written < n:
            written += self.writer(self.fd, data[written:], pos + written)
        new = pos + n
        piece.pos = new
        piece.got += n
        piece.last = time.monotonic()
        self.received += n
        mirror.received += n
        piece.window += n
        if piece.window >= CHUNK and not piece.probe:  # a probe piece counts once, at its end
            now = time.monotonic()
            mirror.count(piece.window, now - piece.window_start)
            piece.window, piece.window_start = 0, now
        # CRC-32 per block here, while the bytes are in the CPU cache (cheaper than reading
        # them back in the hashing thread).
        block_end = min(self.size, (pos // bs + 1) * bs)
        if new < block_end:
            piece.crc = crc32(data, piece.crc)
            return
        off = finished = 0
        while pos + off < new:
            idx = (pos + off) // bs
            seg = min(new, (idx + 1) * bs, self.size) - pos
            piece.crc = crc32(data[off:seg], piece.crc)
            off = seg
            if pos + off == min(self.size, (idx + 1) * bs):
                if not self.done[idx]:
                    self._block_finished(idx, piece.crc, mirror)
                    finished += 1
                piece.crc = 0
        if finished:
            # With the block's row, the marks of the pieces that moved on (this one's CRC
            # is whole again: it covers its block up to ``pos``).
            self._mark(MARK_BYTES)

    async def _read_stream(
        self, piece: Piece, mirror: Mirror, resp: aiohttp.ClientResponse
    ) -> None:
        """A plain GET from byte 0: write what is missing, skip blocks already done."""
        bs = self.block_size
        last = time.monotonic()
        while piece.pos < piece.end:
            chunk = await resp.content.read(CHUNK)
            if not chunk:
                raise MirrorFailure("transient", f"body ended at byte {piece.pos} (short answer)")
            await self.pace(len(chunk))
            now = time.monotonic()
            mirror.received += len(chunk)
            mirror.count(len(chunk), now - last)
            last = now
            view = memoryview(chunk)[: piece.end - piece.pos]
            piece.got += len(view)
            while view:
                idx = piece.pos // bs
                block_end = min(self.size, (idx + 1) * bs)
                seg = view[: block_end - piece.pos]
                if not self.done[idx]:
                    written = 0
                    while written < len(seg):
                        written += self.writer(self.fd, seg[written:], piece.pos + written)
                    piece.crc = crc32(seg, piece.crc)
                self.received += len(seg)
                piece.pos += len(seg)
                view = view[len(seg) :]
                if piece.pos == block_end:
                    if not self.done[idx]:
                        self._block_finished(idx, piece.crc, mirror)
                    piece.crc = 0
