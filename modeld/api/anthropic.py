"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The ``anthropic`` client (and Claude-style agents) work unchanged, over TCP with the key as
``x-api-key`` (or ``Authorization: Bearer``), or over the socket. A request becomes the same
``Generation`` as every other dialect's (``Inference.generate``); its errors come in
Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

What maps to what:
- ``system`` (a string or text blocks): the system message; ``messages``: the turns. Content
  blocks ``text``, ``image`` (base64 source), ``tool_use`` (an assistant's earlier call) and
  ``tool_result`` (its result, as a ``tool`` turn; ``is_error`` marks the text as an error).
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k``: the runtime's; ``stop_sequences``: the
  reply is cut at the first, and ``stop_reason`` says ``stop_sequence`` with the one met.
- ``tools`` (client tools: ``name``, ``description``, ``input_schema``): given to the runtime,
  whose calls come back as ``tool_use`` blocks (``stop_reason: "tool_use"``).
  ``tool_choice`` ``any`` or ``tool`` constrains the reply to a call (as OpenAI's
  ``required``), ``none`` offers no tools, ``disable_parallel_tool_use`` keeps one call.
- ``output_config.format`` (``json_schema``): the runtime's constrained decoding.
- ``usage``: the runtime's prefill and decode counts. A stream's ``message_start`` comes
  before the prefill has counted anything, so it says 0 input tokens; the count follows in
  ``message_delta`` (the client keeps the later one).
- ``count_tokens``: the tokens the request's generation would prefill, counted by the
  model's own engine (``Inference.count``).

Refused with a 400 naming the field: ``thinking`` (enabled), an ``effort``, server tools
(web search, code execution, ...), ``container``, ``mcp_servers``, ``context_management``,
image URLs and documents (modeld fetches nothing), a last ``assistant`` message (prefill).
``metadata``, ``service_tier``, ``cache_control`` and ``inference_geo`` change no output
here and are accepted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from modeld.api import access, requests
from modeld.api.connections import cancelled_when_client_leaves
from modeld.api.dialects import Dialect, Shaped, route
from modeld.api.openai import (
    Cannot,
    Emit,
    FunctionName,
    Records,
    calls_made,
    collect,
    event_stream,
    generate_within,
    read_openai_body,
    with_tools,
)
from modeld.api.openai import (
    Function as FunctionSpec,
)
from modeld.api.requests import INT32, Backends, Duration, ModelId, Number
from modeld.api.stream import Deadline
from modeld.errors import (
    BadRequest,
    Busy,
    ContextLengthExceeded,
    ModeldError,
    NoRoute,
)
from modeld.services.inference import (
    Done,
    Final,
    Generation,
    Options,
    Shape,
    Token,
    ToolCall,
    Turn,
)
from modeld.services.parts import Services

# --- errors in Anthropic's shape ----------------------------------------------------------------

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}


def anthropic_shape(err: ModeldError) -> Shaped:
    """An error as Anthropic words it: its ``type`` from the status, modeld's message.

    A prompt over the window starts with Anthropic's own words ("prompt is too long"), which
    Claude-style agents match to compact their history. A path that matched no route is a
    400: a 404 reads as an unknown model to the clients.
    """
    status, message = err.status, err.message
    if isinstance(err, NoRoute):
        status = 400
    if isinstance(err, ContextLengthExceeded):
        window, tokens = err.details.get("window"), err.details.get("prompt_tokens")
        said = f"{tokens} tokens > {window} maximum" if tokens else f"over {window} tokens"
        message = f"prompt is too long: {said}. {message}"
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if isinstance(err, Busy):
        kind = "overloaded_error"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


ANTHROPIC = Dialect("anthropic", anthropic_shape, prefixes=("/v1/messages",))


# --- bodies ---------------------------------------------------------------------------------


class _Loose(BaseModel):
    # Blocks: fields that change nothing modeld does (``cache_control``, ``citations``) pass.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Loose):
    type: Literal["text"]
    text: StrictStr


class Base64Source(_Loose):
    type: Literal["base64"]
    media_type: StrictStr
    data: StrictStr


class UrlSource(_Loose):
    type: Literal["url"]
    url: StrictStr


