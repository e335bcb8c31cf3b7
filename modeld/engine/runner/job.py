"""The generation job and the records that answer it, as they cross to a runner and back.

Every dialect (native, OpenAI, Ollama, Anthropic, ...) is parsed into one ``Generation`` by
its adapter; the ``Inference`` service turns that into one ``GenerateJob`` (or ``EmbedJob``),
which travels to the runner child as a JSON frame (``to_wire`` / ``job_of``). The child
answers with ``Token`` records and one ``Done`` (or ``Embedded``), which travel back the
same way (``record_of``).

The fields a request sets of the runtime's sampler, conversation and send are listed once,
in ``Options``, each tagged with where it goes (``Destination``). What depends on them is
derived from that list: the arguments of the runtime's calls (``Options.to``), the key under
which a conversation made ahead is reused (``GenerateJob.conversation_key``), whether a
bare session can answer (``GenerateJob.session_plain``) and the settings a kept conversation
is continued under (``GenerateJob.kept_settings``). A field added to ``Options`` reaches
every path, or fails a test (tests/engine/test_job.py).

Like the child, this imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NotRequired, TypedDict, get_args

# Where an option goes in the runtime:
# - "sampler": a field of ``SamplerConfig`` (a conversation's or a bare session's);
# - "conversation": an argument of ``create_conversation`` and ``create_session`` (its
#   runtime name in the field's ``name`` metadata);
# - "send": a field of ``RepetitionPenaltyConfig``, given to ``send_message`` (a bare session
#   has no such argument).
Destination = Literal["sampler", "conversation", "send"]
DESTINATIONS: tuple[Destination, ...] = get_args(Destination)
# What a bare session (``create_session``) takes; any other option needs a conversation.
SESSION_TAKES: frozenset[Destination] = frozenset({"sampler", "conversation"})


def _option(to: Destination, name: str | None = None) -> Any:
    return field(default=None, metadata={"to": to, "name": name})


@dataclass(frozen=True, slots=True)
class Options:
    """What a request sets of the runtime's sampler, conversation and send; None: not set."""

    max_tokens: int | None = _option("conversation", "max_output_tokens")
    temperature: float | None = _option("sampler")
    top_k: int | None = _option("sampler")
    top_p: float | None = _option("sampler")
    seed: int | None = _option("sampler")
    presence_penalty: float | None = _option("send")
    frequency_penalty: float | None = _option("send")
    repetition_penalty: float | None = _option("send")

    def to(self, destination: Destination) -> dict[str, Any]:
        """The options set for ``destination``, under their runtime names."""
        return {
            f.metadata["name"] or f.name: value
            for f in dataclasses.fields(self)
            if f.metadata["to"] == destination and (value := getattr(self, f.name)) is not None
        }

    def values(self, destinations: frozenset[Destination]) -> tuple[Any, ...]:
        """Every option for ``destinations``, set or not, in field order: equal tuples make
        equal runtime objects."""
        return tuple(
            getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.metadata["to"] in destinations
        )

    @classmethod
    def picked(cls, source: object) -> Options:
        """The options of ``source`` (a parsed body) under their own names; a field the body
        does not have stays unset."""
        return cls(**{f.name: getattr(source, f.name, None) for f in dataclasses.fields(cls)})

    def to_wire(self) -> dict[str, Any]:
        return {
            f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None
        }


# --- messages in the runtime's format (litert-lm's ``Message.to_json``) ------------------------


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImagePart(TypedDict):
    type: Literal["image"]
    blob: str  # base64 of the prepared (re-encoded) image


class ToolResponsePart(TypedDict):
    type: Literal["tool_response"]
    name: str
    response: str


Part = TextPart | ImagePart | ToolResponsePart


class ToolCall(TypedDict):
    """A call the model made (or an earlier assistant turn made), arguments as an object."""

    name: str
    arguments: dict[str, Any]


class FunctionCall(TypedDict):
    type: Literal["function"]
    function: ToolCall


class Message(TypedDict):
    role: str
    content: str | list[Part]
    tool_calls: NotRequired[list[FunctionCall]]


def text_only(message: Message) -> list[str] | None:
    """The texts of ``message`` when it holds nothing but text; else None."""
    content = message["content"]
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if part["type"] != "text":
            return None
        texts.append(part["text"])
    return texts


