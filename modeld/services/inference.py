"""The ``Inference`` application service: engines loaded on request, and generation.

A generation request, native or OpenAI, arrives as one ``Generation`` (turns with their
images, sampling options). ``Inference.generate`` checks it (roles, image count,
keep_alive), admits it (the install and the engine target, its plan resolved with the
vision modality before any runner starts, and the prompt's size against the engine's
window), prepares it (images re-encoded, only now) and hands it to the pool, whose token
stream the adapter serializes. Everything that can refuse a request is raised before the
first record, so a refusal is a plain error response, never a broken stream.

``Inference.embed`` is the same path for an embedding model: its engine (an
``EmbeddingEngine`` in a runner of its own, under the same budget, queue and keep_alive)
returns one vector per input in one final record.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from modeld import logs
from modeld.config import Settings
from modeld.engine.engines import Engines
from modeld.engine.pool import KeepAlive, Pool, Target, validate_keep_alive
from modeld.engine.runner.job import (
    Counted,
    CountJob,
    Done,
    Embedded,
    EmbedJob,
    GenerateJob,
    ImagePart,
    Message,
    Options,
    Part,
    Shape,
    Token,
    ToolCall,
    ToolResponsePart,
)
from modeld.engine.views import Final
from modeld.errors import BadRequest, ContextLengthExceeded, Refused, TooLarge
from modeld.schemacheck import json_size

# The job's types, for the adapters that build a ``Generation`` and read its records.
__all__ = [
    "Counted",
    "Done",
    "Embedded",
    "Final",
    "Generation",
    "Inference",
    "Options",
    "Shape",
    "Token",
    "ToolCall",
    "Turn",
]

IMAGE_LONG_SIDE = 640
JPEG_QUALITY = 88
# A prompt over this many UTF-8 bytes per token of the engine's window is refused unread:
# text takes a few bytes a token, so this leaves room for any prompt that fits.
PROMPT_BYTES_PER_TOKEN = 32


def prepare_image(data: bytes, max_pixels: int) -> bytes:
    """Turn upright, downscale to at most 640 px on the long side, re-encode as JPEG 88.

    Pillow reads only the header on ``open``: the pixel count is checked there, before any
    decoding (a small PNG can decode to gigabytes of pixels). The EXIF orientation is
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
    except UnidentifiedImageError as e:
        # Its text names Pillow's buffer object (<_io.BytesIO object at 0x...>): say it plainly.
        raise BadRequest(
            "an image could not be decoded (its bytes are in no image format modeld reads); "
            "send PNG or JPEG bytes"
        ) from e
    except (OSError, ValueError) as e:
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


@dataclass
class Turn:
    """One message: its role, its text and the raw bytes of its images.

    An assistant turn may carry the tool calls it made; a ``tool`` turn names the tool whose
    result its text is.
    """

    role: str
    text: str
    images: list[bytes] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str | None = None

    def message(self, prepared: Callable[[bytes], bytes]) -> Message:
        """The turn in the runtime's message format (litert-lm's ``Message.to_json``)."""
        if self.role == "tool":
            response: ToolResponsePart = {
                "type": "tool_response",
                "name": self.name or "",
                "response": self.text,
            }
            return {"role": "tool", "content": [response]}
        msg: Message
        if not self.images:
            msg = {"role": self.role, "content": self.text}
        else:
            content: list[Part] = [{"type": "text", "text": self.text}]
            content += [
                ImagePart(type="image", blob=base64.b64encode(prepared(b)).decode())
                for b in self.images
            ]
            msg = {"role": self.role, "content": content}
        if self.tool_calls:
            msg["tool_calls"] = [{"type": "function", "function": c} for c in self.tool_calls]
        return msg


@dataclass
class Generation:
    """One generation request, whichever wire format it came in: the model, the turns, what
    the request sets of the runtime (``Options``) and what the reply must be (``Shape``)."""

    model: str
    turns: list[Turn]
    options: Options = field(default_factory=Options)
    shape: Shape = field(default_factory=Shape)
    keep_alive: Any = None
    allow_unverified: bool = False
    backends: dict[str, Any] | None = None
    # The token window the client needs (Ollama's ``num_ctx``); None: the engine's own.
    context: int | None = None
    # Whose prompts these are (``access.scope_of``): what is kept of a conversation between
    # its turns is kept for this scope alone; None keeps nothing.
    scope: str | None = None

    @property
    def image_count(self) -> int:
        return sum(len(t.images) for t in self.turns)

    def job(self, prepared: Callable[[bytes], bytes]) -> GenerateJob:
        """The runner's job; ``prepared`` re-encodes each image."""
        messages = tuple(t.message(prepared) for t in self.turns)
        return GenerateJob(messages, self.options, self.shape, self.scope)


