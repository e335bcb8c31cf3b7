"""The piece engine: Range requests over every healthy mirror at once, into one partial file.

Pieces (``piece_size``) are whole blocks (``journal.BLOCK_SIZE`` or smaller) and sit in one
shared queue; each connection takes the next piece and the mirror that would finish it
soonest (per-connection rate), so fast mirrors take more pieces and a mirror far slower than
the best stops getting any. When the queue is empty, idle connections look at the pieces in
flight (endgame): a slow piece is split at a block boundary so both halves finish together,
or, inside its last block, handed over to a faster mirror. A slower mirror's pieces are
placed ahead of the queue's front, where the others will not arrive before it is done, so
it never holds the prefix or the end. Piece bodies are read by ``rangeio`` (a lean range
reader into preallocated buffers) unless a mirror needs aiohttp (proxy, redirect, expired
signed URL, chunked body). Bytes are written with
``os.pwrite`` at their offset straight from the event loop (aiofiles' seek+write races when
tasks share a file; a thread per write is slower); each block's CRC-32 is computed as it is
written and reported to ``on_block`` (the journal). The hashing thread (``PrefixHasher``)
starts each finished block's writeback (``sync_file_range``, so the final fsync is short)
and feeds the whole-file sha256 from the contiguous prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
import urllib.request
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256

import aiohttp
from yarl import URL

from modeld.errors import DownloadError
from modeld.journal import Block
from modeld.mirrors import (
    Mirror,
    MirrorFailure,
    _headers,
    classify_exception,
    classify_status,
    open_range,
    os_error_to_modeld,
    parse_content_range,
    request,
)
from modeld.rangeio import RangeClient, RangeConn, RangeFallback

CHUNK = 1024 * 1024
# The hashing thread reads the prefix in slices of this size (into one reused buffer).
HASH_READ = 8 * CHUNK
Writer = Callable[[int, memoryview, int], int]
# Piece bodies through the lean range reader (``rangeio``) instead of aiohttp's parser; the
# benchmark turns it off to compare the two in one run.
RAW_RANGES = True

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range back now, without waiting for it."""
    with contextlib.suppress(AttributeError, OSError):
        _libc.sync_file_range(
            fd, ctypes.c_longlong(offset), ctypes.c_longlong(length), _SYNC_FILE_RANGE_WRITE
        )


@dataclass(eq=False)
class Piece:
    """``[start, end)`` of the file; ``pos`` is the next byte to fetch (block aligned at start)."""

    start: int
    end: int
    pos: int
    mirror: Mirror | None = None
    began: float = 0.0
    got: int = 0  # bytes received on the current attempt
    abandoned: bool = False
    stream: bool = False  # a plain GET from byte 0 (a mirror without ranges)
    resp: aiohttp.ClientResponse | None = None  # the open answer, closed on a takeover
    raw: RangeConn | None = None  # or the raw reader's connection, closed on a takeover
    crc: int = 0  # CRC-32 of [start of pos's block, pos): a piece may resume mid-block
    window: int = 0  # bytes not yet counted into the mirror's rate, since window_start
    window_start: float = 0.0

    def rate(self) -> float:
        elapsed = time.monotonic() - self.began
        return self.got / elapsed if elapsed > 0 else 0.0


