"""``/v1/embeddings`` on a real embedding model: the runtime's EmbeddingEngine in a runner,
through the real daemon over its socket, with the real ``openai`` package and plain HTTP."""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from modeld.modelfile.tokens import token_counter
from tests.support.daemon import InProcessDaemon, daemon_with_models
from tests.support.state import MODELS

DIMENSION = 32  # tests/models/fixtures.json: tiny-embed's embedding.dimension
LONGEST = 64  # tests/models/fixtures.json: tiny-embed's longest signature (embedding.lengths)
TEXTS = ["Hello world", "The quick brown fox", "Hello world"]


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with tiny-embed (an embedding model) and tiny-text installed."""
    async with daemon_with_models(clean_env, ("tiny-embed", "tiny-text")) as d:
        yield d


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


async def embed(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await http.post("/v1/embeddings", json={"model": "tiny-embed", **body})


async def test_openai_client_embeds_a_batch_in_order(oa: openai.AsyncOpenAI) -> None:
    """The ``openai`` package's ``embeddings.create`` (it asks for base64 and decodes it) gets
    one normalised vector per input, in order: the same text the same vector, another text
    another vector; each equals the vector of that text sent alone."""
    r = await oa.embeddings.create(model="tiny-embed", input=TEXTS)
    assert r.object == "list" and r.model == "tiny-embed"
    assert [d.index for d in r.data] == [0, 1, 2]
    assert {d.object for d in r.data} == {"embedding"}
    hello, fox, again = (d.embedding for d in r.data)
    assert len(hello) == len(fox) == DIMENSION
    assert norm(hello) == pytest.approx(1.0, abs=1e-5)
    assert hello == again
    assert hello != fox
    for text, vector in zip(TEXTS, (hello, fox, again), strict=True):
        alone = await oa.embeddings.create(model="tiny-embed", input=text)
        assert [d.embedding for d in alone.data] == [vector]


async def test_float_and_base64_give_the_same_vectors(http: httpx.AsyncClient) -> None:
    """``encoding_format: base64`` is the float vector as little-endian float32, exactly."""
    floats = await embed(http, input=TEXTS[:2], encoding_format="float")
    packed = await embed(http, input=TEXTS[:2], encoding_format="base64")
    assert floats.status_code == packed.status_code == 200, floats.text + packed.text
    default = await embed(http, input=TEXTS[:2])
    assert default.json()["data"] == floats.json()["data"]
    for f, b in zip(floats.json()["data"], packed.json()["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        assert len(raw) == 4 * DIMENSION
        assert list(struct.unpack(f"<{DIMENSION}f", raw)) == f["embedding"]
    doc = floats.json()
    # Each text's tokens and the BOS and EOS the runtime adds (test_usage_counts_...).
    assert doc["usage"] == {"prompt_tokens": 10, "total_tokens": 10}
    assert doc["modeld"]["engine"] == "tiny-embed:cpu"
    assert doc["modeld"]["dimensions"] == DIMENSION


async def test_dimensions_shortens_and_renormalises_or_is_refused(
    oa: openai.AsyncOpenAI, http: httpx.AsyncClient
) -> None:
    """``dimensions`` up to the model's own truncates (the runtime's ``output_size``) and the
    vector stays normalised; more than the model has is a 400 that names the field."""
    whole = (await oa.embeddings.create(model="tiny-embed", input="Hello world")).data[0]
    short = await oa.embeddings.create(model="tiny-embed", input="Hello world", dimensions=8)
    vector = short.data[0].embedding
    assert len(vector) == 8
    assert norm(vector) == pytest.approx(1.0, abs=1e-5)
    scale = norm(whole.embedding[:8])
    assert vector == pytest.approx([x / scale for x in whole.embedding[:8]], rel=1e-4, abs=1e-6)
    r = await embed(http, input="Hello world", dimensions=DIMENSION + 1)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_request"
    assert r.json()["error"]["message"] == (
        f"model tiny-embed: dimensions {DIMENSION + 1} is more than this model's {DIMENSION}; "
        f"ask for at most {DIMENSION}, or leave dimensions out"
    )
    # The engine still serves after the refusal.
    assert (await embed(http, input="Hello world")).status_code == 200


async def test_inputs_it_cannot_take_are_clear_errors(http: httpx.AsyncClient) -> None:
    """Token ids, an empty string, an empty list, too many inputs, an unknown field: 400
    naming the field; an input longer than the encoder's longest signature: 413 saying so."""
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": [1, 2, 3]}, "input: token ids are not taken"),
        ({"input": [[1, 2], [3]]}, "input: token ids are not taken"),
        ({"input": ["ok", ""]}, "input[1] is an empty string"),
        ({"input": []}, "input is empty"),
        ({"input": "x", "normalize": False}, "normalize"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]
    for body, needle in cases:
        r = await embed(http, **body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
    # One line for the whole list, not one per branch of input's union (and per item).
    r = await embed(http, input=["x"] * 2049)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == '"input": takes at most 2048 items, got 2049'
    r = await embed(http, input=" ".join(["word"] * 100))
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "too_large"
    # The runtime's sentence, not its status line naming a C++ source file and line.
    assert re.fullmatch(
        r"model tiny-embed: an input is longer than the model takes \(Input sequence length "
        r"\(\d+\) exceeds maximum supported signature length \(64\)\); send shorter inputs",
        err["message"],
    ), err["message"]


def runtime_length(refused: httpx.Response) -> int:
    """The input's length in tokens as the runtime counted it, from its refusal (a 413)."""
    assert refused.status_code == 413, refused.text
    message = refused.json()["error"]["message"]
    found = re.search(
        r"Input sequence length \((\d+)\) exceeds maximum supported signature "
        rf"length \({LONGEST}\)",
        message,
    )
    assert found, message
    return int(found.group(1))


async def test_usage_crosses_the_longest_signature_where_the_runtime_refuses(
    http: httpx.AsyncClient,
) -> None:
    """``usage.prompt_tokens`` is what the engine consumes: one word more each time, the
    count of the last input the runtime takes is its longest signature exactly, and the
    first it refuses is one token more by the runtime's own count."""
    counts: list[int] = []
    for words in range(1, 2 * LONGEST):
        r = await embed(http, input=" ".join(["a"] * words))
        if r.status_code != 200:
            refused = runtime_length(r)
            break
        counts.append(r.json()["usage"]["prompt_tokens"])
    else:
        pytest.fail("the runtime took every input")
    assert counts[-1] == LONGEST
    assert refused == LONGEST + 1
    # One word, one token: the count moves with the input, BOS and EOS on top of it.
    assert counts == list(range(counts[0], LONGEST + 1))
    assert counts[0] == 3


async def test_usage_counts_tokens_the_engine_consumes(http: httpx.AsyncClient) -> None:
    """For any text, the count modeld gives (the file's tokenizer, BOS and EOS) is the
    runtime's: a taken input's ``usage`` and a refused input's length in the runtime's 413
    both equal it; a batch's usage is the sum of its inputs', ``total_tokens`` the same."""
    counter = token_counter(MODELS / "tiny-embed.litertlm")
    texts = [
        "Hello world",
        "  spaces\tand\nnewlines  ",
        "émigré naïve 日本語 🙂, punctuation!?",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "zebra-lorem_ipsum/42 " * 6,
        "The quick brown fox jumps over the lazy dog. " * 5,
    ]
    taken = refused = 0
    for text, expected in zip(texts, counter.count(texts), strict=True):
        r = await embed(http, input=text)
        if r.status_code == 200:
            taken += 1
            assert r.json()["usage"]["prompt_tokens"] == expected, text
        else:
            refused += 1
            assert runtime_length(r) == expected, text
    assert taken >= 3 and refused >= 1
    batch = (await embed(http, input=texts[:3])).json()["usage"]
    total = sum(counter.count(texts[:3]))
    assert batch == {"prompt_tokens": total, "total_tokens": total}


async def test_each_kind_of_model_refuses_the_other_kinds_request(
    oa: openai.AsyncOpenAI,
) -> None:
    """A text model's embeddings and an embedding model's chat or completion are 422s that
    say which kind the model is and what to use instead; no engine is left behind."""
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await oa.embeddings.create(model="tiny-text", input="hello")
    assert refused.value.code == "not_embedding_model"
    assert "model tiny-text is not an embedding model" in refused.value.message
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await oa.chat.completions.create(
            model="tiny-embed", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.code == "not_text_model"
    assert "model tiny-embed is an embedding model" in refused.value.message
    assert "use /v1/embeddings" in refused.value.message
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await oa.completions.create(model="tiny-embed", prompt="hi")
    assert refused.value.code == "not_text_model"


async def test_native_generation_on_an_embedding_model_is_refused(
    http: httpx.AsyncClient,
) -> None:
    """``/api/modeld/generate`` on an embedding model is the same 422 before any runner starts."""
    r = await http.post("/api/modeld/generate", json={"model": "tiny-embed", "prompt": "hi"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "not_text_model"
    assert (await http.get("/api/engines")).json()["engines"] == []


async def test_show_load_and_ps_know_an_embedding_model(http: httpx.AsyncClient) -> None:
    """``show`` reads the kind from the header; a load creates an embedding engine, which
    ``ps`` lists with the runtime's options (its vector length) and which then serves."""
    shown = (await http.get("/api/models/tiny-embed")).json()
    assert shown["header"]["kind"] == "embedding"
    assert shown["plans"]["text"]["plan"]["main"] == "cpu"
    assert (await http.get("/api/models/tiny-text")).json()["header"]["kind"] == "text"
    r = await http.post("/api/engines", json={"model": "tiny-embed", "warm_up": True})
    assert r.status_code == 200, r.text
    # The warm-up of an embedding engine is one embedding, not a generation.
    assert r.json()["warm_up"]["seconds"] > 0
    assert r.json()["warm_up"]["tokens"] == 0
    engines = (await http.get("/api/engines")).json()["engines"]
    (engine,) = [e for e in engines if e["model"] == "tiny-embed"]
    assert engine["state"] == "ready"
    options = engine["engine_options"]
    assert options["embedding_dimension"] == DIMENSION
    assert options["backend"] == "cpu"
    assert "max_num_tokens" not in options
    assert (await embed(http, input="Hello world")).status_code == 200