def _prompt_size(gen: Generation, limit: int) -> int:
    """The bytes of ``gen``'s prompt: its texts, the tool calls its turns made and the tools
    it describes (a template renders them into the prompt); counting stops past ``limit``."""
    size = json_size(list(gen.shape.tools), limit)
    for turn in gen.turns:
        # A character is at least one byte: count bytes only while under the limit.
        size += len(turn.text)
        if size <= limit:
            size += len(turn.text.encode("utf-8", "surrogatepass")) - len(turn.text)
        size += json_size(turn.tool_calls, limit) if turn.tool_calls else 0
        if size > limit:
            break
    return size


def too_large(what: str, size: int, model_id: str, max_tokens: int, fix: str) -> TooLarge:
    """The 413 of a prompt or input over ``PROMPT_BYTES_PER_TOKEN`` bytes a token."""
    limit = max_tokens * PROMPT_BYTES_PER_TOKEN
    logs.event("prompt_refused", logging.WARNING, model=model_id, size=size, limit=limit)
    return TooLarge(
        f"{what} is over {limit} bytes: model {model_id} takes {max_tokens} tokens "
        f"at most, and modeld refuses prompts over {PROMPT_BYTES_PER_TOKEN} bytes a token "
        f"before tokenizing them; {fix}"
    )


def check_prompt(gen: Generation, model_id: str, max_tokens: int) -> None:
    """Refuse a prompt that cannot fit the engine's window, before the runtime tokenizes it.

    The runtime tokenizes the whole conversation before it checks the window: a prompt of
    millions of tokens costs seconds and gigabytes first. Text averages about 4 bytes a token, so
    ``PROMPT_BYTES_PER_TOKEN`` bytes a token of the window is a bound no prompt that fits
    comes near; the runtime still checks the exact count of what passes. Tools and the
    arguments of earlier tool calls count: a template renders them into the prompt.
    """
    limit = max_tokens * PROMPT_BYTES_PER_TOKEN
    size = _prompt_size(gen, limit)
    if size > limit:
        logs.event("prompt_refused", logging.WARNING, model=model_id, size=size, limit=limit)
        # Only a bound is known (the prompt was not tokenized): said as a bound.
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_tokens} tokens. However, your "
            f"messages are over {limit} bytes, more than {max_tokens} tokens hold (modeld "
            f"refuses prompts over {PROMPT_BYTES_PER_TOKEN} bytes a token of model "
            f"{model_id}'s window before tokenizing them). Please reduce the length of the "
            "messages: send a shorter prompt, fewer earlier messages or fewer tools.",
            window=max_tokens,
            prompt_bytes=size,
        )


def check_inputs(inputs: list[str], model_id: str, max_tokens: int) -> None:
    """Refuse an embedding input that cannot fit the model, before the runtime tokenizes it
    (``check_prompt``'s bound: a huge input was tokenized whole, then took the runner down;
    see docs/security.md)."""
    limit = max_tokens * PROMPT_BYTES_PER_TOKEN
    for i, text in enumerate(inputs):
        size = len(text)
        if size <= limit:
            size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise too_large(f"input[{i}]", size, model_id, max_tokens, "send shorter inputs")


def keep_alive_of(value: Any, may_shorten: bool) -> KeepAlive | None:
    """A request's ``keep_alive`` for the pool; None (not given) keeps the engine's."""
    seconds = validate_keep_alive(value)
    return None if seconds is None else KeepAlive(seconds, may_shorten)


@dataclass
class Prepared:
    """A request turned into the runner's job, images re-encoded."""

    job: GenerateJob
    # Seconds spent decoding and re-encoding the images (a phase of the final record).
    image_prepare: float = 0.0


