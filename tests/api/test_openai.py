"""The OpenAI wire format on the socket, with the ``openai`` client, and validated bodies."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import httpx
import litert_lm
import openai
import pytest
from langchain_openai import ChatOpenAI
from PIL import Image
from pydantic import BaseModel, SecretStr

from modeld.api.openai import _Reply
from modeld.engine.runner.generate import calls_of
from modeld.engine.runner.job import Done
from modeld.engine.views import Final, PhaseTimings
from tests.support.daemon import InProcessDaemon, daemon_with_models, engine_turns


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with tiny-text, vision-cpu-ok and gemma3n-like installed."""
    async with daemon_with_models(clean_env, ("tiny-text", "vision-cpu-ok", "gemma3n-like")) as d:
        yield d


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (900, 300), (200, 30, 30)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


_TIMINGS: PhaseTimings = {
    "image_prepare": 0.0,
    "load": 0.0,
    "engine_create": 0.0,
    "warm_up": 0.0,
    "queue": 0.0,
    "prefill": None,
    "first_token": None,
    "decode_tokens_per_second": None,
    "total": 0.0,
}


async def test_models_lists_installed_in_openai_shape(oa: openai.AsyncOpenAI) -> None:
    """``/v1/models`` lists the installed models as OpenAI model objects."""
    page = await oa.models.list()
    assert sorted(m.id for m in page.data) == ["gemma3n-like", "tiny-text", "vision-cpu-ok"]
    assert {m.owned_by for m in page.data} == {"modeld"}
    assert all(m.object == "model" and m.created > 0 for m in page.data)
    assert (await oa.models.retrieve("tiny-text")).id == "tiny-text"
    with pytest.raises(openai.NotFoundError):
        await oa.models.retrieve("not-installed")


async def test_retrieving_a_model_tells_unknown_from_not_installed(
    oa: openai.AsyncOpenAI,
) -> None:
    """``/v1/models/{id}``: an id the catalog does not know is ``model_not_found``, as a
    completion says; a catalog entry that is not installed is ``model_not_installed``."""
    with pytest.raises(openai.NotFoundError) as unknown:
        await oa.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as completion:
        await oa.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.code == completion.value.code == "model_not_found"
    assert unknown.value.message == completion.value.message
    with pytest.raises(openai.NotFoundError) as absent:
        await oa.models.retrieve("gemma-4-E2B-it")  # a bundled entry, never installed here
    assert absent.value.code == "model_not_installed"
    assert "`modeld pull gemma-4-E2B-it`" in str(absent.value.message)


async def test_completion_with_system_and_history_reports_usage(oa: openai.AsyncOpenAI) -> None:
    """A non-streamed completion with system and multi-turn messages carries usage counts."""
    r = await oa.chat.completions.create(
        model="tiny-text",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": [{"type": "text", "text": "again"}]},
        ],
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        seed=7,
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "tiny-text"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"  # random weights never end the reply in 5 tokens
    assert r.usage is not None
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


async def test_max_completion_tokens_wins_and_seed_repeats(oa: openai.AsyncOpenAI) -> None:
    """``max_completion_tokens`` bounds the reply; the same seed gives the same text."""
    kw: dict[str, Any] = {"model": "tiny-text", "messages": [{"role": "user", "content": "x"}]}
    one = await oa.chat.completions.create(**kw, max_completion_tokens=3, max_tokens=9, seed=1)
    two = await oa.chat.completions.create(**kw, max_completion_tokens=3, seed=1)
    assert one.usage is not None and one.usage.completion_tokens == 3
    assert one.choices[0].message.content == two.choices[0].message.content


