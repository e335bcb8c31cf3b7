"""Request bodies as pydantic models, and the native generation body as a ``Generation``.

Every route that takes a JSON body validates it here; a bad body is a 400 ``bad_request``
naming the field and why (``"max_tokens": must be ≥ 1``). A generation request, native or
OpenAI, becomes one ``Generation`` (turns with their images, sampling options) that the
``Inference`` service checks, admits, prepares and streams.
"""

from __future__ import annotations

import base64
import binascii
import warnings
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from modeld.api import access
from modeld.api.bodies import read_json
from modeld.catalog.catalog import ID_PATTERN
from modeld.errors import BadRequest
from modeld.services.inference import Generation, Turn

# Bounds the runtime's C++ side takes without overflow (int32 fields).
INT32 = 2**31 - 1

ModelId = Annotated[StrictStr, Field(pattern=ID_PATTERN)]
Number = StrictInt | StrictFloat
Duration = StrictStr | StrictInt | StrictFloat
Backend = Literal["cpu", "gpu"]

B = TypeVar("B", bound=BaseModel)


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
    """``POST /api/generate``."""

    model: ModelId
    prompt: StrictStr | None = None
    system: StrictStr | None = None
    messages: Annotated[list[NativeMessage], Field(min_length=1)] | None = None
    images: list[StrictStr] = []
    format: Literal["json"] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=INT32)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateBody:
        if (self.prompt is None) == (self.messages is None):
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
        Annotated[StrictStr, Field(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")] | None
    ) = None
    fd: StrictBool = False
    name: (
        Annotated[StrictStr, Field(min_length=1, max_length=255, pattern=r"^[^/\x00]+$")] | None
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


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "constrained-", "literal[")) and part not in (
            "str",
            "int",
            "float",
            "bool",
            "list[str]",
            "list",
        ):
            out += ("." if out else "") + part[:40]
    return out or "body"


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
_UNION_HINTS = {
    "keep_alive": 'must be a duration such as "30s", "5m", 0 or -1',
    "stop": "must be a string or a list of strings",
    "image_url": 'must be {"url": "data:image/png;base64,..."}',
}
_BOUNDS = {
    "greater_than_equal": ("≥", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("≤", "le"),
    "less_than": ("<", "lt"),
}


def _why(err: Any, fields: list[str]) -> str:
    kind, ctx = err["type"], err.get("ctx") or {}
    why = _SIMPLE.get(kind)
    if kind == "extra_forbidden":
        why = "unknown field; allowed: " + ", ".join(fields)
    elif kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        why = f"must be {sign} {ctx.get(key)}"
    elif kind == "literal_error":
        why = f"must be {ctx.get('expected')}"
    elif kind == "string_pattern_mismatch":
        why = (
            "must be an absolute path (no NUL)"
            if err["loc"][:1] == ("path",)
            else "is not a valid model id (letters, digits, . _ -; at most 128; no / or ..)"
        )
    elif kind == "value_error":
        why = str(err["msg"]).removeprefix("Value error, ")
    return why if why is not None else str(err["msg"]).lower()


def validation_message(e: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: ``"field": why``; a union's branches collapse into one."""
    fields = list(model.model_fields)
    by_field: dict[str, list[str]] = {}
    for err in e.errors():
        where = _where(tuple(err["loc"]))
        if where == "body" and err["type"] == "value_error":
            by_field.setdefault("", []).append(_why(err, fields))
            continue
        by_field.setdefault(where, []).append(_why(err, fields))
    parts = []
    for where, whys in by_field.items():
        # A union (int or float, str or list) reports once per branch: say it once.
        unique = list(dict.fromkeys(whys))
        if len(unique) == 1:
            why = unique[0]
        elif where in _UNION_HINTS:
            why = _UNION_HINTS[where]
        elif set(unique) == {"must be an integer", "must be a number"}:
            why = "must be a number"
        elif set(unique) == {"must be an integer", "must be a finite number"}:
            why = "must be a finite number"  # NaN or Infinity: a float, but not a finite one
        else:
            why = " or ".join(unique[:2])
        parts.append(f'"{where}": {why}' if where else why)
    return "; ".join(parts[:6])


def parse(model: type[B], data: Any) -> B:
    """``data`` validated as ``model``, or a 400 naming each bad field and why."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(validation_message(e, model)) from None


async def read_body(request: web.Request, model: type[B], *, optional: bool = False) -> B:
    """The body as ``model``; a field the route keeps for admins is refused here (403)."""
    body = parse(model, await read_json(request, optional=optional))
    access.check_body(request, body)
    return body


# --- generation ------------------------------------------------------------------------------


def check_json_schema(schema: dict[str, Any], where: str) -> None:
    """A 400 naming ``where`` for a schema that is no JSON schema or refers outside itself.

    What only the runtime finds (an unsatisfiable schema, a pattern its regex engine does not
    take) is a 400 from the runner when it makes the constraint.
    """
    with warnings.catch_warnings():
        # An unknown "$schema" is checked against the latest draft (jsonschema warns).
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            validator_for(schema, default=Draft202012Validator).check_schema(schema)
        except SchemaError as e:
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.path)
            raise BadRequest(f'"{where}{at}": is not a valid JSON schema: {e.message}') from None
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise BadRequest(
                    f'"{where}": $ref {ref!r} points outside the schema, and modeld fetches '
                    'nothing; put what it names under "$defs" and refer to it as '
                    '"#/$defs/NAME"'
                )
            stack.extend(node.values())


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
    """A ``POST /api/generate`` body as a ``Generation`` (images go with the last message)."""
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
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_k=body.top_k,
        top_p=body.top_p,
        seed=body.seed,
        stop=stops(body.stop),
        format=body.format,
        keep_alive=body.keep_alive,
        allow_unverified=body.allow_unverified,
        backends=body.backends.model_dump(exclude_none=True) if body.backends else None,
    )
