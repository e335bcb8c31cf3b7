"""Request bodies as pydantic models, and the generation path the native and OpenAI routes share.

Every route that takes a JSON body validates it here; a bad body is a 400 ``bad_request``
naming the field and why (``"max_tokens": must be ≥ 1``). A generation request, native or
OpenAI, becomes one ``Generation`` (turns with their images, sampling options), and
``start`` turns that into the pool's token stream: image preparation, the engine target
(plan resolved with the vision modality before any runner starts), then ``pool.generate``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
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

from modeld import logs
from modeld.api import access
from modeld.api.bodies import read_json
from modeld.catalog.catalog import ID_PATTERN
from modeld.errors import BadRequest, TooLarge
from modeld.services.parts import Services

IMAGE_LONG_SIDE = 640
# A prompt over this many UTF-8 bytes per token of the engine's window is refused unread;
# text averages ~4 bytes a token, so 32 leaves room for any prompt that fits.
PROMPT_BYTES_PER_TOKEN = 32
JPEG_QUALITY = 88
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


def prepare_image(data: bytes, max_pixels: int) -> bytes:
    """Turn upright, downscale to at most 640 px on the long side, re-encode as JPEG 88.

    Pillow reads only the header on ``open``: the pixel count is checked there, before any
    decoding (a 219 KB PNG can decode to 13000 x 13000, 0.9 GB). The EXIF orientation is
    applied before the resize: a phone photo stored sideways reaches the model upright, and
    the 640 px bound applies to its upright long side. The output carries no EXIF, so
    nothing downstream turns it a second time.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise _too_many_pixels(width, height, max_pixels)
            # A JPEG decodes straight to a smaller scale (1/2, 1/4, 1/8) when that is enough.
            img.draft("RGB", (IMAGE_LONG_SIDE, IMAGE_LONG_SIDE))
            img.load()
            rgb = ImageOps.exif_transpose(img).convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own bound (about 179 MP; over 89 MP it warns) is past ours unless
        # MODELD_MAX_IMAGE_PIXELS was raised.
        raise TooLarge(f"an image has too many pixels ({e}); send a smaller image") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise BadRequest(f"an image could not be decoded ({e}); send PNG or JPEG bytes") from e
    rgb.thumbnail((IMAGE_LONG_SIDE, IMAGE_LONG_SIDE))
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def _too_many_pixels(width: int, height: int, max_pixels: int) -> TooLarge:
    logs.event("image_refused", logging.WARNING, width=width, height=height, limit=max_pixels)
    return TooLarge(
        f"an image is {width}x{height} ({width * height / 1e6:.1f} megapixels), over "
        f"MODELD_MAX_IMAGE_PIXELS ({max_pixels / 1e6:g} megapixels); scale it down before "
        f"sending (modeld uses it at {IMAGE_LONG_SIDE} px on the long side anyway)"
    )


def decode_base64(item: str, where: str) -> bytes:
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"{where}: not valid base64") from e


@dataclass
class Turn:
    """One message: its role, its text and the raw bytes of its images.

    An assistant turn may carry the tool calls it made (``{"name", "arguments"}`` with the
    arguments as an object); a ``tool`` turn names the tool whose result its text is.
    """

    role: str
    text: str
    images: list[bytes] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    name: str | None = None

    def message(self, prepared: Callable[[bytes], bytes]) -> dict[str, Any]:
        """The turn in the runtime's message format (litert-lm's ``Message.to_json``)."""
        if self.role == "tool":
            part = {"type": "tool_response", "name": self.name or "", "response": self.text}
            return {"role": "tool", "content": [part]}
        if not self.images:
            msg: dict[str, Any] = {"role": self.role, "content": self.text}
        else:
            content: list[dict[str, Any]] = [{"type": "text", "text": self.text}]
            content += [
                {"type": "image", "blob": base64.b64encode(prepared(b)).decode()}
                for b in self.images
            ]
            msg = {"role": self.role, "content": content}
        if self.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": c} for c in self.tool_calls]
        return msg


