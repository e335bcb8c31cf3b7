"""``GET /api/models``, ``GET /api/models/{id}`` and ``POST /api/models/{id}/verify``.

The rules (install state, plans, what verifies a file) are the ``Models`` service's.
"""

from __future__ import annotations

from aiohttp import web

from modeld.services.parts import Services


def add_routes(app: web.Application, services: Services) -> None:
    models = services.models

    async def index(request: web.Request) -> web.Response:
        flag = request.query.get("installed", "").lower() in ("1", "true", "yes")
        return web.json_response(await models.listing(installed_only=flag))

    async def show(request: web.Request) -> web.Response:
        return web.json_response(await models.show(request.match_info["id"]))

    async def verify(request: web.Request) -> web.Response:
        return web.json_response(await models.verify(request.match_info["id"]))

    app.router.add_get("/api/models", index)
    app.router.add_get("/api/models/{id}", show)
    app.router.add_post("/api/models/{id}/verify", verify)
