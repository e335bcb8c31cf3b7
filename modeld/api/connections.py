"""Connections to the socket: how many at once, and how long one may sit without a request.

aiohttp bounds neither the number of connections nor the time a request head may take, and
its idle timeout (``keepalive_timeout``) defaults to an hour: 20,000 idle connections took
the daemon's every file descriptor. Each accepted connection is therefore wrapped here:

- ``max_connections``: past it, an idle connection (no request running) is closed to make
  room: the one idle the longest of the peer holding the most connections (a uid on the
  socket, an address on TCP). When every other connection is running a request, the new one
  gets a 503 ``busy`` with ``Retry-After`` and is closed. An app flooding the socket with
  idle connections only ever closes its own, never another client's, even one whose request
  is on its way (a flood of 20,000 reset other clients' fresh connections before).
- ``header_timeout``: a request head must be complete this long after its first byte; a
  client sending one header line a second is dropped.
- ``idle_timeout`` (aiohttp's ``keepalive_timeout``): a connection with no request running
  is closed after this long, counted from its opening or from its last response.

aiohttp sees a connection only once its first bytes arrive: one that never sends any (a
flood) costs an accept, a guard entry and its idle timer here, not a request handler and
its task. That keeps the daemon answering others while thousands arrive.

``track_requests`` (a middleware) tells the wrapper when a request starts and ends.

aiohttp does not cancel a handler whose client left, and the daemon does not turn that on
for every route (a pull or an import goes on without its client). A generation, which
holds its engine's queue, runs under ``cancelled_when_client_leaves``: the wrapper's
``connection_lost`` cancels it there, and the handler ends with ``ClientLeft`` (499).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from modeld import logs
from modeld.api.peers import Peer, peer_credentials
from modeld.config import Settings
from modeld.errors import ClientLeft

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A refused connection is closed once the client has read the 503, or after this long.
_REFUSED_LINGER = 1.0
# At most one log line a second for refused or evicted connections (a flood is one line).
_LOG_EVERY = 1.0


class ConnectionGuard:
    """The connections of one listening socket: their count, and which ones are idle.

    The room is made when a connection is made (``admit``), not when it is accepted: only
    then is its peer known, and a burst of accepts (up to the backlog at once) cannot close
    a connection before it had a chance to send its request.
    """

    def __init__(self, settings: Settings) -> None:
        self.max_connections = settings.max_connections
        self.header_timeout = settings.header_timeout
        self.idle_timeout = settings.idle_timeout
        # Made and not yet lost; ``closing`` are those this guard closed (their fds go at
        # connection_lost, a loop turn later: they no longer count).
        self.open: set[GuardedConnection] = set()
        self.closing: set[GuardedConnection] = set()
        # Refused: answering their 503, closed after _REFUSED_LINGER.
        self.refusing: set[GuardedConnection] = set()
        # Set when the sites stop: a connection made later (an accept in flight) is closed.
        self.stopped = False
        # Connections with no request running, by peer, each peer's idle the longest first.
        self.idle: dict[str, OrderedDict[GuardedConnection, None]] = {}
        # Open connections by peer (``uid:N`` on the socket, ``ip:ADDRESS`` on TCP).
        self.by_peer: Counter[str] = Counter()
        self.refused = 0
        self.evicted = 0
        self._logged_at = 0.0
        self._logged = (0, 0)

    def wrap(self, factory: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's ``factory``."""

        def make() -> asyncio.Protocol:
            return GuardedConnection(self, factory())

        return make

    def admit(self, conn: GuardedConnection) -> bool:
        """Count ``conn`` in, making room if the limit is reached; False: refuse it."""
        if len(self.open) - len(self.closing) >= self.max_connections and not self._evict_one(conn):
            self.refused += 1
            self._log()
            return False
        self.open.add(conn)
        self.by_peer[conn.peer] += 1
        self.set_idle(conn)
        return True

    def set_idle(self, conn: GuardedConnection) -> None:
        self.idle.setdefault(conn.peer, OrderedDict())[conn] = None

    def set_busy(self, conn: GuardedConnection) -> None:
        mine = self.idle.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.idle[conn.peer]

    def lost(self, conn: GuardedConnection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self.by_peer[conn.peer] -= 1
            if self.by_peer[conn.peer] <= 0:
                del self.by_peer[conn.peer]
        self.closing.discard(conn)
        self.refusing.discard(conn)
        self.set_busy(conn)

    def close_unstarted(self) -> None:
        """Close the connections aiohttp never had (it closes its own at shutdown), and
        any made from now on."""
        self.stopped = True
        for conn in [*self.open, *self.refusing]:
            if not conn.started:
                conn.close()

    def _evict_one(self, newcomer: GuardedConnection) -> bool:
        """Close an idle connection of the peer holding the most (the newcomer counted);
        False when no connection is idle."""

        def held(peer: str) -> int:
            return self.by_peer[peer] + (peer == newcomer.peer)

        for peer in sorted(self.idle, key=held, reverse=True):
            # The one idle the longest; output still queued is a response being sent, so a
            # connection with some is not idle.
            victim = next((c for c in self.idle[peer] if c.quiet()), None)
            if victim is None:
                continue
            self.set_busy(victim)
            if victim.close():
                self.closing.add(victim)
                self.evicted += 1
                self._log()
                return True
        return False

    def _log(self) -> None:
        now = time.monotonic()
        if now - self._logged_at < _LOG_EVERY:
            return
        refused, evicted = self.refused - self._logged[0], self.evicted - self._logged[1]
        self._logged_at, self._logged = now, (self.refused, self.evicted)
        top = self.by_peer.most_common(1)
        logs.event(
            "connections_bounded",
            logging.WARNING,
            open=len(self.open),
            limit=self.max_connections,
            refused=refused,
            idle_closed=evicted,
            most=f"{top[0][0]}x{top[0][1]}" if top else "-",
        )


class GuardedConnection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the header timer and the idle mark."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.peer = "-"
        # The kernel records a Unix peer's credentials at connect: read once, kept.
        self.credentials: Peer | None = None
        self.in_request = False
        # Refused at connection_made: answered with a 503, and aiohttp never sees it.
        self.refused: _Refused | None = None
        # Whether aiohttp has the connection (from its first bytes on).
        self.started = False
        self._header_timer: asyncio.TimerHandle | None = None
        # Until the first bytes: the idle timeout that aiohttp keeps afterwards.
        self._silent_timer: asyncio.TimerHandle | None = None
        # Called once at connection_lost (``cancelled_when_client_leaves``).
        self.on_lost: list[Callable[[], None]] = []

    def quiet(self) -> bool:
        """Made, and nothing queued to send."""
        return self.transport is not None and not self.transport.get_write_buffer_size()

    def close(self) -> bool:
        """Close the connection; False when it was already closing."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return False
        transport.close()
        return True

    # --- what the request middleware reports ---------------------------------------------

    def request_started(self) -> None:
        self.in_request = True
        self.guard.set_busy(self)
        self._cancel_timer()

    def request_finished(self) -> None:
        self.in_request = False
        if self in self.guard.open:
            self.guard.set_idle(self)

    # --- asyncio.Protocol, passed on to aiohttp --------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.guard.stopped:
            self.refused = _Refused()  # no 503 sent: the daemon is stopping
            transport.close()
            return
        self.credentials = peer_credentials(transport.get_extra_info("socket"))
        self.peer = _peer_key(transport, self.credentials)
        if not self.guard.admit(self):
            self.guard.refusing.add(self)
            self.refused = _Refused()
            self.refused.connection_made(transport)
            return
        if self.guard.idle_timeout > 0:
            loop = asyncio.get_running_loop()
            self._silent_timer = loop.call_later(self.guard.idle_timeout, self.close)

    def _start(self) -> None:
        """Hand the connection to aiohttp, at its first bytes."""
        self.started = True
        if self._silent_timer is not None:
            self._silent_timer.cancel()
            self._silent_timer = None
        assert self.transport is not None
        self.inner.connection_made(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.refused is not None or not data:
            return
        if not self.started:
            self._start()
        # The first bytes of a request head start its clock (once per head).
        if not self.in_request and self._header_timer is None and data:
            loop = asyncio.get_running_loop()
            self._header_timer = loop.call_later(self.guard.header_timeout, self._head_too_slow)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self.refused is not None:
            return self.refused.eof_received()
        if not self.started:
            return None  # closed before a byte: close our side too
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self._silent_timer is not None:
            self._silent_timer.cancel()
            self._silent_timer = None
        self.guard.lost(self)
        self.transport = None
        if self.refused is not None:
            self.refused.connection_lost(exc)
        elif self.started:
            self.inner.connection_lost(exc)
        callbacks, self.on_lost = self.on_lost, []
        for callback in callbacks:
            callback()

    def pause_writing(self) -> None:
        if self.refused is None and self.started:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.refused is None and self.started:
            self.inner.resume_writing()

    def _cancel_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _head_too_slow(self) -> None:
        self._header_timer = None
        if self.in_request:
            return
        peer = _peer(self)
        if self.close():
            seconds = self.guard.header_timeout
            logs.event("header_timeout", logging.WARNING, seconds=seconds, peer=peer)


def _peer_key(transport: asyncio.Transport, peer: Peer | None) -> str:
    """Whose connection this is, for fairness: ``uid:N`` on the socket, ``ip:A`` on TCP."""
    if peer is not None:
        return f"uid:{peer.uid}"
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple) and address:
        return f"ip:{address[0]}"
    return "-"


def _peer(conn: GuardedConnection) -> str:
    """Who the connection is, for a log line: its credentials on the socket, else its
    address (``ip:A`` on TCP)."""
    return str(conn.credentials) if conn.credentials is not None else conn.peer


class _Refused(asyncio.Protocol):
    """A connection past the limit: a 503 with ``Retry-After``, then closed."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        body = json.dumps(
            {
                "error": {
                    "code": "busy",
                    "message": "too many connections to modeld (MODELD_MAX_CONNECTIONS), all "
                    "of them running a request; retry shortly",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        )
        transport.write(head.encode() + body)
        # Half-close: the client reads the answer to its end; its request is never read.
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(_REFUSED_LINGER, transport.close)

    def data_received(self, data: bytes) -> None:
        del data  # the request is not read: it is refused whatever it says

    def eof_received(self) -> bool:
        return False  # the client is done too: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.transport = None


def connection_of(request: web.Request) -> GuardedConnection | None:
    transport = request.transport
    protocol: Any = transport.get_protocol() if transport is not None else None
    return protocol if isinstance(protocol, GuardedConnection) else None


def peer_of(request: web.Request) -> Peer | None:
    """The Unix peer of ``request``'s connection (read at connect), or None on TCP."""
    conn = connection_of(request)
    if conn is not None:
        return conn.credentials
    transport = request.transport
    return peer_credentials(transport.get_extra_info("socket") if transport else None)


class _ClientWatch:
    """One request's watch on its client (``cancelled_when_client_leaves``)."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        # The handler already knows (a write failed): it is cleaning up, not to be cancelled.
        self.noticed = False
        self.cancelled = False

    def lost(self) -> None:
        if not self.noticed:
            self.noticed = self.cancelled = True
            self.task.cancel()


_WATCH: web.RequestKey[_ClientWatch] = web.RequestKey("client_watch", _ClientWatch)


def client_left(request: web.Request) -> ClientLeft:
    """The error for a write that found ``request``'s client gone (a handler raises it)."""
    watch = request.get(_WATCH)
    if watch is not None:
        watch.noticed = True
    return ClientLeft("the client closed the connection before its answer was complete")


@contextlib.asynccontextmanager
async def cancelled_when_client_leaves(request: web.Request) -> AsyncIterator[None]:
    """Run the block, cancelled if ``request``'s client leaves meanwhile; then ``ClientLeft``.

    The cancellation reaches whatever the block waits on (a queue, a load, a reply not
    streamed), whose clean-up runs as for any cancellation (the pool cancels the job in its
    runner). A cancellation from elsewhere (the daemon stopping) passes through as it is.
    """
    conn = connection_of(request)
    task = asyncio.current_task()
    if conn is None or task is None:
        yield
        return
    if conn.transport is None:
        raise client_left(request)
    watch = _ClientWatch(task)
    request[_WATCH] = watch
    conn.on_lost.append(watch.lost)
    try:
        yield
    except asyncio.CancelledError:
        if watch.cancelled and task.uncancel() == 0:
            raise client_left(request) from None
        raise
    finally:
        watch.noticed = True
        with contextlib.suppress(ValueError):
            conn.on_lost.remove(watch.lost)


@web.middleware
async def track_requests(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Mark the connection busy while a request runs (no header timer, never evicted)."""
    conn = connection_of(request)
    if conn is None:
        return await handler(request)
    conn.request_started()
    try:
        return await handler(request)
    finally:
        conn.request_finished()


class GuardedSite(web.SockSite):
    """aiohttp's ``SockSite`` whose connections go through a ``ConnectionGuard``."""

    def __init__(self, runner: web.AppRunner, sock: Any, guard: ConnectionGuard) -> None:
        super().__init__(runner, sock)
        self.guard = guard

    async def start(self) -> None:
        # SockSite.start, with the guard around the server's protocol factory.
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard.wrap(server), sock=self._sock, backlog=self._backlog
        )

    async def stop(self) -> None:
        self.guard.close_unstarted()
        await super().stop()
