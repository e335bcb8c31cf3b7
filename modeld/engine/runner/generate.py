"""The pieces of one generation that need no runner: its arguments, stop strings, JSON checks,
tool calls.

The runner child (``modeld.engine.runner.child``) drives the generation itself with them.
Like the child it imports nothing heavy at module level.
"""

from __future__ import annotations

import codecs
import ctypes
import json
import secrets
import threading
from collections.abc import Callable
from typing import Any, Literal

from modeld.engine.runner.job import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    Finish,
    GenerateJob,
    JsonCheck,
    JsonStatus,
    Options,
    ToolCall,
)


def classify_json(text: str, finish: Finish, schema: dict[str, Any] | None = None) -> JsonCheck:
    """The JSON diagnostics: complete, empty, truncated, not_json, schema_mismatch or
    schema_unchecked.

    "Max number of tokens reached" ends a reply silently in LiteRT-LM 0.18, so a reply that
    stops at the limit and does not parse is *truncated*, not a runtime failure. With a
    ``schema`` (a strict ``json_schema`` request), a reply that parses is also checked
    against it (``modeld.schemacheck``, within its time bound): *schema_mismatch* is complete
    JSON that does not match, *schema_unchecked* complete JSON whose check did not end in time.
    """
    raw = text.strip()
    if not raw:
        status: JsonStatus = "truncated" if finish == FINISH_LENGTH else "empty"
        return {"status": status, "raw": text, "error": None}
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        cut = finish in (FINISH_LENGTH, FINISH_CANCELLED) or e.pos >= len(raw) - 1
        status = "truncated" if cut and raw[0] in '{["' else "not_json"
        return {"status": status, "raw": text, "error": f"{e.msg} at char {e.pos}"}
    if schema is not None:
        from modeld.schemacheck import CheckFailed, reply_problem

        try:
            problem = reply_problem(schema, doc)
        except CheckFailed as e:
            # Bounded (a pattern that backtracks): the reply is the client's to judge.
            error = f"complete JSON, but it could not be checked against the schema: {e}"
            return {"status": "schema_unchecked", "raw": text, "error": error[:500]}
        if problem is not None:
            error = f"complete but does not match the schema {problem}"
            return {"status": "schema_mismatch", "raw": text, "error": error[:500]}
    return {"status": "complete", "raw": text, "error": None}


def calls_of(message: Any) -> list[ToolCall]:
    """The tool calls in a runtime message, as ``{"name", "arguments"}`` (an object)."""
    data = message.to_json() if hasattr(message, "to_json") else message
    calls = data.get("tool_calls") if isinstance(data, dict) else None
    out: list[ToolCall] = []
    for call in calls or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"_raw": args}
        if not isinstance(args, dict):
            args = {"_raw": args}
        out.append({"name": str(fn.get("name", "")), "arguments": args})
    return out


def _tools(descriptions: list[dict[str, Any]]) -> list[Any]:
    """The runtime's ``Tool`` objects for OpenAI tool descriptions; none is ever run here."""
    import litert_lm

    class Described(litert_lm.Tool):  # type: ignore[misc]
        def __init__(self, description: dict[str, Any]) -> None:
            self.description = description

        def get_tool_description(self) -> dict[str, Any]:
            return self.description

        def execute(self, param: Any) -> Any:
            # automatic_tool_calling=False: the runtime hands calls back instead.
            raise RuntimeError("modeld returns tool calls to the caller")

    return [Described(d) for d in descriptions]


# The prompt as it is, without the chat template (``/v1/completions``).
RAW_TEMPLATE = (
    "{{ bos_token }}{% set c = messages[-1]['content'] %}"
    "{% if c is string %}{{ c }}{% else %}{% for p in c %}{{ p['text'] }}{% endfor %}{% endif %}"
)


def text_of(message: Any) -> str:
    data = message.to_json() if hasattr(message, "to_json") else message
    content = data.get("content", "") if isinstance(data, dict) else str(data)
    if isinstance(content, str):
        return content
    return "".join(
        str(c.get("text", "")) for c in content if isinstance(c, dict) and c.get("type") == "text"
    )