async def test_stream_chunks_finish_usage_and_done(oa: openai.AsyncOpenAI) -> None:
    """A streamed completion: role first, content deltas, a finish chunk, usage, then [DONE]."""
    stream = await oa.chat.completions.create(
        model="tiny-text",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1


async def test_non_streamed_matches_streamed_text_and_keeps_timings(
    oa: openai.AsyncOpenAI,
) -> None:
    """The whole-reply path gives the streamed text, usage and phase timings; stop cuts it."""
    kw: dict[str, Any] = {
        "model": "tiny-text",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "seed": 4,
    }
    stream = await oa.chat.completions.create(**kw, stream=True)
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    whole = await oa.chat.completions.create(**kw)
    assert whole.choices[0].message.content == streamed and len(streamed) > 4
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    timings = (whole.model_extra or {})["modeld"]["timings"]
    assert 0 < timings["first_token"] <= timings["total"]
    assert timings["image_prepare"] == 0.0  # no image in this request
    assert timings["prefill"] is not None and timings["decode_tokens_per_second"] > 0
    cut = await oa.chat.completions.create(**kw, stop=[streamed[2:4]])
    text = cut.choices[0].message.content or ""
    assert streamed.startswith(text) and streamed[2:4] not in text
    assert cut.choices[0].finish_reason == "stop"


async def test_raw_sse_ends_with_done(http: httpx.AsyncClient) -> None:
    """The wire format: ``data: {...}`` events and a final ``data: [DONE]``."""
    body = {
        "model": "tiny-text",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
    }
    r = await http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_json_object_uses_native_json_format(oa: openai.AsyncOpenAI) -> None:
    """``response_format: json_object`` runs the native ``format: "json"`` path."""
    r = await oa.chat.completions.create(
        model="tiny-text",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=6,
        response_format={"type": "json_object"},
    )
    extra = r.model_extra or {}
    assert extra["modeld"]["json"]["status"] in ("complete", "empty", "truncated", "not_json")
    assert extra["modeld"]["engine"] == "tiny-text:cpu"


async def test_image_data_url_takes_the_image_path(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """An ``image_url`` data URL takes the native image path: vision plan, same outcome.

    vision-cpu-ok cannot take an image (no embedder for image tokens): the plan's image
    probe fails on the first image request, so both paths get the same 422 with the
    runtime's reason, before any runner starts.
    """
    url = png_data_url()
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url}},
        ],
    }
    oa_resp = await http.post(
        "/v1/chat/completions",
        json={"model": "vision-cpu-ok", "messages": [message], "max_tokens": 3},
    )
    native = await http.post(
        "/api/modeld/generate",
        json={
            "model": "vision-cpu-ok",
            "prompt": "what is this?",
            "images": [url.split(",", 1)[1]],
            "max_tokens": 3,
        },
    )
    assert (oa_resp.status_code, native.status_code) == (422, 422), (oa_resp.text, native.text)
    assert oa_resp.json()["error"]["code"] == native.json()["error"]["code"]
    assert oa_resp.json()["error"]["code"] == "image_probe_failed"
    assert oa_resp.json()["error"]["type"] == "invalid_request_error"
    assert oa_resp.json()["error"]["message"] == native.json()["error"]["message"]
    engines = (await http.get("/api/engines")).json()["engines"]
    assert engines == []
    # A file whose vision encoder needs gpu is refused before any runner starts.
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await oa.chat.completions.create(model="gemma3n-like", messages=[message])  # type: ignore[list-item]
    assert refused.value.code == "backend_constraint"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"max_tokens": 0}, 400, '"max_tokens": must be ≥ 1'),
        ({"temperature": "hot"}, 400, '"temperature": must be a number'),
        ({"top_p": 1.5}, 400, '"top_p": must be ≤ 1'),
        ({"model": "../etc"}, 400, '"model": is not a valid model id'),
        ({"model": "nope"}, 404, "no model 'nope'"),
        ({"messages": []}, 400, '"messages": takes at least 1 item, got 0'),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, '"messages[0].role"'),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c1"}]},
            400,
            '"messages[0].tool_call_id": must name a call of an earlier assistant message',
        ),
        ({"n": 2}, 400, '"n": modeld makes one choice per request'),
        ({"logprobs": True}, 400, '"logprobs": log probabilities are not available'),
        ({"top_logprobs": 2}, 400, '"top_logprobs": log probabilities'),
        ({"logit_bias": {"50": 10}}, 400, '"logit_bias": the LiteRT-LM runtime takes no'),
        ({"functions": [{"name": "f"}]}, 400, '"functions": use tools instead'),
        ({"audio": {"voice": "x"}}, 400, '"audio": modeld answers with text only'),
        ({"store": True}, 400, '"store": modeld stores no completions'),
        ({"frobnicate": 1}, 400, '"frobnicate": unknown field; allowed:'),
        ({"presence_penalty": 3}, 400, '"presence_penalty": must be ≤ 2'),
        ({"response_format": {"type": "json_schema"}}, 400, '"response_format.json_schema" is'),
        ({"tools": [{"type": "function"}]}, 400, '"tools[0].function": is required'),
        ({"tool_choice": "auto"}, 400, '"tool_choice": needs "tools"'),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            400,
            "'x' is not one of the tools",
        ),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            400,
            "cannot be combined with a required tool call",
        ),
        ({"stop": 3}, 400, '"stop": must be a string or a list of strings'),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}],
                    }
                ]
            },
            400,
            "only data URLs",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            400,
            "the last message must have role user (or tool",
        ),
    ],
)
async def test_bad_chat_bodies_get_openai_errors(
    http: httpx.AsyncClient, body: dict[str, Any], status: int, needle: str
) -> None:
    """Each bad field is named with why, in modeld's error shape plus OpenAI's ``type``."""
    full = {"model": "tiny-text", "messages": [{"role": "user", "content": "x"}], **body}
    r = await http.post("/v1/chat/completions", json=full)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["code"], str)


