"""A lean HTTP/1.1 range reader for piece bodies: bytes land in a preallocated buffer.

aiohttp's parser copies every body byte into buffers of its own before we can write them;
on loopback that copy plus its bookkeeping was most of the event loop's time. Here an
``asyncio.BufferedProtocol`` receives straight into one ``bytearray`` per connection
(``recv_into``; with TLS, asyncio's SSL transport decrypts into it), and the body is handed
to a *sink* (the fetcher: ``pwrite`` at the piece's offset + CRC-32) every ``FLUSH`` bytes,
from the protocol callback itself, without a task switch. Connections are kept alive per
``(scheme, host, port)``.

The parser is strict and small: a status line, headers up to CRLFCRLF, and only a ``206``
whose ``Content-Range`` matches the request and whose ``Content-Length`` frames the body is
read. Whatever it does not take (a redirect, a 403 from a signed URL that may have expired,
a chunked body) raises ``RangeFallback`` so the caller uses its aiohttp path for that
request; every other failure is a ``MirrorFailure`` of the classes ``mirrors`` already uses
(or ``TimeoutError`` for silence past the stall timeout). Disk errors from the sink
propagate as the ``OSError`` they are.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_none,
)
from yarl import URL

from modeld.download.mirrors import (
    WRONG_SIZE,
    MirrorFailure,
    classify_status,
    parse_content_range,
    retry_after,
)
from modeld.download.ratelimit import TokenBucket

# Per connection. Small enough that the bytes are still in the CPU cache when ``pwrite`` and
# CRC-32 read them (larger buffers made the page-cache copy slower:
# docs/benchmarks.md#hashing-and-checksums).
BUFFER = 256 * 1024
# The sink gets the body in slices of at least this much (or what is left of it).
FLUSH = 128 * 1024
MAX_HEAD = 64 * 1024
Sink = Callable[[memoryview], bool]  # consume the bytes; False: stop (the piece got shorter)


class RangeFallback(Exception):
    """The raw reader does not take this answer; fetch the range with the aiohttp path.

    ``expired``: a 403 on a cached redirect target (go back to the original URL);
    ``disable``: this mirror's answers are not for the raw reader at all (chunked bodies).
    """

    def __init__(self, message: str, *, expired: bool = False, disable: bool = False) -> None:
        super().__init__(message)
        self.expired = expired
        self.disable = disable


class _Stale(Exception):
    """A kept-alive connection was closed by the server before any answer: retry fresh."""


class RangeConn(asyncio.BufferedProtocol):
    """One connection; at most one request at a time; the body goes to ``sink``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stall: float) -> None:
        self.loop, self.stall = loop, stall
        self.buf = bytearray(BUFFER)
        self.view = memoryview(self.buf)
        self.transport: asyncio.Transport | None = None
        self.alive = True
        self.busy = False
        self.reused = False
        self.fut: asyncio.Future[int] | None = None
        self.sink: Sink | None = None
        self.start = self.end = self.total = 0
        self.from_cache = False
        self.filled = 0
        self.head = True  # reading the status line and headers
        self.need = 0  # body bytes still to come
        self.got = 0  # body bytes received for this request
        self.keep = False
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        # ``--limit-rate``: the job's bucket; reading pauses while it is in debt.
        self.limit: TokenBucket | None = None
        self.paused = False
        self.resume: asyncio.TimerHandle | None = None

    # --- asyncio callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        room = BUFFER - self.filled
        if not self.head and self.busy:
            room = min(room, self.need)
        if self.limit is not None:  # capped: small reads, so that no read runs far past it
            room = min(room, self.limit.read_size)
        return self.view[self.filled : self.filled + room]

    def buffer_updated(self, nbytes: int) -> None:
        self.last = self.loop.time()
        if not self.busy:
            self._close()  # bytes nobody asked for: this connection is out of step
            return
        if self.limit is not None:
            self._pause_for(self.limit.take(nbytes))
        self.filled += nbytes
        if self.head:
            self._parse_head()
            return
        self.need -= nbytes
        if self.filled >= FLUSH or self.need == 0:
            self._flush()

    def eof_received(self) -> bool:
        self._lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)

    # --- one request -------------------------------------------------------------------

    def begin(  # noqa: PLR0917 (a range is start, end and total, plus the request)
        self, request: bytes, start: int, end: int, total: int, sink: Sink, from_cache: bool
    ) -> asyncio.Future[int]:
        assert self.transport is not None
        self.fut = self.loop.create_future()
        self.busy, self.head, self.filled, self.got = True, True, 0, 0
        self.start, self.end, self.total, self.sink = start, end, total, sink
        self.from_cache = from_cache
        self.last = self.loop.time()
        self.timer = self.loop.call_later(self.stall, self._check_stall)
        self.transport.write(request)
        if self.limit is not None:
            self._pause_for(self.limit.wait())  # the job's debt first, then this answer
        return self.fut

    def _finish(self, result: int | BaseException) -> None:
        fut = self.fut
        self.busy, self.sink, self.fut = False, None, None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if fut is not None and not fut.done():
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    def _fail(self, exc: BaseException) -> None:
        self._close()
        self._finish(exc)

    def abort(self) -> None:
        """Close now; the request in flight (if any) fails (the caller gave its piece up)."""
        self._close()
        self._finish(MirrorFailure("transient", "connection closed by the fetcher"))

    def _close(self) -> None:
        self.alive = False
        if self.transport is not None:
            self.transport.abort()

    def _lost(self, exc: Exception | None) -> None:
        was_alive, self.alive = self.alive, False
        if not self.busy:
            return
        if self.head and self.filled == 0 and self.reused and was_alive:
            self._finish(_Stale())
            return
        if not self.head and self.filled:
            self._flush()  # keep what came before the end: less to fetch again
            if not self.busy:
                return
        why = f"{exc.__class__.__name__}: {exc}" if exc is not None else "connection closed"
        where = self.start + self.got
        self._fail(MirrorFailure("transient", f"body ended at byte {where} (short answer; {why})"))

    def _check_stall(self) -> None:
        self.timer = None
        if not self.busy:
            return
        if self.paused:  # holding back for --limit-rate is not the server's silence
            self.timer = self.loop.call_later(self.stall, self._check_stall)
            return
        quiet = self.loop.time() - self.last
        if quiet < self.stall:
            self.timer = self.loop.call_later(self.stall - quiet, self._check_stall)
            return
        if not self.head and self.filled:
            self._flush()
            if not self.busy:
                return
        self._fail(TimeoutError(f"no bytes for {self.stall:g} s"))

    def _flush(self) -> None:
        data = self.view[: self.filled]
        self.filled = 0
        self._deliver(data)

    def _deliver(self, data: memoryview) -> None:
        """Hand body bytes to the sink; end the request when the body (or the need) is over."""
        self.got += len(data)
        assert self.sink is not None
        try:
            go_on = self.sink(data)
        except BaseException as e:  # a disk error: the caller stops the pull with it
            self._fail(e)
            return
        if not self.busy:
            return  # the sink gave the piece up (a takeover): already closed
        if self.need == 0:
            if not self.keep:
                self._close()
            self._finish(self.start + self.got)
        elif not go_on:
            self._close()  # the rest of this body is not wanted any more
            self._finish(self.start + self.got)

    # --- --limit-rate ------------------------------------------------------------------

    def _pause_for(self, delay: float) -> None:
        """Stop reading for ``delay`` seconds (TCP then holds the server back)."""
        if delay <= 0 or self.transport is None or not self.alive:
            return
        if not self.paused:
            self.transport.pause_reading()
            self.paused = True
        if self.resume is not None:
            self.resume.cancel()
        self.resume = self.loop.call_later(delay, self._resume)

    def _resume(self) -> None:
        self.resume = None
        if not self.paused:
            return
        wait = self.limit.wait() if self.limit is not None else 0.0
        if wait > 0:  # other connections took bytes meanwhile: the debt is not paid yet
            self.resume = self.loop.call_later(wait, self._resume)
            return
        self.paused = False
        self.last = self.loop.time()
        if self.alive and self.transport is not None:
            self.transport.resume_reading()

    # --- the answer's head -------------------------------------------------------------

    def _parse_head(self) -> None:
        end = self.buf.find(b"\r\n\r\n", 0, self.filled)
        if end < 0:
            if self.filled > MAX_HEAD:
                self._fail(MirrorFailure("transient", "HTTP answer head larger than 64 KiB"))
            return
        try:
            status, headers, keep = _parse(bytes(self.view[:end]))
        except ValueError as e:
            self._fail(MirrorFailure("transient", f"malformed HTTP answer: {e}"))
            return
        rest = self.filled - (end + 4)
        if 100 <= status < 200:  # e.g. 103 Early Hints: the real answer follows
            self.view[:rest] = bytes(self.view[end + 4 : self.filled])
            self.filled = rest
            if rest:
                self._parse_head()
            return
        try:
            length = self._check(status, headers)
        except (MirrorFailure, RangeFallback) as e:
            self._fail(e)
            return
        self.head, self.keep, self.need = False, keep, length - rest
        if rest > length:
            self._fail(MirrorFailure("transient", "more bytes than Content-Length"))
            return
        data = self.view[end + 4 : self.filled]
        self.filled = 0  # the head is consumed: the buffer is for the body from now on
        if rest:
            # The first body bytes came with the head: hand them over from where they are.
            self._deliver(data)
        elif length == 0:
            self._finish(self.start)

    def _check(self, status: int, headers: dict[str, str]) -> int:
        """The body length of an acceptable answer; raise for anything else."""
        if status in (301, 302, 303, 307, 308):
            raise RangeFallback(f"HTTP {status}: a redirect")
        if status == 403 and self.from_cache:
            raise RangeFallback("HTTP 403 from a redirect target", expired=True)
        if status == 200:
            raise MirrorFailure("no_ranges", "answered a Range request with 200")
        if status != 206:
            failure = classify_status(status)
            if failure.kind == "transient":
                failure.retry_after = retry_after(headers.get("retry-after"))
            raise failure
        encoding = headers.get("content-encoding", "identity").lower()
        if encoding not in ("identity", ""):
            raise MirrorFailure("gone", f"sent Content-Encoding {encoding} despite identity")
        if "transfer-encoding" in headers:
            raise RangeFallback("a 206 with Transfer-Encoding", disable=True)
        raw_range = headers.get("content-range")
        parsed = parse_content_range(raw_range)
        start, end = self.start, self.end
        if parsed is None or parsed[0] != start or parsed[1] >= end or parsed[1] < start:
            raise MirrorFailure("gone", f"wrong Content-Range {raw_range!r}")
        if parsed[2] is not None and parsed[2] != self.total:
            raise MirrorFailure(
                "gone", f"file is {parsed[2]} bytes, the entry says {self.total}", cause=WRONG_SIZE
            )
        raw_length = headers.get("content-length")
        if raw_length is None:
            raise RangeFallback("a 206 without Content-Length", disable=True)
        if not raw_length.isdigit() or int(raw_length) != parsed[1] - parsed[0] + 1:
            raise MirrorFailure(
                "gone", f"Content-Length {raw_length} does not match Content-Range {raw_range}"
            )
        return int(raw_length)


