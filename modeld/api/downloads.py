"""``POST /api/models/{id}/pull``, ``GET /api/downloads``, ``DELETE /api/downloads/{id}``,
``POST /api/models/import``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from aiohttp import web

from modeld.api.stream import ndjson
from modeld.errors import BadRequest
from modeld.pulls import Downloads, result_dict
from modeld.services import Services


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({e}); send a JSON object") from e
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def add_routes(app: web.Application, services: Services) -> None:
    def downloads() -> Downloads:
        part: Downloads = services.parts["downloads"]
        return part

    async def pull(request: web.Request) -> web.StreamResponse:
        model_id = request.match_info["id"]
        body = await _body(request)
        dl = downloads()
        current = await dl.is_current(model_id) if dl.is_current else None
        if body.get("detach") or body.get("stream") is False:
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
        body = await _body(request)
        path, model_id = body.get("path"), body.get("id")
        if not isinstance(path, str) or not path:
            raise BadRequest('send {"path": "/abs/file.litertlm", "id": optional model id}')
        if model_id is not None and not isinstance(model_id, str):
            raise BadRequest('"id" must be a string')
        return web.json_response(await downloads().import_file(Path(path), model_id))

    app.router.add_post("/api/models/import", import_)
    app.router.add_post("/api/models/{id}/pull", pull)
    app.router.add_get("/api/downloads", index)
    app.router.add_delete("/api/downloads/{id}", cancel)
