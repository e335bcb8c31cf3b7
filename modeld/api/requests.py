"""Request bodies as pydantic models, and the native generation body as a ``Generation``.

Every route that takes a JSON body validates it here; a bad body is a 400 ``bad_request``
naming the field and why (``"max_tokens": must be ≥ 1``). A generation request, native or
OpenAI, becomes one ``Generation`` (turns with their images, sampling options) that the
``Inference`` service checks, admits, prepares and streams.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from modeld import logs, schemacheck
from modeld.api import access
from modeld.api.bodies import read_json
from modeld.catalog.catalog import ID_PATTERN
from modeld.errors import BadRequest, TooLarge
from modeld.layout import tag_refusal, untagged
from modeld.services.inference import Generation, Options, Shape, Turn

# Bounds the runtime's C++ side takes without overflow (int32 fields).
INT32 = 2**31 - 1

# What a value that does not match a field's pattern is told, by pattern (``pattern``).
_PATTERNS: dict[str, str] = {}


def pattern(regex: str, says: str) -> Any:
    """A ``Field`` whose value must match ``regex``; one that does not is told ``says``."""
    _PATTERNS[regex] = says
    return Field(pattern=regex)


def _untagged(value: Any) -> Any:
    """A model id without its ``:latest`` tag; another tag is refused saying why."""
    if not isinstance(value, str):
        return value
    value = untagged(value)
    refusal = tag_refusal(value)
    if refusal is not None:
        raise ValueError(refusal)
    return value


ModelId = Annotated[
    StrictStr,
    BeforeValidator(_untagged),
    pattern(
        ID_PATTERN, "is not a valid model id (letters, digits, . _ -; at most 128; no / or ..)"
    ),
]
Number = StrictInt | StrictFloat
Duration = StrictStr | StrictInt | StrictFloat
Backend = Literal["cpu", "gpu"]

B = TypeVar("B", bound=BaseModel)
T = TypeVar("T")

# What turning a request's content into a job (its schemas and their patterns, its images'
# base64, its tools) may take in a worker thread, once its sizes passed their bounds.
CONTENT_SECONDS = 10.0


class Strict(BaseModel):
    """A body whose unknown fields are errors (they are typos)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Backends(Strict):
    main: Backend | None = None
    vision: Backend | None = None
    audio: Backend | None = None


class Sampling(Strict):
    """Sampling options shared by the native and OpenAI bodies."""

    temperature: Annotated[Number, Field(ge=0, le=100)] | None = None
    top_k: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None
    top_p: Annotated[Number, Field(ge=0, le=1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=INT32)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=16)] | None = None
    keep_alive: Duration | None = None
    allow_unverified: StrictBool = False
    backends: Backends | None = None


class NativeMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class GenerateBody(Sampling):
    """``POST /api/modeld/generate``."""

    model: ModelId
    prompt: StrictStr | None = None
    system: StrictStr | None = None
    messages: Annotated[list[NativeMessage], Field(min_length=1)] | None = None
    images: list[StrictStr] = []
    format: Literal["json"] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateBody:
        if self.prompt is None and self.messages is None:
            raise ValueError('"prompt" (a string) or "messages" (a list) is required; send one')
        if self.prompt is not None and self.messages is not None:
            raise ValueError('send either "prompt" (a string) or "messages" (a list), not both')
        return self


class LoadBody(Strict):
    """``POST /api/engines``."""

    model: ModelId
    backends: Backends | None = None
    keep_alive: Duration | None = None
    pin: StrictBool = False
    # One short generation at load; absent: gpu plans and pinned loads do (``Engines``).
    warm_up: StrictBool | None = None
    allow_unverified: StrictBool = False


class CheckBody(Strict):
    """``POST /api/models/{id}/check``: would a generation request be admitted."""

    images: Annotated[StrictInt, Field(ge=0, le=64)] = 0
    allow_unverified: StrictBool = False


class PullBody(Strict):
    """``POST /api/models/{id}/pull``; ``{}`` streams progress."""

    detach: StrictBool = False
    stream: StrictBool | None = None
    # Download even when the model could never fit the memory budget.
    force: StrictBool = False
    # Cap the download's total rate, bytes per second (``pull --limit-rate``).
    limit_rate: Annotated[StrictInt, Field(ge=1)] | None = None


class PullSourceBody(PullBody):
    """``POST /api/models/pull``: a Hub file (``hf://ORG/REPO/FILE[@REV]`` or its resolve
    URL) made into an entry and pulled; ``id`` names the entry (else one from REPO/FILE)."""

    source: Annotated[StrictStr, Field(min_length=6, max_length=2048)]
    id: ModelId | None = None