def _parse(head: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, lower-cased headers, keep-alive) of an HTTP/1.x answer head."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if version not in ("HTTP/1.1", "HTTP/1.0") or not code.isdigit() or rest[3:4] not in ("", " "):
        raise ValueError(f"status line {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise ValueError(f"header line {line[:80]!r}")
        key, value = name.lower(), value.strip()
        if key in headers and key in ("content-length", "content-range"):
            if headers[key] != value:
                raise ValueError(f"two different {name} headers")
            continue
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    conn = headers.get("connection", "").lower()
    keep = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
    return int(code), headers, keep


def _key(url: URL) -> tuple[str, str, int]:
    return url.scheme, url.raw_host or "", url.port or (443 if url.scheme == "https" else 80)


class RangeClient:
    """Keep-alive connections per (scheme, host, port); ``fetch`` one range into a sink."""

    def __init__(self, *, connect_timeout: float, stall_timeout: float) -> None:
        self.connect_timeout, self.stall_timeout = connect_timeout, stall_timeout
        self._idle: dict[tuple[str, str, int], list[RangeConn]] = {}
        self.limit: TokenBucket | None = None  # --limit-rate: given to each request's conn
        self._all: set[RangeConn] = set()
        self._ssl: ssl.SSLContext | None = None
        self.connects = 0  # new connections made (the rest were kept alive)

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()  # honours SSL_CERT_FILE / SSL_CERT_DIR
        return self._ssl

    async def _connect(self, url: URL) -> RangeConn:
        key = _key(url)
        host, port = key[1], key[2]
        idle = self._idle.get(key, [])
        while idle:
            conn = idle.pop()
            if conn.alive:
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        tls = url.scheme == "https"
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, proto = await loop.create_connection(
                    lambda: RangeConn(loop, self.stall_timeout),
                    url.host or host,
                    port,
                    ssl=self._ssl_context() if tls else None,
                    server_hostname=url.host if tls else None,
                )
        except TimeoutError:
            raise TimeoutError(f"no connection to {host}:{port} within the timeout") from None
        except OSError as e:  # refused, unreachable, DNS, certificate: the mirror's, not ours
            # A certificate may be fixed while the pull goes on; no route or name will not.
            kind = "transient" if isinstance(e, ssl.SSLError) else "unreachable"
            raise MirrorFailure(
                kind, f"cannot connect to {host}:{port}: {e.__class__.__name__}: {e}"
            ) from e
        self.connects += 1
        self._all = {c for c in self._all if c.alive}
        self._all.add(proto)
        return proto

    async def fetch(  # noqa: PLR0917 (a range is start, end and total, plus where to put it)
        self,
        url: URL,
        headers: dict[str, str],
        start: int,
        end: int,
        total: int,
        sink: Sink,
        *,
        from_cache: bool = False,
        on_conn: Callable[[RangeConn | None], None] | None = None,
    ) -> int:
        """GET ``[start, end)`` of ``url``; body bytes go to ``sink``; returns the end served.

        The end served is below ``end`` for a short 206 (or when the sink stopped early).
        """
        host = url.raw_host or ""
        if ":" in host:
            host = f"[{host}]"
        if url.explicit_port:
            host = f"{host}:{url.port}"
        lines = [f"GET {url.raw_path_qs} HTTP/1.1", f"Host: {host}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        lines.append(f"Range: bytes={start}-{end - 1}")
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        # The server closed a kept-alive connection before answering: once more, on a fresh
        # connection, at once (no back-off: nothing failed but the idle connection's timer).
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(_Stale), stop=stop_after_attempt(2), wait=wait_none()
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._fetch_once(
                        url, request, (start, end, total), sink, from_cache, on_conn
                    )
        except RetryError:
            pass
        raise MirrorFailure("transient", "kept-alive connection closed twice in a row")

    async def _fetch_once(  # noqa: PLR0917 (fetch's arguments, passed on)
        self,
        url: URL,
        request: bytes,
        span: tuple[int, int, int],
        sink: Sink,
        from_cache: bool,
        on_conn: Callable[[RangeConn | None], None] | None,
    ) -> int:
        start, end, total = span
        conn = await self._connect(url)
        if on_conn is not None:
            on_conn(conn)
        conn.limit = self.limit
        try:
            served = await conn.begin(request, start, end, total, sink, from_cache)
        except _Stale:
            raise
        except BaseException:
            conn.abort()  # cancel or failure: never leave a half-read answer open
            raise
        finally:
            if on_conn is not None:
                on_conn(None)
        if conn.alive:
            self._idle.setdefault(_key(url), []).append(conn)
        return served

    def close(self) -> None:
        """Close every connection, idle or busy (the end of a download, or a cancel)."""
        for conn in self._all:
            conn.abort()
        self._all.clear()
        self._idle.clear()