async def test_openai_client_raises_typed_errors(oa: openai.AsyncOpenAI) -> None:
    """The openai client maps modeld's statuses to its exception classes."""
    with pytest.raises(openai.BadRequestError) as bad:
        await oa.chat.completions.create(
            model="tiny-text", messages=[{"role": "user", "content": "x"}], max_tokens=0
        )
    assert bad.value.code == "bad_request"
    with pytest.raises(openai.NotFoundError):
        await oa.chat.completions.create(
            model="unknown-model", messages=[{"role": "user", "content": "x"}]
        )


@pytest.mark.parametrize(
    ("method", "path", "body", "needle"),
    [
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "max_tokens": 0},
            "≥ 1",
        ),
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "tokens": 3},
            "unknown",
        ),
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            'either "prompt" (a string) or "messages" (a list), not both',
        ),
        ("POST", "/api/modeld/generate", {"model": "tiny-text", "prompt": 5}, '"prompt": must be'),
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "images": ["*"]},
            "base64",
        ),
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "keep_alive": []},
            "30s",
        ),
        ("POST", "/api/engines", {"model": "tiny-text", "pin": "yes"}, '"pin": must be true'),
        ("POST", "/api/engines", {"model": "tiny-text", "backends": {"main": "tpu"}}, "main"),
        ("POST", "/api/models/import", {"path": "relative.litertlm"}, "absolute path"),
        ("POST", "/api/models/import", {"path": "/x.litertlm", "id": "../x"}, "valid model id"),
        ("POST", "/api/models/tiny-text/pull", {"detach": 1}, '"detach": must be true'),
        ("GET", "/api/models/..%2f..%2fetc", None, "not a valid model id"),
        ("DELETE", "/api/downloads/" + "x" * 300, None, "not a valid model id"),
        ("DELETE", "/api/engines/a%00b", None, "not an engine or model id"),
        ("POST", "/api/modeld/generate", None, "body is empty"),
    ],
)
async def test_native_bodies_and_ids_are_validated(
    http: httpx.AsyncClient, method: str, path: str, body: Any, needle: str
) -> None:
    """Native routes answer 400 naming the field (or the id) and why."""
    r = await http.request(method, path, json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    assert needle in r.json()["error"]["message"], r.json()


CHAT = "/v1/chat/completions"
CALL: Any = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{nope"}}


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (
            CHAT,
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            400,
            '"tools[0].function.name": is not a valid function name (1 to 64 letters, digits, '
            "_ . or -)",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": 5}]},
            400,
            '"messages[0].content": must be a string or a list of parts ({"type": "text", ...} '
            'or {"type": "image_url", ...})',
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            400,
            "\"messages[0].content[0].type\": must be 'text' or 'image_url', not 'input_audio'",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            '"messages[0].content[0].text": is required',
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            400,
            '"messages[0].content[0].text": must be a string',
        ),
        (
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                ]
            },
            400,
            '"messages[1].tool_calls[0].function.arguments": not JSON (Expecting property name '
            "enclosed in double quotes)",
        ),
        (
            "/v1/completions",
            {"prompt": ["a", "b"]},
            400,
            '"prompt": takes one prompt per request (got 2); send a string',
        ),
        (
            "/api/modeld/generate",
            {"prompt": None},
            400,
            '"prompt" (a string) or "messages" (a list) is required; send one',
        ),
        (
            "/api/engines",
            {"backends": {"vision": "gpu"}},
            422,
            "model tiny-text has no vision encoder, so backends.vision does not apply; load it "
            "without backends.vision",
        ),
    ],
    ids=[
        "tool-name",
        "content-type",
        "audio-part",
        "part-field",
        "part-tag-is-a-key",
        "tool-arguments",
        "prompt-list",
        "no-prompt",
        "load-vision",
    ],
)
async def test_validation_messages_name_the_field_in_the_clients_terms(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    """A refusal names the field as the client wrote it and what it must be: no pydantic
    union branch (``list[tagged-union[...]]``), no other field's wording, one line a field."""
    full = {"model": "tiny-text", **body}
    if path == CHAT:
        full = {"messages": [{"role": "user", "content": "x"}], **full}
    full = {k: v for k, v in full.items() if v is not None}
    r = await http.post(path, json=full)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"] == message


@pytest.mark.parametrize("path", ["/api/modeld/generate", "/v1/chat/completions"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
async def test_a_temperature_that_is_not_finite_says_so_once(
    http: httpx.AsyncClient, path: str, value: str
) -> None:
    """A NaN or infinite temperature (JSON as Python writes it) is a 400 saying it must be a
    finite number, not \"must be an integer or must be a finite number\"."""
    fields = '"prompt": "x"'
    if path.startswith("/v1/"):
        fields = '"messages": [{"role": "user", "content": "x"}]'
    body = '{"model": "tiny-text", ' + fields + ', "temperature": ' + value + "}"
    r = await http.post(path, content=body.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == '"temperature": must be a finite number'


LONE = '"a\\ud800b"'  # the JSON escape of an unpaired surrogate
PAIRED = '"a\\ud83d\\ude00b"'  # the JSON escapes of one emoji


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        (
            "/api/modeld/generate",
            '{"model": "tiny-text", "prompt": TEXT, "max_tokens": 2}',
            '"prompt"',
        ),
        (
            "/api/modeld/generate",
            '{"model": "tiny-text", "prompt": "x", "system": TEXT, "max_tokens": 2}',
            '"system"',
        ),
        (
            "/v1/chat/completions",
            '{"model": "tiny-text", "max_tokens": 2, "messages": [{"role": "system", '
            '"content": TEXT}, {"role": "user", "content": "x"}]}',
            '"messages[0].content"',
        ),
        (
            "/v1/completions",
            '{"model": "tiny-text", "prompt": TEXT, "max_tokens": 2}',
            '"prompt"',
        ),
    ],
    ids=["generate-prompt", "generate-system", "chat-system", "completions-prompt"],
)
async def test_an_unpaired_surrogate_is_a_400_naming_the_field(
    http: httpx.AsyncClient, path: str, body: str, field: str
) -> None:
    """A lone UTF-16 surrogate, escaped or as its UTF-8 bytes, is no text the runtime takes:
    a 400 naming the field, not a 500 from the engine; a pair (an emoji) is text and served."""
    for text in (LONE.encode(), b'"a\xed\xa0\x80b"'):
        r = await http.post(path, content=body.encode().replace(b"TEXT", text))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            f"{field}: is not valid text: it holds an unpaired UTF-16 surrogate \\ud800; "
            "send valid UTF-8"
        )
    r = await http.post(path, content=body.replace("TEXT", PAIRED).encode())
    assert r.status_code == 200, r.text


async def test_daemon_serves_after_bad_requests(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """A burst of invalid bodies leaves valid requests working."""
    for raw in (b"{", b"[]", b"null", b'{"model": 1}', b"\xff\xfe"):
        r = await http.post("/v1/chat/completions", content=raw)
        assert r.status_code == 400, r.text
    r2 = await oa.chat.completions.create(
        model="tiny-text", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    assert r2.usage is not None and r2.usage.completion_tokens == 1


# --- runtime features: schemas, tools, sampling, completions, embeddings --------------------------


class Verdict(BaseModel):
    """A reply whose every value is short, so random weights finish it within the limit."""

    ok: bool
    color: Literal["red", "blue"]


VERDICT_SCHEMA: Any = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
}
SCHEMA_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "verdict", "schema": VERDICT_SCHEMA, "strict": True},
}
ASK: Any = [{"role": "user", "content": "weather?"}]


