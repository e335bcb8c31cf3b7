"""The OpenAI wire format on the socket, with the ``openai`` client, and validated bodies."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from modeld.config import load_settings
from tests.support.daemon import InProcessDaemon, running_daemon
from tests.support.state import MODELS, install_fixture


@pytest.fixture
async def daemon_with_models(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with tiny-text, vision-cpu-ok and gemma3n-like installed."""
    home, registry = clean_env / "home", clean_env / "registry"
    for name in ("tiny-text", "vision-cpu-ok", "gemma3n-like"):
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    settings = load_settings(
        home=home, socket=home / "modeld.sock", registry=[registry], main_backend="cpu"
    )
    async with running_daemon(settings) as d:
        yield d


@pytest.fixture
async def http(daemon_with_models: InProcessDaemon) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.AsyncHTTPTransport(uds=str(daemon_with_models.settings.socket_path))
    async with httpx.AsyncClient(transport=transport, base_url="http://modeld") as client:
        yield client


@pytest.fixture
def oa(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://modeld/v1",
        api_key="x",
        http_client=http,  # type: ignore[arg-type]  # openai types name its own httpx copy
        max_retries=0,
    )


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (900, 300), (200, 30, 30)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


async def test_models_lists_installed_in_openai_shape(oa: openai.AsyncOpenAI) -> None:
    """``/v1/models`` lists the installed models as OpenAI model objects."""
    page = await oa.models.list()
    assert sorted(m.id for m in page.data) == ["gemma3n-like", "tiny-text", "vision-cpu-ok"]
    assert {m.owned_by for m in page.data} == {"modeld"}
    assert all(m.object == "model" and m.created > 0 for m in page.data)
    assert (await oa.models.retrieve("tiny-text")).id == "tiny-text"
    with pytest.raises(openai.NotFoundError):
        await oa.models.retrieve("not-installed")


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
        "/api/generate",
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
        ({"messages": []}, 400, '"messages": list should have at least 1 item'),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, '"messages[0].role"'),
        ({"n": 2}, 400, '"n": must be 1'),
        ({"response_format": {"type": "json_schema"}}, 400, '"response_format.type"'),
        ({"tools": [{"type": "function"}]}, 400, "tool calling is not supported"),
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
            "the last message must have role user",
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
        ("POST", "/api/generate", {"model": "tiny-text", "prompt": "x", "max_tokens": 0}, "≥ 1"),
        ("POST", "/api/generate", {"model": "tiny-text", "prompt": "x", "tokens": 3}, "unknown"),
        ("POST", "/api/generate", {"model": "tiny-text"}, 'either "prompt"'),
        ("POST", "/api/generate", {"model": "tiny-text", "prompt": 5}, '"prompt": must be'),
        ("POST", "/api/generate", {"model": "tiny-text", "prompt": "x", "images": ["*"]}, "base64"),
        ("POST", "/api/generate", {"model": "tiny-text", "prompt": "x", "keep_alive": []}, "30s"),
        ("POST", "/api/engines", {"model": "tiny-text", "pin": "yes"}, '"pin": must be true'),
        ("POST", "/api/engines", {"model": "tiny-text", "backends": {"main": "tpu"}}, "main"),
        ("POST", "/api/models/import", {"path": "relative.litertlm"}, "absolute path"),
        ("POST", "/api/models/import", {"path": "/x.litertlm", "id": "../x"}, "valid model id"),
        ("POST", "/api/models/tiny-text/pull", {"detach": 1}, '"detach": must be true'),
        ("GET", "/api/models/..%2f..%2fetc", None, "not a valid model id"),
        ("DELETE", "/api/downloads/" + "x" * 300, None, "not a valid model id"),
        ("DELETE", "/api/engines/a%00b", None, "not an engine or model id"),
        ("POST", "/api/generate", None, "body is empty"),
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
