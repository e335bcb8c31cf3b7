"""``GET /api/models/{id}/bug-report``: the facts an upstream issue about a model needs.

What goes in is ``Models.bug_report``'s; the CLI (``modeld bug-report ID``) writes it to one
file.
"""

from __future__ import annotations

from aiohttp import web

from modeld.services.parts import Services


def add_routes(app: web.Application, services: Services) -> None:
    async def report(request: web.Request) -> web.Response:
        doc = await services.models.bug_report(request.match_info["id"], services.version)
        return web.json_response(doc)

    app.router.add_get("/api/models/{id}/bug-report", report)
