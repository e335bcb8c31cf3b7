"""``/api/health``, ``/api/status`` and ``/metrics``."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from modeld.services.parts import Services


def add_routes(app: web.Application, services: Services) -> None:
    async def health(_: web.Request) -> web.Response:
        return web.json_response(
            {"status": "stopping" if services.stopping else "ok", "version": services.version}
        )

    async def status(_: web.Request) -> web.Response:
        return web.json_response(await services.status())

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=services.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app.router.add_get("/api/health", health)
    app.router.add_get("/api/status", status)
    app.router.add_get("/metrics", metrics)
