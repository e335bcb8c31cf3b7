"""Ollama's API: ``/api/version``, ``/api/tags``, ``/api/show``, ``/api/ps``, ``/api/pull``,
``/api/delete``, ``/api/chat``, ``/api/generate``, ``/api/embed`` and ``/api/embeddings``.

The ``ollama`` clients (Python and npm) and the front-ends that speak only Ollama's API work
unchanged, over the socket or TCP with a key (``Authorization: Bearer``). The routes parse and
serialize: generation builds the same ``Generation`` as every dialect and reads its ``Token``
and ``Final`` records; pulls go through the ``Models`` service (mirrors, resume and the sha256
check underneath), deletes through the ``Remover``. Errors are Ollama's ``{"error": "..."}``
with modeld's status; a stream that fails after it started ends with one such record.

What maps where is in docs/ollama.md: ``options`` to the sampler (``num_predict``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``repeat_penalty``,
``presence_penalty``, ``frequency_penalty``), ``num_ctx`` held against the engine's window,
``format`` to constrained decoding, the phase timings to ``*_duration`` (ns). An option or
field that would change the reply and cannot be honoured is a 400 naming it; options that
only place or tune the work (``num_gpu``, ``num_thread``, ...) change no reply and are taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from modeld import __version__
from modeld.api import access, requests
from modeld.api.bodies import read_json
from modeld.api.connections import cancelled_when_client_leaves
from modeld.api.dialects import Dialect, Shaped, route
from modeld.api.openai import Cannot, FunctionName, ToolDef, collect, refuse_unhonoured
from modeld.api.requests import INT32, Duration, ModelId, Number
from modeld.api.stream import Deadline, as_is, ndjson
from modeld.config import parse_duration
from modeld.errors import BadRequest, EngineNotFound, ModeldError
from modeld.layout import LATEST_TAG
from modeld.services.inference import Done, Final, Generation, Options, Shape, Token, ToolCall, Turn
from modeld.services.models import Capabilities
from modeld.services.parts import Services

# An Ollama release with every feature these routes serve (structured outputs, tools,
# capabilities in ``show``): ``/api/version`` says it, for clients that gate features on it.
OLLAMA_VERSION = "0.12.0"
FORMAT = "litertlm"
# An engine kept loaded forever (keep_alive -1) expires, for Ollama's clients, at the end of time.
NEVER = "9999-12-31T23:59:59Z"

# --- errors in Ollama's shape ------------------------------------------------------------------


def ollama_shape(err: ModeldError) -> Shaped:
    """Ollama's error body, the message alone, with modeld's status."""
    return err.status, {"error": err.message}


# Ollama's paths are flat ``/api/<verb>`` among modeld's own, so its prefixes are its paths:
# a wrong method on one of them is answered in Ollama's shape, other ``/api/`` paths in modeld's.
PATHS = (
    "/api/version",
    "/api/tags",
    "/api/show",
    "/api/ps",
    "/api/pull",
    "/api/delete",
    "/api/chat",
    "/api/generate",
    "/api/embed",
    "/api/embeddings",
)
OLLAMA = Dialect("ollama", ollama_shape, prefixes=PATHS)


# --- bodies ------------------------------------------------------------------------------------


class _Body(BaseModel):
    """A top-level body: an unknown field is an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class _Loose(BaseModel):
    # Objects inside messages: fields modeld does not use change nothing it does.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _not(default: object) -> Callable[[Any], bool]:
    return lambda v: v is not None and v != default


# Options that would change the reply and that the LiteRT-LM sampler has no setting for: each
# is a 400 unless it asks for Ollama's default (which is what modeld does anyway).
_OPTIONS_CANNOT: Cannot = {
    "min_p": (_not(0), "the LiteRT-LM sampler has no min_p"),
    "typical_p": (_not(1), "the LiteRT-LM sampler has no typical sampling"),
    "tfs_z": (_not(1), "the LiteRT-LM sampler has no tail-free sampling"),
    "mirostat": (_not(0), "the LiteRT-LM sampler has no mirostat"),
    "repeat_last_n": (_not(64), "the LiteRT-LM repetition penalty has no window setting"),
}