class ImageBlock(_Loose):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ToolUseBlock(_Loose):
    type: Literal["tool_use"]
    id: StrictStr
    name: FunctionName
    input: dict[str, Any]


ResultPart = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(_Loose):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[ResultPart] | None = None
    is_error: StrictBool | None = None


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class MessageIn(_Loose):
    role: Literal["user", "assistant"]
    content: StrictStr | list[Block]


class ToolIn(_Loose):
    name: FunctionName
    description: StrictStr | None = None
    input_schema: dict[str, Any]
    # A client tool; server tools (``web_search_20250305``, ...) are refused by name.
    type: Literal["custom"] | None = None


class ToolChoice(_Loose):
    type: Literal["auto", "any", "tool", "none"]
    name: FunctionName | None = None
    disable_parallel_tool_use: StrictBool | None = None


class OutputFormat(_Loose):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_Loose):
    format: OutputFormat | None = None
    effort: None = None


class _Asked(BaseModel):
    """What both routes take: the model, the conversation, its tools and output format."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: ModelId
    messages: Annotated[list[MessageIn], Field(min_length=1, max_length=1024)]
    system: StrictStr | list[TextBlock] | None = None
    tools: Annotated[list[ToolIn], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    # They change no output here.
    metadata: dict[str, StrictStr | None] | None = None
    service_tier: StrictStr | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: StrictStr | None = None
    # modeld's own.
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


class MessagesBody(_Asked):
    """``POST /v1/messages``."""

    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)]
    stop_sequences: Annotated[list[StrictStr], Field(max_length=16)] | None = None
    stream: StrictBool = False
    temperature: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None


class CountBody(_Asked):
    """``POST /v1/messages/count_tokens``."""


def _thinking_asked(value: Any) -> bool:
    return value is not None and not (isinstance(value, dict) and value.get("type") == "disabled")


CANNOT: Cannot = {
    "thinking": (_thinking_asked, "modeld does not return the model's thinking"),
    "container": (lambda v: v is not None, "modeld runs no code containers"),
    "mcp_servers": (lambda v: v is not None, "modeld connects to no MCP servers"),
    "context_management": (lambda v: v is not None, "modeld does not edit the context"),
    "speed": (lambda v: v not in (None, "standard"), "modeld has one speed"),
    "diagnostics": (lambda v: v is not None, "modeld reports no diagnostics object"),
}


# --- requests -----------------------------------------------------------------------------------


def _image(block: ImageBlock, where: str) -> bytes:
    if isinstance(block.source, UrlSource):
        raise BadRequest(
            f'"{where}.source": only base64 images are taken; modeld fetches nothing from '
            "the network"
        )
    return requests.decode_base64(block.source.data, f'"{where}.source.data"')


def _result_text(block: ToolResultBlock, where: str) -> str:
    if isinstance(block.content, list):
        if any(isinstance(p, ImageBlock) for p in block.content):
            raise BadRequest(f'"{where}.content": images in a tool result are not taken')
        text = "\n".join(p.text for p in block.content if isinstance(p, TextBlock))
    else:
        text = block.content or ""
    return f"error: {text}" if block.is_error else text


def _turns(i: int, m: MessageIn, names: dict[str, str]) -> list[Turn]:
    """One message as its turns (tool results first, each a ``tool`` turn); ``names`` maps
    earlier ``tool_use`` ids to their tool."""
    if isinstance(m.content, str):
        return [Turn(m.role, m.content)]
    where = f"messages[{i}]"
    texts: list[str] = []
    images: list[bytes] = []
    calls: list[ToolCall] = []
    results: list[Turn] = []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            if m.role != "user":
                raise BadRequest(f'"{at}": only user messages may carry images')
            images.append(_image(block, at))
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise BadRequest(f'"{at}": only assistant messages make tool calls')
            names[block.id] = block.name
            calls.append({"name": block.name, "arguments": block.input})
        else:
            if m.role != "user" or block.tool_use_id not in names:
                raise BadRequest(
                    f'"{at}.tool_use_id": must name a tool_use of an earlier assistant message'
                )
            results.append(Turn("tool", _result_text(block, at), name=names[block.tool_use_id]))
    if texts or images or calls or not results:
        return [*results, Turn(m.role, "\n".join(texts), images, tool_calls=calls)]
    return results


def generation_of(body: _Asked, options: Options, shape: Shape) -> tuple[Generation, bool]:
    """A Messages body as the native ``Generation``, and whether a tool call is forced."""
    names: dict[str, str] = {}
    turns = [t for i, m in enumerate(body.messages) for t in _turns(i, m, names)]
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "\n".join(b.text for b in system)
        turns.insert(0, Turn("system", text))
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        where = "output_config.format.schema"
        requests.check_json_schema(fmt.schema_, where)
        shape = dataclasses.replace(shape, schema=fmt.schema_, strict=True, schema_of=where)
    choice = body.tool_choice
    forced = False
    if body.tools and (choice is None or choice.type != "none"):
        functions = [
            FunctionSpec(t.name, t.description, t.input_schema, f"tools[{i}].input_schema")
            for i, t in enumerate(body.tools)
        ]
        for i, t in enumerate(body.tools):
            requests.check_json_schema(t.input_schema, f"tools[{i}].input_schema")
        forced = choice is not None and choice.type in ("any", "tool")
        if choice is not None and choice.type == "tool" and choice.name is None:
            raise BadRequest('"tool_choice.name": is required for type tool')
        shape = with_tools(
            shape,
            functions,
            forced=forced,
            name=choice.name if choice is not None and choice.type == "tool" else None,
            choice="tool_choice.name",
            format_field="output_config.format",
            parameters_field="tools[].input_schema",
        )
    gen = Generation(
        model=body.model,
        turns=turns,
        options=options,
        shape=shape,
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )
    return gen, forced


async def _read(request: web.Request, model: type[requests.B]) -> requests.B:
    """The body as ``model``: server tools and unhonoured fields refused by name first."""
    return await read_openai_body(request, model, CANNOT, check=_server_tools)


def _server_tools(data: dict[str, Any]) -> None:
    tools = data.get("tools")
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise BadRequest(
                f'"tools[{i}].type": {kind!r} is a server tool, and modeld runs no tools; '
                "send client tools (name, description, input_schema) and run them yourself"
            )


# --- replies ------------------------------------------------------------------------------------


def _usage(final: Final[Done]) -> dict[str, int]:
    return {
        "input_tokens": final.result.prompt_tokens,
        "output_tokens": final.result.tokens,
        # modeld caches no prompt: none of it was written to or read from a cache.
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _stop(final: Final[Done], calls: list[ToolCall]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``."""
    if calls:
        return "tool_use", None
    if final.result.stop_sequence is not None:
        return "stop_sequence", final.result.stop_sequence
    return ("max_tokens" if final.result.finish == "length" else "end_turn"), None


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return (
        f"event: {name}\ndata: ".encode()
        + json.dumps(doc, separators=(",", ":")).encode()
        + (b"\n\n")
    )


class _Reply:
    """One message's identity, and its blocks as a whole or as stream events."""

    def __init__(self, model: str, *, forced: bool, parallel: bool) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model = model
        self.forced = forced
        self.parallel = parallel

    def calls(self, final: Final[Done], text: str) -> list[ToolCall]:
        calls = calls_made(final, text, self.forced)
        return calls if self.parallel else calls[:1]

    def blocks(self, text: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if text and not (calls and self.forced):
            out.append({"type": "text", "text": text})
        out += [
            {
                "type": "tool_use",
                "id": "toolu_" + secrets.token_hex(12),
                "name": c["name"],
                "input": c["arguments"],
            }
            for c in calls
        ]
        return out

    def head(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
        }

    def message(self, text: str, final: Final[Done]) -> dict[str, Any]:
        calls = self.calls(final, text)
        reason, sequence = _stop(final, calls)
        doc = self.head(self.blocks(text, calls))
        doc.update(stop_reason=reason, stop_sequence=sequence, usage=_usage(final))
        return doc

    def opening(self) -> bytes:
        doc = self.head([])
        usage = {"input_tokens": 0, "output_tokens": 0}
        doc.update(stop_reason=None, stop_sequence=None, usage=usage)
        start = _event("message_start", {"type": "message_start", "message": doc})
        return start + _event("ping", {"type": "ping"})

    def ending(self, final: Final[Done], held: str, text_open: bool) -> bytes:
        """The events after the last token: the text block's end, the tool calls' blocks,
        then the stop reason and usage."""
        calls = self.calls(final, held)
        out = []
        index = 0
        if self.forced and not calls and held:
            out.append(_text_start(0) + _text_delta(0, held))  # cut short: the text as it is
            text_open = True
        if text_open:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": 0}))
            index = 1
        for block in self.blocks("", calls):
            start = {**block, "input": {}}
            out.append(_block_start(index, start))
            partial = json.dumps(block["input"])
            delta = {"type": "input_json_delta", "partial_json": partial}
            out.append(_event("content_block_delta", _delta(index, delta)))
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
            index += 1
        reason, sequence = _stop(final, calls)
        usage = {"input_tokens": final.result.prompt_tokens, "output_tokens": final.result.tokens}
        delta_doc = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        out.append(_event("message_delta", delta_doc))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)


