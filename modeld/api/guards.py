"""Ids in request paths are checked before any handler (or the store) sees them.

A model id must match the catalog's id pattern, an engine id that pattern plus
``:plan`` (``tiny-text:cpu+vision-gpu``). Either may carry Ollama's ``:latest`` tag
(``tiny-text:latest``), which names the id itself; the handlers see the id without it.
Anything else is a 400 that says what an id looks like, so ``..``, NUL, slashes or a
5,000-character id never reach a path or a query.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from modeld.errors import BadRequest
from modeld.layout import MODEL_ID_PATTERN, MODEL_ID_RE, tag_refusal, untagged
from modeld.services.parts import Services

# An engine id is ``<model id>:<main>[+vision-<b>][+audio-<b>]``; a model id selects all.
# A model id, then optionally ":" and a plan (``modeld ps`` shows engine ids so).
ENGINE_RE = re.compile(MODEL_ID_PATTERN.removesuffix("$") + r"(?::[a-z0-9+_-]{1,64})?$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def check_model_id(text: str) -> str:
    """The id ``text`` names (``:latest`` taken off), else a 400 naming what an id may contain."""
    model_id = untagged(text)
    if not MODEL_ID_RE.fullmatch(model_id):
        refusal = tag_refusal(model_id)
        if refusal is not None:
            raise BadRequest(refusal)
        raise BadRequest(
            f"{model_id[:60]!r} is not a valid model id: letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 128 characters; see `modeld list`"
        )
    return model_id


@web.middleware
async def check_ids(request: web.Request, handler: Handler) -> web.StreamResponse:
    ident = request.match_info.get("id")
    if ident is not None:
        resource = request.match_info.route.resource
        canonical = resource.canonical if resource is not None else ""
        if canonical.startswith("/api/engines/"):
            ident = untagged(ident)  # no plan is named "latest"
            if not ENGINE_RE.fullmatch(ident):
                raise BadRequest(
                    f"{ident[:60]!r} is not an engine or model id; `modeld ps` lists engines"
                )
        else:
            ident = check_model_id(ident)
        request.match_info["id"] = ident
    return await handler(request)


def add_routes(app: web.Application, services: Services) -> None:
    """Install the id check inside the error middleware (so its 400 is mapped)."""
    del services
    app.middlewares.append(check_ids)