# --- jobs ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """What a reply must be besides its options: stop strings, JSON, tools, the template."""

    stop: tuple[str, ...] = ()
    # ``format: "json"``: any JSON (constrained decoding with the schema ``{"type": "object"}``).
    json: bool = False
    # A JSON schema the reply is constrained to, and whether the finished reply is checked
    # against it too; ``schema_of`` names the request's field it came from.
    schema: dict[str, Any] | None = None
    strict: bool = False
    schema_of: str | None = None
    # OpenAI tool descriptions (``{"type": "function", "function": {...}}``); the runtime
    # hands calls back instead of running them.
    tools: tuple[dict[str, Any], ...] = ()
    # The prompt goes to the model as it is, without the chat template (``/v1/completions``).
    raw: bool = False
    # False: the caller waits for the whole reply, so the runner sends it in one record.
    stream: bool = True

    @property
    def constrained(self) -> bool:
        return self.json or self.schema is not None

    @property
    def plain(self) -> bool:
        """No tools, no constraint, no raw template: what a conversation made ahead or a bare
        session can serve."""
        return not (self.tools or self.raw or self.constrained)

    def to_wire(self) -> dict[str, Any]:
        return {
            f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(self)
            if (v := getattr(self, f.name)) != f.default
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Shape:
        return cls(
            stop=tuple(str(s) for s in data.get("stop") or ()),
            json=bool(data.get("json")),
            schema=data.get("schema"),
            strict=bool(data.get("strict")),
            schema_of=data.get("schema_of"),
            tools=tuple(data.get("tools") or ()),
            raw=bool(data.get("raw")),
            stream=data.get("stream", True) is not False,
        )


# Why a turn did not continue a conversation kept after an earlier reply (``Done.restart``);
# docs/engines.md#conversations-that-continue says what each one means.
Restart = Literal[
    "first",  # no earlier reply in the request: nothing to continue
    "off",  # MODELD_KEPT_CONVERSATIONS=0, or an engine that keeps none (gpu, a model that thinks)
    "shape",  # tools, JSON, raw, images, tool turns, penalties: no bare session answers it
    "seeded",  # a fixed seed that samples: a kept sampler has moved on, the reply would differ
    "anonymous",  # no caller to keep it for
    "unknown",  # nothing kept for this caller and these settings on this engine
    "history",  # kept ones for this caller and settings, none with this history
    "options",  # this history is kept under other options
    "prompt",  # the history matched, the rendered prompt or its tokens did not extend it
]
RESTARTS: tuple[Restart, ...] = get_args(Restart)


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """One reply to make: the conversation's messages (the last one is sent), its options
    and its shape; ``scope``: whose it is (``Generation.scope``), None: no one's, so nothing
    is kept for it."""

    op: ClassVar[Literal["generate"]] = "generate"

    messages: tuple[Message, ...]
    options: Options = Options()
    shape: Shape = Shape()
    scope: str | None = None

    def conversation_key(self) -> tuple[Any, ...] | None:
        """What the job's conversation is made from, when that can be made before the job
        comes: one turn and a plain shape. Jobs with equal keys get equal conversations;
        None: made for the job alone. Options given at send are not part of it."""
        if len(self.messages) != 1 or not self.shape.plain:
            return None
        return self.options.values(frozenset(d for d in DESTINATIONS if d != "send"))

    def session_plain(self) -> bool:
        """Whether a bare session (``PlainSession``) can answer: one user turn of text without
        a NUL (the rendered prompt comes back as a C string), a plain shape, and no option a
        session does not take."""
        return len(self.messages) == 1 and self.session_turns()

    def session_turns(self) -> bool:
        """Whether a bare session can answer the whole conversation, given its prompt rendered:
        turns of text without a NUL from the system, the user and the assistant (no tool
        calls), the last from the user, a plain shape, and no option a session does not
        take. What a conversation kept for the next turn is made of."""
        if not self.messages or self.messages[-1]["role"] != "user" or not self.shape.plain:
            return False
        if any(self.options.to(d) for d in DESTINATIONS if d not in SESSION_TAKES):
            return False
        for turn in self.messages:
            texts = text_only(turn)
            if (
                turn["role"] not in ("system", "user", "assistant")
                or "tool_calls" in turn
                or texts is None
                or any("\x00" in t for t in texts)
            ):
                return False
        return True

    def kept_settings(self) -> tuple[Any, ...]:
        """What a kept conversation must have been made with to continue this job: every
        option its session takes, set or not."""
        return self.options.values(SESSION_TAKES)

    def to_wire(self) -> dict[str, Any]:
        out = {
            "messages": list(self.messages),
            "options": self.options.to_wire(),
            "shape": self.shape.to_wire(),
        }
        if self.scope is not None:
            out["scope"] = self.scope
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> GenerateJob:
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("a generate job's messages must be a list of objects")
        scope = data.get("scope")
        return cls(
            messages=tuple(messages),
            options=Options(**(data.get("options") or {})),
            shape=Shape.from_wire(data.get("shape") or {}),
            scope=None if scope is None else str(scope),
        )


@dataclass(frozen=True, slots=True)
class EmbedJob:
    """Vectors for ``inputs``, in order; ``dimensions`` None: the model's own length."""

    op: ClassVar[Literal["embed"]] = "embed"

    inputs: tuple[str, ...]
    dimensions: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"inputs": list(self.inputs), "dimensions": self.dimensions}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> EmbedJob:
        size = data.get("dimensions")
        return cls(
            inputs=tuple(str(t) for t in data.get("inputs") or ()),
            dimensions=None if size is None else int(size),
        )


