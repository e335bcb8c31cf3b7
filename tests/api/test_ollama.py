"""Ollama's API (``modeld.api.ollama``) through the real ``ollama`` Python client, on a real
daemon with the tiny models, over the socket (an httpx Unix-socket transport)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from PIL import Image

from modeld.api.ollama import NEVER, OLLAMA_VERSION, _Reply
from modeld.engine.views import Final
from modeld.services.inference import Done, Token, ToolCall
from tests.support.daemon import InProcessDaemon, daemon_with_models, engine_turns
from tests.support.mirror import Faults, Mirror
from tests.support.state import model_bytes, write_entry
from tests.support.wait import until

MODELS = ("tiny-text", "tiny-embed", "vision-cpu-ok")
PULLED = model_bytes(300_000, seed=31)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture
async def mirror() -> AsyncIterator[Mirror]:
    m = await Mirror(PULLED, Faults()).start()
    yield m
    await m.stop()


@pytest.fixture
async def daemon(clean_env: Path, mirror: Mirror) -> AsyncIterator[InProcessDaemon]:
    """tiny-text, tiny-embed and vision-cpu-ok installed; ``pulled`` in the catalog, served by
    a loopback mirror."""
    registry = clean_env / "registry"
    write_entry(registry, "pulled", size=len(PULLED), sha256=mirror.sha256, urls=[mirror.url])
    async with daemon_with_models(clean_env, MODELS) as d:
        yield d


@pytest.fixture
async def client(daemon: InProcessDaemon) -> AsyncIterator[ollama.AsyncClient]:
    transport = httpx.AsyncHTTPTransport(uds=str(daemon.settings.socket_path))
    async with ollama.AsyncClient(host="http://modeld", transport=transport, timeout=120) as c:
        yield c


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


async def test_version_tags_and_show(client: ollama.AsyncClient, http: httpx.AsyncClient) -> None:
    """Version, status's cloud section, the installed models as ``name:latest`` with their
    capabilities, and ``show`` with the context length and capabilities read from the file."""
    # The one path both APIs have: modeld's status carries Ollama's answer too.
    assert (await http.get("/api/status")).json()["cloud"] == {"disabled": True, "source": "modeld"}
    version = (await http.get("/api/version")).json()
    assert version["version"] == OLLAMA_VERSION and version["modeld"]
    listed = await client.list()
    names = [m.model for m in listed.models]
    assert names == ["tiny-embed:latest", "tiny-text:latest", "vision-cpu-ok:latest"]
    assert all(m.size and m.digest and m.details and m.modified_at for m in listed.models)
    raw = {m["name"]: m for m in (await http.get("/api/tags")).json()["models"]}
    assert raw["tiny-text:latest"]["capabilities"] == ["completion"]
    assert raw["tiny-embed:latest"]["capabilities"] == ["embedding"]
    assert raw["vision-cpu-ok:latest"]["capabilities"] == ["completion", "vision"]

    shown = await client.show("tiny-text:latest")
    assert shown.capabilities == ["completion"]
    assert shown.modelinfo is not None
    arch = shown.modelinfo["general.architecture"]
    assert arch == "generic_model" and shown.modelinfo[f"{arch}.context_length"] == 256
    assert (await client.show("vision-cpu-ok")).capabilities == ["completion", "vision"]
    with pytest.raises(ollama.ResponseError) as unknown:
        await client.show("no-such-model")
    assert unknown.value.status_code == 404 and "no-such-model" in unknown.value.error


async def test_chat_streams_by_default_and_answers_whole(client: ollama.AsyncClient) -> None:
    """A streamed chat is records of text then one ``done`` record with Ollama's counts and
    durations; ``stream: false`` is one record with the whole reply."""
    messages = [{"role": "user", "content": "Say hello"}]
    parts = [p async for p in await client.chat("tiny-text", messages, stream=True)]
    assert len(parts) >= 2 and not any(p.done for p in parts[:-1])
    last = parts[-1]
    assert last.done and last.done_reason in ("stop", "length")
    assert last.eval_count and last.eval_count >= 1 and last.prompt_eval_count
    assert last.total_duration and last.prompt_eval_duration and last.eval_duration
    assert last.model == "tiny-text" and last.created_at
    streamed = "".join(p.message.content or "" for p in parts)
    assert streamed

    whole = await client.chat(
        "tiny-text:latest", messages, options={"num_predict": 3, "temperature": 0}
    )
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 3
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.model == "tiny-text:latest"


async def test_generate_streams_and_answers_whole(client: ollama.AsyncClient) -> None:
    """``/api/generate`` with a system text, streamed and not; ``raw`` skips the template."""
    parts = [
        p
        async for p in await client.generate(
            "tiny-text", "Say hello", system="Be brief", stream=True, options={"num_predict": 4}
        )
    ]
    assert parts[-1].done and parts[-1].eval_count == 4 and parts[-1].done_reason == "length"
    assert "".join(p.response for p in parts if p.response)
    whole = await client.generate("tiny-text", "Say hello", raw=True, options={"num_predict": 2})
    assert whole.done and whole.response and whole.eval_count == 2


async def test_options_reach_the_sampler(client: ollama.AsyncClient) -> None:
    """Greedy sampling (temperature 0) gives the same reply twice; a seed with sampling does
    too; ``stop`` cuts the reply; ``num_ctx`` within the window is taken."""
    msgs = [{"role": "user", "content": "Tell me a story"}]
    greedy = {"temperature": 0, "num_predict": 8, "num_ctx": 256}
    a = await client.chat("tiny-text", msgs, options=greedy)
    b = await client.chat("tiny-text", msgs, options=greedy)
    assert a.message.content == b.message.content
    seeded = {"temperature": 1.5, "top_k": 40, "top_p": 0.9, "seed": 7, "num_predict": 8}
    c = await client.chat("tiny-text", msgs, options=seeded)
    d = await client.chat("tiny-text", msgs, options=seeded)
    assert c.message.content == d.message.content
    text = a.message.content or ""
    stop = text[len(text) // 2 :][:3]
    if stop.strip():
        cut = await client.chat("tiny-text", msgs, options={**greedy, "stop": [stop]})
        assert stop not in (cut.message.content or "")
    penalties = {"repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    r = await client.chat("tiny-text", msgs, options={**penalties, "num_predict": 3})
    assert r.done


async def test_format_json_and_schema_use_constrained_decoding(
    client: ollama.AsyncClient, http: httpx.AsyncClient
) -> None:
    """``format: "json"`` and a JSON schema reach the runtime's constrained decoding (modeld's
    final record says so, with the JSON diagnostics)."""
    schema = {
        "type": "object",
        "properties": {"age": {"type": "integer"}},
        "required": ["age"],
    }
    for fmt in ("json", schema):
        body = {
            "model": "tiny-text",
            "messages": [{"role": "user", "content": "age?"}],
            "format": fmt,
            "stream": False,
            "options": {"num_predict": 24, "temperature": 0},
        }
        doc = (await http.post("/api/chat", json=body)).json()
        assert doc["done"] and doc["modeld"]["json"]["status"] in ("complete", "truncated")
        if doc["modeld"]["json"]["status"] == "complete":
            assert isinstance(json.loads(doc["message"]["content"]), dict)
    r = await client.chat(
        "tiny-text", [{"role": "user", "content": "x"}], format=schema, options={"num_predict": 4}
    )
    assert r.done


async def test_tools_and_the_tool_result_round_trip(client: ollama.AsyncClient) -> None:
    """Tools reach the runtime, and a tool result answering an earlier call (named or, from
    older clients, not) is taken as the next turn."""
    r = await client.chat(
        "tiny-text",
        [{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER],
        options={"num_predict": 4},
    )
    assert r.done
    history: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "11 degrees", "tool_name": "get_weather"},
    ]
    named = await client.chat("tiny-text", history, tools=[WEATHER], options={"num_predict": 3})
    assert named.done
    history[-1] = {"role": "tool", "content": "11 degrees"}
    parts = [
        p
        async for p in await client.chat(
            "tiny-text", history, tools=[WEATHER], stream=True, options={"num_predict": 3}
        )
    ]
    assert parts[-1].done


def test_the_models_tool_calls_come_back_in_ollamas_shape() -> None:
    """Calls the runtime hands back are the reply's ``message.tool_calls`` (arguments an
    object), streamed in a record of their own before the last one."""
    calls: tuple[ToolCall, ...] = ({"name": "get_weather", "arguments": {"city": "Rome"}},)
    timings: Any = {
        "image_prepare": 0.0,
        "load": 0.0,
        "engine_create": None,
        "warm_up": 0.0,
        "queue": 0.0,
        "prefill": 0.01,
        "first_token": 0.02,
        "decode_tokens_per_second": 100.0,
        "total": 0.1,
    }
    final = Final(Done("stop", prompt_tokens=4, tokens=5, tool_calls=calls), "m", "m:cpu", timings)

    async def records() -> Any:
        yield Token("")
        yield final

    import asyncio

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any]]:
        reply = _Reply("m", chat=True)
        streamed = [d async for d in reply.stream(records())]
        return streamed, await reply.whole(records())

    streamed, whole = asyncio.run(go())
    wanted = [{"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]
    assert streamed[-2]["message"]["tool_calls"] == wanted and not streamed[-2]["done"]
    assert streamed[-1]["done"] and "tool_calls" not in streamed[-1]["message"]
    assert whole["message"]["tool_calls"] == wanted and whole["done_reason"] == "stop"
    # 5 tokens at 100 tokens/s: 50 ms of decode, in nanoseconds.
    assert whole["eval_count"] == 5 and whole["eval_duration"] == 50_000_000
    assert whole["prompt_eval_duration"] == 10_000_000 and whole["total_duration"] == 100_000_000


async def test_images_take_the_image_path(client: ollama.AsyncClient) -> None:
    """Base64 ``images`` take the native image path: vision-cpu-ok's plan fails its image
    probe, so the request gets that 422, in Ollama's error shape."""
    for call in (
        client.generate("vision-cpu-ok", "what is this?", images=[_png()]),
        client.chat(
            "vision-cpu-ok", [{"role": "user", "content": "what is this?", "images": [_png()]}]
        ),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            await call
        assert refused.value.status_code == 422, refused.value
        assert "image" in refused.value.error


async def test_keep_alive_loads_keeps_and_unloads(
    client: ollama.AsyncClient, http: httpx.AsyncClient
) -> None:
    """No prompt loads the model (``done_reason: load``), ``keep_alive: -1`` keeps it for
    ever, a duration sets its idle time, and ``keep_alive: 0`` without a prompt unloads it."""
    loaded = await client.generate("tiny-text", keep_alive=-1)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    (engine,) = (await client.ps()).models
    assert engine.model == "tiny-text:latest" and engine.context_length == 256
    assert engine.size and engine.size_vram == 0
    assert (await http.get("/api/ps")).json()["models"][0]["expires_at"] == NEVER
    await client.chat("tiny-text", [{"role": "user", "content": "hi"}], keep_alive="10m")
    ((doc,),) = [(await http.get("/api/ps")).json()["models"]]
    assert doc["expires_at"] != NEVER
    chat_load = await client.chat("tiny-text", [])
    assert chat_load.done_reason == "load"
    unloaded = await client.chat("tiny-text", [], keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    assert (await client.ps()).models == []
    # Nothing loaded: the unload has nothing to do, and says so the same way.
    again = await client.generate("tiny-text", keep_alive="0s")
    assert again.done_reason == "unload"


async def test_embed_and_embeddings(client: ollama.AsyncClient) -> None:
    """``/api/embed`` returns a vector per input (``dimensions`` cuts them) and the inputs'
    token count; the older
    ``/api/embeddings`` one vector; a text model is refused in Ollama's shape."""
    doc = await client.embed("tiny-embed", ["hello", "world"])
    assert len(doc.embeddings) == 2 and len(doc.embeddings[0]) > 4
    assert doc.total_duration and doc.model == "tiny-embed:latest"
    # The tokens the engine consumed, counted by the file's own tokenizer.
    assert doc.prompt_eval_count and doc.prompt_eval_count >= 2
    cut = await client.embed("tiny-embed:latest", "hello", dimensions=4)
    assert [len(v) for v in cut.embeddings] == [4]
    old = await client.embeddings("tiny-embed", "hello")
    assert list(old.embedding) == list(doc.embeddings[0])
    with pytest.raises(ollama.ResponseError) as refused:
        await client.embed("tiny-text", "hello")
    assert refused.value.status_code == 422 and "not an embedding model" in refused.value.error


async def test_pull_streams_ollamas_progress_then_delete(
    client: ollama.AsyncClient, mirror: Mirror
) -> None:
    """A pull streams Ollama's records (status, and digest/total/completed while the file
    comes) down to ``success``; the model is then listed, and ``delete`` removes it."""
    records = [r async for r in await client.pull("pulled", stream=True)]
    statuses = [r.status for r in records]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    layer = [r for r in records if r.digest]
    assert layer and all(r.digest == f"sha256:{mirror.sha256}" for r in layer)
    assert layer[-1].total == len(PULLED) and layer[-1].completed == len(PULLED)
    assert all(r.status == f"pulling {mirror.sha256[:12]}" for r in layer)
    assert "pulled:latest" in [m.model for m in (await client.list()).models]
    # Installed already: one layer at its whole size, then success, without a byte fetched.
    sent = mirror.sent
    assert (await client.pull("pulled:latest")).status == "success"
    assert mirror.sent == sent
    assert (await client.delete("pulled")).status == "success"
    assert "pulled:latest" not in [m.model for m in (await client.list()).models]
    with pytest.raises(ollama.ResponseError) as missing:
        await client.pull("no-such-model")
    assert missing.value.status_code == 404


async def test_refusals_name_the_field_in_ollamas_shape(http: httpx.AsyncClient) -> None:
    """What modeld cannot honour, and bad values, are 400s naming the field, as
    ``{"error": "..."}``; an id with another tag says modeld has one file per id."""
    chat = {"model": "tiny-text", "messages": [{"role": "user", "content": "x"}]}
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/api/chat", {**chat, "options": {"min_p": 0.1}}, 400, '"options": min_p: '),
        ("/api/chat", {**chat, "options": {"min_p": 0.0, "num_gpu": 1}}, 200, ""),
        ("/api/chat", {**chat, "options": {"num_ctx": 4096}}, 400, "context window of 4096"),
        ("/api/chat", {**chat, "options": {"bogus": 1}}, 400, "options.bogus"),
        ("/api/chat", {**chat, "think": True}, 400, '"think"'),
        ("/api/chat", {**chat, "think": False, "stream": False}, 200, ""),
        ("/api/chat", {**chat, "format": "yaml"}, 400, '"format"'),
        ("/api/chat", {**chat, "model": "tiny-text:q4"}, 400, "asks for tag 'q4'"),
        ("/api/chat", {**chat, "keep_alive": "forever"}, 400, "keep_alive"),
        ("/api/generate", {"model": "tiny-text", "prompt": "x", "suffix": "y"}, 400, "suffix"),
        (
            "/api/generate",
            {"model": "tiny-text", "prompt": "x", "max_tokens": 3},
            400,
            "/api/modeld/generate",
        ),
        (
            "/api/generate",
            {"model": "tiny-text", "prompt": "x", "raw": True, "system": "s"},
            400,
            '"system"',
        ),
        ("/api/chat", {**chat, "model": "nope"}, 404, "nope"),
    ]
    for path, body, status, needle in cases:
        sent = body
        if status == 200:
            options = {**body.get("options", {}), "num_predict": 1}
            sent = {**body, "stream": False, "options": options}
        r = await http.post(path, json=sent)
        assert r.status_code == status, (sent, r.text)
        if status != 200:
            error = r.json()["error"]
            assert isinstance(error, str) and needle in error, (sent, error)
    # Refusals before any handler (a wrong method) take Ollama's shape on its paths too.
    r = await http.get("/api/chat")
    assert r.status_code == 405 and isinstance(r.json()["error"], str)


async def test_a_stream_that_fails_ends_with_an_ollama_error_record(
    clean_env: Path, daemon: InProcessDaemon, http: httpx.AsyncClient
) -> None:
    """A pull whose mirror serves a wrong file fails after the stream started: its last
    record is ``{"error": "..."}``, which the client raises."""
    registry = clean_env / "registry"
    write_entry(registry, "liar", size=len(PULLED), sha256="0" * 64, urls=[_dead_url()])

    async def known() -> bool:
        return (await http.get("/api/models/liar")).status_code == 200

    await until(known, 10.0)
    async with http.stream("POST", "/api/pull", json={"model": "liar"}) as r:
        assert r.status_code == 200
        lines = [json.loads(line) async for line in r.aiter_lines() if line]
    assert isinstance(lines[-1]["error"], str) and lines[-1]["error"], lines


def _dead_url() -> str:
    return "http://127.0.0.1:9/liar.litertlm"


async def test_a_chat_continues_the_conversation_its_engine_kept(
    client: ollama.AsyncClient, http: httpx.AsyncClient
) -> None:
    """Each turn of an Ollama chat after the first (the whole history sent, whole or
    streamed) continues the conversation its engine kept after the last reply."""
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    options = {"num_predict": 6, "temperature": 0}
    for n in range(3):
        if n % 2:
            stream = await client.chat("tiny-text", messages, stream=True, options=options)
            text = "".join([p.message.content or "" async for p in stream])
        else:
            text = (await client.chat("tiny-text", messages, options=options)).message.content or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    turns = await engine_turns(http, "tiny-text")
    assert turns == {"kept": 1, "continued": 2, "restarted": {"first": 1}}
