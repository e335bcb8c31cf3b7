"""The piece engine: Range requests over every healthy mirror at once, into one partial file.

Pieces (``piece_size``) are whole blocks (``journal.BLOCK_SIZE`` or smaller) and sit in one
shared queue; each connection takes the next piece and the mirror that would finish it
soonest (per-connection rate), so fast mirrors take more pieces and a mirror far slower than
the best stops getting any. When the queue is empty, idle connections look at the pieces in
flight (endgame): a slow piece is split at a block boundary so both halves finish together,
or, inside its last block, handed over to a faster mirror. Bytes are written with
``os.pwrite`` at their offset straight from the event loop (aiofiles' seek+write races when
tasks share a file; a thread per write is slower), each block's CRC-32 is computed as it is
written and reported to ``on_block`` (the journal), and writeback is started per block
(``sync_file_range``) so the final fsync is short.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from hashlib import sha256

import aiohttp

from modeld.errors import DownloadError
from modeld.journal import Block
from modeld.mirrors import (
    Mirror,
    MirrorFailure,
    classify_exception,
    classify_status,
    open_range,
    os_error_to_modeld,
    parse_content_range,
    request,
)

CHUNK = 1024 * 1024
Writer = Callable[[int, memoryview, int], int]

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
    crc: int = 0  # CRC-32 of [start of pos's block, pos): a piece may resume mid-block

    def rate(self) -> float:
        elapsed = time.monotonic() - self.began
        return self.got / elapsed if elapsed > 0 else 0.0


class PrefixHasher:
    """sha256 of the file's contiguous written prefix, computed in a thread while downloading."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.hashed = 0
        self._target = 0
        self._cond = threading.Condition()
        self._digest: str | None = None
        self._error: BaseException | None = None
        self._hash = sha256()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="modeld-hash", daemon=True)
        self._thread.start()

    def advance(self, prefix: int) -> None:
        with self._cond:
            if prefix > self._target:
                self._target = prefix
                self._cond.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self.hashed >= self._target and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    target = self._target
                while self.hashed < target:
                    n = min(8 * CHUNK, target - self.hashed)
                    data = os.pread(self.fd, n, self.hashed)
                    if not data:
                        raise OSError(f"short read at {self.hashed}")
                    self._hash.update(data)
                    self.hashed += len(data)
                if self.hashed >= self.size:
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
        start_writeback(self.fd, start, end - start)
        self.done[idx] = 1
        self.sources[idx] = mirror.label
        self.on_block(Block(idx, crc, mirror.label))
        self._advance_prefix()

    # --- choosing work -------------------------------------------------------------

    def _choose_mirror(self, piece: Piece, exclude: Mirror | None = None) -> Mirror | None:
        now = time.monotonic()
        best: tuple[float, int, Mirror] | None = None
        for m in self.mirrors:
            if not m.usable or not m.ranges or m is exclude or m.not_before > now:
                continue
            if m.conn_rate is None:
                # Not measured yet: try it when it has no connection, else after the measured.
                score = 0.0 if m.active == 0 else 1e9
            else:
                score = (piece.end - piece.pos) / m.conn_rate
            if best is None or (score, m.active) < best[:2]:
                best = (score, m.active, m)
        return best[2] if best else None

    def _steal(self, mirror: Mirror) -> Piece | None:
        """Endgame: split or take over the in-flight piece that will finish last."""
        rate_f = mirror.conn_rate
        if rate_f is None:
            return None
        slowest: tuple[float, Piece] | None = None
        for p in self.inflight:
            if p.abandoned or p.stream or p.mirror is None or time.monotonic() - p.began < 0.2:
                continue
            if p.mirror is mirror and len([m for m in self.mirrors if m.usable]) > 1:
                continue
            left = (p.end - p.pos) / max(p.rate(), 1.0)
            if slowest is None or left > slowest[0]:
                slowest = (left, p)
        if slowest is None:
            return None
        t_slow, p = slowest
        rate_s = max(p.rate(), 1.0)
        bs = self.block_size
        cur_block_end = min(p.end, (p.pos // bs + 1) * bs)
        ideal = p.pos + (p.end - p.pos) * rate_s / (rate_s + rate_f)
        split = max(cur_block_end, -(-int(ideal) // bs) * bs)
        if split < p.end:
            if (p.end - split) / rate_f > t_slow * 0.8:
                return None
            new = Piece(split, p.end, split)
            p.end = split
            return new
        restart = (p.pos // bs) * bs
        t_fast = (p.end - restart) / rate_f
        if t_slow < 0.2 or t_fast * 2 > t_slow:
            return None
        p.abandoned = True
        self.inflight.discard(p)
        return Piece(restart, p.end, restart)

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
            piece = self.queue.popleft() if self.queue else None
            mirror = self._choose_mirror(piece) if piece else None
            if piece is None:
                if not self.inflight:
                    await self._idle(0.05)
                    continue
                candidate = self._choose_mirror(Piece(0, self.block_size, 0))
                piece = self._steal(candidate) if candidate else None
                mirror = candidate
                if piece is None:
                    await self._idle(0.1)
                    continue
            if mirror is None:
                self.queue.appendleft(piece)
                if not any(m.usable and m.ranges for m in self.mirrors):
                    if any(m.usable for m in self.mirrors):
                        await self._stream_all()
                        continue
                    self._fatal = self._no_mirror_error()
                    self._wake()
                    return
                waits = [m.not_before for m in self.mirrors if m.usable]
                await self._idle(max(0.01, min(waits) - time.monotonic()) if waits else 0.05)
                continue
            await self._run_piece(piece, mirror)

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
        self.inflight.add(piece)
        mirror.active += 1
        resp: aiohttp.ClientResponse | None = None
        try:
            if piece.stream:
                resp = await request(self.session, mirror, {}, self.token)
                if resp.status != 200:
                    raise classify_status(resp.status, resp)
            else:
                resp = await open_range(
                    self.session, mirror, piece.pos, piece.end, self.size, self.token
                )
            await self._read_into(piece, mirror, resp)
            mirror.succeed()
            if piece.pos < piece.end and not piece.abandoned and not piece.stream:
                # A short 206 (RFC 9110 §15.3.7) is allowed: queue the rest, no strike.
                self.queue.appendleft(Piece(piece.pos, piece.end, piece.pos, crc=piece.crc))
        except OSError as e:
            failure = classify_exception(e)
            if failure is None:
                self._fatal = os_error_to_modeld(e, self.path)
                self._wake()
                return
            self._requeue(piece, mirror, failure)
        except (MirrorFailure, aiohttp.ClientError, TimeoutError) as e:
            self._requeue(piece, mirror, classify_exception(e) or MirrorFailure("gone", str(e)))
        finally:
            mirror.active -= 1
            self.inflight.discard(piece)
            if resp is not None:
                resp.close()
        self._wake()

    def _requeue(self, piece: Piece, mirror: Mirror, failure: MirrorFailure) -> None:
        mirror.fail(failure)
        if piece.abandoned or piece.stream:
            return
        if piece.pos < piece.end:
            self.queue.appendleft(Piece(piece.pos, piece.end, piece.pos, crc=piece.crc))

    async def _read_into(self, piece: Piece, mirror: Mirror, resp: aiohttp.ClientResponse) -> None:
        bs = self.block_size
        last = time.monotonic()
        served = parse_content_range(resp.headers.get("Content-Range"))
        stop = min(piece.end, served[1] + 1) if served and not piece.stream else piece.end
        while piece.pos < min(stop, piece.end):
            chunk = await resp.content.read(CHUNK)
            if piece.abandoned:
                return
            if not chunk:
                raise MirrorFailure("transient", f"body ended at byte {piece.pos} (short answer)")
            now = time.monotonic()
            mirror.count(len(chunk), now - last)
            last = now
            view = memoryview(chunk)[: min(stop, piece.end) - piece.pos]
            piece.got += len(view)
            while view:
                idx = piece.pos // bs
                block_end = min(self.size, (idx + 1) * bs)
                seg = view[: block_end - piece.pos]
                if not (piece.stream and self.done[idx]):
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
