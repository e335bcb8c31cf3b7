"""``GET/POST /api/engines``, ``DELETE /api/engines/{id}``, ``POST /api/generate`` and
``DELETE /api/models/{id}/memory`` (forget the peaks learned for a model's file).

Bodies are validated by the pydantic models in ``modeld.api.requests``; generation goes
through ``requests.start``, which the OpenAI routes share.
"""

from __future__ import annotations

from aiohttp import web

from modeld.api import requests
from modeld.api.requests import GenerateBody, LoadBody
from modeld.api.stream import ndjson
from modeld.engine.engines import Engines
from modeld.engine.pool import Pool, validate_keep_alive
from modeld.services.parts import Services


def add_routes(app: web.Application, services: Services) -> None:
    def parts() -> tuple[Engines, Pool]:
        return services.parts["engines"], services.parts["pool"]

    async def list_engines(_: web.Request) -> web.Response:
        engines, pool = parts()
        runtime = await engines.runtime_info()
        return web.json_response({"engines": pool.list(), **pool.status(), "runtime": runtime})

    async def load(request: web.Request) -> web.Response:
        engines, pool = parts()
        body = await requests.read_body(request, LoadBody)
        backends = body.backends.model_dump(exclude_none=True) if body.backends else None
        modalities = ["text"] + (["image"] if backends and backends.get("vision") else [])
        keep_alive = validate_keep_alive(body.keep_alive)
        target = await engines.target(
            body.model,
            modalities=modalities,
            backends=backends,
            allow_unverified=body.allow_unverified,
        )
        view = await pool.load(target, keep_alive=keep_alive, pin=body.pin, warm_up=body.warm_up)
        return web.json_response(view)

    async def unload(request: web.Request) -> web.Response:
        pool = parts()[1]
        return web.json_response({"unloaded": await pool.unload(request.match_info["id"])})

    async def forget_memory(request: web.Request) -> web.Response:
        engines, _ = parts()
        return web.json_response(await engines.forget_memory(request.match_info["id"]))

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await requests.read_body(request, GenerateBody)
        _, records = await requests.start(services, requests.from_native(body))
        return await ndjson(request, records)

    app.router.add_get("/api/engines", list_engines)
    app.router.add_post("/api/engines", load)
    app.router.add_delete("/api/engines/{id}", unload)
    app.router.add_post("/api/generate", generate)
    app.router.add_delete("/api/models/{id}/memory", forget_memory)