class ImportBody(Strict):
    """``POST /api/models/import``: a ``path`` the daemon opens, or ``fd: true`` and the
    file's ``name``, the descriptor following over the socket (``SCM_RIGHTS``)."""

    path: (
        Annotated[
            StrictStr,
            Field(min_length=1, max_length=4096),
            pattern(r"^/[^\x00]*$", "must be an absolute path (no NUL)"),
        ]
        | None
    ) = None
    fd: StrictBool = False
    name: (
        Annotated[
            StrictStr,
            Field(min_length=1, max_length=255),
            pattern(r"^[^/\x00]+$", "must be a file name (no / or NUL)"),
        ]
        | None
    ) = None
    id: ModelId | None = None

    @model_validator(mode="after")
    def _one_source(self) -> ImportBody:
        if self.fd == (self.path is not None):
            raise ValueError("give either path or fd (with name), not both or neither")
        if self.fd and self.name is None:
            raise ValueError("fd needs the file's name")
        return self


# --- validation messages -------------------------------------------------------------------
# pydantic lists each problem with its location (``loc``), its ``type`` and its context
# (``ctx``). In a union the location also names the branch tried, and after a tagged union's
# branch, the tag; those parts are no field of the body. Which parts are fields is read off
# the body itself: a part is a field where the value at that point has it (a key of an
# object, an index of a list); any other part names a branch, whatever pydantic calls it
# (``_problem``). The branches' problems are then narrowed to the branch the value was meant
# for (``_meant``).

# Problems that say the value is not of a branch's type: that branch was not meant.
_MISMATCH = frozenset(
    (
        "int_type",
        "int_from_float",
        "float_type",
        "string_type",
        "bool_type",
        "list_type",
        "dict_type",
        "model_type",
        "model_attributes_type",
        "literal_error",
        "none_required",
    )
)
_SIMPLE = {
    "missing": "is required",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}