class PrefixHasher:
    """sha256 of the file's contiguous written prefix, computed in a thread while downloading.

    The thread also starts the writeback of each finished block (``block_done``), so that
    syscall is off the event loop and the final fsync is short. ``sha256.update`` releases
    the GIL on large buffers, so hashing runs on the other core beside the loop; the prefix
    is read back from the page cache into one reused buffer.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.hashed = 0
        self._target = 0
        self._jobs: deque[tuple[int, int]] = deque()
        self._cond = threading.Condition()
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._hash = sha256()
        self._stop = False
        self._buf = memoryview(bytearray(HASH_READ))
        self._thread = threading.Thread(target=self._run, name="modeld-hash", daemon=True)
        self._thread.start()

    def advance(self, prefix: int) -> None:
        with self._cond:
            if prefix > self._target:
                self._target = prefix
                self._cond.notify()

    def block_done(self, start: int, length: int) -> None:
        """``[start, start + length)`` is wholly written: start its writeback."""
        with self._cond:
            self._jobs.append((start, length))
            self._cond.notify()

    def _read(self, start: int, length: int) -> memoryview:
        view = self._buf[:length]
        got = 0
        while got < length:
            n = os.preadv(self.fd, [view[got:]], start + got)
            if n <= 0:
                raise OSError(f"short read at {start + got}")
            got += n
        return view

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._jobs and self.hashed >= self._target and not self._stop:
                        self._cond.wait()
                    jobs = list(self._jobs)
                    self._jobs.clear()
                    target, stop = self._target, self._stop
                for start, length in jobs:
                    start_writeback(self.fd, start, length)
                if stop:
                    return
                while self.hashed < target:
                    n = min(HASH_READ, target - self.hashed)
                    self._hash.update(self._read(self.hashed, n))
                    self.hashed += n
                if self.hashed >= self.size and not self._jobs:
                    self._digest = self._hash.hexdigest()
                    return
        except BaseException as e:  # reported to the waiter in digest()
            self._error = e

    async def digest(self) -> str:
        """Wait for the whole file's digest (call after advancing to ``size``)."""
        self.advance(self.size)
        await asyncio.to_thread(self._thread.join)
        if self._error is not None:
            raise self._error
        assert self._digest is not None
        return self._digest

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()


