"""``POST /api/models/{id}/pull``, ``GET /api/downloads``, ``DELETE /api/downloads/{id}``,
``POST /api/models/import``."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from aiohttp import web

from modeld.api.access import on_unix_socket
from modeld.api.peers import peer_credentials
from modeld.api.requests import ImportBody, PullBody, read_body
from modeld.api.stream import ndjson
from modeld.download.downloads import Downloads, result_dict
from modeld.errors import BadRequest, Forbidden
from modeld.services.fit import Fits
from modeld.services.parts import Services

# How long the daemon waits for the descriptor once it asked for it (a 100 Continue).
FD_TIMEOUT = 30.0


def _may_import_by_path(request: web.Request) -> None:
    """A path is opened by the daemon, so only peers who could open any file it can may name
    one: root and the daemon's own uid, on the socket. Others pass the file itself."""
    peer = peer_credentials(
        request.transport.get_extra_info("socket") if request.transport else None
    )
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
    def downloads() -> Downloads:
        part: Downloads = services.parts["downloads"]
        return part

    async def pull(request: web.Request) -> web.StreamResponse:
        model_id = request.match_info["id"]
        body = await read_body(request, PullBody, optional=True)
        dl = downloads()
        current = await dl.is_current(model_id) if dl.is_current else None
        choice: dict[str, Any] | None = None
        if current is None and model_id not in dl.jobs:
            # Before any byte: a model that can never load is refused, or a variant taken.
            found = await Fits.of_services(services).choose(model_id, force=body.force)
            choice = {**found, "fit": found["fit"].to_dict()}
            if found["chosen"] != model_id:
                model_id = found["chosen"]
                current = await dl.is_current(model_id) if dl.is_current else None
        already = {"id": model_id, "state": "installed", "already": True, "installed": current}
        if choice is not None:
            already["choice"] = choice
        if body.detach or body.stream is False:
            if current is not None:
                return web.json_response(already)
            return web.json_response(dl.pull(model_id).snapshot() | {"choice": choice})

        async def records() -> AsyncGenerator[dict[str, Any], None]:
            if current is not None:
                yield already
                return
            job = dl.pull(model_id)
            first = True
            # Leaving this generator (the client went away) never cancels the job.
            async for record in job.events():
                if record["state"] == "installed":
                    record["installed"] = result_dict(job.result)
                if choice is not None and (first or record["state"] == "installed"):
                    record["choice"] = choice
                first = False
                yield record

        return await ndjson(request, records())

    async def index(_: web.Request) -> web.Response:
        return web.json_response({"downloads": downloads().list()})

    async def cancel(request: web.Request) -> web.Response:
        return web.json_response(await downloads().cancel(request.match_info["id"]))

    async def import_(request: web.Request) -> web.Response:
        body = await read_body(request, ImportBody)
        if body.path is not None:
            _may_import_by_path(request)
            return web.json_response(await downloads().import_file(Path(body.path), body.id))
        assert body.name is not None
        fd = await receive_fd(request)
        try:
            doc = await downloads().import_fd(fd, body.name, body.id)
        finally:
            os.close(fd)
        response = web.json_response(doc)
        response.force_close()
        return response

    app.router.add_post("/api/models/import", import_)
    app.router.add_post("/api/models/{id}/pull", pull)
    app.router.add_get("/api/downloads", index)
    app.router.add_delete("/api/downloads/{id}", cancel)
