"""Anthropic's Messages API with the real ``anthropic`` client, on the socket and over TCP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from tests.api.conftest import KeyedTcp
from tests.support.daemon import InProcessDaemon, daemon_with_models, engine_turns

# The anthropic client brings its own copy of httpx (``httpx2``).

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ASK: Any = [{"role": "user", "content": "weather?"}]


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with tiny-text installed."""
    async with daemon_with_models(clean_env, ("tiny-text",)) as d:
        yield d


@pytest.fixture
async def ac(daemon: InProcessDaemon) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The real ``anthropic`` client on the daemon's socket (no key needed there)."""
    transport = httpx2.AsyncHTTPTransport(uds=str(daemon.settings.socket_path))
    async with httpx2.AsyncClient(transport=transport, base_url="http://modeld", timeout=60) as h:
        yield anthropic.AsyncAnthropic(
            base_url="http://modeld", api_key="x", http_client=h, max_retries=0
        )


async def test_a_message_with_system_and_history_reports_usage_and_its_count(
    ac: anthropic.AsyncAnthropic,
) -> None:
    """A non-streamed message answers with a text block, a stop reason and usage; its input
    tokens are what count_tokens says for the same request (the runtime's prefill count)."""
    messages: Any = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "user", "content": [{"type": "text", "text": "how are you?"}]},
    ]
    # This client version has no sampling arguments of its own; older ones send them so.
    sampling = {"temperature": 0, "top_k": 1, "top_p": 1}
    m = await ac.messages.create(
        model="tiny-text", max_tokens=6, system="be brief", messages=messages, extra_body=sampling
    )
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny-text"
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert 0 < m.usage.output_tokens <= 6 and m.usage.input_tokens > 10
    counted = await ac.messages.count_tokens(
        model="tiny-text", system="be brief", messages=messages
    )
    assert counted.input_tokens == m.usage.input_tokens


async def test_count_tokens_matches_the_prefill_with_tools_and_results(
    ac: anthropic.AsyncAnthropic,
) -> None:
    """count_tokens renders and tokenizes the prompt (no prefill): with tools, a tool call
    and its result it still says exactly what the generation then prefills."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    messages: Any = [*ASK, {"role": "assistant", "content": [call]}]
    messages.append({"role": "user", "content": [result]})
    m = await ac.messages.create(
        model="tiny-text", max_tokens=2, tools=[WEATHER], messages=messages
    )
    counted = await ac.messages.count_tokens(model="tiny-text", tools=[WEATHER], messages=messages)
    assert counted.input_tokens == m.usage.input_tokens > 0


async def test_stream_follows_anthropics_event_sequence(
    ac: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    """A stream is message_start, ping, one text block (start, deltas, stop), message_delta
    with the stop reason and usage, message_stop; the client's final message has both
    counts (the input count comes with message_delta)."""
    body = {"model": "tiny-text", "max_tokens": 5, "stream": True, "messages": ASK}
    async with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        raw = (await r.aread()).decode()
    events = [
        (lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: ")))
        for lines in (e.split("\n") for e in raw.strip().split("\n\n"))
    ]
    names = [name for name, _ in events]
    assert all(name == doc["type"] for name, doc in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[-2][1]["usage"]["output_tokens"] == 5
    async with ac.messages.stream(model="tiny-text", max_tokens=5, messages=ASK) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text
    counted = await ac.messages.count_tokens(model="tiny-text", messages=ASK)
    assert final.usage.input_tokens == counted.input_tokens and final.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_tool_call_comes_back_and_its_result_goes_in(
    ac: anthropic.AsyncAnthropic, stream: bool
) -> None:
    """``tool_choice`` ``tool`` makes the model call it: a ``tool_use`` block with its input
    (streamed as an input_json_delta), ``stop_reason: tool_use``; the ``tool_result`` then
    sent back is taken and answered."""
    choice: Any = {"type": "tool", "name": "get_weather"}
    kw: Any = {"model": "tiny-text", "max_tokens": 80, "tools": [WEATHER], "tool_choice": choice}
    if stream:
        async with ac.messages.stream(messages=ASK, **kw) as s:
            m = await s.get_final_message()
    else:
        m = await ac.messages.create(messages=ASK, **kw)
    assert m.stop_reason == "tool_use", m
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert use.input in ({"city": "Paris"}, {"city": "Rome"}) and use.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    history: Any = [*ASK, {"role": "assistant", "content": m.content}]
    history.append({"role": "user", "content": [result]})
    after = await ac.messages.create(
        model="tiny-text", max_tokens=3, tools=[WEATHER], messages=history
    )
    assert after.usage.output_tokens > 0


async def test_output_config_format_constrains_the_reply(ac: anthropic.AsyncAnthropic) -> None:
    """``output_config.format`` (a JSON schema) is the runtime's constrained decoding."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    m = await ac.messages.create(
        model="tiny-text",
        max_tokens=40,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    block = m.content[0]
    assert block.type == "text" and isinstance(json.loads(block.text)["ok"], bool)