@dataclass(frozen=True, slots=True)
class CountJob:
    """The tokens ``job``'s prompt takes: what its generation would prefill, none decoded."""

    op: ClassVar[Literal["count"]] = "count"

    job: GenerateJob

    def to_wire(self) -> dict[str, Any]:
        return self.job.to_wire()

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CountJob:
        return cls(GenerateJob.from_wire(data))


Job = GenerateJob | EmbedJob | CountJob


def job_of(op: str, data: dict[str, Any]) -> Job:
    """The job a ``generate``, ``embed`` or ``count`` frame carries; ValueError for anything
    else."""
    if op == GenerateJob.op:
        return GenerateJob.from_wire(data)
    if op == EmbedJob.op:
        return EmbedJob.from_wire(data)
    if op == CountJob.op:
        return CountJob.from_wire(data)
    raise ValueError(f"unknown job op {op!r}")


# --- records back from the runner -----------------------------------------------------------

Finish = Literal["stop", "length", "cancelled"]
FINISH_STOP: Finish = "stop"  # the model ended its reply (or a stop string matched)
FINISH_LENGTH: Finish = "length"  # max_tokens or the engine's token window ran out
FINISH_CANCELLED: Finish = "cancelled"

JsonStatus = Literal[
    "complete", "empty", "truncated", "not_json", "schema_mismatch", "schema_unchecked"
]


class JsonCheck(TypedDict):
    """The JSON diagnostics of a reply asked for as JSON (``classify_json``)."""

    status: JsonStatus
    raw: str
    error: str | None


@dataclass(frozen=True, slots=True)
class Token:
    """Text of a reply as it comes (one or more tokens)."""

    text: str


@dataclass(frozen=True, slots=True)
class RunnerTimings:
    """Seconds (and a rate) the runner measured for one job; None where not measured."""

    prefill: float | None = None
    first_token: float | None = None
    decode_tokens_per_second: float | None = None
    generate: float | None = None
    embed: float | None = None


# How the job's conversation was had: "ready" (made ahead), "none" (a bare session made in
# line), "none ready" (a bare session made ahead), "continued" (the bare session kept after
# the conversation's last reply); None: a conversation made for the job.
Made = Literal["ready", "none", "none ready", "continued"]


@dataclass(frozen=True, slots=True)
class Done:
    """The runner's last record of a generation."""

    finish: Finish
    prompt_tokens: int = 0
    tokens: int = 0
    timings: RunnerTimings = RunnerTimings()
    constrained: bool = False
    # The whole reply, for a job not streamed (it sent no ``Token``).
    text: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    json: JsonCheck | None = None
    conversation: Made | None = None
    # The stop string the reply was cut at (``finish`` is "stop"); None: none was met.
    stop_sequence: str | None = None
    # Of ``prompt_tokens``, those a kept conversation already held (not prefilled again).
    continued_tokens: int = 0
    # Why the turn did not continue a kept conversation; None: it did.
    restart: Restart | None = None
    # How many conversations the runner keeps once this job is over.
    kept: int = 0