def _delta(index: int, delta: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    doc = {"type": "content_block_start", "index": index, "content_block": block}
    return _event("content_block_start", doc)


def _text_start(index: int) -> bytes:
    return _block_start(index, {"type": "text", "text": ""})


def _text_delta(index: int, text: str) -> bytes:
    return _event("content_block_delta", _delta(index, {"type": "text_delta", "text": text}))


async def _write_events(
    emit: Emit,
    first: Token | Final[Done] | None,
    records: Records,
    *,
    reply: _Reply,
) -> bytes:
    """Write Anthropic's events as the records come; return the last ones (sent with the
    stream's end). A failure after the start ends the stream with an ``error`` event; a
    forced tool call's text is held back: it is sent as the call's block."""
    held: list[str] = []
    pending = reply.opening()
    text_open = False
    try:
        rec = first
        while rec is not None:
            if not isinstance(rec, Token):
                return pending + reply.ending(rec, "".join(held), text_open)
            if reply.forced:
                held.append(rec.text)
            else:
                if not text_open:
                    pending += _text_start(0)
                    text_open = True
                pending += _text_delta(0, rec.text)
            if pending:
                await emit(pending)
                pending = b""
            rec = await anext(records, None)
        return pending
    except ModeldError as e:
        return pending + _event("error", anthropic_shape(e)[1])
    except ConnectionError:
        raise  # the client left: nothing can reach it
    except Exception:
        logging.getLogger("modeld").exception("messages stream failed")
        err = ModeldError("internal error; see the daemon's log")
        return pending + _event("error", anthropic_shape(err)[1])


# --- routes -----------------------------------------------------------------------------------


def add_routes(app: web.Application, services: Services) -> None:
    async def messages(request: web.Request) -> web.StreamResponse:
        body = await _read(request, MessagesBody)
        until = Deadline(request, services.settings.request_timeout)
        shape = Shape(stop=tuple(body.stop_sequences or ()), stream=body.stream)
        async with until.bound():
            gen, forced = await requests.off_loop(generation_of, body, Options.picked(body), shape)
        parallel = not (body.tool_choice and body.tool_choice.disable_parallel_tool_use)
        reply = _Reply(body.model, forced=forced, parallel=parallel)
        async with cancelled_when_client_leaves(request):
            records = await generate_within(request, services, gen, until)
            if body.stream:
                write = functools.partial(_write_events, reply=reply)
                return await event_stream(request, records, write, until)
            text, final = await collect(until.records(records))
        return web.json_response(reply.message(text, final))

    async def count_tokens(request: web.Request) -> web.Response:
        body = await _read(request, CountBody)
        until = Deadline(request, services.settings.request_timeout)
        async with until.bound():
            gen, _ = await requests.off_loop(generation_of, body, Options(), Shape(stream=False))
        async with cancelled_when_client_leaves(request), until.bound():
            counted = await services.inference.count(
                gen, may_shorten_keep_alive=access.administers(request)
            )
        return web.json_response({"input_tokens": counted.result.prompt_tokens})

    route(app, "POST", "/v1/messages", messages, ANTHROPIC)
    route(app, "POST", "/v1/messages/count_tokens", count_tokens, ANTHROPIC)
