"""OpenAI wire format on the socket: ``GET /v1/models`` and ``POST /v1/chat/completions``.

The ``openai`` client (and similar ones) work unchanged with an httpx Unix-socket transport.
Requests go through the native generation path (``requests.start``); images come as
``image_url`` data URLs and take the native image path. Errors keep modeld's ``code`` and
``message`` and add OpenAI's ``type`` and ``param``. Unknown OpenAI fields are ignored (clients
send many defaults), except those whose meaning modeld cannot honour (``n`` > 1, tools).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from modeld.api import requests
from modeld.api.guards import check_model_id
from modeld.api.requests import INT32, Backends, Duration, Generation, ModelId, Number, Turn
from modeld.errors import BadRequest, Busy, ModeldError, ModelNotInstalled, TooLarge
from modeld.services.parts import Services

SSE = "text/event-stream"
_DONE = b"data: [DONE]\n\n"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Loose(BaseModel):
    # OpenAI clients send fields modeld has no use for (user, logit_bias, ...): ignore them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class ImageUrl(_Loose):
    url: StrictStr
    detail: StrictStr | None = None


class TextPart(_Loose):
    type: Literal["text"]
    text: StrictStr


class ImagePart(_Loose):
    type: Literal["image_url"]
    image_url: ImageUrl | StrictStr


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[Part] | None = None


class ResponseFormat(_Loose):
    type: Literal["text", "json_object"]


class StreamOptions(_Loose):
    include_usage: StrictBool = False


class ChatBody(_Loose):
    """``POST /v1/chat/completions``; ``top_k``, ``keep_alive``, ``backends`` are modeld's."""

    model: ModelId
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=INT32)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    response_format: ResponseFormat | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    tools: list[Any] | None = None
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


# --- errors in OpenAI's shape ------------------------------------------------------------------


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """modeld's ``{"error": {"code", "message"}}`` plus OpenAI's ``type`` and ``param``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "rate_limit_error" if code == "busy" else "server_error"
    return {"error": {"code": code, "message": message, "type": kind, "param": None}}


def openai_errors(handler: Handler) -> Handler:
    """Answer a refusal in OpenAI's error shape (with ``Retry-After`` when busy)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ModeldError as e:
            headers = {}
            if isinstance(e, Busy):
                headers["Retry-After"] = str(max(1, round(e.retry_after)))
            return web.json_response(
                error_body(e.status, e.code, e.message), status=e.status, headers=headers
            )
        except web.HTTPRequestEntityTooLarge:
            err = TooLarge(
                "request body over the limit (64 MiB); send smaller images or fewer of them"
            )
            return web.json_response(error_body(err.status, err.code, err.message), status=413)

    return wrapped


# --- requests -----------------------------------------------------------------------------------


def _image(url: str, where: str) -> bytes:
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise BadRequest(
            f"{where}: only data URLs (data:image/png;base64,...) are accepted; "
            "modeld fetches nothing from the network"
        )
    return requests.decode_base64(data, where)


def _turn(i: int, m: ChatMessage) -> Turn:
    role = "system" if m.role == "developer" else m.role
    if m.content is None:
        if role != "assistant":
            raise BadRequest(f'"messages[{i}].content": is required for role {m.role}')
        return Turn(role, "")
    if isinstance(m.content, str):
        return Turn(role, m.content)
    texts, images = [], []
    for j, part in enumerate(m.content):
        if isinstance(part, TextPart):
            texts.append(part.text)
            continue
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        images.append(_image(url, f'"messages[{i}].content[{j}].image_url"'))
    if images and role != "user":
        raise BadRequest(f'"messages[{i}]": only user messages may carry images')
    return Turn(role, "\n".join(texts), images)


def generation_of(body: ChatBody) -> Generation:
    """A chat completion body as the native ``Generation``."""
    if body.tools:
        raise BadRequest('"tools": tool calling is not supported; send plain messages')
    fmt = "json" if body.response_format and body.response_format.type == "json_object" else None
    return Generation(
        model=body.model,
        turns=[_turn(i, m) for i, m in enumerate(body.messages)],
        max_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=requests.stops(body.stop),
        format=fmt,
        stream=bool(body.stream),
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )


# --- responses ----------------------------------------------------------------------------------