async def test_json_schema_constrains_the_reply(oa: openai.AsyncOpenAI) -> None:
    """``json_schema`` runs the runtime's constrained decoding: the random model's reply is
    JSON that matches the schema, streamed or not, and strict checks it (status complete)."""
    r = await oa.chat.completions.create(
        model="tiny-text",
        messages=ASK,
        max_tokens=80,
        response_format=SCHEMA_FORMAT,
    )
    content = r.choices[0].message.content or ""
    Verdict.model_validate_json(content)
    assert (r.model_extra or {})["modeld"]["json"]["status"] == "complete"
    assert r.choices[0].finish_reason == "stop"
    stream = await oa.chat.completions.create(
        model="tiny-text",
        messages=ASK,
        max_tokens=80,
        seed=3,
        stream=True,
        response_format=SCHEMA_FORMAT,
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    Verdict.model_validate_json(streamed)


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "nonsense"}, '"response_format.json_schema.schema.type": is not a valid JSON'),
        ({"type": "string", "pattern": "(["}, 'schema.pattern": is not a valid JSON schema'),
        ({"$ref": "http://example.com/s.json"}, "points outside the schema, and modeld fetches"),
        # What only the runtime finds: unsatisfiable, a pattern its regex engine does not take.
        (
            {"type": "integer", "minimum": 5, "maximum": 3},
            "the runtime cannot constrain the reply to this schema (Unsatisfiable schema: "
            "minimum (5) is greater than maximum (3)); change the schema",
        ),
        ({"type": "string", "pattern": "(?<=a)b"}, "look-around, including look-ahead"),
    ],
    ids=["invalid", "bad-regex", "remote-ref", "unsatisfiable", "regex-the-runtime-refuses"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_schema_that_cannot_constrain_is_a_400_naming_response_format(
    oa: openai.AsyncOpenAI, schema: dict[str, Any], why: str, stream: bool
) -> None:
    """A schema that is none, or that the runtime cannot make a constraint of, is the
    client's to fix: a 400 naming the field and why (it was a 500 engine_error)."""
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as bad:
        await oa.chat.completions.create(
            model="tiny-text", messages=ASK, max_tokens=4, stream=stream, response_format=fmt
        )
    assert bad.value.code == "bad_request"
    message = bad.value.message
    assert '"response_format.json_schema.schema' in message and why in message, message
    assert "\n" not in message and "RuntimeError" not in message, message


async def test_a_required_call_to_a_tool_with_a_bad_schema_names_the_tool(
    oa: openai.AsyncOpenAI,
) -> None:
    """A required call's schema is the tool's parameters: a bad one is a 400 naming them."""
    bad_tool: Any = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "required": "city"}},
    }
    with pytest.raises(openai.BadRequestError) as bad:
        await oa.chat.completions.create(
            model="tiny-text", messages=ASK, tools=[bad_tool], tool_choice="required"
        )
    assert '"tools[0].function.parameters.required": is not a valid JSON schema' in (
        bad.value.message
    )
    r = await oa.chat.completions.create(
        model="tiny-text", messages=ASK, max_tokens=80, response_format=SCHEMA_FORMAT
    )
    Verdict.model_validate_json(r.choices[0].message.content or "")


async def test_openai_parse_helper_gets_a_pydantic_object(oa: openai.AsyncOpenAI) -> None:
    """The client's own structured-output helper (a strict schema made from a pydantic model)
    gets back a parsed object."""
    r = await oa.chat.completions.parse(
        model="tiny-text", messages=ASK, max_tokens=80, response_format=Verdict
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Verdict)


async def test_required_tool_call_comes_back_to_the_caller(oa: openai.AsyncOpenAI) -> None:
    """``tool_choice`` naming a function makes the model call it: the call comes back with an
    id, the name and JSON arguments matching the tool's parameters (finish ``tool_calls``);
    the tool's result sent back in a ``tool`` message gets the model's answer."""
    r = await oa.chat.completions.create(
        model="tiny-text",
        messages=ASK,
        max_tokens=80,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_") and calls[0].type == "function"
    fn = calls[0].function
    assert fn.name == "get_weather"
    assert json.loads(fn.arguments)["city"] in ("Paris", "Rome")
    history: Any = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"},
    ]
    follow = await oa.chat.completions.create(
        model="tiny-text",
        messages=history,
        max_tokens=4,
        tools=[WEATHER_TOOL],
    )
    # The tiny model's template has no tool syntax: the runtime gets the result, and it answers.
    assert follow.choices[0].message.content
    assert follow.usage is not None and follow.usage.completion_tokens == 4


async def test_required_tool_call_streams_as_openai_streams_it(oa: openai.AsyncOpenAI) -> None:
    """Streamed, a call arrives as ``delta.tool_calls``: index, id, type and name first, then
    argument chunks that join into the JSON arguments; the last chunk finishes ``tool_calls``."""
    stream = await oa.chat.completions.create(
        model="tiny-text",
        messages=ASK,
        max_tokens=80,
        stream=True,
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    chunks = [c async for c in stream]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].id.startswith("call_")
    assert deltas[0].function is not None and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert all(d.index == 0 for d in deltas) and all(d.id is None for d in deltas[1:])
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_tool_choice_none_and_auto_answer_with_text(oa: openai.AsyncOpenAI) -> None:
    """With ``auto`` the tools go to the runtime, which hands back any call the model's own
    syntax makes; the tiny model has none, so it answers with text (as with ``none``)."""
    choices: list[Any] = ["auto", "none"]
    for choice in choices:
        r = await oa.chat.completions.create(
            model="tiny-text",
            messages=ASK,
            max_tokens=3,
            tools=[WEATHER_TOOL],
            tool_choice=choice,
        )
        assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "length"


async def test_penalties_reach_the_sampler(oa: openai.AsyncOpenAI) -> None:
    """Presence and frequency penalties change what the same seed produces (the random model
    repeats itself without them); the same penalties and seed give the same text again.

    24 tokens, not more: the tiny tokenizer has 487 tokens for the model's 512 logits, so a
    penalty pushes sampling toward ids it cannot decode, and the runtime then fails with
    "Invalid token id" (seed 5 stays clear of them within 24 tokens; real models' vocabularies
    match)."""
    kw: dict[str, Any] = {"model": "tiny-text", "messages": ASK, "max_tokens": 24, "seed": 5}
    plain = await oa.chat.completions.create(**kw)
    pen: dict[str, Any] = {"presence_penalty": 2.0, "frequency_penalty": 2.0}
    one = await oa.chat.completions.create(**kw, **pen)
    two = await oa.chat.completions.create(**kw, **pen)
    assert one.choices[0].message.content == two.choices[0].message.content
    assert one.choices[0].message.content != plain.choices[0].message.content