@dataclass(frozen=True, slots=True)
class Embedded:
    """The runner's one record for an ``EmbedJob``: one vector per input, in order, and the
    tokens the engine consumed for each (None: the file's tokenizer is not one modeld reads,
    ``modeld.modelfile.tokens``)."""

    embeddings: tuple[tuple[float, ...], ...] | list[list[float]]
    dimensions: int | None
    timings: RunnerTimings = RunnerTimings()
    tokens: tuple[int, ...] | None = None

    @property
    def prompt_tokens(self) -> int | None:
        """All inputs' tokens together, or None where they were not counted."""
        return None if self.tokens is None else sum(self.tokens)


# How a ``Counted`` was had: "rendered" (the prompt rendered with the model's template, then
# tokenized: no prefill), "prefilled" (the runtime prefilled it: a prompt with images).
CountedBy = Literal["rendered", "prefilled"]


@dataclass(frozen=True, slots=True)
class Counted:
    """The runner's one record for a ``CountJob``."""

    prompt_tokens: int
    by: CountedBy
    timings: RunnerTimings = RunnerTimings()


Record = Token | Done | Embedded | Counted


class WarmUp(TypedDict):
    """The warm-up generation at an engine's creation (one short reply)."""

    seconds: float
    prefill: float | None
    prompt_tokens: int | None
    tokens: int | None
    decode_tokens_per_second: NotRequired[float | None]


@dataclass(frozen=True, slots=True)
class Created:
    """The runner's answer to ``create``: ``litert_lm.Engine()``'s own seconds, the warm-up
    (None: not asked), the process's memory then, and the settings the engine was created
    with, read back from the runtime (``engine_options``)."""

    seconds: float
    warm_up: WarmUp | None
    pss: int
    rss: int
    options: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True, **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Created:
        return cls(
            seconds=float(data.get("seconds") or 0.0),
            warm_up=data.get("warm_up"),
            pss=int(data.get("pss") or 0),
            rss=int(data.get("rss") or 0),
            options=dict(data.get("options") or {}),
        )


def record_to_wire(rec: Done | Embedded | Counted) -> dict[str, Any]:
    """A final record as the runner sends it (a ``Token`` has frames of its own)."""
    out: dict[str, Any] = {"done": True}
    for f in dataclasses.fields(rec):
        value = getattr(rec, f.name)
        if f.name == "timings":
            value = {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
        elif isinstance(value, tuple):
            value = list(value)
        if value is not None:
            out[f.name] = value
    return out


def record_of(data: dict[str, Any]) -> Done | Embedded | Counted:
    """A final record from its frame (``record_to_wire``)."""
    timings = RunnerTimings(**(data.get("timings") or {}))
    if "embeddings" in data:
        tokens = data.get("tokens")
        counts = None if tokens is None else tuple(int(n) for n in tokens)
        return Embedded(data["embeddings"], data.get("dimensions"), timings, counts)
    if "by" in data:
        by = next((b for b in get_args(CountedBy) if b == data.get("by")), None)
        if by is None:
            raise ValueError(f"a count's record says it was had by {data.get('by')!r}")
        return Counted(int(data.get("prompt_tokens") or 0), by, timings)
    finish = next((f for f in get_args(Finish) if f == data.get("finish")), None)
    if finish is None:
        raise ValueError(f"a final record's finish is {data.get('finish')!r}")
    return Done(
        finish=finish,
        prompt_tokens=int(data.get("prompt_tokens") or 0),
        tokens=int(data.get("tokens") or 0),
        timings=timings,
        constrained=bool(data.get("constrained")),
        text=data.get("text"),
        tool_calls=tuple(data.get("tool_calls") or ()),
        json=data.get("json"),
        conversation=data.get("conversation"),
        stop_sequence=data.get("stop_sequence"),
        continued_tokens=int(data.get("continued_tokens") or 0),
        restart=next((r for r in RESTARTS if r == data.get("restart")), None),
        kept=int(data.get("kept") or 0),
    )