class StopFilter:
    """Holds back text that could still become a stop string; cuts at the first match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False
        # The stop string the reply was cut at (the first to appear), once ``hit``.
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        found = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if found:
            cut, self.matched = min(found)
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        if self.keep <= 0:
            out, self.pending = self.pending, ""
            return out
        out = self.pending[: -self.keep] if len(self.pending) > self.keep else ""
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


# The top-k of a request that samples (a temperature above 0) and names none, where the
# file names none either: Ollama's and llama.cpp's default.
DEFAULT_TOP_K = 40


def sampler_fields(options: Options, defaults: dict[str, Any] | None) -> dict[str, Any]:
    """The runtime's ``SamplerConfig`` fields for ``options``: {} for the engine's own sampler.

    A ``SamplerConfig`` replaces the file's sampler whole, and what it leaves out takes the
    runtime's fallback: top_k 1, top_p 0.95, temperature 1, seed 0. So ``temperature: 0.8``
    alone was greedy (top_k 1), and the same reply every time (seed 0). Here the request's
    fields go over the file's defaults (``defaults``: ``sampler_defaults``); a request that
    samples gets ``DEFAULT_TOP_K`` where neither names a top-k, and a random seed where it
    names none, as an OpenAI client expects."""
    given = options.to("sampler")
    if not given:
        return {}
    out = _merged(given, defaults)
    greedy = out.get("temperature") == 0
    out.setdefault("top_k", 1 if greedy else DEFAULT_TOP_K)
    if "seed" not in out:
        out["seed"] = secrets.randbelow(1 << 31)
    return out


def _merged(given: dict[str, Any], defaults: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (defaults or {}).items() if v is not None} | given


Sampling = Literal["greedy", "random", "seeded"]


def sampling(options: Options, defaults: dict[str, Any] | None) -> Sampling:
    """How a reply's tokens are picked: ``"greedy"`` (the likeliest, whatever the sampler's
    state), ``"random"`` (sampled with a seed drawn for the request, ``sampler_fields``) or
    ``"seeded"`` (sampled with a fixed seed: the request's, or the runtime's for the engine's
    own sampler, so the same prompt gets the same reply). A kept conversation's sampler has
    drawn its earlier replies: it answers greedy and random requests as a fresh one would,
    not seeded ones."""
    given = options.to("sampler")
    out = _merged(given, defaults)
    if out.get("temperature") == 0 or out.get("top_k") == 1:
        return "greedy"
    return "random" if given and given.get("seed") is None else "seeded"


def sampler_defaults(path: str) -> dict[str, Any]:
    """The sampler the file names (its ``LlmMetadata``): ``top_k``, ``top_p``,
    ``temperature``, each None where it names none (0 for top_k and top_p is none)."""
    import litert_lm

    with litert_lm.ModelInfo(path) as info:
        params = info.llm.default_sampler_params if info.llm is not None else None
    if params is None:
        return {}
    top_k, top_p = params.top_k, params.top_p
    return {
        "top_k": int(top_k) if top_k else None,
        "top_p": float(top_p) if top_p else None,
        "temperature": None if params.temperature is None else float(params.temperature),
    }


def conversation_args(
    job: GenerateJob, defaults: dict[str, Any] | None = None
) -> tuple[dict[str, Any], Any, bool, dict[str, Any]]:
    """``create_conversation`` kwargs, the message to send, constrained, ``send`` kwargs;
    ``defaults``: the file's sampler (``sampler_defaults``)."""
    import litert_lm

    messages = list(job.messages)
    if not messages or messages[-1].get("role") not in ("user", "tool"):
        raise ValueError("the last message must come from the user (or carry tool results)")
    # Results of several calls go in as one tool message, one tool_response part each.
    first = len(messages) - 1
    last: Any = messages[-1]
    if last.get("role") == "tool":
        while first > 0 and messages[first - 1].get("role") == "tool":
            first -= 1
        parts = [part for m in messages[first:] for part in m.get("content") or []]
        last = {"role": "tool", "content": parts}
    system = "\n\n".join(
        str(m.get("content", "")) for m in messages[:first] if m.get("role") == "system"
    )
    history = [m for m in messages[:first] if m.get("role") != "system"]
    kwargs: dict[str, Any] = {}
    if system:
        kwargs["system_message"] = system
    if history:
        kwargs["messages"] = history
    shape = job.shape
    if shape.tools:
        kwargs["tools"] = _tools(list(shape.tools))
        kwargs["automatic_tool_calling"] = False
    if shape.raw:
        kwargs["chat_template"] = RAW_TEMPLATE
    sampler = sampler_fields(job.options, defaults)
    if sampler:
        kwargs["sampler_config"] = litert_lm.SamplerConfig(**sampler)
    kwargs.update(job.options.to("conversation"))
    send: dict[str, Any] = {}
    repetition = job.options.to("send")
    if repetition:
        send["repetition_penalty_config"] = litert_lm.RepetitionPenaltyConfig(**repetition)
    if shape.constrained:
        kwargs["constrained_decoding_config"] = litert_lm.ConstrainedDecodingConfig(
            enable=True, provider=litert_lm.LiteRtLmConstraintProviderType.LL_GUIDANCE
        )
    return kwargs, last, shape.constrained, send


