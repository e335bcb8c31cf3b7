"""OpenAI wire format: ``/v1/models[/{id}]``, ``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``.

The ``openai`` client (and LangChain's ``ChatOpenAI``, litellm, ...) work unchanged, over the
socket (an httpx Unix-socket transport) or TCP with a key. Requests go through the native
generation path (``Inference.generate``); images come as ``image_url`` data URLs and take the
native image path. Errors keep modeld's ``code`` and ``message`` and add OpenAI's ``type`` and
``param``.

What maps to the runtime (LiteRT-LM's conversation API):
- ``temperature``, ``top_p``, ``top_k``, ``seed``: its sampler; ``presence_penalty``,
  ``frequency_penalty`` (and modeld's ``repetition_penalty``): its repetition settings;
  ``max_tokens``/``max_completion_tokens``: ``max_output_tokens``; ``stop``: cut here.
- ``response_format`` ``json_object``/``json_schema``: its constrained decoding (llguidance);
  with ``strict`` the finished reply is also validated, and ``modeld.json.status`` says
  ``schema_mismatch`` when complete JSON does not match.
- ``tools``: given to the runtime with automatic tool calling off, so the calls the model
  makes come back to the caller (``finish_reason: "tool_calls"``). ``tool_choice: "required"``
  or a named function constrains the reply to a call (a JSON object naming one of the tools,
  its arguments matching the tool's parameters), which modeld returns as the call.
  ``tool_choice: "none"`` gives the model no tools.

A field modeld cannot honour (``logprobs``, ``logit_bias``, ``n`` > 1, ``audio``, ...) is a 400
naming it; an unknown field is a 400 too. Only fields that identify the caller and change no
output (``user``, ``metadata``, ``safety_identifier``, ``prompt_cache_key``) are accepted and
not used.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import logging
import secrets
import struct
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from modeld.api import access, requests
from modeld.api.bodies import read_json
from modeld.api.connections import cancelled_when_client_leaves, client_left
from modeld.api.dialects import Dialect, Shaped, route
from modeld.api.guards import check_model_id
from modeld.api.requests import INT32, Backends, Duration, ModelId, Number
from modeld.api.stream import Deadline
from modeld.errors import BadRequest, EngineError, ModeldError, NoRoute, Unauthorized
from modeld.services.inference import (
    Done,
    Embedded,
    Final,
    Generation,
    Options,
    Shape,
    Token,
    ToolCall,
    Turn,
)
from modeld.services.models import Capabilities
from modeld.services.parts import Services

SSE = "text/event-stream"
# OpenAI's own limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048
_DONE = b"data: [DONE]\n\n"

Records = AsyncGenerator[Token | Final[Done], None]


class _Loose(BaseModel):
    # Message parts and objects inside messages: fields modeld does not use (a participant's
    # ``name``, an assistant's ``refusal``) change nothing it does, so they are let through.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class OpenAIBody(BaseModel):
    """A top-level body: an unknown field is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # They identify the caller for OpenAI's own bookkeeping and change no output.
    user: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None


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

FunctionName = Annotated[
    StrictStr,
    requests.pattern(
        r"^[A-Za-z0-9_.-]{1,64}$",
        "is not a valid function name (1 to 64 letters, digits, _ . or -)",
    ),
]


class CalledFunction(_Loose):
    name: FunctionName
    arguments: StrictStr


class ToolCallIn(_Loose):
    """A call an earlier assistant message made (sent back with the tool's result)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Loose):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Part] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDef(_Loose):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Loose):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Loose):
    name: FunctionName


class NamedTool(_Loose):
    type: Literal["function"]
    function: NamedFunction


SchemaName = Annotated[
    StrictStr,
    requests.pattern(
        r"^[A-Za-z0-9_-]{1,64}$", "is not a valid schema name (1 to 64 letters, digits, _ or -)"
    ),
]


class JsonSchema(_Loose):
    name: SchemaName = "response"
    description: StrictStr | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = {}
    strict: StrictBool | None = None


class ResponseFormat(_Loose):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('"response_format.json_schema" is required for type json_schema')
        return self


class StreamOptions(_Loose):
    include_usage: StrictBool = False


Penalty = Annotated[Number, Field(ge=-2, le=2)]


class _Sampled(OpenAIBody):
    """Sampling fields of both completion bodies; ``top_k``, ``repetition_penalty``,
    ``keep_alive``, ``backends`` and ``allow_unverified`` are modeld's."""

    model: ModelId
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=INT32)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[Number, Field(ge=1, le=10)] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


