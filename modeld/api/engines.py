"""``GET/POST /api/engines``, ``DELETE /api/engines/{id}`` and ``POST /api/generate``."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from aiohttp import web

from modeld.api.stream import ndjson
from modeld.engines import Engines
from modeld.errors import BadRequest, TooLarge
from modeld.pool import Pool, validate_keep_alive
from modeld.services import Services

IMAGE_LONG_SIDE = 640
JPEG_QUALITY = 88
_ROLES = ("system", "user", "assistant")


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequest(f"the body is not JSON ({e}); send a JSON object") from e
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest('"model" is required: the id of an installed model')
    return model


def _backends(body: dict[str, Any]) -> dict[str, Any] | None:
    backends = body.get("backends")
    if backends is not None and not isinstance(backends, dict):
        raise BadRequest('"backends" must be an object like {"main": "cpu", "vision": "gpu"}')
    return backends


def prepare_image(data: bytes) -> bytes:
    """Downscale to at most 640 px on the long side and re-encode as JPEG quality 88."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise BadRequest(f"an image could not be decoded ({e}); send PNG or JPEG bytes") from e
    rgb.thumbnail((IMAGE_LONG_SIDE, IMAGE_LONG_SIDE))
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def _images(body: dict[str, Any], limit: int) -> list[bytes]:
    raw = body.get("images") or []
    if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
        raise BadRequest('"images" must be a list of base64 strings')
    if len(raw) > limit:
        raise TooLarge(f"{len(raw)} images sent; this model takes at most {limit}")
    out = []
    for item in raw:
        try:
            out.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError) as e:
            raise BadRequest("an image is not valid base64") from e
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise BadRequest('send either "prompt" (a string) or "messages" (a list), not both')
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRequest('"prompt" must be a string')
        out = [{"role": "user", "content": prompt}]
        if isinstance(body.get("system"), str):
            out.insert(0, {"role": "system", "content": body["system"]})
        return out
    if not isinstance(messages, list) or not messages:
        raise BadRequest('"messages" must be a non-empty list of {"role", "content"}')
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise BadRequest(f"each message needs a role out of {', '.join(_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise BadRequest("each message's content must be a string")
    if messages[-1]["role"] != "user":
        raise BadRequest("the last message must have role user")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _number(body: dict[str, Any], key: str, kind: type, low: float, high: float | None) -> Any:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise BadRequest(f'"{key}" must be a{"n integer" if kind is int else " number"}')
    if value < low or (high is not None and value > high):
        raise BadRequest(f'"{key}" must be between {low} and {high if high is not None else "∞"}')
    return value


def generation_job(body: dict[str, Any], images: list[bytes]) -> dict[str, Any]:
    """The runner's ``generate`` fields from a validated request body."""
    messages = _messages(body)
    if images:
        last = messages[-1]
        last["content"] = [{"type": "text", "text": last["content"]}] + [
            {"type": "image", "blob": base64.b64encode(prepare_image(b)).decode()} for b in images
        ]
    fmt = body.get("format")
    if fmt not in (None, "json"):
        raise BadRequest('"format" must be "json" or left out')
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)
    ):
        raise BadRequest('"stop" must be a string or a list of strings')
    return {
        "messages": messages,
        "max_tokens": _number(body, "max_tokens", int, 1, None),
        "temperature": _number(body, "temperature", float, 0, None),
        "top_k": _number(body, "top_k", int, 1, None),
        "top_p": _number(body, "top_p", float, 0, 1),
        "seed": _number(body, "seed", int, 0, None),
        "stop": stop or [],
        "format": fmt,
    }


def add_routes(app: web.Application, services: Services) -> None:
    def parts() -> tuple[Engines, Pool]:
        return services.parts["engines"], services.parts["pool"]

    async def list_engines(_: web.Request) -> web.Response:
        pool = parts()[1]
        return web.json_response({"engines": pool.list(), **pool.status()})

    async def load(request: web.Request) -> web.Response:
        engines, pool = parts()
        body = await _body(request)
        backends = _backends(body)
        modalities = ["text"] + (["image"] if backends and backends.get("vision") else [])
        target = await engines.target(
            _model(body),
            modalities=modalities,
            backends=backends,
            allow_unverified=bool(body.get("allow_unverified")),
        )
        view = await pool.load(
            target,
            keep_alive=validate_keep_alive(body.get("keep_alive")),
            pin=bool(body.get("pin")),
        )
        return web.json_response(view)

    async def unload(request: web.Request) -> web.Response:
        pool = parts()[1]
        return web.json_response({"unloaded": await pool.unload(request.match_info["id"])})

    async def generate(request: web.Request) -> web.StreamResponse:
        engines, pool = parts()
        body = await _body(request)
        model = _model(body)
        images = _images(body, engines.max_images(model))
        job = generation_job(body, images)
        keep_alive = validate_keep_alive(body.get("keep_alive"))
        # The plan is resolved with the vision modality before any runner starts, so a
        # file whose vision encoder needs gpu is refused here when vision=cpu.
        target = await engines.target(
            model,
            modalities=["text", "image"] if images else ["text"],
            backends=_backends(body),
            allow_unverified=bool(body.get("allow_unverified")),
        )

        return await ndjson(request, pool.generate(target, job, keep_alive=keep_alive))

    app.router.add_get("/api/engines", list_engines)
    app.router.add_post("/api/engines", load)
    app.router.add_delete("/api/engines/{id}", unload)
    app.router.add_post("/api/generate", generate)