# The template conversation renders prompts on the generate thread and, for a job that
# waits, on the ``ahead`` thread: two renders at once on one conversation can give a wrong
# prompt or raise UnicodeDecodeError (a test renders from two threads in a loop).
_RENDER_LOCK = threading.Lock()


def render(template: Any, message: Any) -> str:
    """``message`` rendered with the model's chat template by ``template`` (a conversation
    never sent to), one render at a time; "" when the runtime could not render it."""
    with _RENDER_LOCK:
        return str(template.render_message_to_string(message) or "")


def _preface(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What of a conversation's arguments (``conversation_args``) its prompt is rendered
    from besides the message sent: the system message and the earlier messages."""
    return {k: kwargs[k] for k in ("system_message", "messages") if k in kwargs}


def prompt_of(engine: Any, template: Any, kwargs: dict[str, Any], message: Any) -> str:
    """The prompt a conversation made with ``kwargs`` prefills when ``message`` is sent to
    it first: its system message and earlier messages, then ``message`` and the generation
    prompt, rendered with the model's template ("" when the runtime could not)."""
    preface = _preface(kwargs)
    if not preface:
        return render(template, message)
    # A conversation never sent to renders the whole preface with the message.
    conversation = engine.create_conversation(**preface)
    try:
        return render(conversation, message)
    finally:
        conversation.close()


def history_of(engine: Any, kwargs: dict[str, Any], messages: list[Any]) -> str:
    """The system message of ``kwargs`` and ``messages`` rendered as a conversation's
    preface, with no generation prompt: what a later prompt of the same conversation starts
    with ("" when the runtime could not render it). The runtime's private C API
    (``can_keep`` checks it)."""
    preface = _preface(kwargs) | {"messages": messages}
    conversation = engine.create_conversation(**preface)
    try:
        with _RENDER_LOCK:
            raw = conversation._lib.litert_lm_conversation_render_preface_to_string(
                conversation._ptr
            )
        return raw.decode("utf-8") if raw else ""
    finally:
        conversation.close()


def can_keep(engine: Any) -> bool:
    """Whether the runtime has what a kept conversation needs: a session's checkpoints
    (``checkpoint``) and a conversation's preface render (``history_of``). Both are its
    private C API: a runtime that moved them keeps no conversation
    (tests/engine/test_runner.py fails on such an upgrade)."""
    try:
        lib = engine._lib
        calls = (
            lib.litert_lm_session_save_checkpoint,
            lib.litert_lm_session_rewind_to_checkpoint,
        )
        preface = lib.litert_lm_conversation_render_preface_to_string
    except AttributeError:
        return False
    for call in calls:
        call.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        call.restype = ctypes.c_int
    preface.argtypes = [ctypes.c_void_p]
    preface.restype = ctypes.c_char_p
    return True


# The one checkpoint a kept session has: where its conversation's prompt so far ends.
_CHECKPOINT = b"kept"
# One token scored at a kept session's checkpoint (``rewind``).
_OVERWRITE = "a"


def checkpoint(session: Any) -> None:
    """Save a runtime session's checkpoint where it is (``can_keep`` set the calls up)."""
    _checkpoint_call(session._lib.litert_lm_session_save_checkpoint, session, "save")


def rewind(session: Any, *, decoded: bool) -> None:
    """Take a runtime session back to its checkpoint; ``decoded``: it decoded since, and
    nothing of that may be left to reuse.

    Rewound, the runtime keeps the tokens it processed past the checkpoint, and a later
    prefill whose tokens match them takes their cache entries as they are: entries the
    decode computed one token at a time, which are not quite those a prefill computes, so
    the reply after them was not a fresh conversation's (the real-size fixture, a reply
    of newlines sent back). One token scored at the checkpoint (its steps drop those
    tokens, and cost no prefill), and rewound, leaves nothing to match."""
    call = session._lib.litert_lm_session_rewind_to_checkpoint
    _checkpoint_call(call, session, "go back to")
    if decoded:
        session.run_text_scoring([_OVERWRITE])
        _checkpoint_call(call, session, "go back to")


def _checkpoint_call(call: Any, session: Any, what: str) -> None:
    if call(session._ptr, _CHECKPOINT) != 0:
        raise RuntimeError(f"the runtime could not {what} a session's checkpoint")


class PlainSession:
    """A reply to one plain user turn (``GenerateJob.session_plain``) on a bare runtime
    session, where making a conversation costs far more than a session, enough to matter for a
    short reply (docs/engines.md#the-runner-protocol); or to a conversation of plain turns
    (``session_turns``) given its whole prompt, which may then be kept for its next turn
    (``checkpointed``, ``resume``: docs/engines.md#conversations-that-continue).

    The prompt is the one a conversation prefills: the engine's template conversation (made
    once, never sent to) renders the turn with the model's chat template
    (``render_message_to_string``), and the session, told to apply no template of its own,
    prefills it and decodes, in one call (``send_message``) or chunk by chunk (``stream``).
    Same tokens in, same reply out: a test compares the two paths on the fixtures. It has
    the methods of a conversation that the runner calls.

    A cancel that reaches the runtime's session before its decode starts (during the
    prefill) leaves it so that ``run_decode_async`` never calls back: the runner waited
    for the reply's end for ever. So until the decode starts a cancel is only noted, and
    the decode is then not started; once it runs, the runtime's cancel ends it.
    """

    def __init__(
        self, engine: Any, template: Any, kwargs: dict[str, Any], message: Any = None
    ) -> None:
        """``message``: the turn, when the session is made ahead for a job that waits (its
        prompt is rendered now too; the job passes the same turn to ``send_message`` or
        ``stream``)."""
        self.template = template
        self.session = engine.create_session(
            apply_prompt_template=False,
            sampler_config=kwargs.get("sampler_config"),
            max_output_tokens=kwargs.get("max_output_tokens"),
        )
        self.lock = threading.Lock()  # orders a cancel against the start of the decode
        self.cancelled = False
        self.decoding = False
        # What the next prefill sends: the rendered prompt, or the part of it that a kept
        # session does not hold yet; "": ``message`` rendered by the template.
        self.prompt = render(template, message) if message is not None else ""
        # A kept session goes back to its checkpoint before the prefill (``resume``); one
        # that may be kept saves a checkpoint after it (``checkpointed``); ``decoded``: it
        # decoded past its checkpoint.
        self.resume = False
        self.checkpointed = False
        self.decoded = False

    def resume_at(self, prompt: str) -> None:
        """Set a kept session up for its conversation's next turn: back to its checkpoint,
        then ``prompt`` (what it does not hold yet), and a checkpoint after it again."""
        with self.lock:
            self.cancelled = self.decoding = False
        self.prompt, self.resume, self.checkpointed = prompt, True, True

    def _prefill(self, message: Any) -> None:
        prompt = self.prompt = self.prompt or render(self.template, message)
        if not prompt:
            # The runtime could not render it (it says "" then): a conversation tells why.
            raise RuntimeError("the template conversation rendered no prompt")
        if self.resume:
            rewind(self.session, decoded=self.decoded)
        self.session.run_prefill([prompt])
        if self.checkpointed:
            checkpoint(self.session)
            self.decoded = False

    def _begin(self, start: Callable[[], None] | None = None) -> bool:
        """Mark the decode begun, unless a cancel came first (then False). ``start`` runs
        under the lock, so that a cancel that comes meanwhile reaches a running decode."""
        with self.lock:
            if self.cancelled:
                return False
            self.decoding = self.decoded = True
            if start is not None:
                start()
        return True

    def send_message(self, message: Any) -> dict[str, Any]:
        self._prefill(message)
        if not self._begin():
            return {"role": "assistant", "content": ""}
        texts = self.session.run_decode().texts
        return {"role": "assistant", "content": texts[0] if texts else ""}

    def stream(self, message: Any, on_message: Callable[[dict[str, Any]], bool]) -> None:
        """The reply chunk by chunk, as ``stream_reply`` gives a conversation's: the
        runtime's callback calls ``on_message`` with ``{"content": text}`` on its own thread;
        the reply is cancelled once ``on_message`` returns True. A session's chunk is the
        bare text (no JSON): read through an incremental UTF-8 decoder, so that a character
        split over two chunks comes out whole. The callback is the runtime's private API
        (``Session._lib``, ``STREAM_CALLBACK_TYPE``); a runtime that moved it is driven
        through ``run_decode_async`` instead."""
        self._prefill(message)
        session = self.session
        try:
            from litert_lm._ffi import STREAM_CALLBACK_TYPE

            lib = session._lib
            run = lib.litert_lm_session_run_decode_async
            pointer = session._ptr
        except (ImportError, AttributeError):
            stopped = False
            if not self._begin():
                return
            for response in session.run_decode_async():
                # Read to the end after a cancel: the runtime is done with the session then.
                if not stopped and response.texts and on_message({"content": response.texts[0]}):
                    stopped = True
                    session.cancel_process()
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        reply = _Reply(lib, on_message, lambda raw: {"content": decoder.decode(raw)})
        c_callback = STREAM_CALLBACK_TYPE(reply.callback)
        # Kept on the session, as the runtime's own code does, while the runtime may call it.
        session._current_callback = c_callback

        def start() -> None:
            if run(pointer, c_callback, None) != 0:
                raise RuntimeError("litert_lm_session_run_decode_async failed")

        if self._begin(start):
            reply.wait(session.cancel_process)

    def get_benchmark_info(self) -> Any:
        return self.session.get_benchmark_info()

    def cancel_process(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.decoding:
                self.session.cancel_process()

    def close(self) -> None:
        self.session.close()


# The runtime's own end-of-reply errors: the reply is over, nothing failed.
_QUIET_ENDS = ("CANCELLED", "Max number of tokens reached")
# The runtime's JSON for a chunk of plain text, around the text: most chunks of a reply.
_TEXT_HEAD = b'{"role":"assistant","content":[{"type":"text","text":"'
_TEXT_TAIL = b'"}]}'


def parse_chunk(raw: bytes) -> dict[str, Any]:
    """One streamed chunk's message. A chunk of plain text with nothing escaped in it is
    read without ``json.loads``, which was half of the callback's time a token; any other
    chunk (escapes, tool calls, other parts) goes through ``json.loads``."""
    if raw.startswith(_TEXT_HEAD) and raw.endswith(_TEXT_TAIL):
        body = raw[len(_TEXT_HEAD) : -len(_TEXT_TAIL)]
        if b"\\" not in body and b'"' not in body:
            text = body.decode("utf-8", "replace")
            return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    text = raw.decode("utf-8", "replace")
    try:
        message: dict[str, Any] = json.loads(text)
    except json.JSONDecodeError:
        return {"role": "assistant", "content": [{"type": "text", "text": text}]}
    return message


# What ``_create_optional_args`` takes besides the message and the response format.
_OPTIONAL_ARGS = (
    "repetition_penalty_config",
    "no_repeat_ngram_config",
    "suppress_tokens_config",
    "max_output_tokens",
    "thinking_config",
)


# Threads of the runtime that keep a Python thread state between stream callbacks.
KEPT_THREADS: set[int] = set()


def keep_thread_state() -> None:
    """On a thread the runtime started, keep the Python thread state of this callback for
    the next ones.

    ctypes calls a callback on a thread Python did not start through PyGILState_Ensure and
    PyGILState_Release, which make a thread state for the call and free it after: a cost
    paid on every token of a streamed reply. One more PyGILState_Ensure, never released, keeps
    the state: ctypes' own Release then only lets the GIL go. One state per runtime thread
    is kept for the life of the process (the runner's).
    """
    ident = threading.get_ident()
    if ident not in KEPT_THREADS:
        KEPT_THREADS.add(ident)
        ctypes.pythonapi.PyGILState_Ensure()


class _Reply:
    """One streamed reply between the runtime's callback thread and the thread that waits."""

    def __init__(
        self,
        lib: Any,
        on_message: Callable[[dict[str, Any]], bool],
        parse: Callable[[bytes], dict[str, Any]] = parse_chunk,
    ) -> None:
        self.parse = parse  # a chunk's bytes -> its message
        self.get_error = lib.litert_lm_stream_chunk_get_error
        self.get_text = lib.litert_lm_stream_chunk_get_text
        self.is_final = lib.litert_lm_stream_chunk_is_final
        self.on_message = on_message
        self.cv = threading.Condition(threading.Lock())
        self.over = False  # the runtime is done with this reply
        self.stop = False  # on_message asked to stop
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        with self.cv:
            self.over = True
            self.error = self.error or error
            self.cv.notify()

    def callback(self, _data: Any, chunk: Any) -> None:
        """The runtime's stream callback, on its own thread."""
        try:
            keep_thread_state()
            err = self.get_error(chunk)
            if err:
                text = err.decode("utf-8", "replace")
                self.finish(None if any(q in text for q in _QUIET_ENDS) else RuntimeError(text))
                return
            raw = self.get_text(chunk)
            final = bool(self.is_final(chunk))
            if raw and not self.stop and self.on_message(self.parse(raw)):
                with self.cv:
                    self.stop = True
                    self.cv.notify()
            if final:
                self.finish()
        except BaseException as e:  # never unwind into the runtime's thread
            self.stop = True
            self.finish(e)

    def wait(self, cancel: Callable[[], None]) -> None:
        """Until the runtime is done; ``cancel`` it once ``on_message`` asks to stop."""
        cancelled = False
        with self.cv:
            while not self.over:
                if self.stop and not cancelled:
                    cancelled = True
                    self.cv.release()
                    try:
                        cancel()
                    finally:
                        self.cv.acquire()
                    continue
                self.cv.wait()
        if self.error is not None:
            raise self.error


def stream_reply(
    conversation: Any,
    message: Any,
    send_kwargs: dict[str, Any],
    on_message: Callable[[dict[str, Any]], bool],
) -> None:
    """Stream one reply, calling ``on_message`` with each chunk; stop when it returns True.

    ``send_message_async`` hands every chunk from the runtime's thread to the caller's
    through a queue, as a ``Message`` object: two thread switches and a Python object per
    token, more than a small model's decode step takes. Here the runtime's
    callback parses the chunk and calls ``on_message`` itself, on the runtime's thread,
    and this thread only waits for the end. The callback path is the runtime's private
    API (``Conversation._lib``, ``_create_optional_args``, ``STREAM_CALLBACK_TYPE``): a
    runtime that moved it is driven through ``send_message_async`` instead. A bare session
    (``PlainSession``) streams its own way.
    """
    if isinstance(conversation, PlainSession):
        conversation.stream(message, on_message)
        return
    try:
        from litert_lm._ffi import STREAM_CALLBACK_TYPE
        from litert_lm.conversation import normalize_message

        send = conversation._lib.litert_lm_conversation_send_message_stream
        reply = _Reply(conversation._lib, on_message)
        make_args = conversation._create_optional_args
        drop_args = conversation._delete_optional_args
        resolve_format = conversation._resolve_response_format
    except (ImportError, AttributeError):
        _stream_async(conversation, message, send_kwargs, on_message)
        return
    current = normalize_message(message)
    c_callback = STREAM_CALLBACK_TYPE(reply.callback)
    # Kept on the conversation, as the runtime's own code does, while the runtime may call it.
    conversation._current_callback = c_callback
    args = make_args(
        **{name: send_kwargs.get(name) for name in _OPTIONAL_ARGS},
        current_message=current,
        response_format=resolve_format(current, send_kwargs.get("response_format")),
    )
    try:
        context = json.dumps(getattr(conversation, "extra_context", {}))
        res = send(conversation._ptr, json.dumps(current), context, args, c_callback, None)
    finally:
        drop_args(args)
    if res != 0:
        raise RuntimeError("litert_lm_conversation_send_message_stream failed")
    reply.wait(conversation.cancel_process)


def _stream_async(
    conversation: Any,
    message: Any,
    send_kwargs: dict[str, Any],
    on_message: Callable[[dict[str, Any]], bool],
) -> None:
    """``stream_reply`` through the runtime's public ``send_message_async``."""
    for msg in conversation.send_message_async(message, **send_kwargs):
        data = msg.to_json() if hasattr(msg, "to_json") else msg
        if on_message(data):
            conversation.cancel_process()
            break
