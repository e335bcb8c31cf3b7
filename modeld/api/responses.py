"""OpenAI's Responses API: ``POST /v1/responses``, streamed (server-sent events) or not.

The default of ``openai-agents`` and of Codex-style tools, opt-in in the ``openai`` client.
A request becomes the same ``Generation`` as a chat completion's (``Inference.generate``);
errors come in OpenAI's shape (the ``openai`` dialect).

What maps to what:
- ``input``: a string (one user turn) or items: messages (``input_text``, ``input_image``
  as a data URL, an assistant's ``output_text``), ``function_call`` (an earlier call) and
  ``function_call_output`` (its result, as a ``tool`` turn); ``instructions``: the system
  message.
- ``tools`` (``function`` tools) and ``tool_choice`` as in chat completions: the calls come
  back as ``function_call`` items; ``required`` or a named function constrains the reply to
  a call; ``parallel_tool_calls: false`` keeps one.
- ``text.format`` ``json_object`` / ``json_schema``: the runtime's constrained decoding.
- ``max_output_tokens``, ``temperature``, ``top_p`` (and modeld's ``top_k``, ``seed``): the
  runtime's; a reply cut by ``max_output_tokens`` is ``incomplete``.
- ``usage``: the runtime's prefill and decode counts.

modeld keeps no responses: ``store`` is false in every response, and ``store: true``,
``previous_response_id`` and ``conversation`` are a 400 that says to send the whole
conversation in ``input``. Hosted tools (web search, file search, code interpreter, ...),
``reasoning``, ``background``, ``include``, log probabilities and ``truncation: "auto"`` are a
400 naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import secrets
import time
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
)

from modeld.api import requests
from modeld.api.connections import cancelled_when_client_leaves
from modeld.api.dialects import route
from modeld.api.openai import (
    OPENAI,
    Cannot,
    Emit,
    Function,
    FunctionName,
    ImageUrl,
    OpenAIBody,
    Records,
    SchemaName,
    calls_made,
    collect,
    event_stream,
    generate_within,
    image_of_url,
    openai_shape,
    parse_arguments,
    read_openai_body,
    with_tools,
)
from modeld.api.requests import INT32, Backends, Duration, ModelId, Number
from modeld.api.stream import Deadline
from modeld.errors import BadRequest, ModeldError
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

_NO_STORE = (
    "modeld keeps no responses: send the whole conversation in input instead (earlier "
    "messages, function_call and function_call_output items)"
)


class _Loose(BaseModel):
    # Items and parts: fields that change nothing modeld does (an item's ``id``, ``status``,
    # an output text's ``annotations``) pass.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class InputText(_Loose):
    type: Literal["input_text", "output_text"]
    text: StrictStr


class InputImage(_Loose):
    type: Literal["input_image"]
    image_url: StrictStr | ImageUrl | None = None
    detail: StrictStr | None = None


Part = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(_Loose):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[Part]


class FunctionCallItem(_Loose):
    type: Literal["function_call"]
    call_id: StrictStr
    name: FunctionName
    arguments: StrictStr


class FunctionCallOutputItem(_Loose):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[Part]


def _item_type(value: Any) -> str:
    # A message may leave its ``type`` out (``{"role": ..., "content": ...}``).
    return str(value.get("type", "message")) if isinstance(value, dict) else "message"


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Loose):
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Loose):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    name: SchemaName = "response"
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: StrictBool | None = None
    description: StrictStr | None = None


class TextConfig(_Loose):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesBody(OpenAIBody):
    """``POST /v1/responses``; ``top_k``, ``seed``, ``keep_alive``, ``backends`` and
    ``allow_unverified`` are modeld's."""

    model: ModelId
    input: StrictStr | Annotated[list[Item], Field(min_length=1, max_length=1024)]
    instructions: StrictStr | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=INT32)] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    truncation: Literal["disabled"] | None = None
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


def _set(value: Any) -> bool:
    return value is not None


CANNOT: Cannot = {
    "store": (bool, _NO_STORE),
    "previous_response_id": (_set, _NO_STORE),
    "conversation": (_set, _NO_STORE),
    "background": (bool, "modeld answers while the request is open"),
    "reasoning": (
        lambda v: v is not None and any(x is not None for x in dict(v).values()),
        "modeld has no reasoning settings and returns no reasoning",
    ),
    "include": (bool, "modeld returns no extra output data"),
    "top_logprobs": (
        lambda v: v not in (None, 0),
        "log probabilities are not available from the LiteRT-LM runtime",
    ),
    "prompt": (_set, "modeld has no stored prompts; send the prompt in input"),
    "max_tool_calls": (_set, "modeld runs no tools; it returns the calls the model makes"),
    "service_tier": (lambda v: v not in (None, "auto", "default"), "modeld has one service tier"),
    "context_management": (_set, "modeld does not edit the context"),
}


def _check_tools(data: dict[str, Any]) -> None:
    tools = data.get("tools")
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise BadRequest(
                f'"tools[{i}].type": {kind!r} is a hosted tool, and modeld runs no tools; '
                "send function tools and run them yourself"
            )