# What a value that fits no branch of a union must be, by the field's name.
UNION_HINTS = {
    "keep_alive": 'must be a duration such as "30s", "5m", 0 or -1',
    "stop": "must be a string or a list of strings",
    "image_url": 'must be {"url": "data:image/png;base64,..."}',
    "content": 'must be a string or a list of parts ({"type": "text", ...} or '
    '{"type": "image_url", ...})',
    "input": "must be a string or a list of strings",
    "prompt": "must be a string",
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": '
    '{"name": ...}}',
    "partials": 'must be true (all), false, or an age such as "7d" (only partials older than that)',
    "unused_for": 'must be a duration such as "30d", "12h" or a number of seconds',
}
_BOUNDS = {
    "greater_than_equal": ("≥", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("≤", "le"),
    "less_than": ("<", "lt"),
}
_ABSENT = object()


@dataclass
class _Problem:
    where: str
    name: str  # the field's own name: the last one in ``where``
    kind: str
    why: str
    # The unions the location went through: (where the union is, the branch tried).
    unions: list[tuple[str, str]]


def _path(parts: list[int | str]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part[:40]
    return out


def _step(node: Any, part: Any) -> Any:
    """The value of ``node`` at ``part`` (a key or an index), or ``_ABSENT``."""
    if isinstance(node, dict) and isinstance(part, str):
        return node.get(part, _ABSENT)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return _ABSENT


def _problem(err: Any, data: Any, model: type[BaseModel]) -> _Problem:
    """One problem, its location read against the body ``data`` (see above)."""
    loc, kind = list(err["loc"]), err["type"]
    node = data
    parts: list[int | str] = []
    unions: list[tuple[str, str]] = []
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        below = _step(node, part)
        # A tagged union's tag is the value's own "type"; when the object also has a key of
        # that name, the next part being one of its keys tells the tag apart.
        tag = isinstance(node, dict) and node.get("type") == part and not last
        if tag and _step(node, loc[i + 1]) is not _ABSENT:
            below = _ABSENT
        if below is not _ABSENT:
            parts.append(part)
            node = below
        elif last and kind in ("missing", "extra_forbidden"):
            parts.append(part)  # a field the body lacks, or one it should not have
        elif isinstance(part, int):
            parts.append(part)
            node = _ABSENT
        else:
            unions.append((_path(parts), str(part)))
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        parts.append(str((err.get("ctx") or {}).get("discriminator", "type")).strip("'"))
    names = [p for p in parts if isinstance(p, str)]
    return _Problem(_path(parts), names[-1] if names else "", kind, _why(err, model), unions)


def _meant(problems: list[_Problem], level: int = 0) -> list[_Problem]:
    """The problems of the union branches the values were meant for.

    A branch whose type the value is not (a string for a list) was not meant; of the others,
    the one with the fewest problems was (a list of 2,049 strings is a list of strings one
    too long, not a list of integers); when no branch takes the value's type, all are said.
    """
    kept = [p for p in problems if len(p.unions) <= level]
    at: dict[str, dict[str, list[_Problem]]] = {}
    for p in problems:
        if len(p.unions) > level:
            where, label = p.unions[level]
            at.setdefault(where, {}).setdefault(label, []).append(p)
    for where, branches in at.items():
        tried = [
            ps
            for ps in branches.values()
            if not any(p.where == where and p.kind in _MISMATCH for p in ps)
        ]
        if not tried:
            kept += [p for ps in branches.values() for p in ps]
            continue
        fewest = min(len(ps) for ps in tried)
        kept += _meant([p for ps in tried if len(ps) == fewest for p in ps], level + 1)
    return [p for p in problems if any(p is k for k in kept)]


def _items(n: Any) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _why(err: Any, model: type[BaseModel]) -> str:  # noqa: PLR0911
    kind, ctx = err["type"], err.get("ctx") or {}
    why = _SIMPLE.get(kind)
    if why is not None:
        return why
    if kind == "extra_forbidden":
        return "unknown field; allowed: " + ", ".join(model.model_fields)
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"must be {sign} {ctx.get(key)}"
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}"
    if kind == "string_pattern_mismatch":
        regex = str(ctx.get("pattern"))
        return _PATTERNS.get(regex, f"must match {regex}")
    if kind == "too_long":
        return f"takes at most {_items(ctx.get('max_length'))}, got {ctx.get('actual_length')}"
    if kind == "too_short":
        return f"takes at least {_items(ctx.get('min_length'))}, got {ctx.get('actual_length')}"
    if kind == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if kind == "string_too_short":
        return f"must be at least {ctx.get('min_length')} characters"
    if kind == "union_tag_invalid":
        head, _, last = str(ctx.get("expected_tags")).rpartition(", ")
        return f"must be {head + ' or ' if head else ''}{last}, not {ctx.get('tag')!r}"
    if kind == "union_tag_not_found":
        return "is required"
    if kind == "value_error" and isinstance(ctx.get("error"), ValueError):
        return str(ctx["error"])  # modeld's own validators, worded for the client
    return str(err["msg"]).lower()


def _one(name: str, whys: list[str]) -> str:
    """What a field must be, once, from what each branch of its union said."""
    if len(whys) == 1:
        return whys[0]
    if name in UNION_HINTS:
        return UNION_HINTS[name]
    if set(whys) == {"must be an integer", "must be a number"}:
        return "must be a number"
    if all(w.startswith("must be ") for w in whys):
        return "must be " + " or ".join(w.removeprefix("must be ") for w in whys)
    return " or ".join(whys[:2])


def validation_message(e: ValidationError, data: Any, model: type[BaseModel]) -> str:
    """One line per problem of ``data`` as ``model``: ``"field": why``; a union's branches
    collapse into one."""
    by_field: dict[str, tuple[str, list[str]]] = {}
    for p in _meant([_problem(err, data, model) for err in e.errors()]):
        # A check of the whole body (a model validator) says its own field names.
        where = p.where or ("" if p.kind == "value_error" else "body")
        by_field.setdefault(where, (p.name, []))[1].append(p.why)
    parts = []
    for where, (name, whys) in by_field.items():
        why = _one(name, list(dict.fromkeys(whys)))
        parts.append(f'"{where}": {why}' if where else why)
    return "; ".join(parts[:6])


def parse(model: type[B], data: Any) -> B:
    """``data`` validated as ``model``, or a 400 naming each bad field and why."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(validation_message(e, data, model)) from None


async def read_body(request: web.Request, model: type[B], *, optional: bool = False) -> B:
    """The body as ``model``; a field the route keeps for admins is refused here (403)."""
    data = await read_json(request, optional=optional)
    access.check_body(request, data)
    return parse(model, data)


# --- generation ------------------------------------------------------------------------------


def check_json_schema(schema: dict[str, Any], where: str) -> None:
    """A 400 naming ``where`` for a schema modeld does not take (``schemacheck``: too large,
    a pattern too long, a ``$ref`` outside it or in a loop, not a JSON schema).

    It compiles the schema's patterns: call it off the event loop (``off_loop``). What only
    the runtime finds (an unsatisfiable schema, a pattern its regex engine does not take) is
    a 400 from the runner when it makes the constraint.
    """
    try:
        schemacheck.check_schema(schema)
    except schemacheck.SchemaRefused as e:
        raise BadRequest(f'"{where}{e.at}": {e.message}') from None


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread, within ``CONTENT_SECONDS``: what parses, compiles or
    checks a request's content never runs on the event loop (``/api/health`` answers
    throughout), and each of its parts had its size bounded first."""
    try:
        async with asyncio.timeout(CONTENT_SECONDS):
            return await asyncio.to_thread(fn, *args)
    except TimeoutError:
        logs.event("content_refused", logging.WARNING, reason="content_seconds")
        raise TooLarge(
            f"checking the request's content (schemas, images, tools) took over "
            f"{CONTENT_SECONDS:g} s; send smaller schemas or images"
        ) from None


def decode_base64(item: str, where: str) -> bytes:
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where}: not valid base64") from e


def stops(value: str | list[str] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def from_native(body: GenerateBody) -> Generation:
    """A ``POST /api/modeld/generate`` body as a ``Generation`` (images go with the last
    message)."""
    if body.prompt is not None:
        turns = [Turn("user", body.prompt)]
        if body.system is not None:
            turns.insert(0, Turn("system", body.system))
    else:
        assert body.messages is not None
        turns = [Turn(m.role, m.content) for m in body.messages]
    turns[-1].images = [decode_base64(s, f'"images"[{i}]') for i, s in enumerate(body.images)]
    return Generation(
        model=body.model,
        turns=turns,
        options=Options.picked(body),
        shape=Shape(stop=tuple(stops(body.stop)), json=body.format == "json"),
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )
