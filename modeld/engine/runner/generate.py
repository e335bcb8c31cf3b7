"""One generation inside a runner: conversation, streamed tokens, stop strings, timings.

Runs on the runner's generate thread. ``send_message_async`` is a blocking generator over a
queue filled by the runtime's thread, so driving it from this thread keeps the runner's
socket reader free to receive ``cancel``. Like ``runner.py`` it imports nothing heavy at
module level.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from modeld.engine.runner.child import _Child

FINISH_STOP = "stop"  # the model ended its reply (or a stop string matched)
FINISH_LENGTH = "length"  # max_tokens or the engine's token window ran out
FINISH_CANCELLED = "cancelled"


def classify_json(text: str, finish: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON diagnostics: complete, empty, truncated, not_json or schema_mismatch.

    "Max number of tokens reached" ends a reply silently in LiteRT-LM 0.18, so a reply that
    stops at the limit and does not parse is *truncated*, not a runtime failure. With a
    ``schema`` (a strict ``json_schema`` request), a reply that parses is also checked
    against it: *schema_mismatch* is complete JSON that does not match.
    """
    raw = text.strip()
    if not raw:
        status = "truncated" if finish == FINISH_LENGTH else "empty"
        return {"status": status, "raw": text, "error": None}
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        cut = finish in (FINISH_LENGTH, FINISH_CANCELLED) or e.pos >= len(raw) - 1
        status = "truncated" if cut and raw[0] in '{["' else "not_json"
        return {"status": status, "raw": text, "error": f"{e.msg} at char {e.pos}"}
    if schema is not None:
        import jsonschema

        found = jsonschema.exceptions.best_match(
            jsonschema.validators.validator_for(schema)(schema).iter_errors(doc)
        )
        if found is not None:
            where = "/".join(str(p) for p in found.absolute_path) or "(root)"
            error = f"complete but does not match the schema at {where}: {found.message}"
            return {"status": "schema_mismatch", "raw": text, "error": error[:500]}
    return {"status": "complete", "raw": text, "error": None}


def _calls_of(message: Any) -> list[dict[str, Any]]:
    """The tool calls in a runtime message, as ``{"name", "arguments"}`` (an object)."""
    data = message.to_json() if hasattr(message, "to_json") else message
    calls = data.get("tool_calls") if isinstance(data, dict) else None
    out = []
    for call in calls or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {"_raw": args}
        out.append({"name": str(fn.get("name", "")), "arguments": args or {}})
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


def _text_of(message: Any) -> str:
    data = message.to_json() if hasattr(message, "to_json") else message
    content = data.get("content", "") if isinstance(data, dict) else str(data)
    if isinstance(content, str):
        return content
    return "".join(
        str(c.get("text", "")) for c in content if isinstance(c, dict) and c.get("type") == "text"
    )


class _StopFilter:
    """Holds back text that could still become a stop string; cuts at the first match."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
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


def _conversation_args(
    child: _Child, job: dict[str, Any]
) -> tuple[dict[str, Any], Any, bool, dict[str, Any]]:
    """``create_conversation`` kwargs, the message to send, constrained, ``send`` kwargs."""
    import litert_lm

    messages = list(job.get("messages") or [])
    if not messages or messages[-1].get("role") not in ("user", "tool"):
        raise ValueError("the last message must come from the user (or carry tool results)")
    # Results of several calls go in as one tool message, one tool_response part each.
    first = len(messages) - 1
    last = messages[-1]
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
    if job.get("tools"):
        kwargs["tools"] = _tools(job["tools"])
        kwargs["automatic_tool_calling"] = False
    if job.get("raw"):
        kwargs["chat_template"] = RAW_TEMPLATE
    names = ("top_k", "top_p", "temperature", "seed")
    sampler = {k: job[k] for k in names if job.get(k) is not None}
    if sampler:
        kwargs["sampler_config"] = litert_lm.SamplerConfig(**sampler)
    if job.get("max_tokens"):
        kwargs["max_output_tokens"] = int(job["max_tokens"])
    send: dict[str, Any] = {}
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    repetition = {k: float(job[k]) for k in penalties if job.get(k) is not None}
    if repetition:
        send["repetition_penalty_config"] = litert_lm.RepetitionPenaltyConfig(**repetition)
    constrained = job.get("format") == "json" or job.get("schema") is not None
    if constrained:
        kwargs["constrained_decoding_config"] = litert_lm.ConstrainedDecodingConfig(
            enable=True, provider=litert_lm.LiteRtLmConstraintProviderType.LL_GUIDANCE
        )
    return kwargs, last, constrained, send


def _open(child: _Child, rid: int, kwargs: dict[str, Any], constrained: bool) -> tuple[Any, bool]:
    """A new conversation for ``rid``, registered so that ``cancel`` can reach it."""
    try:
        conversation = child.engine.create_conversation(**kwargs)
    except RuntimeError:
        if not constrained:
            raise
        # Constrained decoding needs the model's tokenizer support; fall back to plain.
        kwargs.pop("constrained_decoding_config")
        constrained = False
        conversation = child.engine.create_conversation(**kwargs)
    with child.current_lock:
        child.current = (rid, conversation)
    if rid in child.cancelled:
        conversation.cancel_process()
    return conversation, constrained


def _whole_reply(child: _Child, rid: int, conversation: Any, last: Any, **kw: Any) -> Any:
    """The reply message in one blocking call, or None when the runtime refused it.

    ``send_message`` is ~1 ms cheaper than ``send_message_async`` per request (no callback
    queue and no message object per token): what a non-streamed request costs, since its
    client sees nothing before the end anyway.
    """
    if rid in child.cancelled:
        return {"content": ""}
    try:
        return conversation.send_message(last, **kw)
    except RuntimeError:
        # Cancelled (the client left): nobody reads the text. Any other failure is retried
        # by the streaming path, which carries the runtime's own reason in its exception.
        return {"content": ""} if rid in child.cancelled else None


def run_generation(child: _Child, job: dict[str, Any]) -> None:  # noqa: PLR0912, PLR0915
    """Stream one reply for ``job`` to the parent, then a final record with timings.

    With ``"stream": false`` no token frame is sent: the final record carries the whole
    ``text`` (one frame, one wake-up of the daemon), and without stop strings the reply is
    made by one blocking call.
    """
    import litert_lm

    rid = job["id"]
    streamed = job.get("stream", True) is not False
    started = time.perf_counter()
    child.clear_error()
    kwargs, last, constrained, send_kwargs = _conversation_args(child, job)
    conversation, constrained = _open(child, rid, kwargs, constrained)
    if constrained:
        schema = job.get("schema") or {"type": "object"}
        send_kwargs["response_format"] = litert_lm.ResponseFormat.json(schema)
    stops = _StopFilter([str(s) for s in job.get("stop") or []])
    first_at: float | None = None
    chunks = 0
    text_parts: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    whole = None
    asked = time.perf_counter()
    if not streamed and not stops.stops:
        whole = _whole_reply(child, rid, conversation, last, **send_kwargs)
        if whole is None:
            conversation.close()
            child.clear_error()
            conversation, constrained = _open(child, rid, kwargs, constrained)
    if whole is not None:
        text_parts.append(_text_of(whole))
        tool_calls += _calls_of(whole)
    else:
        for message in conversation.send_message_async(last, **send_kwargs):
            now = time.perf_counter()
            if first_at is None:
                first_at = now
            chunks += 1
            tool_calls += _calls_of(message)
            piece = stops.feed(_text_of(message))
            if piece:
                text_parts.append(piece)
                if streamed:
                    child.send_token(rid, piece)
            if stops.hit:
                conversation.cancel_process()
                break
    tail = stops.flush()
    if tail:
        text_parts.append(tail)
        if streamed:
            child.send_token(rid, tail)
    ended = time.perf_counter()
    cancelled = rid in child.cancelled and not stops.hit
    info = None
    try:
        info = conversation.get_benchmark_info()
    except RuntimeError:
        info = None
    prefill_tokens = info.last_prefill_token_count if info else 0
    decode_tokens = info.last_decode_token_count if info else chunks
    max_out = job.get("max_tokens")
    window = child.max_tokens
    if cancelled:
        finish = FINISH_CANCELLED
    elif stops.hit:
        finish = FINISH_STOP
    elif (max_out and decode_tokens >= int(max_out)) or (
        window and prefill_tokens + decode_tokens >= int(window)
    ):
        finish = FINISH_LENGTH
    else:
        finish = FINISH_STOP
    ttft = (first_at - started) if first_at is not None else None
    decode_seconds = (ended - first_at) if first_at is not None else 0.0
    prefill = (
        prefill_tokens / info.last_prefill_tokens_per_second
        if info and info.last_prefill_tokens_per_second
        else None
    )
    if whole is not None and prefill is not None and info and info.last_decode_tokens_per_second:
        # One blocking call shows no first token: setup, prefill and one decode step.
        ttft = (asked - started) + prefill + 1 / info.last_decode_tokens_per_second
    timings = {
        "prefill": prefill,
        "first_token": ttft,
        "decode_tokens_per_second": (
            info.last_decode_tokens_per_second
            if info and info.last_decode_tokens_per_second
            else ((chunks - 1) / decode_seconds if chunks > 1 and decode_seconds > 0 else None)
        ),
        "generate": ended - started,
    }
    # No PSS here: reading smaps_rollup costs ~2.4 ms on this process, so the daemon
    # measures it from /proc off the request path.
    final: dict[str, Any] = {
        "id": rid,
        "done": True,
        "finish": finish,
        "prompt_tokens": prefill_tokens,
        "tokens": decode_tokens,
        "timings": timings,
        "constrained": constrained,
    }
    if not streamed:
        final["text"] = "".join(text_parts)
    if tool_calls:
        final["tool_calls"] = tool_calls
    if job.get("format") == "json" or job.get("schema") is not None:
        strict = job.get("schema") if job.get("strict") else None
        final["json"] = classify_json("".join(text_parts), finish, strict)
    child.send(final)
    # After the final record, not before: closing is the runner's business, not the
    # client's wait (the next job runs on this same thread, so it starts on a closed one).
    conversation.close()