async def test_a_temperature_samples_without_a_top_k_or_a_seed(oa: openai.AsyncOpenAI) -> None:
    """``temperature`` alone samples (the runtime's own fallback was top_k 1, greedy, and
    seed 0): replies differ from one another and from the file's greedy one; a seed makes
    one repeat, and another seed another reply; ``temperature: 0`` is greedy."""
    kw: dict[str, Any] = {"model": "tiny-text", "messages": ASK, "max_tokens": 8}

    async def text(**more: Any) -> str | None:
        r = await oa.chat.completions.create(**kw, **more)
        content: str | None = r.choices[0].message.content
        return content

    greedy = await text()
    sampled = [await text(temperature=1.0) for _ in range(4)]
    assert len(set(sampled)) > 1 and set(sampled) != {greedy}
    seeded = [await text(temperature=1.0, seed=s) for s in (11, 11, 12)]
    assert seeded[0] == seeded[1] != seeded[2]
    assert await text(temperature=0.0, seed=11) == greedy


async def test_completions_send_the_prompt_without_the_chat_template(
    oa: openai.AsyncOpenAI,
) -> None:
    """``/v1/completions`` sends the prompt as it is (fewer prompt tokens than the same text as
    a chat turn), stops at OpenAI's default 16 tokens, and streams text chunks."""
    prompt = "Once upon a time"
    r = await oa.completions.create(model="tiny-text", prompt=prompt)
    chat = await oa.chat.completions.create(
        model="tiny-text", messages=[{"role": "user", "content": prompt}], max_tokens=1
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert chat.usage is not None and 0 < r.usage.prompt_tokens < chat.usage.prompt_tokens
    stream = await oa.completions.create(
        model="tiny-text",
        prompt=[prompt],
        max_tokens=5,
        seed=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = await oa.completions.create(model="tiny-text", prompt=prompt, max_tokens=5, seed=2)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


async def test_completions_refuse_what_they_cannot_honour(http: httpx.AsyncClient) -> None:
    """``echo``, ``suffix``, ``best_of`` > 1 and ``logprobs`` are 400s naming the field."""
    for extra, needle in (
        ({"echo": True}, '"echo"'),
        ({"suffix": "end"}, '"suffix"'),
        ({"best_of": 3}, '"best_of"'),
        ({"logprobs": 2}, '"logprobs"'),
    ):
        r = await http.post("/v1/completions", json={"model": "tiny-text", "prompt": "x", **extra})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


async def test_embeddings_of_a_text_model_say_it_is_not_one(oa: openai.AsyncOpenAI) -> None:
    """``/v1/embeddings`` names the model that is not an embedding model (422), and an
    unknown one (404); no runner starts."""
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await oa.embeddings.create(model="tiny-text", input="hello")
    assert refused.value.code == "not_embedding_model"
    assert "model tiny-text is not an embedding model" in str(refused.value.message)
    with pytest.raises(openai.NotFoundError):
        await oa.embeddings.create(model="no-such-model", input="hello")


def test_runtime_tool_calls_take_openai_shape() -> None:
    """A call the runtime parsed from a model's own syntax (a real ``litert_lm.Message`` as the
    runtime returns it with automatic tool calling off) comes back in OpenAI's shape, whole and
    streamed: arguments as a JSON string, ``finish_reason: "tool_calls"``; one call only with
    ``parallel_tool_calls: false``."""
    message = litert_lm.Message.from_json(
        {
            "role": "assistant",
            "content": [{"type": "text", "text": ""}],
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
                {"type": "function", "function": {"name": "get_time", "arguments": {}}},
            ],
        }
    )
    done = Done("stop", prompt_tokens=4, tokens=9, tool_calls=tuple(calls_of(message)))
    final = Final(done, "m", "m@cpu", _TIMINGS)
    reply = _Reply("m", chat=True)
    doc = reply.completion("", final)
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert len({c["id"] for c in calls}) == 2
    events = [
        json.loads(e[6:])
        for e in b"".join(reply.ending(final, "", True)).decode().split("\n\n")
        if e
    ]
    deltas = [
        d for e in events if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])
    ]
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""} and deltas[0]["id"]
    assert json.loads(deltas[1]["function"]["arguments"]) == {"city": "Rome"}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-1]["usage"]["completion_tokens"] == 9
    # parallel_tool_calls: false: at most one call comes back.
    one = _Reply("m", chat=True, parallel=False).completion("", final)
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == [
        "get_weather"
    ]