@dataclass
class Generation:
    """One generation request, whichever wire format it came in."""

    model: str
    turns: list[Turn]
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    format: str | None = None
    # Repetition settings (the runtime's RepetitionPenaltyConfig).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # A JSON schema the reply is constrained to (the runtime's constrained decoding), and
    # whether the daemon also checks the finished reply against it.
    schema: dict[str, Any] | None = None
    strict: bool = False
    # OpenAI tool descriptions (``{"type": "function", "function": {...}}``) given to the
    # runtime, which hands calls back instead of running them.
    tools: list[dict[str, Any]] = field(default_factory=list)
    # The prompt goes to the model as it is, without the chat template (``/v1/completions``).
    raw: bool = False
    keep_alive: Any = None
    allow_unverified: bool = False
    backends: dict[str, Any] | None = None
    # False: the client waits for the whole reply, so the runner sends it in one record.
    stream: bool = True

    @property
    def image_count(self) -> int:
        return sum(len(t.images) for t in self.turns)

    def job(self, prepared: Callable[[bytes], bytes]) -> dict[str, Any]:
        """The runner's ``generate`` fields; ``prepared`` re-encodes each image."""
        job: dict[str, Any] = {
            "messages": [t.message(prepared) for t in self.turns],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "format": self.format,
            "stream": self.stream,
        }
        extra = {
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "schema": self.schema,
            "strict": self.strict or None,
            "tools": self.tools or None,
            "raw": self.raw or None,
        }
        # Only what is set: a plain request's frame stays as it was.
        job.update({k: v for k, v in extra.items() if v is not None})
        return job


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


async def start(
    services: Services, gen: Generation
) -> tuple[str, AsyncGenerator[dict[str, Any], None]]:
    """Resolve the engine and return ``(engine id, token records then a final record)``.

    Everything that can refuse the request (unknown or uninstalled model, too many images,
    a backend constraint, a bad keep_alive) is raised here, before a response starts.
    """
    from modeld.engine.pool import validate_keep_alive

    engines, pool = services.parts["engines"], services.parts["pool"]
    if not gen.turns or gen.turns[-1].role not in ("user", "tool"):
        raise BadRequest("the last message must have role user (or tool, with tool results)")
    limit = engines.max_images(gen.model)
    if gen.image_count > limit:
        raise TooLarge(f"{gen.image_count} images sent; model {gen.model} takes at most {limit}")
    keep_alive = validate_keep_alive(gen.keep_alive)
    # The install and the plan come first, resolved with the vision modality before any
    # runner starts: a model that is not installed, or whose plan cannot take images (a
    # vision encoder that needs gpu when vision=cpu), is refused before an image is decoded.
    target = await engines.target(
        gen.model,
        modalities=["text", "image"] if gen.image_count else ["text"],
        backends=gen.backends,
        allow_unverified=gen.allow_unverified,
        images=gen.image_count > 0,
    )
    check_prompt(gen, target.model_id, target.max_tokens)
    prepared = 0.0
    if gen.image_count:
        # Decoding and re-encoding takes tens of ms per image: keep it off the event loop.
        prepare = functools.partial(prepare_image, max_pixels=services.settings.max_image_pixels)
        began = time.perf_counter()
        job = await asyncio.to_thread(gen.job, prepare)
        prepared = time.perf_counter() - began
    else:
        job = gen.job(bytes)
    return target.engine_id, pool.generate(
        target, job, keep_alive=keep_alive, image_prepare=prepared
    )


def check_prompt(gen: Generation, model_id: str, max_tokens: int) -> None:
    """Refuse a prompt that cannot fit the engine's window, before the runtime tokenizes it.

    The runtime tokenizes the whole conversation before it checks the window: a prompt of
    millions of tokens took 15 s and 3.5 GB first. Text averages about 4 bytes a token, so
    ``PROMPT_BYTES_PER_TOKEN`` bytes a token of the window is a bound no prompt that fits
    comes near; the runtime still checks the exact count of what passes.
    """
    limit = max_tokens * PROMPT_BYTES_PER_TOKEN
    size = 0
    for turn in gen.turns:
        # A character is at least one byte: count bytes only while under the limit.
        size += len(turn.text)
        if size <= limit:
            size += len(turn.text.encode("utf-8", "surrogatepass")) - len(turn.text)
        if size > limit:
            logs.event("prompt_refused", logging.WARNING, model=model_id, size=size, limit=limit)
            raise TooLarge(
                f"the prompt is over {limit} bytes: model {model_id} takes {max_tokens} tokens "
                f"at most, and modeld refuses prompts over {PROMPT_BYTES_PER_TOKEN} bytes a token "
                "before tokenizing them; send a shorter prompt or fewer earlier messages"
            )