class OllamaOptions(_Body):
    """``options``: what maps to the sampler, ``num_ctx``, and what changes no reply."""

    num_predict: Annotated[StrictInt, Field(ge=-2, le=INT32)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=100)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0, le=INT32)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=-INT32, le=INT32)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    num_ctx: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    repeat_penalty: Annotated[Number, Field(ge=1, le=10)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    # Asked for at their defaults only (``_OPTIONS_CANNOT``).
    min_p: Number | None = None
    typical_p: Number | None = None
    tfs_z: Number | None = None
    mirostat: StrictInt | None = None
    repeat_last_n: StrictInt | None = None
    # They place or tune the work (threads, GPU layers, memory mapping, batch size) or only
    # matter for what modeld never does (mirostat's own settings, context shifting), and
    # change no reply: taken, not used.
    mirostat_tau: Number | None = None
    mirostat_eta: Number | None = None
    num_keep: StrictInt | None = None
    penalize_newline: StrictBool | None = None
    numa: StrictBool | None = None
    num_batch: StrictInt | None = None
    num_gpu: StrictInt | None = None
    main_gpu: StrictInt | None = None
    low_vram: StrictBool | None = None
    f16_kv: StrictBool | None = None
    logits_all: StrictBool | None = None
    vocab_only: StrictBool | None = None
    use_mmap: StrictBool | None = None
    use_mlock: StrictBool | None = None
    embedding_only: StrictBool | None = None
    num_thread: StrictInt | None = None

    @model_validator(mode="after")
    def _honoured(self) -> OllamaOptions:
        found = [
            f"{name}: {why}; leave it out"
            for name, (asks, why) in _OPTIONS_CANNOT.items()
            if asks(getattr(self, name))
        ]
        if found:
            raise ValueError("; ".join(found))
        return self

    def sampler(self) -> Options:
        """The runtime's options: Ollama's "no limit" and "random" values leave them unset."""
        return Options(
            max_tokens=self.num_predict if self.num_predict and self.num_predict > 0 else None,
            temperature=self.temperature,
            top_k=self.top_k or None,
            top_p=self.top_p,
            seed=self.seed if self.seed is not None and self.seed >= 0 else None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repeat_penalty,
        )


# ``""`` asks for no format; ``"json"`` for any JSON; an object is a JSON schema.
Format = Literal["", "json"] | dict[str, Any]
Think = StrictBool | Literal["low", "medium", "high", "max"]

# Top-level fields that would change the reply and that modeld cannot honour, with why; each
# is a 400 when it asks for something (``think: false``, an empty ``suffix`` pass).
_CANNOT: Cannot = {
    "think": (
        lambda v: v not in (None, False),
        "modeld runs no separate thinking mode (false is taken)",
    ),
    "logprobs": (bool, "log probabilities are not available from the LiteRT-LM runtime"),
    "top_logprobs": (bool, "log probabilities are not available from the LiteRT-LM runtime"),
    "suffix": (bool, "the LiteRT-LM runtime has no insertion (fill-in-the-middle) mode"),
    "template": (bool, "modeld renders prompts with the template in the model's file"),
    "context": (
        bool,
        "modeld returns no context tokens (send the whole conversation to /api/chat)",
    ),
    "width": (lambda v: v is not None, "modeld generates no images"),
    "height": (lambda v: v is not None, "modeld generates no images"),
    "steps": (lambda v: v is not None, "modeld generates no images"),
}


class _Generating(_Body):
    """What ``/api/chat`` and ``/api/generate`` share."""

    model: ModelId
    format: Format | None = None
    options: OllamaOptions | None = None
    stream: StrictBool = True
    keep_alive: Duration | None = None


class FunctionCall(_Loose):
    name: FunctionName
    # Some clients send the arguments as a JSON string, as OpenAI's wire format does.
    arguments: dict[str, Any] | StrictStr = {}


class ToolCallIn(_Loose):
    function: FunctionCall


class Message(_Loose):
    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | None = None
    images: Annotated[list[StrictStr], Field(max_length=64)] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=128)] | None = None
    tool_name: StrictStr | None = None


class ChatBody(_Generating):
    """``POST /api/chat``; no messages loads the model (with ``keep_alive: 0``, unloads it)."""

    messages: Annotated[list[Message], Field(max_length=1024)] = []
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = None


class GenerateBody(_Generating):
    """``POST /api/generate``; no prompt loads the model (with ``keep_alive: 0``, unloads it)."""

    prompt: StrictStr | None = None
    system: StrictStr | None = None
    images: Annotated[list[StrictStr], Field(max_length=64)] | None = None
    raw: StrictBool = False


class EmbedBody(_Body):
    """``POST /api/embed``."""

    model: ModelId
    input: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=2048)]
    # Inputs are never cut: one over the model's longest input is a 413 saying so.
    truncate: StrictBool | None = None
    dimensions: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    options: OllamaOptions | None = None
    keep_alive: Duration | None = None


class EmbeddingsBody(_Body):
    """``POST /api/embeddings`` (Ollama's older route: one prompt, one vector)."""

    model: ModelId
    prompt: StrictStr
    options: OllamaOptions | None = None
    keep_alive: Duration | None = None


class _Named(_Body):
    # Ollama's older clients send ``name`` where newer ones send ``model``.
    model: ModelId | None = None
    name: ModelId | None = None

    @model_validator(mode="after")
    def _one_name(self) -> _Named:
        if self.model is None and self.name is None:
            raise ValueError('"model" is required: the id of a model, e.g. "tiny-text:latest"')
        return self

    @property
    def model_id(self) -> str:
        found = self.model or self.name
        assert found is not None
        return found


class ShowBody(_Named):
    verbose: StrictBool = False


class DeleteBody(_Named):
    pass


class PullBody(_Named):
    # modeld's sources are its catalog's, and every file is checked by its sha256 whatever
    # the connection: taken, changes nothing.
    insecure: StrictBool = False
    stream: StrictBool = True
    username: StrictStr | None = None
    password: StrictStr | None = None


async def _data(request: web.Request) -> dict[str, Any]:
    """The decoded body: fields kept for admins refused, unhonoured ones refused or taken out."""
    data = await read_json(request)
    access.check_body(request, data)
    refuse_unhonoured(data, _CANNOT)
    return data


async def _body(request: web.Request, model: type[requests.B]) -> requests.B:
    return requests.parse(model, await _data(request))


# --- requests ----------------------------------------------------------------------------------


B = TypeVar("B", bound=_Generating)


def _shape(body: _Generating, tools: tuple[dict[str, Any], ...] = (), raw: bool = False) -> Shape:
    fmt = body.format
    stop = tuple(requests.stops(body.options.stop if body.options else None))
    shape = Shape(stop=stop, tools=tools, raw=raw, stream=body.stream)
    if fmt == "json":
        return dataclasses.replace(shape, json=True)
    if isinstance(fmt, dict):
        requests.check_json_schema(fmt, "format")
        return dataclasses.replace(shape, schema=fmt, schema_of="format")
    return shape


def _images(items: list[str] | None, where: str) -> list[bytes]:
    return [requests.decode_base64(s, f'"{where}[{i}]"') for i, s in enumerate(items or [])]


def _arguments(call: FunctionCall, where: str) -> dict[str, Any]:
    if isinstance(call.arguments, dict):
        return call.arguments
    try:
        args = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as e:
        raise BadRequest(f'"{where}.function.arguments": not JSON ({e.msg})') from e
    if not isinstance(args, dict):
        raise BadRequest(f'"{where}.function.arguments": must be a JSON object')
    return args


def chat_turns(messages: list[Message]) -> list[Turn]:
    """The messages as turns. A tool result without ``tool_name`` (older clients) answers the
    earlier assistant turn's calls in order."""
    turns: list[Turn] = []
    pending: list[str] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        text = m.content or ""
        if m.images and m.role != "user":
            raise BadRequest(f'"{where}.images": only user messages may carry images')
        if m.role == "tool":
            name = m.tool_name or (pending.pop(0) if pending else None)
            if name is None:
                raise BadRequest(
                    f'"{where}.tool_name": name the tool whose result this is (no earlier '
                    "assistant message made a call it could answer)"
                )
            turns.append(Turn("tool", text, name=name))
            continue
        calls: list[ToolCall] = []
        for j, call in enumerate(m.tool_calls or []):
            if m.role != "assistant":
                raise BadRequest(f'"{where}.tool_calls": only assistant messages make tool calls')
            args = _arguments(call.function, f"{where}.tool_calls[{j}]")
            calls.append({"name": call.function.name, "arguments": args})
        if calls:
            pending = [c["name"] for c in calls]
        turns.append(Turn(m.role, text, _images(m.images, f"{where}.images"), tool_calls=calls))
    return turns


def _generation(body: _Generating, turns: list[Turn], shape: Shape) -> Generation:
    options = body.options or OllamaOptions()
    return Generation(
        model=body.model,
        turns=turns,
        options=options.sampler(),
        shape=shape,
        keep_alive=body.keep_alive,
        context=options.num_ctx,
    )


def chat_generation(body: ChatBody) -> Generation:
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools or [])
    return _generation(body, chat_turns(body.messages), _shape(body, tools))


def generate_generation(body: GenerateBody) -> Generation:
    if body.raw and body.system is not None:
        raise BadRequest(
            '"system": raw: true sends the prompt to the model as it is, without the template '
            "a system text would go through; put it in the prompt, or leave raw out"
        )
    turns = [Turn("user", body.prompt or "", _images(body.images, "images"))]
    if body.system is not None:
        turns.insert(0, Turn("system", body.system))
    return _generation(body, turns, _shape(body, raw=body.raw))


# --- replies -----------------------------------------------------------------------------------


def now() -> str:
    """An RFC 3339 time in UTC, as Ollama's ``created_at`` and ``modified_at``."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _at(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float | None) -> int:
    return round((seconds or 0.0) * 1e9)


def metrics(final: Final[Done]) -> dict[str, Any]:
    """Ollama's ``*_duration`` (ns) and ``*_count`` fields from modeld's phase timings.

    The decode is the reply's tokens at the runner's measured rate; where it measured none,
    the time from the first token to the end.
    """
    t, done = final.timings, final.result
    total = t["total"] + t["image_prepare"]
    rate = t["decode_tokens_per_second"]
    if rate and done.tokens:
        decode = done.tokens / rate
    elif t["first_token"] is not None:
        decode = max(0.0, t["total"] - t["first_token"])
    else:
        decode = 0.0
    return {
        "total_duration": _ns(total),
        "load_duration": _ns(t["load"]),
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_duration": _ns(t["prefill"]),
        "eval_count": done.tokens,
        "eval_duration": _ns(decode),
    }


def _extension(final: Final[Done]) -> dict[str, Any]:
    """modeld's own fields: engine, phase timings and, for JSON output, the diagnostics."""
    doc = final.to_json()
    return {k: doc[k] for k in ("engine", "timings", "json") if k in doc}


def tool_calls_of(final: Final[Done]) -> list[dict[str, Any]]:
    return [
        {"function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in final.result.tool_calls
    ]


class _Reply:
    """One chat or generate reply's records, as Ollama streams them."""

    def __init__(self, name: str, *, chat: bool) -> None:
        self.name = name
        self.chat = chat

    def piece(self, text: str, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        doc: dict[str, Any] = {"model": self.name, "created_at": now()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            doc["message"] = message
        else:
            doc["response"] = text
        doc["done"] = False
        return doc

    def last(self, final: Final[Done], text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        doc = self.piece(text, calls)
        doc["done"] = True
        doc["done_reason"] = "length" if final.result.finish == "length" else "stop"
        doc.update(metrics(final))
        doc["modeld"] = _extension(final)
        return doc

    def marker(self, reason: str) -> dict[str, Any]:
        """The one record of a load or an unload (a request with nothing to answer)."""
        doc = self.piece("")
        doc.update(done=True, done_reason=reason)
        return doc

    async def stream(
        self, records: AsyncGenerator[Token | Final[Done], None]
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A record per token; the calls the model made, then the last record with the
        timings (as Ollama streams tool calls: in a record of their own before the last)."""
        async with contextlib.aclosing(records):
            async for rec in records:
                if isinstance(rec, Token):
                    yield self.piece(rec.text)
                    continue
                calls = tool_calls_of(rec)
                if calls:
                    yield self.piece("", calls)
                yield self.last(rec, "", [])

    async def whole(self, records: AsyncGenerator[Token | Final[Done], None]) -> dict[str, Any]:
        text, final = await collect(records)
        return self.last(final, text, tool_calls_of(final))


# --- models ------------------------------------------------------------------------------------


def _is_zero(value: str | float) -> bool:
    try:
        return parse_duration(value) == 0
    except ValueError:
        return False  # the load refuses it, saying what a keep_alive looks like


def tagged(model_id: str) -> str:
    """The name Ollama's clients know a model by."""
    return f"{model_id}:{LATEST_TAG}"


def capability_names(caps: Capabilities | None) -> list[str]:
    """Ollama's capability names for what the file can do."""
    if caps is None:
        return []
    if caps.embedding:
        return ["embedding"]
    names = ["completion"]
    names += [name for name in ("tools", "vision", "thinking") if getattr(caps, name)]
    return names


def details(family: str | None = None) -> dict[str, Any]:
    """Ollama's ``details``: a LiteRT-LM file says no parameter size or quantization level."""
    return {
        "parent_model": "",
        "format": FORMAT,
        "family": family or "",
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": "",
    }


def engine_doc(view: dict[str, Any], at: float) -> dict[str, Any]:
    """A loaded engine as ``/api/ps`` lists it (``at``: the time now)."""
    size = int(view["pss"] or view["pss_estimate"])
    if view["keep_alive"] < 0:
        expires = NEVER
    else:
        left = view["expires_in"]
        expires = _at(at + (view["keep_alive"] if left is None else left))
    return {
        "name": tagged(view["model"]),
        "model": tagged(view["model"]),
        "size": size,
        "digest": view["digest"],
        "details": details(),
        "expires_at": expires,
        "size_vram": size if view["plan"]["main"] == "gpu" else 0,
        "context_length": view["max_tokens"],
    }


def _step(status: str, record: dict[str, Any], digest: str) -> dict[str, Any]:
    return {
        "status": status,
        "digest": digest,
        "total": record["size"],
        "completed": record["arrived"],
    }


def pull_progress(record: dict[str, Any], digest: str) -> list[dict[str, Any]]:
    """A modeld progress record as Ollama's: the file is its one layer, named by ``digest``."""
    state = record["state"]
    if state in ("starting", "probing"):
        return [{"status": "pulling manifest"}]
    if state == "downloading":
        return [_step(f"pulling {digest.removeprefix('sha256:')[:12]}", record, digest)]
    if state in ("verifying", "repairing"):
        return [{"status": "verifying sha256 digest"}]
    if state == "installing":
        return [{"status": "writing manifest"}]
    # Installed (or installed already): the whole layer, then success.
    size = record.get("size") or (record.get("installed") or {}).get("size") or 0
    done = {"size": size, "arrived": size}
    return [
        _step(f"pulling {digest.removeprefix('sha256:')[:12]}", done, digest),
        {"status": "success"},
    ]


async def _progress(
    records: AsyncGenerator[dict[str, Any], None], digest: str
) -> AsyncGenerator[dict[str, Any], None]:
    """Ollama's progress records, each status once while it holds (bytes as they move)."""
    last: dict[str, Any] | None = None
    async with contextlib.aclosing(records):
        async for record in records:
            for doc in pull_progress(record, digest):
                if doc != last:
                    last = doc
                    yield doc


class _Routes:
    """The handlers, over the daemon's services."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self.inference = services.inference
        self.models = services.models

    async def _capabilities(self, model_id: str) -> Capabilities | None:
        # A listing is not refused over one file whose header cannot be read.
        with contextlib.suppress(ModeldError):
            return await self.models.capabilities(model_id)
        return None

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION, "modeld": __version__})

    async def tags(self, _: web.Request) -> web.Response:
        listed = []
        for inst in sorted(await self.models.servable(), key=lambda i: i.model_id):
            caps = await self._capabilities(inst.model_id)
            listed.append(
                {
                    "name": tagged(inst.model_id),
                    "model": tagged(inst.model_id),
                    "modified_at": _at(inst.installed_at),
                    "size": inst.size,
                    "digest": inst.digest,
                    "details": details(),
                    "capabilities": capability_names(caps),
                }
            )
        return web.json_response({"models": listed})

    async def show(self, request: web.Request) -> web.Response:
        body = await _body(request, ShowBody)
        model_id = body.model_id
        caps = await self.models.capabilities(model_id)
        shown = await self.models.show(model_id)
        llm = (shown["header"] or {}).get("llm_metadata") or {}
        family = llm.get("model_type") or FORMAT
        installed = shown["installed"] or {}
        doc = {
            "modelfile": f"# modeld serves {model_id} from its catalog entry\nFROM {model_id}\n",
            "parameters": "",
            "template": "",
            "details": details(family),
            "model_info": {
                "general.architecture": family,
                "general.basename": model_id,
                f"{family}.context_length": caps.context_length,
            },
            "capabilities": capability_names(caps),
            "modified_at": _at(installed.get("installed_at") or time.time()),
            "modeld": {"capabilities": caps.to_dict(), "state": shown["state"]},
        }
        return web.json_response(doc)

    async def ps(self, _: web.Request) -> web.Response:
        engines = (await self.inference.loaded())["engines"]
        at = time.time()
        return web.json_response({"models": [engine_doc(v, at) for v in engines]})

    async def pull(self, request: web.Request) -> web.StreamResponse:
        body = await _body(request, PullBody)
        started = await self.models.pull(body.model_id)
        entry = self.services.catalog.find(started.model_id)
        known = entry is not None and entry.sha256
        digest = f"sha256:{entry.sha256}" if entry is not None and known else started.model_id
        progress = _progress(started.records(), digest)
        if not body.stream:
            async with contextlib.aclosing(progress):
                async for _ in progress:
                    pass
            return web.json_response({"status": "success"})
        return await ndjson(request, progress, as_is, dialect=OLLAMA)

    async def delete(self, request: web.Request) -> web.Response:
        body = await _body(request, DeleteBody)
        await self.services.remover.remove_model(body.model_id, force=False)
        return web.json_response({})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data = await _data(request)
        body = requests.parse(ChatBody, data)
        return await self._answer(request, data.get("model"), chat_generation, body)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        data = await _data(request)
        moved = [k for k in ("max_tokens", "messages") if k in data]
        if moved:
            raise BadRequest(
                f"\"{moved[0]}\": /api/generate takes Ollama's body; modeld's own generation "
                "body goes to POST /api/modeld/generate"
            )
        body = requests.parse(GenerateBody, data)
        return await self._answer(request, data.get("model"), generate_generation, body)

    async def _answer(
        self,
        request: web.Request,
        raw_name: Any,
        generation: Callable[[B], Generation],
        body: B,
    ) -> web.StreamResponse:
        """Answer ``body`` (as ``generation`` makes it a ``Generation``, off the event loop:
        images are decoded and schemas checked there), within the request's deadline."""
        chat = isinstance(body, ChatBody)
        deadline = Deadline(request, self.services.settings.request_timeout)
        administers = access.administers(request)
        async with cancelled_when_client_leaves(request):
            async with deadline.bound():
                gen = await requests.off_loop(generation, body)
            reply = _Reply(raw_name if isinstance(raw_name, str) else tagged(gen.model), chat=chat)
            if not gen.turns or (not gen.turns[-1].text and not gen.image_count and not chat):
                return web.json_response(await self._load_or_unload(request, gen, reply))
            gen.scope = access.scope_of(request)
            async with deadline.bound():
                _, records = await self.inference.generate(gen, may_shorten_keep_alive=administers)
            if gen.shape.stream:
                return await ndjson(request, reply.stream(records), as_is, deadline, OLLAMA)
            doc = await reply.whole(deadline.records(records))
        return web.json_response(doc)

    async def _load_or_unload(
        self, request: web.Request, gen: Generation, reply: _Reply
    ) -> dict[str, Any]:
        """A request with nothing to answer loads the model, or with ``keep_alive: 0``
        unloads it (Ollama's way to do either); an unload is an admin's."""
        alive = gen.keep_alive
        if alive is not None and _is_zero(alive):
            access.require_admin(request, "unload (keep_alive 0 without a prompt)")
            with contextlib.suppress(EngineNotFound):
                await self.inference.unload(gen.model)
            return reply.marker("unload")
        await self.inference.load(
            gen.model,
            backends=None,
            keep_alive=alive,
            pin=False,
            allow_unverified=False,
            may_shorten_keep_alive=access.administers(request),
        )
        return reply.marker("load")

    async def _vectors(
        self, request: web.Request, inputs: list[str], body: EmbedBody | EmbeddingsBody
    ) -> tuple[list[list[float]], dict[str, Any]]:
        dimensions = body.dimensions if isinstance(body, EmbedBody) else None
        deadline = Deadline(request, self.services.settings.request_timeout)
        async with cancelled_when_client_leaves(request), deadline.bound():
            rec = await self.inference.embed(
                body.model,
                inputs,
                dimensions=dimensions,
                keep_alive=body.keep_alive,
                may_shorten_keep_alive=access.administers(request),
            )
        t = rec.timings
        timing: dict[str, Any] = {
            "total_duration": _ns(t["total"]),
            "load_duration": _ns(t["load"]),
        }
        if rec.result.prompt_tokens is not None:
            timing["prompt_eval_count"] = rec.result.prompt_tokens
        return [list(v) for v in rec.result.embeddings], timing

    async def embed(self, request: web.Request) -> web.Response:
        body = await _body(request, EmbedBody)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        if "" in inputs:
            raise BadRequest(
                f'"input[{inputs.index("")}]": an empty string has nothing to embed; leave it out'
            )
        vectors, timing = await self._vectors(request, inputs, body)
        return web.json_response({"model": tagged(body.model), "embeddings": vectors, **timing})

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await _body(request, EmbeddingsBody)
        if not body.prompt:
            raise BadRequest('"prompt": an empty string has nothing to embed; send some text')
        (vector,), _ = await self._vectors(request, [body.prompt], body)
        return web.json_response({"embedding": vector})


def add_routes(app: web.Application, services: Services) -> None:
    r = _Routes(services)
    for method, path, handler in (
        ("GET", "/api/version", r.version),
        ("GET", "/api/tags", r.tags),
        ("POST", "/api/show", r.show),
        ("GET", "/api/ps", r.ps),
        ("POST", "/api/pull", r.pull),
        ("DELETE", "/api/delete", r.delete),
        ("POST", "/api/chat", r.chat),
        ("POST", "/api/generate", r.generate),
        ("POST", "/api/embed", r.embed),
        ("POST", "/api/embeddings", r.embeddings),
    ):
        route(app, method, path, handler, OLLAMA)
        if method == "GET":  # HEAD too, as Ollama answers it
            route(app, "HEAD", path, handler, OLLAMA)
