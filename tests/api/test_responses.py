"""OpenAI's Responses API (and the OpenAI dialect's refusals) with the real ``openai`` client,
on the socket and over TCP with a key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.api.conftest import KeyedTcp
from tests.support.daemon import InProcessDaemon, daemon_with_models, engine_turns

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with tiny-text and tiny-embed installed."""
    async with daemon_with_models(clean_env, ("tiny-text", "tiny-embed")) as d:
        yield d


async def test_a_response_to_a_string_with_instructions(oa: openai.AsyncOpenAI) -> None:
    """A string input with instructions answers with one message item, its text, and usage;
    a reply cut by max_output_tokens is ``incomplete`` saying why."""
    r = await oa.responses.create(
        model="tiny-text", input="hi", instructions="be brief", max_output_tokens=4
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model_dump()["store"] is False
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text and r.usage is not None
    assert r.usage.output_tokens == 4 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + 4
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"


async def test_a_streamed_response_sends_the_events_in_order(oa: openai.AsyncOpenAI) -> None:
    """A stream is response.created, in_progress, the message item and its text part opened,
    text deltas, their ends, then the final response with usage; numbered in order."""
    stream = await oa.responses.create(
        model="tiny-text", input="hi", max_output_tokens=5, stream=True
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage is not None
    assert final.usage.output_tokens == 5


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_required_function_call_round_trip(oa: openai.AsyncOpenAI, stream: bool) -> None:
    """``tool_choice: "required"`` makes the model call the function: a ``function_call``
    item (streamed as its arguments' delta and done); its ``function_call_output`` then sent
    back is taken and answered."""
    kw: Any = {"model": "tiny-text", "input": "weather?", "tools": [WEATHER]}
    kw |= {"tool_choice": "required", "max_output_tokens": 80}
    if stream:
        async with oa.responses.stream(**kw) as s:
            kinds = [e.type async for e in s]
            r = await s.get_final_response()
        assert "response.function_call_arguments.done" in kinds
    else:
        r = await oa.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    back: Any = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    back[1]["arguments"] = call.arguments
    after = await oa.responses.create(
        model="tiny-text", input=back, tools=[WEATHER], max_output_tokens=3
    )
    assert after.usage is not None and after.usage.output_tokens > 0


async def test_text_format_json_schema_constrains_the_reply(oa: openai.AsyncOpenAI) -> None:
    """``text.format`` json_schema is the runtime's constrained decoding."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    fmt: Any = {"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": True}}
    r = await oa.responses.create(model="tiny-text", input="x", text=fmt, max_output_tokens=40)
    assert isinstance(json.loads(r.output_text)["ok"], bool)


async def test_stored_responses_are_refused_saying_so(oa: openai.AsyncOpenAI) -> None:
    """modeld keeps no responses: ``previous_response_id`` and ``store: true`` are a 400 that
    says to send the whole conversation; a hosted tool is a 400 naming it."""
    for extra in ({"previous_response_id": "resp_1"}, {"store": True}):
        with pytest.raises(openai.BadRequestError) as refused:
            await oa.responses.create(model="tiny-text", input="x", **extra)
        assert "keeps no responses: send the whole conversation in input" in (refused.value.message)
    with pytest.raises(openai.BadRequestError) as hosted:
        await oa.responses.create(model="tiny-text", input="x", tools=[{"type": "web_search"}])
    assert '"tools[0].type"' in hosted.value.message


async def test_openai_error_fidelity(oa: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    """A prompt over the window is 400 ``context_length_exceeded`` in OpenAI's words; a path
    that matched no route is a 400 that never says "model" (LangChain and pydantic-ai read
    any 404 as an unknown model); token ids for embeddings say what to set in LangChain."""
    for long in ("zq " * 2700, "zq " * 3000):  # the runtime's count, then the byte bound
        with pytest.raises(openai.BadRequestError) as over:
            await oa.responses.create(model="tiny-text", input=long)
        assert over.value.code == "context_length_exceeded"
        assert (
            "This model's maximum context length is 256 tokens. However, your messages "
            in over.value.message
        )
    r = await http.post("/v1/audio/speech", json={})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_route"
    assert "model" not in r.json()["error"]["message"].lower()
    with pytest.raises(openai.BadRequestError) as ids:
        await oa.embeddings.create(model="tiny-embed", input=[[1, 2, 3]])
    assert "check_embedding_ctx_length=False" in ids.value.message


async def test_models_carry_the_context_length_and_capabilities(oa: openai.AsyncOpenAI) -> None:
    """``/v1/models`` and ``/v1/models/{id}`` carry the window (as ``context_length`` and
    ``max_model_len``) and what each model can do, read from its file."""
    page = await oa.models.list()
    docs = {m.id: m.model_dump() for m in page.data}
    text, embed = docs["tiny-text"], docs["tiny-embed"]
    assert text["context_length"] == text["max_model_len"] == 256
    assert text["capabilities"]["embedding"] is False and text["capabilities"]["vision"] is False
    assert embed["capabilities"]["embedding"] is True
    one = (await oa.models.retrieve("tiny-text")).model_dump()
    assert one["context_length"] == 256 and one["capabilities"] == text["capabilities"]


def test_responses_over_tcp_with_a_key(keyed_tcp: KeyedTcp) -> None:
    """Over TCP with a key the client's responses work, streamed and not; a bad key is a 401
    ``invalid_api_key`` (OpenAI's own code, which older litellm needs)."""
    client = openai.OpenAI(base_url=keyed_tcp.base_url + "/v1", api_key=keyed_tcp.key)
    r = client.responses.create(model="tiny-text", input="hi", max_output_tokens=3)
    assert r.usage is not None and r.usage.output_tokens == 3
    stream = client.responses.create(
        model="tiny-text", input="hi", max_output_tokens=3, stream=True
    )
    last = list(stream)[-1]
    assert last.type == "response.incomplete" and last.response.usage is not None
    bad = openai.OpenAI(base_url=keyed_tcp.base_url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        bad.responses.create(model="tiny-text", input="hi")
    assert refused.value.code == "invalid_api_key"


async def test_a_conversation_sent_whole_continues_the_one_its_engine_kept(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """Each turn of a conversation sent whole as input items (no previous_response_id: it
    is not stored), the reply sent back as its message item, continues the conversation its
    engine kept after the last reply."""
    items: list[Any] = [{"role": "user", "content": "hello"}]
    for _ in range(3):
        r = await oa.responses.create(
            model="tiny-text",
            input=items,
            instructions="be brief",
            max_output_tokens=6,
            temperature=0,
        )
        items += [
            {"role": "assistant", "content": [{"type": "output_text", "text": r.output_text}]},
            {"role": "user", "content": "more"},
        ]
    turns = await engine_turns(http, "tiny-text")
    assert turns == {"kept": 1, "continued": 2, "restarted": {"first": 1}}
