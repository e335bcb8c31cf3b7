"""``POST /api/models/{id}/pull``, ``POST /api/models/pull`` (a Hub file),
``GET /api/downloads``, ``DELETE /api/downloads/{id}``, ``POST /api/models/import``."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

from aiohttp import web

from modeld.api.access import on_unix_socket
from modeld.api.connections import peer_of
from modeld.api.requests import ImportBody, PullBody, PullSourceBody, read_body
from modeld.api.stream import as_is, ndjson
from modeld.errors import BadRequest, Forbidden
from modeld.services.parts import Services

# How long the daemon waits for the descriptor once it asked for it (a 100 Continue).
FD_TIMEOUT = 30.0


def _may_import_by_path(request: web.Request) -> None:
    """A path is opened by the daemon, so only peers who could open any file it can may name
    one: root and the daemon's own uid, on the socket. Others pass the file itself."""
    peer = peer_of(request)
    if peer is None or peer.uid not in (0, os.getuid()):
        raise Forbidden(
            "import by path is only for root and the daemon's own user; `modeld import PATH` "
            "opens the file as you and passes it to the daemon instead"
        )


async def receive_fd(request: web.Request) -> int:
    """Ask for the descriptor (``HTTP/1.1 100 Continue``) and take it off the socket.

    The client sends one byte carrying the descriptor (``SCM_RIGHTS``) only after the 100,
    and the connection's reading is paused first, so the byte and its descriptor reach
    ``recvmsg`` here and never the HTTP parser (which would drop the descriptor).
    """
    transport = request.transport
    if transport is None or not on_unix_socket(request):
        raise BadRequest(
            "a file descriptor can only be passed on the Unix socket; over TCP give a path "
            "on the daemon's host"
        )
    transport.pause_reading()
    try:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await request.writer.drain()
        sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        try:
            sock.setblocking(False)
            return await asyncio.wait_for(_recv_one_fd(sock), FD_TIMEOUT)
        except TimeoutError:
            raise BadRequest(
                f"no file descriptor came within {FD_TIMEOUT:g} s of the 100 Continue; "
                "use `modeld import PATH`, which sends it"
            ) from None
        finally:
            sock.close()
    finally:
        transport.resume_reading()


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


async def _recv_one_fd(sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    while True:
        ready: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _wake, ready)
        try:
            await ready
        finally:
            loop.remove_reader(sock.fileno())
        try:
            _, fds, flags, _ = socket.recv_fds(sock, 1, 1)
        except BlockingIOError:
            continue
        if len(fds) != 1 or flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise BadRequest(
                "the request said a file descriptor follows, but exactly one did not; "
                "use `modeld import PATH`, which sends it"
            )
        return fds[0]


def add_routes(app: web.Application, services: Services) -> None:
    downloads = services.downloads

    async def pull(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, PullBody, optional=True)
        # Already installed (and current), or the download started or joined.
        started = await services.models.pull(
            request.match_info["id"], force=body.force, limit_rate=body.limit_rate
        )
        if body.detach or body.stream is False:
            return web.json_response(started.snapshot())
        return await ndjson(request, started.records(), as_is)

    async def pull_source(request: web.Request) -> web.StreamResponse:
        body = await read_body(request, PullSourceBody)
        started = await services.sources.pull_source(
            body.source, model_id=body.id, force=body.force, limit_rate=body.limit_rate
        )
        if body.detach or body.stream is False:
            return web.json_response(started.snapshot())
        return await ndjson(request, started.records(), as_is)

    async def index(_: web.Request) -> web.Response:
        return web.json_response({"downloads": downloads.list()})

    async def cancel(request: web.Request) -> web.Response:
        return web.json_response(await downloads.cancel(request.match_info["id"]))

    async def import_(request: web.Request) -> web.Response:
        body = await read_body(request, ImportBody)
        if body.path is not None:
            _may_import_by_path(request)
            return web.json_response(await downloads.import_file(Path(body.path), body.id))
        assert body.name is not None
        fd = await receive_fd(request)
        try:
            doc = await downloads.import_fd(fd, body.name, body.id)
        finally:
            os.close(fd)
        response = web.json_response(doc)
        response.force_close()
        return response

    app.router.add_post("/api/models/import", import_)
    app.router.add_post("/api/models/pull", pull_source)
    app.router.add_post("/api/models/{id}/pull", pull)
    app.router.add_get("/api/downloads", index)
    app.router.add_delete("/api/downloads/{id}", cancel)