async def test_refusals_come_in_anthropics_shape(
    ac: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    """A bad body, an unknown model, a prompt over the window and what modeld cannot honour
    are Anthropic errors the client maps to its classes; a path that matched no route is a
    400, never a 404 that reads as an unknown model."""
    with pytest.raises(anthropic.BadRequestError) as bad:
        await ac.messages.create(model="tiny-text", max_tokens=0, messages=ASK)
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": '"max_tokens": must be ≥ 1'},
    }
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await ac.messages.create(model="no-such-model", max_tokens=2, messages=ASK)
    assert "no-such-model" in unknown.value.message
    long: Any = [{"role": "user", "content": "zq " * 2700}]
    with pytest.raises(anthropic.BadRequestError) as over:
        await ac.messages.create(model="tiny-text", max_tokens=2, messages=long)
    said = over.value.body["error"]["message"]  # type: ignore[index]
    assert said.startswith("prompt is too long: "), said
    assert "tokens > 256 maximum" in said
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError) as think:
        await ac.messages.create(model="tiny-text", max_tokens=2, messages=ASK, thinking=thinking)
    assert '"thinking": modeld does not return' in think.value.message
    server_tool: Any = {"type": "web_search_20250305", "name": "web_search"}
    with pytest.raises(anthropic.BadRequestError) as tool:
        await ac.messages.create(model="tiny-text", max_tokens=2, messages=ASK, tools=[server_tool])
    assert '"tools[0].type"' in tool.value.message and "server tool" in tool.value.message
    r = await http.post("/v1/messages/batches", json={})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "model" not in err["message"].lower()


def test_the_client_over_tcp_sends_its_key_as_x_api_key(keyed_tcp: KeyedTcp) -> None:
    """Over TCP the key comes as ``x-api-key``: a message and a count go through with it; a
    bad key is an ``AuthenticationError`` in Anthropic's shape."""
    good = anthropic.Anthropic(base_url=keyed_tcp.base_url, api_key=keyed_tcp.key, max_retries=0)
    m = good.messages.create(model="tiny-text", max_tokens=3, messages=ASK)
    assert m.usage.output_tokens > 0
    assert good.messages.count_tokens(model="tiny-text", messages=ASK).input_tokens > 0
    with good.messages.stream(model="tiny-text", max_tokens=3, messages=ASK) as s:
        assert s.get_final_message().usage.output_tokens > 0
    bad = anthropic.Anthropic(base_url=keyed_tcp.base_url, api_key="mdk_" + "A" * 43)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        bad.with_options(max_retries=0).messages.create(
            model="tiny-text", max_tokens=3, messages=ASK
        )
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    assert "modeld key list" in refused.value.message


async def test_a_conversation_continues_the_one_its_engine_kept(
    ac: anthropic.AsyncAnthropic, http: httpx.AsyncClient
) -> None:
    """Each turn of a Messages conversation after the first (the whole history sent, whole
    or streamed, the reply sent back as its text block) continues the conversation its
    engine kept after the last reply."""
    messages: Any = [{"role": "user", "content": "hello"}]
    sampling = {"temperature": 0, "top_k": 1, "top_p": 1}
    for n in range(3):
        kw: Any = {"model": "tiny-text", "max_tokens": 6, "system": "be brief"}
        if n % 2:
            async with ac.messages.stream(**kw, messages=messages, extra_body=sampling) as s:
                text = "".join([t async for t in s.text_stream])
        else:
            m = await ac.messages.create(**kw, messages=messages, extra_body=sampling)
            text = m.content[0].text if m.content[0].type == "text" else ""
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": text}]},
            {"role": "user", "content": "more"},
        ]
    turns = await engine_turns(http, "tiny-text")
    assert turns == {"kept": 1, "continued": 2, "restarted": {"first": 1}}
