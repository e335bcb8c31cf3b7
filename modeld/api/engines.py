"""``GET/POST /api/engines``, ``DELETE /api/engines/{id}``, ``POST /api/modeld/generate``,
``POST /api/models/{id}/check`` (would a generation be admitted) and
``DELETE /api/models/{id}/memory`` (forget the peaks learned for a model's file).

Bodies are validated by the pydantic models in ``modeld.api.requests``; loads and
generation go through the ``Inference`` service, which the OpenAI routes share.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from modeld.api import access, requests
from modeld.api.connections import cancelled_when_client_leaves
from modeld.api.requests import CheckBody, GenerateBody, LoadBody
from modeld.api.stream import Deadline, ndjson
from modeld.config import parse_duration
from modeld.errors import BadRequest
from modeld.services.inference import Done, Final, Token
from modeld.services.parts import Services


def unload_grace(text: str | None) -> float | None:
    """``?grace=D`` of an unload: how long its in-flight requests may take (None: the
    default); a 400 names the parameter for anything but a duration of 0 or more."""
    if text is None:
        return None
    try:
        grace = parse_duration(text)
    except ValueError:
        grace = -1.0
    if grace < 0:
        raise BadRequest(
            f"grace={text!r} is not a duration of 0 or more; send e.g. grace=30s, or grace=0 "
            "to refuse at once what has not ended"
        )
    return grace


def generation_json(record: Token | Final[Done]) -> dict[str, Any]:
    """A generation record on the native API: ``{"token": ...}``, then the final record."""
    return {"token": record.text} if isinstance(record, Token) else record.to_json()


def add_routes(app: web.Application, services: Services) -> None:
    inference = services.inference

    async def list_engines(_: web.Request) -> web.Response:
        return web.json_response(await inference.loaded())

    async def load(request: web.Request) -> web.Response:
        body = await requests.read_body(request, LoadBody)
        view = await inference.load(
            body.model,
            backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
            keep_alive=body.keep_alive,
            pin=body.pin,
            allow_unverified=body.allow_unverified,
            may_shorten_keep_alive=access.administers(request),
            warm_up=body.warm_up,
        )
        return web.json_response(view)

    async def unload(request: web.Request) -> web.Response:
        grace = unload_grace(request.query.get("grace"))
        unloaded = await inference.unload(request.match_info["id"], grace=grace)
        return web.json_response({"unloaded": unloaded})

    async def forget_memory(request: web.Request) -> web.Response:
        return web.json_response(await inference.forget_memory(request.match_info["id"]))

    async def check(request: web.Request) -> web.Response:
        body = await requests.read_body(request, CheckBody, optional=True)
        ready = await inference.ready(
            request.match_info["id"], images=body.images, allow_unverified=body.allow_unverified
        )
        return web.json_response(ready)

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await requests.read_body(request, GenerateBody)
        deadline = Deadline(request, services.settings.request_timeout)
        async with cancelled_when_client_leaves(request):
            async with deadline.bound():
                gen = await requests.off_loop(requests.from_native, body)
                gen.scope = access.scope_of(request)
                _, records = await inference.generate(
                    gen, may_shorten_keep_alive=access.administers(request)
                )
            return await ndjson(request, records, generation_json, deadline)

    app.router.add_get("/api/engines", list_engines)
    app.router.add_post("/api/engines", load)
    app.router.add_delete("/api/engines/{id}", unload)
    app.router.add_post("/api/modeld/generate", generate)
    app.router.add_post("/api/models/{id}/check", check)
    app.router.add_delete("/api/models/{id}/memory", forget_memory)
