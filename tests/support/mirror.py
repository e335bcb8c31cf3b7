"""A test mirror: aiohttp on 127.0.0.1 (ephemeral port) serving one file, with switchable faults.

Each fault is a field of ``Faults`` and can be changed while the mirror runs:
throttle (after a burst, as socket buffers give one), stall after N bytes, drop mid-piece,
ignore Range (200), short 206, wrong Content-Range, flip a byte, wrong total size, a fixed
status (404), 500-then-OK, a redirect loop, a redirect to any URL (e.g. https → http or
ftp), and a Hugging Face-like redirect that carries ``X-Linked-Etag``/``X-Linked-Size`` and
whose signed target expires (403).

``SlowHeadMirror`` is a raw server for what aiohttp cannot do: an answer whose header lines
come one at a time (or whose body never starts) until the test releases it.

A mirror serves its file at ``path`` (``/f``, or a Hugging Face-style pinned path from
``pinned_path``); ``tests.support.hub`` has the stand-in for huggingface.co itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ssl
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

CHUNK = 64 * 1024
T = TypeVar("T")
# A made-up pinned commit: tests never reach a real hub.
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def pinned_path(file: str = "m.litertlm", commit: str = COMMIT, repo: str = "org/repo") -> str:
    """``/ORG/REPO/resolve/COMMIT/FILE``, the path of a file at a pinned revision."""
    return f"/{repo}/resolve/{commit}/{file}"


@dataclass
class Faults:
    throttle: float | None = None  # bytes per second per response
    burst: int = 0  # bytes of each response sent at once before the throttle applies
    stall_after: int | None = None  # after this many body bytes in total, stop sending
    # (after, block): once this many body bytes are sent in all, each answer stops halfway
    # through its next block of the file (offsets in ``block``s) until this is set to None.
    hold_mid_block: tuple[int, int] | None = None
    drop_after: int | None = None  # abort the connection after this many bytes of a response
    drop_times: int = 1_000_000  # how many responses to drop
    ignore_range: bool = False  # answer Range requests with 200 and the whole file
    short: bool = False  # answer with a 206 covering only the first half of the asked range
    wrong_content_range: bool = False  # Content-Range start shifted by one
    flip_byte: int | None = None  # offset whose byte is served XOR 0xFF
    wrong_size: bool = False  # total size in Content-Range is one more than the file
    status: int | None = None  # answer every request with this status
    fail_first: int = 0  # answer this many requests with 500 (then serve normally)
    retry_after: str | None = None  # Retry-After on the 500s
    redirect_loop: bool = False
    redirect_to: str | None = None
    hf: bool = False  # redirect like huggingface.co: X-Linked-* headers, signed /cdn target
    linked_sha256: str | None = None  # X-Linked-Etag value in hf mode (default: the truth)
    sign_ttl: float | None = None  # signed /cdn URLs answer 403 after this many seconds
    etag: str | None = None  # override the ETag (to simulate a changed file)


@dataclass
class Mirror:
    """One running mirror; ``url`` is where the file is."""

    data: bytes
    faults: Faults = field(default_factory=Faults)
    requests: list[dict[str, Any]] = field(default_factory=list)
    sent: int = 0
    runner: web.AppRunner | None = None
    port: int = 0
    host: str = "127.0.0.1"
    tls: ssl.SSLContext | None = None  # serve https with this server context
    path: str = "/f"  # where the file is (the redirect target of hf mode stays /cdn/f)

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.port}{self.path}"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def routes(self, app: web.Application) -> None:
        app.router.add_get(self.path, self._origin)
        app.router.add_get("/cdn/f", self._cdn)

    async def start(self) -> Mirror:
        app = web.Application()
        self.routes(app)
        # A short shutdown timeout: a stalled handler must not hold the test's teardown.
        self.runner = web.AppRunner(
            app, access_log=None, handle_signals=False, shutdown_timeout=0.2
        )
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.tls)
        await site.start()
        server = site._server
        assert server is not None
        sockets: Any = getattr(server, "sockets", None)  # asyncio.Server; typed as abstract
        self.port = sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _etag(self) -> str:
        return self.faults.etag or f'"{self.sha256[:16]}"'

    async def _origin(self, request: web.Request) -> web.StreamResponse:
        f = self.faults
        self.requests.append({"path": request.path_qs, **dict(request.headers)})
        if f.status is not None:
            return web.Response(status=f.status)
        if f.fail_first > 0:
            f.fail_first -= 1
            headers = {"Retry-After": f.retry_after} if f.retry_after else {}
            return web.Response(status=500, headers=headers)
        if f.redirect_loop:
            n = int(request.query.get("n", "0")) + 1
            raise web.HTTPFound(f"{self.path}?n={n}")
        if f.redirect_to:
            raise web.HTTPFound(f.redirect_to)
        if f.hf:
            sha = f.linked_sha256 or self.sha256
            raise web.HTTPFound(
                # The CDN is another host, as cas-bridge.xethub.hf.co is for huggingface.co.
                f"http://127.0.0.1:{self.port}/cdn/f?sig={time.monotonic()}",
                headers={"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(self.data))},
            )
        return await self._serve(request)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"path": request.path_qs, **dict(request.headers)})
        ttl = self.faults.sign_ttl
        if ttl is not None and time.monotonic() - float(request.query.get("sig", "0")) > ttl:
            return web.Response(status=403, text="Request has expired")
        return await self._serve(request, etag='"cdn-etag-differs"')

    async def _serve(
        self, request: web.Request, etag: str | None = None, data: bytes | None = None
    ) -> web.StreamResponse:
        f = self.faults
        data = self.data if data is None else data
        total = len(data) + (1 if f.wrong_size else 0)
        etag = etag or self._etag()
        rng = request.headers.get("Range")
        if_range = request.headers.get("If-Range")
        start, end = 0, len(data) - 1
        partial = False
        if rng and not f.ignore_range and (if_range is None or if_range == etag):
            spec = rng.removeprefix("bytes=")
            a, _, b = spec.partition("-")
            start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
            if start >= len(data):
                return web.Response(status=416, headers={"Content-Range": f"bytes */{total}"})
            partial = True
            if f.short and end > start:
                end = start + (end - start) // 2
        resp = web.StreamResponse(status=206 if partial else 200)
        resp.headers["ETag"] = etag
        resp.headers["Accept-Ranges"] = "bytes"
        if partial:
            shown = start + 1 if f.wrong_content_range else start
            resp.headers["Content-Range"] = f"bytes {shown}-{end}/{total}"
        resp.content_length = end - start + 1 if partial else total
        await resp.prepare(request)
        pos = start
        sent_here = 0
        began = time.monotonic()
        while pos <= end:
            n = min(CHUNK, end - pos + 1)
            if f.stall_after is not None and self.sent + n > f.stall_after:
                await asyncio.sleep(3600)
            while (hold := f.hold_mid_block) is not None and self.sent >= hold[0]:
                into, half = pos % hold[1], hold[1] // 2
                if not into <= half < into + n:
                    break
                await asyncio.sleep(0.01)  # a test thread clears it: polled, not awaited
            if f.drop_after is not None and f.drop_times > 0 and sent_here + n > f.drop_after:
                f.drop_times -= 1
                assert request.transport is not None
                request.transport.abort()
                return resp
            chunk = bytearray(data[pos : pos + n])
            if f.flip_byte is not None and pos <= f.flip_byte < pos + n:
                chunk[f.flip_byte - pos] ^= 0xFF
            await resp.write(bytes(chunk))
            pos += n
            sent_here += n
            self.sent += n
            if f.throttle and sent_here > f.burst:
                ahead = (sent_here - f.burst) / f.throttle - (time.monotonic() - began)
                if ahead > 0:
                    await asyncio.sleep(ahead)
        await resp.write_eof()
        return resp


async def start_mirrors(data: bytes, *faults: Faults) -> list[Mirror]:
    """Start one mirror per ``Faults`` (at least one), all serving ``data``."""
    return [await Mirror(data, f).start() for f in (faults or (Faults(),))]


class LoopThread:
    """An event loop in a thread, for servers that tests driving subprocesses need."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run ``coro`` on the thread's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class ThreadMirror:
    """A test mirror on its own event loop in a thread, for tests that drive subprocesses."""

    def __init__(self, data: bytes, faults: Faults) -> None:
        self.loop = LoopThread()
        self.mirror = self.loop.run(Mirror(data, faults).start())

    def close(self) -> None:
        self.loop.run(self.mirror.stop())
        self.loop.close()