class Fetcher:
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
        token: str | None,
        done: bytearray,
        on_block: Callable[[Block], None],
        writer: Writer = os.pwrite,
    ) -> None:
        self.fd, self.path, self.size = fd, path, size
        self.block_size = block_size
        self.piece_blocks = max(1, piece_size // block_size)
        self.connections = connections
        self.mirrors = mirrors
        self.session, self.token = session, token
        self.done = done
        self.on_block = on_block
        self.writer = writer
        self.nblocks = len(done)
        self.sources: dict[int, str] = {}
        self.received = 0
        self.splits = 0  # endgame: in-flight pieces split with a faster mirror
        self.takeovers = 0  # endgame: in-flight blocks taken over by a faster mirror
        self.raw_pieces = 0  # pieces (attempts) read by the raw range reader
        self.fallbacks = 0  # raw attempts handed to aiohttp (redirect, expired URL, chunked)
        timeout = session.timeout
        self.rangeio = RangeClient(
            connect_timeout=timeout.sock_connect or 15.0,
            stall_timeout=timeout.sock_read or 20.0,
        )
        self._no_raw: set[int] = set()  # id() of mirrors the raw reader does not serve
        self._proxies = urllib.request.getproxies()
        self.prefix_blocks = 0
        self.hasher: PrefixHasher | None = None
        self.queue: deque[Piece] = deque()
        self.inflight: set[Piece] = set()
        self._changed = asyncio.Event()
        self._fatal: BaseException | None = None
        self._advance_prefix()

    # --- bookkeeping ---------------------------------------------------------------

    def block_range(self, idx: int) -> tuple[int, int]:
        start = idx * self.block_size
        return start, min(self.size, start + self.block_size)

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

    def _plan(self) -> None:
        """Queue runs of missing blocks as pieces of at most ``piece_blocks`` blocks."""
        i = 0
        while i < self.nblocks:
            if self.done[i]:
                i += 1
                continue
            j = i
            while j < self.nblocks and not self.done[j] and j - i < self.piece_blocks:
                j += 1
            start, end = i * self.block_size, min(self.size, j * self.block_size)
            self.queue.append(Piece(start, end, start))
            i = j

    def _block_finished(self, idx: int, crc: int, mirror: Mirror) -> None:
        start, end = self.block_range(idx)
        self.done[idx] = 1
        self.sources[idx] = mirror.label
        if self.hasher is not None:
            self.hasher.block_done(start, end - start)
        self.on_block(Block(idx, crc, mirror.label))
        self._advance_prefix()
        if self.prefix_blocks >= self.nblocks:
            for p in list(self.inflight):
                self._abandon(p)  # e.g. a slow duplicate: the file is complete

    # --- choosing work -------------------------------------------------------------

    def _rate(self, m: Mirror) -> float | None:
        """Per-connection rate, lowered to what its pieces in flight get now (a stalled
        mirror's past rate must not keep attracting work)."""
        if m.conn_rate is None:
            return None
        now = time.monotonic()
        live = [p.rate() for p in self.inflight if p.mirror is m and now - p.began > 0.5]
        return min(m.conn_rate, max(live)) if live else m.conn_rate

    def _remaining(self) -> int:
        """Bytes not yet received: queued pieces plus the rest of those in flight."""
        left = sum(p.end - p.pos for p in self.queue)
        return left + sum(p.end - p.pos for p in self.inflight if not p.abandoned)

    def _time_left(self, exclude: Mirror) -> float:
        """How long the other mirrors would take for everything left (inf when unmeasured)."""
        rate = sum(m.current_speed() for m in self.mirrors if m is not exclude and m.usable)
        return self._remaining() / rate if rate > 0 else float("inf")

    def _take(self, front: bool, blocks: int | None = None) -> Piece:
        """A piece off the queue's front (file order) or back, cut to ``blocks`` blocks."""
        piece = self.queue[0] if front else self.queue[-1]
        bs = self.block_size
        first = piece.pos // bs
        last = -(-piece.end // bs)
        if blocks is None or last - first <= blocks:
            if front:
                self.queue.popleft()
            else:
                self.queue.pop()
            return piece
        if front:
            cut = (first + blocks) * bs
            self.queue[0] = Piece(cut, piece.end, cut)
            return Piece(piece.pos, cut, piece.pos)
        cut = (last - blocks) * bs
        self.queue[-1] = Piece(piece.start, cut, piece.pos)
        return Piece(cut, piece.end, cut)

    def _next_piece(self) -> tuple[Mirror, Piece] | None:
        """The next (mirror, piece) from the queue for a free connection, if any.

        The mirror that would fetch a piece soonest (per-connection rate) takes the queue's
        front, in file order, so the prefix hasher keeps up. A mirror not measured yet gets
        one connection and one block off the back (a probe). A mirror more than twice
        slower per connection gets no more work (the endgame takes over what it holds); a
        near-best one shares the front (``_spread``).
        """
        if not self.queue:
            return None
        now = time.monotonic()
        ready = [m for m in self.mirrors if m.usable and m.ranges and m.not_before <= now]
        for m in ready:
            if m.conn_rate is None and m.active == 0:
                return m, self._take(front=m is ready[0] and m.primary, blocks=1)
        rates = {id(m): r for m in ready if (r := self._rate(m)) is not None}
        measured = [m for m in ready if id(m) in rates]
        if not measured:
            return None  # only probes in flight: wait for a rate
        best = max(measured, key=lambda m: rates[id(m)])
        best_rate = rates[id(best)]
        # A slower mirror is worth a connection only while it is near the best per connection.
        others = [m for m in measured if m is not best and rates[id(m)] > 0.5 * best_rate]
        return self._spread(best, others)

    def _spread(self, best: Mirror, others: list[Mirror]) -> tuple[Mirror, Piece]:
        """Best mirror, or a near-best one with fewer connections per unit of rate.

        A slower mirror's piece is cut to what it can fetch before the others would finish
        everything else, so it is never the straggler.
        """
        best_rate = best.conn_rate or 1.0
        head = self.queue[0]
        if not others or head.end - head.pos <= self.block_size:
            return best, self._take(front=True)
        slower = min(others, key=lambda m: m.active / (m.conn_rate or 1.0))
        rate = slower.conn_rate or 1.0
        if slower.active / rate >= best.active / best_rate:
            return best, self._take(front=True)
        left = self._time_left(slower)
        if left == float("inf"):  # the others' speed is not known yet: no bet on the slower
            return best, self._take(front=True)
        # At most half the time the others need for everything left, so it ends well before.
        blocks = int(min(0.5 * left * rate, self.piece_blocks * self.block_size) // self.block_size)
        if blocks < 1:
            return best, self._take(front=True)
        # Not at the front: far enough ahead that the others do not reach it before the
        # slower mirror is done with it, so it never holds the prefix hasher (or the end).
        rest = sum(m.current_speed() for m in self.mirrors if m is not slower and m.usable)
        piece = self._take_ahead(int(1.5 * rest * blocks * self.block_size / rate), blocks)
        if piece is None:
            return best, self._take(front=True)
        return slower, piece

    def _take_ahead(self, skip: int, blocks: int) -> Piece | None:
        """``blocks`` blocks cut from the queue at least ``skip`` queued bytes past its front
        (None when the queue holds less than that)."""
        bs = self.block_size
        seen = 0
        for i, piece in enumerate(self.queue):
            if seen + piece.end - piece.pos <= skip:
                seen += piece.end - piece.pos
                continue
            first = max(piece.pos // bs, -(-(piece.pos + skip - seen) // bs))
            start = max(piece.pos, first * bs)
            end = min(piece.end, (first + blocks) * bs)
            if end - start < min(bs, piece.end - piece.pos) or start >= piece.end:
                return None
            rest = (
                [Piece(piece.start, start, piece.pos, crc=piece.crc)] if start > piece.pos else []
            )
            if end < piece.end:
                rest.append(Piece(end, piece.end, end))
            del self.queue[i]
            for j, part in enumerate(rest):
                self.queue.insert(i + j, part)
            return Piece(start, end, start)
        return None

    def _steal(self) -> tuple[Mirror, Piece] | None:
        """Endgame: split or take over an in-flight piece that would finish late.

        For each piece, lowest in the file first (it holds the prefix hasher back), the
        fastest other mirror (by current rate) gets the share it would finish first: the
        piece is split at a block boundary so both parts end together, or, inside its last
        block, taken over. Judged on the piece's current rate.
        """
        now = time.monotonic()
        ready = [m for m in self.mirrors if m.usable and m.ranges and m.not_before <= now]
        rates = {id(m): r for m in ready if (r := self._rate(m)) is not None}
        bs = self.block_size
        for p in sorted(self.inflight, key=lambda p: p.pos):
            if p.abandoned or p.stream or p.mirror is None or now - p.began < 0.05:
                continue
            helpers = [m for m in ready if id(m) in rates and m is not p.mirror]
            if not helpers:
                # One mirror only: a fresh connection to it may still beat a stuck one.
                helpers = [m for m in ready if id(m) in rates and len(ready) == 1]
            if not helpers:
                continue
            mirror = max(helpers, key=lambda m: rates[id(m)])
            rate_f = rates[id(mirror)]
            rate_s = max(p.rate(), 1.0)
            t_slow = (p.end - p.pos) / rate_s
            cur_block_end = min(p.end, (p.pos // bs + 1) * bs)
            ideal = p.pos + (p.end - p.pos) * rate_s / (rate_s + rate_f)
            split = max(cur_block_end, -(-int(ideal) // bs) * bs)
            if split < p.end:
                if (p.end - split) / rate_f > t_slow * 0.8:
                    continue
                new = Piece(split, p.end, split)
                p.end = split
                self.splits += 1
                return mirror, new
            restart = (p.pos // bs) * bs
            t_fast = (p.end - restart) / rate_f
            if t_slow < 0.05 or t_fast * 2 > t_slow:
                continue
            self._abandon(p)
            self.takeovers += 1
            return mirror, Piece(restart, p.end, restart)
        return None

    def _abandon(self, p: Piece) -> None:
        """Stop fetching ``p`` (taken over, or no longer needed): close its connection now."""
        p.abandoned = True
        self.inflight.discard(p)
        if p.resp is not None:
            p.resp.close()  # its reader wakes with an error that is not held against the mirror
        if p.raw is not None:
            p.raw.abort()

    # --- the connections -------------------------------------------------------------

    async def run(self) -> None:
        """Fetch until every block is done; raise DownloadError/DiskFull on failure."""
        self._plan()
        workers = [asyncio.create_task(self._worker()) for _ in range(self.connections)]
        try:
            await asyncio.gather(*workers)
        except BaseException:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            raise
        finally:
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

    async def _idle(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    async def _worker(self) -> None:
        while self._fatal is None and not self._all_done():
            work = self._next_piece()
            if work is not None:
                await self._run_piece(work[1], work[0])
                continue
            ready = [m for m in self.mirrors if m.usable and m.ranges]
            if self.queue and not ready:
                if any(m.usable for m in self.mirrors):
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
        mirror = next(m for m in self.mirrors if m.usable)
        await self._run_piece(Piece(0, self.size, 0, stream=True), mirror)
        if not self._all_done():
            self._plan()

    async def _run_piece(self, piece: Piece, mirror: Mirror) -> None:
        piece.mirror, piece.began, piece.got, piece.abandoned = mirror, time.monotonic(), 0, False
        piece.window, piece.window_start = 0, piece.began
        self.inflight.add(piece)
        mirror.active += 1
        try:
            if not (self._raw_ok(piece, mirror) and await self._read_raw(piece, mirror)):
                await self._read_aiohttp(piece, mirror)
            mirror.succeed()
            if piece.pos < piece.end and not piece.abandoned and not piece.stream:
                # A short 206 (RFC 9110 §15.3.7) is allowed: queue the rest, no strike.
                self.queue.appendleft(Piece(piece.pos, piece.end, piece.pos, crc=piece.crc))
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
                mirror.count(piece.window, time.monotonic() - piece.window_start)
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
            piece.resp = await request(self.session, mirror, {}, self.token)
            if piece.resp.status != 200:
                raise classify_status(piece.resp.status, piece.resp)
            await self._read_stream(piece, mirror, piece.resp)
            return
        piece.resp = await open_range(
            self.session, mirror, piece.pos, piece.end, self.size, self.token
        )
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
        # A proxy that applies to this host: aiohttp (trust_env) talks to it.
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
                _headers(url, self.token, extra),
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
        mirror.fail(failure)
        if piece.abandoned or piece.stream:
            return
        if piece.pos < piece.end:
            self.queue.appendleft(Piece(piece.pos, piece.end, piece.pos, crc=piece.crc))

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
        self.received += n
        piece.window += n
        if piece.window >= CHUNK:
            now = time.monotonic()
            mirror.count(piece.window, now - piece.window_start)
            piece.window, piece.window_start = 0, now
        # CRC-32 per block here, while the bytes are in the CPU cache (cheaper than reading
        # them back in the hashing thread; zlib releases the GIL meanwhile).
        block_end = min(self.size, (pos // bs + 1) * bs)
        if new < block_end:
            piece.crc = zlib.crc32(data, piece.crc)
            return
        off = 0
        while pos + off < new:
            idx = (pos + off) // bs
            seg = min(new, (idx + 1) * bs, self.size) - pos
            piece.crc = zlib.crc32(data[off:seg], piece.crc)
            off = seg
            if pos + off == min(self.size, (idx + 1) * bs):
                if not self.done[idx]:
                    self._block_finished(idx, piece.crc, mirror)
                piece.crc = 0

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
            now = time.monotonic()
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
                    piece.crc = zlib.crc32(seg, piece.crc)
                self.received += len(seg)
                piece.pos += len(seg)
                view = view[len(seg) :]
                if piece.pos == block_end:
                    if not self.done[idx]:
                        self._block_finished(idx, piece.crc, mirror)
                    piece.crc = 0
