"""``POST /api/models/{id}/pull``, ``GET /api/downloads``, ``DELETE /api/downloads/{id}``,
``POST /api/models/import``."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from aiohttp import web

from modeld.api.requests import ImportBody, PullBody, read_body
from modeld.api.stream import ndjson
from modeld.download.downloads import Downloads, result_dict
from modeld.services.parts import Services


def add_routes(app: web.Application, services: Services) -> None:
    def downloads() -> Downloads:
        part: Downloads = services.parts["downloads"]
        return part

    async def pull(request: web.Request) -> web.StreamResponse:
        model_id = request.match_info["id"]
        body = await read_body(request, PullBody, optional=True)
        dl = downloads()
        current = await dl.is_current(model_id) if dl.is_current else None
        if body.detach or body.stream is False:
            if current is not None:
                return web.json_response(
                    {"id": model_id, "state": "installed", "already": True, "installed": current}
                )
            return web.json_response(dl.pull(model_id).snapshot())

        async def records() -> AsyncGenerator[dict[str, Any], None]:
            if current is not None:
                yield {"id": model_id, "state": "installed", "already": True, "installed": current}
                return
            job = dl.pull(model_id)
            # Leaving this generator (the client went away) never cancels the job.
            async for record in job.events():
                if record["state"] == "installed":
                    record["installed"] = result_dict(job.result)
                yield record

        return await ndjson(request, records())

    async def index(_: web.Request) -> web.Response:
        return web.json_response({"downloads": downloads().list()})

    async def cancel(request: web.Request) -> web.Response:
        return web.json_response(await downloads().cancel(request.match_info["id"]))

    async def import_(request: web.Request) -> web.Response:
        body = await read_body(request, ImportBody)
        return web.json_response(await downloads().import_file(Path(body.path), body.id))

    app.router.add_post("/api/models/import", import_)
    app.router.add_post("/api/models/{id}/pull", pull)
    app.router.add_get("/api/downloads", index)
    app.router.add_delete("/api/downloads/{id}", cancel)