# --- a second real client: LangChain's ChatOpenAI ----------------------------------------------


def langchain_chat(http: httpx.AsyncClient, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model="tiny-text",
        base_url="http://modeld/v1",
        api_key=SecretStr("x"),
        http_async_client=http,
        max_retries=0,
        **kw,
    )


async def test_langchain_chat_streamed_and_not(http: httpx.AsyncClient) -> None:
    """LangChain's ``ChatOpenAI`` gets a reply with usage, and the same text streamed."""
    llm = langchain_chat(http, max_completion_tokens=6, seed=9)
    whole = await llm.ainvoke([("system", "be brief"), ("human", "hello")])
    assert isinstance(whole.content, str) and whole.content
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] == 6
    parts = [c.content async for c in llm.astream([("system", "be brief"), ("human", "hello")])]
    assert "".join(str(p) for p in parts) == whole.content


async def test_langchain_structured_output_and_tools(http: httpx.AsyncClient) -> None:
    """``with_structured_output`` (a strict json_schema) gets a pydantic object; ``bind_tools``
    with a required tool gets a tool call, whole and streamed (LangChain merges the chunks)."""
    llm = langchain_chat(http, max_completion_tokens=80)
    verdict = await llm.with_structured_output(Verdict, method="json_schema").ainvoke("weather?")
    assert isinstance(verdict, Verdict)
    tooled = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    ai = await tooled.ainvoke("weather?")
    assert [c["name"] for c in ai.tool_calls] == ["get_weather"]
    assert ai.tool_calls[0]["args"]["city"] in ("Paris", "Rome") and ai.tool_calls[0]["id"]
    merged: Any = None
    async for chunk in tooled.astream("weather?"):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]
    assert merged.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    assert merged.response_metadata["finish_reason"] == "tool_calls"


async def test_a_chat_continues_the_conversation_its_engine_kept(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """Each turn of a chat after the first (the whole history sent, streamed or not)
    continues the conversation its engine kept after the last reply: ``ps`` and the metrics
    count them. The same history sent to another model's engine is not continued, nor is
    the next turn after an unload."""
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    for n in range(4):
        kw: dict[str, Any] = {"model": "tiny-text", "max_tokens": 6, "temperature": 0}
        if n % 2:
            stream = await oa.chat.completions.create(messages=messages, **kw, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            whole = await oa.chat.completions.create(messages=messages, **kw)
            text = whole.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    assert await engine_turns(http, "tiny-text") == {
        "kept": 1,
        "continued": 3,
        "restarted": {"first": 1},
    }
    metrics = (await http.get("/metrics")).text
    assert 'modeld_turns_total{how="continued",model="tiny-text"} 3.0' in metrics
    assert 'modeld_turns_total{how="first",model="tiny-text"} 1.0' in metrics

    await oa.chat.completions.create(messages=messages, **{**kw, "model": "vision-cpu-ok"})
    assert (await engine_turns(http, "vision-cpu-ok"))["restarted"] == {"unknown": 1}

    assert (await http.delete("/api/engines/tiny-text")).status_code == 200
    await oa.chat.completions.create(messages=messages, **kw)
    assert await engine_turns(http, "tiny-text") == {
        "kept": 1,
        "continued": 0,
        "restarted": {"unknown": 1},
    }
