"""``DELETE /api/models/{id}`` (``rm``) and ``POST /api/prune``."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from modeld.api import requests
from modeld.api.bodies import read_json
from modeld.config import parse_duration
from modeld.errors import BadRequest
from modeld.services.parts import Services
from modeld.services.prune import DEFAULT_SELECTION, Selection

_TRUE = {"1", "true", "yes"}
_FALSE = {"0", "false", "no", ""}


class PruneBody(BaseModel):
    """The body of ``POST /api/prune``; with no selection field, partials and orphans."""

    model_config = ConfigDict(extra="forbid")

    dry_run: StrictBool = False
    partials: StrictBool | StrictStr | StrictInt | StrictFloat | None = None
    orphans: StrictBool | None = None
    unused_for: StrictStr | StrictInt | StrictFloat | None = None
    to_budget: StrictBool | None = None


class RmBody(BaseModel):
    """The optional body of ``DELETE /api/models/{id}``."""

    model_config = ConfigDict(extra="forbid")

    force: StrictBool = False
    # Also remove the entry modeld wrote for it (``pull hf://``, ``import`` of a bare file).
    entry: StrictBool = False


def _duration(name: str, value: str | int | float) -> float:
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = -1.0
    if seconds < 0:
        raise BadRequest(
            f"{name}: {str(value)[:40]!r} is not a duration; {name} {requests.UNION_HINTS[name]}"
        )
    return seconds


def selection_of(body: PruneBody) -> Selection:
    """The prune selection a body asks for (partials and orphans when it names none)."""
    named = (body.partials, body.orphans, body.unused_for, body.to_budget)
    if all(v is None for v in named):
        return DEFAULT_SELECTION
    age = 0.0
    partials = body.partials
    if isinstance(partials, str) and partials.strip().lower() == "all":
        partials = True
    if partials is not None and not isinstance(partials, bool):
        age = _duration("partials", partials)
        partials = True
    unused = None if body.unused_for is None else _duration("unused_for", body.unused_for)
    sel = Selection(
        partials=bool(partials),
        partials_age=age,
        orphans=bool(body.orphans),
        unused_for=unused,
        to_budget=bool(body.to_budget),
    )
    if sel.empty:
        raise BadRequest(
            "nothing selected to prune: set partials, orphans, unused_for or to_budget "
            "(or send {} for partials and orphans)"
        )
    return sel


def _flag(request: web.Request, body: dict[str, Any], name: str) -> bool:
    """``force`` or ``entry`` of a removal: in the body or the query (either one sets it)."""
    from_body = bool(getattr(requests.parse(RmBody, body), name))
    raw = request.query.get(name)
    if raw is None:
        return from_body
    value = raw.strip().lower()
    if value not in _TRUE | _FALSE:
        raise BadRequest(f"{name}={raw[:20]!r}: use {name}=1 or {name}=0")
    return from_body or value in _TRUE


def add_routes(app: web.Application, services: Services) -> None:
    remover = services.remover

    async def remove(request: web.Request) -> web.Response:
        model_id = request.match_info["id"]
        body = await read_json(request, optional=True)
        force = _flag(request, body, "force")
        if _flag(request, body, "entry"):
            doc = await services.sources.remove_entry(model_id, force=force)
            return web.json_response(doc)
        return web.json_response(await remover.remove_model(model_id, force=force))

    async def prune(request: web.Request) -> web.Response:
        body = await read_json(request, optional=True)
        parsed = requests.parse(PruneBody, body)
        sel = selection_of(parsed)
        return web.json_response(await remover.prune(sel, dry_run=parsed.dry_run))

    app.router.add_delete("/api/models/{id}", remove)
    app.router.add_post("/api/prune", prune)