# --- requests -----------------------------------------------------------------------------------


def _texts(parts: list[InputText | InputImage], where: str) -> tuple[str, list[bytes]]:
    texts, images = [], []
    for j, part in enumerate(parts):
        if isinstance(part, InputText):
            texts.append(part.text)
            continue
        url = part.image_url.url if isinstance(part.image_url, ImageUrl) else part.image_url
        if url is None:
            raise BadRequest(f'"{where}[{j}].image_url": is required (modeld takes no file ids)')
        images.append(image_of_url(url, f'"{where}[{j}].image_url"'))
    return "\n".join(texts), images


def _turns(body: ResponsesBody) -> list[Turn]:
    """The instructions and input as turns; an assistant's calls join its message."""
    turns: list[Turn] = []
    if body.instructions:
        turns.append(Turn("system", body.instructions))
    if isinstance(body.input, str):
        return [*turns, Turn("user", body.input)]
    names: dict[str, str] = {}
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            args = parse_arguments(item.arguments, f"{where}.arguments")
            call: ToolCall = {"name": item.name, "arguments": args}
            if turns and turns[-1].role == "assistant":
                turns[-1].tool_calls.append(call)
            else:
                turns.append(Turn("assistant", "", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            turns.append(_output_turn(item, names, where))
        else:
            turns.append(_message_turn(item, where))
    return turns


def _output_turn(item: FunctionCallOutputItem, names: dict[str, str], where: str) -> Turn:
    if item.call_id not in names:
        raise BadRequest(
            f'"{where}.call_id": must name the call_id of an earlier function_call item'
        )
    text = item.output
    if not isinstance(text, str):
        text, images = _texts(list(text), f"{where}.output")
        if images:
            raise BadRequest(f'"{where}.output": images in a function output are not taken')
    return Turn("tool", text, name=names[item.call_id])


def _message_turn(item: MessageItem, where: str) -> Turn:
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return Turn(role, item.content)
    text, images = _texts(list(item.content), f"{where}.content")
    if images and role != "user":
        raise BadRequest(f'"{where}": only user messages may carry images')
    return Turn(role, text, images)


def generation_of(body: ResponsesBody) -> tuple[Generation, bool]:
    """A Responses body as the native ``Generation``, and whether a tool call is forced."""
    shape = Shape(stream=body.stream)
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        shape = dataclasses.replace(shape, json=True)
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.schema_ or {"type": "object"}
        where = "text.format.schema"
        requests.check_json_schema(schema, where)
        shape = dataclasses.replace(shape, schema=schema, strict=bool(fmt.strict), schema_of=where)
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise BadRequest('"tool_choice": needs "tools"')
    forced = False
    if body.tools and choice != "none":
        functions = [
            Function(t.name, t.description, t.parameters, f"tools[{i}].parameters")
            for i, t in enumerate(body.tools)
        ]
        forced = choice == "required" or isinstance(choice, NamedFunction)
        shape = with_tools(
            shape,
            functions,
            forced=forced,
            name=choice.name if isinstance(choice, NamedFunction) else None,
            choice="tool_choice.name",
            format_field="text.format",
            parameters_field="tools[].parameters",
        )
    options = dataclasses.replace(Options.picked(body), max_tokens=body.max_output_tokens)
    gen = Generation(
        model=body.model,
        turns=_turns(body),
        options=options,
        shape=shape,
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )
    return gen, forced


# --- replies ------------------------------------------------------------------------------------


def _usage(final: Final[Done]) -> dict[str, Any]:
    prompt, completion = final.result.prompt_tokens, final.result.tokens
    return {
        "input_tokens": prompt,
        # modeld caches no prompt, and the model's reply holds no reasoning of its own.
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class _Reply:
    """One response's identity, its output items, and its stream's events."""

    def __init__(self, body: ResponsesBody, *, forced: bool) -> None:
        self.body = body
        self.forced = forced
        self.parallel = body.parallel_tool_calls is not False
        self.id = "resp_" + secrets.token_hex(12)
        self.message_id = "msg_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.sequence = 0

    def doc(
        self,
        status: str,
        output: list[dict[str, Any]],
        final: Final[Done] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        fmt = body.text.format if body.text and body.text.format else None
        incomplete = final is not None and final.result.finish == "length" and status != "failed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "model": body.model,
            "output": output,
            "usage": _usage(final) if final is not None else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": self.parallel,
            "previous_response_id": None,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": _dump(fmt) if fmt is not None else {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "store": False,
            "background": False,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "user": body.user,
        }

    def calls(self, final: Final[Done], text: str) -> list[ToolCall]:
        calls = calls_made(final, text, self.forced)
        return calls if self.parallel else calls[:1]

    def message(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }

    def output(self, text: str, final: Final[Done]) -> list[dict[str, Any]]:
        calls = self.calls(final, text)
        out = [] if calls and (self.forced or not text) else [self.message(text)]
        return out + [_call_item(c) for c in calls]

    def event(self, kind: str, **fields: Any) -> bytes:
        doc = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + _compact(doc) + b"\n\n"


def _dump(value: BaseModel | str) -> Any:
    return value if isinstance(value, str) else value.model_dump(by_alias=True, exclude_none=True)


def _call_item(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + secrets.token_hex(12),
        "call_id": "call_" + secrets.token_hex(12),
        "name": call["name"],
        "arguments": json.dumps(call["arguments"]),
        "status": "completed",
    }


def _compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


class _Events:
    """The stream's events: the response's start, the message's text as it comes, then the
    calls and the completed response."""

    def __init__(self, reply: _Reply) -> None:
        self.reply = reply
        self.text_open = False
        self.text: list[str] = []

    def opening(self) -> bytes:
        r = self.reply
        doc = r.doc("in_progress", [])
        return r.event("response.created", response=doc) + r.event(
            "response.in_progress", response=doc
        )

    def _text_open(self) -> bytes:
        r = self.reply
        self.text_open = True
        item = r.message("", "in_progress")
        item["content"] = []
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ids = {"item_id": r.message_id, "output_index": 0}
        return r.event("response.output_item.added", output_index=0, item=item) + r.event(
            "response.content_part.added", **ids, content_index=0, part=part
        )

    def token(self, text: str) -> bytes:
        r = self.reply
        head = b"" if self.text_open else self._text_open()
        self.text.append(text)
        delta = r.event(
            "response.output_text.delta",
            item_id=r.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )
        return head + delta

    def ending(self, final: Final[Done], held: str) -> bytes:
        r = self.reply
        calls = r.calls(final, held)
        out = []
        if r.forced and not calls and held:
            out.append(self.token(held))  # cut short: no call, the text as it is
        output: list[dict[str, Any]] = []
        if self.text_open:
            text = "".join(self.text)
            item = r.message(text)
            part = item["content"][0]
            ids = {"item_id": r.message_id, "output_index": 0, "content_index": 0}
            out.append(r.event("response.output_text.done", **ids, text=text, logprobs=[]))
            out.append(r.event("response.content_part.done", **ids, part=part))
            out.append(r.event("response.output_item.done", output_index=0, item=item))
            output.append(item)
        for call in calls:
            index = len(output)
            item = _call_item(call)
            added = {**item, "arguments": "", "status": "in_progress"}
            ids = {"item_id": item["id"], "output_index": index}
            out.append(r.event("response.output_item.added", output_index=index, item=added))
            out.append(
                r.event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            )
            out.append(
                r.event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(r.event("response.output_item.done", output_index=index, item=item))
            output.append(item)
        doc = r.doc("completed", output, final)
        kind = "response.incomplete" if doc["status"] == "incomplete" else "response.completed"
        out.append(r.event(kind, response=doc))
        return b"".join(out)

    def failed(self, err: ModeldError) -> bytes:
        """A failure after the stream began: ``response.failed`` with the error."""
        r = self.reply
        doc = r.doc("failed", [])
        error = openai_shape(err)[1]["error"]
        doc["error"] = {"code": error["code"], "message": error["message"]}
        return r.event("response.failed", response=doc)


async def _write_events(
    emit: Emit,
    first: Token | Final[Done] | None,
    records: Records,
    *,
    events: _Events,
) -> bytes:
    """Write the Responses events as the records come; return the last ones (sent with the
    stream's end). A failure after the start ends with ``response.failed``; a forced call's
    text is held back: it is sent as the call's item."""
    held: list[str] = []
    pending = events.opening()
    try:
        rec = first
        while rec is not None:
            if not isinstance(rec, Token):
                return pending + events.ending(rec, "".join(held))
            if events.reply.forced:
                held.append(rec.text)
            else:
                pending += events.token(rec.text)
            if pending:
                await emit(pending)
                pending = b""
            rec = await anext(records, None)
        return pending
    except ModeldError as e:
        return pending + events.failed(e)
    except ConnectionError:
        raise  # the client left: nothing can reach it
    except Exception:
        logging.getLogger("modeld").exception("responses stream failed")
        return pending + events.failed(ModeldError("internal error; see the daemon's log"))


def add_routes(app: web.Application, services: Services) -> None:
    async def responses(request: web.Request) -> web.StreamResponse:
        body = await read_openai_body(request, ResponsesBody, CANNOT, check=_check_tools)
        until = Deadline(request, services.settings.request_timeout)
        async with until.bound():
            gen, forced = await requests.off_loop(generation_of, body)
        reply = _Reply(body, forced=forced)
        async with cancelled_when_client_leaves(request):
            records = await generate_within(request, services, gen, until)
            if body.stream:
                write = functools.partial(_write_events, events=_Events(reply))
                return await event_stream(request, records, write, until)
            text, final = await collect(until.records(records))
        doc = reply.doc("completed", reply.output(text, final), final)
        return web.Response(body=_compact(doc), content_type="application/json")

    route(app, "POST", "/v1/responses", responses, OPENAI)