class ChatBody(_Sampled):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=1024)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    # false: at most one call comes back (a required call is always one).
    parallel_tool_calls: StrictBool | None = None


class CompletionBody(_Sampled):
    """``POST /v1/completions``: the prompt goes to the model without the chat template."""

    prompt: StrictStr | list[StrictStr]
    # OpenAI's default for this route.
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = 16

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        if isinstance(prompt, list) and len(prompt) != 1:
            raise ValueError(f"takes one prompt per request (got {len(prompt)}); send a string")
        return prompt


class EmbeddingBody(OpenAIBody):
    """``POST /v1/embeddings``; ``keep_alive``, ``backends`` and ``allow_unverified`` are
    modeld's."""

    model: ModelId
    input: (
        StrictStr
        | Annotated[list[StrictStr], Field(max_length=MAX_EMBEDDING_INPUTS)]
        | list[StrictInt]
        | list[list[StrictInt]]
    )
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


# Fields of OpenAI's bodies that modeld cannot honour, with why; each is a 400 when it asks for
# something (a value that asks for nothing, such as ``logprobs: false``, passes).
Cannot = dict[str, tuple[Callable[[Any], bool], str]]
CANNOT: Cannot = {
    "logprobs": (
        lambda v: v not in (None, False, 0),
        "log probabilities are not available from the LiteRT-LM runtime",
    ),
    "top_logprobs": (
        lambda v: v not in (None, 0),
        "log probabilities are not available from the LiteRT-LM runtime",
    ),
    "logit_bias": (bool, "the LiteRT-LM runtime takes no per-token bias"),
    "n": (lambda v: v not in (None, 1), "modeld makes one choice per request; send n: 1"),
    "best_of": (lambda v: v not in (None, 1), "modeld makes one choice per request"),
    "echo": (bool, "modeld does not echo the prompt"),
    "suffix": (lambda v: v not in (None, ""), "the LiteRT-LM runtime has no insertion mode"),
    "functions": (lambda v: v is not None, "use tools instead (the legacy field is not taken)"),
    "function_call": (
        lambda v: v is not None,
        "use tool_choice instead (the legacy field is not taken)",
    ),
    "audio": (lambda v: v is not None, "modeld answers with text only"),
    "modalities": (lambda v: v not in (None, ["text"]), "modeld answers with text only"),
    "prediction": (lambda v: v is not None, "predicted outputs are not supported"),
    "web_search_options": (lambda v: v is not None, "modeld has no web search"),
    "reasoning_effort": (lambda v: v is not None, "modeld has no reasoning-effort setting"),
    "verbosity": (lambda v: v is not None, "modeld has no verbosity setting"),
    "store": (bool, "modeld stores no completions"),
    "service_tier": (
        lambda v: v not in (None, "auto", "default"),
        "modeld has one service tier",
    ),
}


def refuse_unhonoured(data: dict[str, Any], cannot: Cannot) -> None:
    """A 400 naming each field of ``cannot`` that asks for what modeld cannot do (before
    validation); the others, which ask for nothing, are taken out."""
    found = [
        f'"{name}": {why}; leave it out'
        for name, (asks, why) in cannot.items()
        if name in data and asks(data[name])
    ]
    if found:
        raise BadRequest("; ".join(found))
    for name in cannot:
        data.pop(name, None)