def usage_of(final: dict[str, Any]) -> dict[str, int]:
    """OpenAI usage from the runner's final record (prefill and decode token counts)."""
    prompt, completion = int(final.get("prompt_tokens") or 0), int(final.get("tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _finish(final: dict[str, Any]) -> str:
    return "length" if final.get("finish") == "length" else "stop"


def _extension(final: dict[str, Any]) -> dict[str, Any]:
    """modeld's own fields: engine, phase timings and, for JSON output, the diagnostics."""
    out = {"engine": final.get("engine"), "timings": final.get("timings")}
    if "json" in final:
        out["json"] = final["json"]
    return out


def _compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


class _Chat:
    """One completion's identity, shared by its chunks."""

    def __init__(self, model: str) -> None:
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        doc = self.head("chat.completion.chunk")
        doc["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        return b"data: " + _compact(doc) + b"\n\n"

    def completion(self, text: str, final: dict[str, Any]) -> dict[str, Any]:
        doc = self.head("chat.completion")
        message = {"role": "assistant", "content": text, "refusal": None}
        doc["choices"] = [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": _finish(final)}
        ]
        doc["usage"] = usage_of(final)
        doc["modeld"] = _extension(final)
        return doc


async def _collect(chat: _Chat, records: AsyncGenerator[dict[str, Any], None]) -> dict[str, Any]:
    parts: list[str] = []
    final: dict[str, Any] = {}
    async with contextlib.aclosing(records):
        async for rec in records:
            if "token" in rec:
                parts.append(rec["token"])
            else:
                final = rec
    # A non-streamed job's final record carries the whole text (no token records).
    text = final.pop("text", None)
    return chat.completion("".join(parts) if text is None else text, final)


async def _sse(
    request: web.Request,
    chat: _Chat,
    records: AsyncGenerator[dict[str, Any], None],
    include_usage: bool,
) -> web.StreamResponse:
    """Stream chunks as server-sent events; refusals before the first token keep their status."""
    try:
        first: dict[str, Any] | None = await anext(records)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await records.aclose()
        raise
    response = web.StreamResponse(headers={"Content-Type": SSE, "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        await response.write(chat.chunk({"role": "assistant", "content": ""}))
        rec = first
        while rec is not None:
            if "token" in rec:
                await response.write(chat.chunk({"content": rec["token"]}))
            else:
                await response.write(chat.chunk({}, _finish(rec)))
                if include_usage:
                    doc = chat.head("chat.completion.chunk")
                    doc.update(choices=[], usage=usage_of(rec), modeld=_extension(rec))
                    await response.write(b"data: " + json.dumps(doc).encode() + b"\n\n")
            rec = await anext(records, None)
        await response.write(_DONE)
    except ModeldError as e:
        body = error_body(e.status, e.code, e.message)
        await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    except (ConnectionResetError, ConnectionError):
        pass  # the client left; closing the generator below cancels the generation
    except Exception:
        logging.getLogger("modeld").exception("chat stream failed")
        body = error_body(500, "internal", "internal error; see the daemon's log")
        await response.write(b"data: " + json.dumps(body).encode() + b"\n\n")
    finally:
        await records.aclose()
    await response.write_eof()
    return response


def _model_doc(model_id: str, created: float) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "modeld"}


def add_routes(app: web.Application, services: Services) -> None:
    async def installed() -> dict[str, dict[str, Any]]:
        catalog, store = services.parts["catalog"], services.parts["store"]
        out = {}
        for inst in await store.list_installed():
            # Only what can answer: an install without a catalog entry has no limits to load.
            if catalog.find(inst.model_id) is not None:
                out[inst.model_id] = _model_doc(inst.model_id, inst.installed_at)
        return out

    @openai_errors
    async def list_models(_: web.Request) -> web.Response:
        models = sorted((await installed()).values(), key=lambda m: m["id"])
        return web.json_response({"object": "list", "data": models})

    @openai_errors
    async def get_model(request: web.Request) -> web.Response:
        model_id = check_model_id(request.match_info["model"])
        doc = (await installed()).get(model_id)
        if doc is None:
            raise ModelNotInstalled(
                f"model {model_id} is not installed; run `modeld pull {model_id}` first"
            )
        return web.json_response(doc)

    @openai_errors
    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await requests.read_body(request, ChatBody)
        chat = _Chat(body.model)
        _, records = await requests.start(services, generation_of(body))
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return await _sse(request, chat, records, usage)
        doc = await _collect(chat, records)
        return web.Response(body=_compact(doc), content_type="application/json")

    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