class SlowHeadMirror:
    """A raw HTTP/1.1 server for slow answers, on 127.0.0.1 (ephemeral port).

    Each answer sends its status line, then (``trickle``) one made-up header line every
    ``interval`` seconds, or (``hold_body``) its whole head but no body, until ``release``
    is set; then the rest of a proper answer to the asked range of ``data`` (206 with
    ``Content-Range``), and the connection closes. ``waiting`` counts answers held now.
    With ``redirect_to``, the answer is instead a hub's 302 there, carrying
    ``X-Linked-Etag: linked_sha256`` and ``X-Linked-Size``.
    """

    def __init__(
        self,
        data: bytes,
        *,
        trickle: bool = True,
        hold_body: bool = False,
        interval: float = 1.0,
        redirect_to: str | None = None,
        linked_sha256: str | None = None,
    ) -> None:
        self.data, self.trickle, self.hold_body, self.interval = data, trickle, hold_body, interval
        self.redirect_to = redirect_to
        self.linked_sha256 = linked_sha256 or hashlib.sha256(data).hexdigest()
        self.release = asyncio.Event()
        self.requests: list[str] = []
        self.waiting = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/f"

    async def start(self) -> SlowHeadMirror:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _hold(self, writer: asyncio.StreamWriter) -> None:
        self.waiting += 1
        try:
            n = 0
            while not self.release.is_set():
                if self.trickle and not self.hold_body:
                    n += 1
                    writer.write(f"X-Line-{n}: x\r\n".encode())
                    await writer.drain()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.release.wait(), self.interval)
        finally:
            self.waiting -= 1

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            self.requests.append(head)
            size = len(self.data)
            start, end = 0, size - 1
            for line in head.split("\r\n"):
                name, _, value = line.partition(":")
                if name.strip().lower() == "range":
                    a, _, b = value.strip().removeprefix("bytes=").partition("-")
                    start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if self.redirect_to is not None:
                writer.write(b"HTTP/1.1 302 Found\r\n")
                rest = (
                    f"Location: {self.redirect_to}\r\n"
                    f'X-Linked-Etag: "{self.linked_sha256}"\r\nX-Linked-Size: {size}\r\n'
                    "Content-Length: 0\r\nConnection: close\r\n\r\n"
                ).encode()
                start, end = 0, -1  # no body
            else:
                writer.write(b"HTTP/1.1 206 Partial Content\r\n")
                rest = (
                    f"Content-Range: bytes {start}-{end}/{size}\r\n"
                    f"Content-Length: {end - start + 1}\r\nConnection: close\r\n\r\n"
                ).encode()
            if self.hold_body:
                writer.write(rest)
            await writer.drain()
            await self._hold(writer)
            if not self.hold_body:
                writer.write(rest)
            writer.write(self.data[start : end + 1])
            await writer.drain()
            writer.close()