async def read_openai_body(
    request: web.Request,
    model: type[requests.B],
    cannot: Cannot = CANNOT,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> requests.B:
    """The body as ``model``: admin-only fields, ``check`` and unhonoured fields
    (``cannot``), then validation."""
    data = await read_json(request)
    access.check_body(request, data)
    if check is not None:
        check(data)
    refuse_unhonoured(data, cannot)
    return requests.parse(model, data)


# --- errors in OpenAI's shape ------------------------------------------------------------------


def error_body(status: int, code: str, message: str) -> dict[str, Any]:
    """modeld's ``{"error": {"code", "message"}}`` plus OpenAI's ``type`` and ``param``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "rate_limit_error" if code == "busy" else "server_error"
    return {"error": {"code": code, "message": message, "type": kind, "param": None}}


def openai_shape(err: ModeldError) -> Shaped:
    """An error in OpenAI's shape; what OpenAI's clients match on is OpenAI's own word.

    A bad key is ``invalid_api_key`` (older litellm takes any other 401 for a bad request).
    A path that matched no route is a 400: LangChain and pydantic-ai report every 404 as an
    unknown model, which would send the user looking for the wrong thing.
    """
    status, code = err.status, err.code
    if isinstance(err, NoRoute):
        status, code = 400, "unknown_route"
    elif isinstance(err, Unauthorized):
        code = "invalid_api_key"
    return status, error_body(status, code, err.message)


OPENAI = Dialect("openai", openai_shape, prefixes=("/v1",))


# --- requests -----------------------------------------------------------------------------------


def image_of_url(url: str, where: str) -> bytes:
    """The bytes of an image sent as a data URL; any other URL is a 400 naming ``where``."""
    head, sep, data = url.partition(",")
    if not (url.startswith("data:") and sep and head.endswith(";base64")):
        raise BadRequest(
            f"{where}: only data URLs (data:image/png;base64,...) are accepted; "
            "modeld fetches nothing from the network"
        )
    return requests.decode_base64(data, where)


def parse_arguments(text: str, where: str) -> dict[str, Any]:
    """A tool call's ``arguments`` (a JSON text) as the object they must be."""
    try:
        args = json.loads(text or "{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f'"{where}": not JSON ({e.msg})') from e
    if not isinstance(args, dict):
        raise BadRequest(f'"{where}": must be a JSON object')
    return args


def _turn(i: int, m: ChatMessage, names: dict[str, str]) -> Turn:
    """One message as a ``Turn``; ``names`` maps earlier tool call ids to their function."""
    role = "system" if m.role == "developer" else m.role
    where = f'"messages[{i}]'
    if role == "tool":
        if m.tool_call_id is None or m.tool_call_id not in names:
            raise BadRequest(
                f'{where}.tool_call_id": must name a call of an earlier assistant message'
            )
        text = m.content if isinstance(m.content, str) else None
        if text is None:
            parts = m.content or []
            text = "\n".join(p.text for p in parts if isinstance(p, TextPart))
        return Turn("tool", text, name=names[m.tool_call_id])
    calls: list[ToolCall] = []
    for j, call in enumerate(m.tool_calls or []):
        if role != "assistant":
            raise BadRequest(f'{where}.tool_calls": only assistant messages make tool calls')
        names[call.id] = call.function.name
        args = parse_arguments(
            call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
        )
        calls.append({"name": call.function.name, "arguments": args})
    if m.content is None:
        if role != "assistant":
            raise BadRequest(f'{where}.content": is required for role {m.role}')
        return Turn(role, "", tool_calls=calls)
    if isinstance(m.content, str):
        return Turn(role, m.content, tool_calls=calls)
    texts, images = [], []
    for j, part in enumerate(m.content):
        if isinstance(part, TextPart):
            texts.append(part.text)
            continue
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        images.append(image_of_url(url, f'{where}.content[{j}].image_url"'))
    if images and role != "user":
        raise BadRequest(f'{where}": only user messages may carry images')
    return Turn(role, "\n".join(texts), images, tool_calls=calls)


@dataclasses.dataclass(frozen=True)
class Function:
    """A tool the caller describes, whichever dialect it came in: its name, its parameters'
    JSON schema (None: takes none) and the request's field that holds that schema."""

    name: str
    description: str | None
    parameters: dict[str, Any] | None
    where: str

    def described(self) -> dict[str, Any]:
        """The runtime's tool description (OpenAI's shape, which ``Shape.tools`` carries)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def forced_call_schema(
    functions: list[Function], name: str | None, choice: str = "tool_choice.function.name"
) -> dict[str, Any]:
    """The JSON schema of one call to ``name`` (or to any of ``functions``); ``choice`` names
    the request's field that named it."""
    options = []
    for fn in functions:
        if name is not None and fn.name != name:
            continue
        params = fn.parameters or {"type": "object", "properties": {}}
        if fn.parameters is not None:
            requests.check_json_schema(params, fn.where)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not options:
        raise BadRequest(f'"{choice}": {name!r} is not one of the tools')
    return options[0] if len(options) == 1 else {"anyOf": options}


def with_tools(
    shape: Shape,
    functions: list[Function],
    *,
    forced: bool,
    name: str | None,
    choice: str,
    format_field: str,
    parameters_field: str,
) -> Shape:
    """``shape`` with the tools offered, and with a forced call (``forced``: any tool, or
    ``name``) as its constraint; a forced call cannot also have a response format. The
    ``*_field`` arguments name the request's fields in refusals."""
    shape = dataclasses.replace(shape, tools=tuple(f.described() for f in functions))
    if not forced:
        return shape
    if shape.constrained:
        raise BadRequest(
            f'"{format_field}": cannot be combined with a required tool call; the reply is '
            "then the call"
        )
    return dataclasses.replace(
        shape,
        schema=forced_call_schema(functions, name, choice),
        strict=True,
        schema_of=parameters_field,
    )


def _generation(body: _Sampled, turns: list[Turn], shape: Shape) -> Generation:
    """The ``Generation`` of either completion body: its sampling fields, ``turns`` and
    ``shape`` (stop strings and streaming are added here)."""
    return Generation(
        model=body.model,
        turns=turns,
        options=Options.picked(body),
        shape=dataclasses.replace(
            shape, stop=tuple(requests.stops(body.stop)), stream=bool(body.stream)
        ),
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )


def generation_of(body: ChatBody) -> tuple[Generation, bool]:
    """A chat completion body as the native ``Generation``, and whether a call is forced."""
    names: dict[str, str] = {}
    turns = [_turn(i, m, names) for i, m in enumerate(body.messages)]
    shape = Shape()
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        shape = Shape(json=True)
    elif fmt is not None and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_ or {"type": "object"}
        where = "response_format.json_schema.schema"
        requests.check_json_schema(schema, where)
        shape = Shape(schema=schema, strict=bool(fmt.json_schema.strict), schema_of=where)
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise BadRequest('"tool_choice": needs "tools"')
    forced = False
    if body.tools and choice != "none":
        functions = [
            Function(
                t.function.name,
                t.function.description,
                t.function.parameters,
                f"tools[{i}].function.parameters",
            )
            for i, t in enumerate(body.tools)
        ]
        forced = choice == "required" or isinstance(choice, NamedTool)
        shape = with_tools(
            shape,
            functions,
            forced=forced,
            name=choice.function.name if isinstance(choice, NamedTool) else None,
            choice="tool_choice.function.name",
            format_field="response_format",
            parameters_field="tools[].function.parameters",
        )
    gen = _generation(body, turns, shape)
    # OpenAI's newer name wins over the older one.
    max_tokens = body.max_completion_tokens or body.max_tokens
    gen.options = dataclasses.replace(gen.options, max_tokens=max_tokens)
    return gen, forced


def completion_generation(body: CompletionBody) -> Generation:
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    return _generation(body, [Turn("user", prompt)], Shape(raw=True))


# --- responses ----------------------------------------------------------------------------------


def usage_of(final: Final[Done]) -> dict[str, int]:
    """OpenAI usage from the runner's final record (prefill and decode token counts)."""
    prompt, completion = final.result.prompt_tokens, final.result.tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _extension(final: Final[Done]) -> dict[str, Any]:
    """modeld's own fields: engine, phase timings and, for JSON output, the diagnostics."""
    doc = final.to_json()
    return {k: doc[k] for k in ("engine", "timings", "json") if k in doc}


def calls_made(final: Final[Done], text: str, forced: bool) -> list[ToolCall]:
    """The reply's tool calls: the runtime's, or a forced reply as one call.

    A forced reply was constrained to the call's schema and validated against it; one cut
    short (``max_tokens``) is no call, and its text is the reply instead.
    """
    check = final.result.json
    if forced and check is not None and check["status"] == "complete":
        doc = json.loads(text)
        return [{"name": doc["name"], "arguments": doc["arguments"]}]
    return list(final.result.tool_calls)


def tool_calls_of(final: Final[Done], text: str, forced: bool) -> list[dict[str, Any]]:
    """The reply's tool calls in OpenAI's shape (``calls_made``)."""
    return [
        {
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for c in calls_made(final, text, forced)
    ]


def _finish(final: Final[Done], calls: list[dict[str, Any]]) -> str:
    if calls:
        return "tool_calls"
    return "length" if final.result.finish == "length" else "stop"


def _compact(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + _compact(doc) + b"\n\n"


class _Reply:
    """One completion's identity and shape (chat or text), shared by its chunks."""

    def __init__(
        self, model: str, *, chat: bool, forced: bool = False, parallel: bool = True
    ) -> None:
        self.chat = chat
        self.forced = forced
        self.parallel = parallel
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model

    def calls(self, final: Final[Done], text: str) -> list[dict[str, Any]]:
        calls = tool_calls_of(final, text, self.forced)
        return calls if self.parallel else calls[:1]

    def head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        """A streamed chunk: a chat ``delta``, or a text completion's ``{"text": ...}``."""
        if self.chat:
            doc = self.head("chat.completion.chunk")
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            doc = self.head("text_completion")
            choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None}
            choice["finish_reason"] = finish
        doc["choices"] = [choice]
        return _event(doc)

    def usage_chunk(self, final: Final[Done]) -> bytes:
        doc = self.head("chat.completion.chunk" if self.chat else "text_completion")
        doc.update(choices=[], usage=usage_of(final), modeld=_extension(final))
        return _event(doc)

    def completion(self, text: str, final: Final[Done]) -> dict[str, Any]:
        calls = self.calls(final, text)
        finish = _finish(final, calls)
        if self.chat:
            doc = self.head("chat.completion")
            content = None if calls and (self.forced or not text) else text
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            doc = self.head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        doc["choices"] = [choice]
        doc["usage"] = usage_of(final)
        doc["modeld"] = _extension(final)
        return doc

    def opening(self) -> list[bytes]:
        """A chat stream starts with the role; a text completion's starts with text."""
        return [self.chunk({"role": "assistant", "content": ""})] if self.chat else []

    def ending(self, final: Final[Done], held: str, include_usage: bool) -> list[bytes]:
        """The chunks after the last token: tool calls, the finish, then usage if asked."""
        calls = self.calls(final, held)
        out = []
        if self.forced and not calls and held:
            out.append(self.chunk({"content": held}))  # cut short: no call, the text as it is
        out += self.call_chunks(calls)
        out.append(self.chunk({}, _finish(final, calls)))
        if include_usage:
            out.append(self.usage_chunk(final))
        return out

    def call_chunks(self, calls: list[dict[str, Any]]) -> list[bytes]:
        """Tool calls as OpenAI streams them: id, type and name first, then the arguments."""
        out = []
        for i, call in enumerate(calls):
            fn = call["function"]
            head = {"index": i, "id": call["id"], "type": "function"}
            head["function"] = {"name": fn["name"], "arguments": ""}
            out.append(self.chunk({"tool_calls": [head]}))
            args = {"index": i, "function": {"arguments": fn["arguments"]}}
            out.append(self.chunk({"tool_calls": [args]}))
        return out


async def collect(records: Records) -> tuple[str, Final[Done]]:
    """The whole reply's text and its final record."""
    parts: list[str] = []
    final: Final[Done] | None = None
    async with contextlib.aclosing(records):
        async for rec in records:
            if isinstance(rec, Token):
                parts.append(rec.text)
            else:
                final = rec
    if final is None:
        raise EngineError("the generation ended without its final record")
    # A non-streamed job's final record carries the whole text (no token records).
    text = final.result.text
    return ("".join(parts) if text is None else text), final


async def _collect(reply: _Reply, records: Records, deadline: Deadline) -> dict[str, Any]:
    text, final = await collect(deadline.records(records))
    return reply.completion(text, final)


# What writes a stream's bytes, within the request's deadline (``Deadline.write``).
Emit = Callable[[bytes], Awaitable[None]]
# What writes a stream's events as its records come, and returns the last ones (sent with
# the end of the body): (emit, the first record, the records after it).
WriteEvents = Callable[[Emit, Token | Final[Done] | None, Records], Awaitable[bytes]]


async def generate_within(
    request: web.Request, services: Services, gen: Generation, deadline: Deadline
) -> Records:
    """The records of ``gen`` from the ``Inference`` service, admitted within ``deadline``
    (its records are read within it by ``event_stream`` or ``collect``); what is kept of
    its conversation is kept for the request's caller (``access.scope_of``)."""
    gen.scope = access.scope_of(request)
    async with deadline.bound():
        _, records = await services.inference.generate(
            gen, may_shorten_keep_alive=access.administers(request)
        )
    return records


async def event_stream(
    request: web.Request, records: Records, write: WriteEvents, deadline: Deadline
) -> web.StreamResponse:
    """A reply as server-sent events, whichever dialect words them (``write``).

    The first record is awaited before the response starts, so a refusal before it (a busy
    queue, a prompt over the window) keeps its status and its dialect's error shape. A
    client that leaves closes ``records`` (the generation is cancelled) and the request
    ends with ``ClientLeft`` (499); so does one that stops reading until the ``deadline``.
    """
    async with contextlib.aclosing(deadline.records(records)) as recs:
        first = await anext(recs, None)
        response = web.StreamResponse(headers={"Content-Type": SSE, "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            last = await write(functools.partial(deadline.write, response), first, recs)
            await deadline.write(response, last, last=True)
            await response.write_eof()
        except ConnectionError as e:
            raise client_left(request) from e
    return response


async def _write_events(
    emit: Emit,
    first: Token | Final[Done] | None,
    records: Records,
    *,
    reply: _Reply,
    include_usage: bool,
) -> bytes:
    """Write the chunks as they come; return what ends the stream (sent with its end). A
    forced tool call's text is held back: it is the call, sent as ``tool_calls`` deltas."""
    held: list[str] = []
    # What is ready goes out in one write: the opening with the first tokens, and the
    # ending, [DONE] and the end of the body together (one send each, not one per chunk).
    pending = reply.opening()
    last = b""
    try:
        rec = first
        while rec is not None:
            if not isinstance(rec, Token):
                last = b"".join([*pending, *reply.ending(rec, "".join(held), include_usage)])
                pending = []
            elif reply.forced:
                held.append(rec.text)
            else:
                pending.append(reply.chunk({"content": rec.text}))
            if pending:
                await emit(b"".join(pending))
                pending = []
            rec = await anext(records, None)
        return last + _DONE
    except ConnectionError:
        raise  # the client left (or stopped reading): nothing can reach it
    except ModeldError as e:
        return _event(openai_shape(e)[1])
    except Exception:
        logging.getLogger("modeld").exception("chat stream failed")
        return _event(openai_shape(ModeldError("internal error; see the daemon's log"))[1])


def embedding_texts(body: EmbeddingBody) -> list[str]:
    """The texts to embed, in order; token ids and empty strings are a 400 naming ``input``."""
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise BadRequest("input is empty; send a string or a list of strings")
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest(
            "input: token ids are not taken (the LiteRT-LM embedding engine tokenizes the "
            "text itself); send a string or a list of strings. LangChain's OpenAIEmbeddings "
            "sends token ids unless made with check_embedding_ctx_length=False"
        )
    strings = [str(t) for t in texts]
    if "" in strings:
        raise BadRequest(
            f"input[{strings.index('')}] is an empty string, which has nothing to embed; "
            "leave it out"
        )
    return strings


def embeddings_doc(body: EmbeddingBody, rec: Final[Embedded]) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects, floats or base64 (little-endian float32).

    ``usage`` counts the tokens the engine consumed (the file's tokenizer, with the BOS and
    EOS the runtime adds); null for a file whose tokenizer modeld does not read.
    """
    tokens = rec.result.prompt_tokens
    data: list[dict[str, Any]] = []
    for index, vector in enumerate(rec.result.embeddings):
        value: Any = vector
        if body.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"object": "embedding", "index": index, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "modeld": {
            "engine": rec.engine,
            "dimensions": rec.result.dimensions,
            "timings": rec.to_json()["timings"],
        },
    }


def _model_doc(model_id: str, created: float, caps: Capabilities) -> dict[str, Any]:
    """An OpenAI model object, with the context length under the names clients read it by
    (OpenRouter's ``context_length``, vLLM's ``max_model_len``) and what the model can do."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(created),
        "owned_by": "modeld",
        "context_length": caps.context_length,
        "max_model_len": caps.context_length,
        "capabilities": caps.to_dict(),
    }


def add_routes(app: web.Application, services: Services) -> None:
    async def list_models(_: web.Request) -> web.Response:
        docs = []
        for inst in await services.models.servable():
            caps = await services.models.capabilities(inst.model_id)
            docs.append(_model_doc(inst.model_id, inst.installed_at, caps))
        docs.sort(key=lambda m: str(m["id"]))
        return web.json_response({"object": "list", "data": docs})

    async def get_model(request: web.Request) -> web.Response:
        model_id = check_model_id(request.match_info["model"])
        inst = await services.models.servable_one(model_id)
        caps = await services.models.capabilities(model_id)
        return web.json_response(_model_doc(inst.model_id, inst.installed_at, caps))

    def deadline(request: web.Request) -> Deadline:
        return Deadline(request, services.settings.request_timeout)

    async def answer(
        request: web.Request, reply: _Reply, gen: Generation, body: _Sampled, deadline: Deadline
    ) -> web.StreamResponse:
        async with cancelled_when_client_leaves(request):
            records = await generate_within(request, services, gen, deadline)
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                write = functools.partial(_write_events, reply=reply, include_usage=usage)
                return await event_stream(request, records, write, deadline)
            doc = await _collect(reply, records, deadline)
        return web.Response(body=_compact(doc), content_type="application/json")

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        body = await read_openai_body(request, ChatBody)
        until = deadline(request)
        async with until.bound():
            gen, forced = await requests.off_loop(generation_of, body)
        parallel = body.parallel_tool_calls is not False
        reply = _Reply(body.model, chat=True, forced=forced, parallel=parallel)
        return await answer(request, reply, gen, body, until)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await read_openai_body(request, CompletionBody)
        gen = completion_generation(body)
        return await answer(request, _Reply(body.model, chat=False), gen, body, deadline(request))

    async def embeddings(request: web.Request) -> web.StreamResponse:
        body = await read_openai_body(request, EmbeddingBody)
        texts = embedding_texts(body)
        async with cancelled_when_client_leaves(request), deadline(request).bound():
            rec = await services.inference.embed(
                body.model,
                texts,
                dimensions=body.dimensions,
                keep_alive=body.keep_alive,
                may_shorten_keep_alive=access.administers(request),
                allow_unverified=body.allow_unverified,
                backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
            )
        return web.Response(
            body=_compact(embeddings_doc(body, rec)), content_type="application/json"
        )

    route(app, "GET", "/v1/models", list_models, OPENAI)
    route(app, "GET", "/v1/models/{model}", get_model, OPENAI)
    route(app, "POST", "/v1/chat/completions", chat_completions, OPENAI)
    route(app, "POST", "/v1/completions", completions, OPENAI)
    route(app, "POST", "/v1/embeddings", embeddings, OPENAI)