class Inference:
    """Loads, unloads and generation, over the daemon's engines and pool."""

    def __init__(self, settings: Settings, engines: Engines, pool: Pool) -> None:
        self.settings = settings
        self.engines = engines
        self.pool = pool

    # --- engines ---------------------------------------------------------------------

    async def loaded(self) -> dict[str, Any]:
        """The loaded engines, the pool's budget use and the runtime."""
        runtime = await self.engines.runtime_info()
        return {"engines": self.pool.list(), **self.pool.status(), "runtime": runtime}

    async def load(
        self,
        model: str,
        *,
        backends: dict[str, Any] | None,
        keep_alive: Any,
        pin: bool,
        allow_unverified: bool,
        may_shorten_keep_alive: bool,
        warm_up: bool | None = None,
        preload: bool = False,
    ) -> dict[str, Any]:
        """Load an engine for ``model`` (a vision backend asked for loads the vision plan).

        A preload, like a pinned load, is made for a quick first reply: it warms up unless
        the entry or ``MODELD_WARM_UP=0`` says no (``Target.warm_up`` False).
        ``may_shorten_keep_alive`` False: ``keep_alive`` only lengthens the engine's
        (``KeepAlive``).
        """
        vision = bool(backends and backends.get("vision"))
        modalities = ["text"] + (["image"] if vision else [])
        alive = keep_alive_of(keep_alive, may_shorten_keep_alive)
        try:
            target = await self.engines.target(
                model,
                modalities=modalities,
                backends=backends,
                allow_unverified=allow_unverified,
                kind=None,  # a load takes the file's own kind: an embedding model loads too
            )
        except Refused as e:
            if not (vision and e.details.get("modality") == "image"):
                raise
            # The plan's refusal speaks of a request with images; this load asked for none.
            raise Refused(
                f"model {model} has no vision encoder, so backends.vision does not apply; "
                "load it without backends.vision",
                modality="image",
            ) from None
        if warm_up is None and preload:
            warm_up = True if target.warm_up is None else target.warm_up
        view = await self.pool.load(target, keep_alive=alive, pin=pin, warm_up=warm_up)
        self.engines.touch(target.model_id)
        return view

    async def unload(self, selector: str, *, grace: float | None = None) -> list[dict[str, Any]]:
        """Stop ``selector``'s engines once what they admitted has ended, or ``grace``
        seconds have passed (None: the pool's default)."""
        return await self.pool.unload(selector, grace=grace)

    async def forget_memory(self, model_id: str) -> dict[str, Any]:
        """Forget the peaks learned for ``model_id``'s file (an admin's reset)."""
        return await self.engines.forget_memory(model_id)

    # --- generation ------------------------------------------------------------------

    def check(self, gen: Generation) -> float | None:
        """Refuse what is wrong with the request itself; return its keep_alive in seconds."""
        if not gen.turns or gen.turns[-1].role not in ("user", "tool"):
            raise BadRequest("the last message must have role user (or tool, with tool results)")
        limit = self.engines.max_images(gen.model)
        if gen.image_count > limit:
            raise TooLarge(
                f"{gen.image_count} images sent; model {gen.model} takes at most {limit}"
            )
        return validate_keep_alive(gen.keep_alive)

    async def admit(self, gen: Generation) -> Target:
        """The engine target for the request, or its refusal, before any runner starts.

        The install and the plan come first, resolved with the vision modality when images
        came: a model that is not installed, or whose plan cannot take images (a vision
        encoder that needs gpu when vision=cpu), is refused before an image is decoded. Then
        the prompt's size, and the window the client needs, are held against the engine's.
        """
        target = await self._target(gen)
        check_prompt(gen, target.model_id, target.max_tokens)
        if gen.context is not None and gen.context > target.max_tokens:
            raise BadRequest(
                f"a context window of {gen.context} tokens was asked for; model "
                f"{target.model_id}'s engine has {target.max_tokens} (its entry's [limits] "
                "max_tokens, else its file's own): ask for that many or fewer, or leave it out"
            )
        return target

    async def _target(self, gen: Generation) -> Target:
        return await self.engines.target(
            gen.model,
            modalities=["text", "image"] if gen.image_count else ["text"],
            backends=gen.backends,
            allow_unverified=gen.allow_unverified,
            images=gen.image_count > 0,
        )

    async def ready(
        self, model: str, *, images: int = 0, allow_unverified: bool = False
    ) -> dict[str, Any]:
        """The engine a generation request for ``model`` with ``images`` images would get,
        or the refusal it would get before its prompt is read (an unknown id, no install, an
        unverified file, no plan, too many images): ``modeld run`` asks before it prompts.
        """
        turn = Turn("user", "", [b""] * images)  # only counted: nothing is decoded
        gen = Generation(model, [turn], allow_unverified=allow_unverified)
        self.check(gen)
        target = await self._target(gen)
        return {
            "id": target.model_id,
            "engine": target.engine_id,
            "plan": target.plan.to_dict(),
            "max_tokens": target.max_tokens,
        }

    async def prepare(self, gen: Generation) -> Prepared:
        """The runner's job; images decoded and re-encoded off the event loop."""
        if not gen.image_count:
            return Prepared(gen.job(bytes))
        # Decoding and re-encoding takes tens of ms per image: keep it off the event loop.
        prepare = functools.partial(prepare_image, max_pixels=self.settings.max_image_pixels)
        began = time.perf_counter()
        job = await asyncio.to_thread(gen.job, prepare)
        return Prepared(job, time.perf_counter() - began)

    async def embed(
        self,
        model: str,
        inputs: list[str],
        *,
        dimensions: int | None = None,
        keep_alive: Any = None,
        may_shorten_keep_alive: bool,
        allow_unverified: bool = False,
        backends: dict[str, Any] | None = None,
    ) -> Final[Embedded]:
        """One vector per input, in order, from ``model``'s embedding engine, with where it
        ran and its phase timings. A model
        that generates text is refused (``not_embedding_model``), as is an input the
        runtime cannot take: longer than its longest signature (413), or ``dimensions``
        over the model's own (400).
        """
        if not inputs:
            raise BadRequest("no input to embed; send a string or a list of strings")
        alive = keep_alive_of(keep_alive, may_shorten_keep_alive)
        target = await self.engines.target(
            model, kind="embedding", backends=backends, allow_unverified=allow_unverified
        )
        check_inputs(inputs, target.model_id, target.max_tokens)
        job = EmbedJob(tuple(inputs), dimensions)
        embedded = await self.pool.embed(target, job, keep_alive=alive)
        self.engines.touch(target.model_id)
        return embedded

    async def count(self, gen: Generation, *, may_shorten_keep_alive: bool) -> Final[Counted]:
        """The tokens ``gen``'s prompt takes on its model: what its generation would prefill,
        counted by the model's own engine (loaded for it, as a generation would be), nothing
        decoded. Refused as a generation would be, before any runner starts."""
        seconds = self.check(gen)
        keep_alive = None if seconds is None else KeepAlive(seconds, may_shorten_keep_alive)
        target = await self.admit(gen)
        prepared = await self.prepare(gen)
        return await self.pool.count(target, CountJob(prepared.job), keep_alive=keep_alive)

    async def generate(
        self, gen: Generation, *, may_shorten_keep_alive: bool
    ) -> tuple[str, AsyncGenerator[Token | Final[Done], None]]:
        """``(engine id, token records then the final record)`` for an admitted request.

        Everything that can refuse the request (unknown or uninstalled model, too many
        images, a backend constraint, a prompt over the window, a bad keep_alive or image)
        is raised here, before a response starts. ``may_shorten_keep_alive`` False: the
        request's keep_alive only lengthens the engine's (``KeepAlive``).
        """
        seconds = self.check(gen)
        keep_alive = None if seconds is None else KeepAlive(seconds, may_shorten_keep_alive)
        target = await self.admit(gen)
        prepared = await self.prepare(gen)
        records = self.pool.generate(
            target, prepared.job, keep_alive=keep_alive, image_prepare=prepared.image_prepare
        )
        return target.engine_id, self._used(target.model_id, records)

    async def _used(
        self, model_id: str, records: AsyncGenerator[Token | Final[Done], None]
    ) -> AsyncGenerator[Token | Final[Done], None]:
        """``records``, noting a use of ``model_id`` (``last_used``) once the first one came:
        a request refused in the pool (over the budget, the queue full) is no use."""
        async with contextlib.aclosing(records):
            async for rec in records:
                self.engines.touch(model_id)
                yield rec
                break
            async for rec in records:
                yield rec
