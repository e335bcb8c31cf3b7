"""The token counter of an embedding model (``modeld.modelfile.tokens``) on files rebuilt from
tiny-embed's own sections with another tokenizer: a SentencePiece model (held to the real
runtime's count through the daemon) and none at all."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import sentencepiece
from litert_lm_builder import litertlm_builder as lb

from modeld.config import load_settings
from modeld.modelfile.header import read_header
from modeld.modelfile.tokens import NoTokenCounter, token_counter
from tests.support.daemon import running_daemon, socket_http
from tests.support.state import MODELS, install_fixture

LONGEST = 64  # tests/models/fixtures.json: tiny-embed's longest signature
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world of tokens",
    "émigré naïve café",
] * 50


def rebuilt(tmp: Path, tokenizer: str | None) -> Path:
    """tiny-embed with its metadata and models, and an ``sp`` tokenizer trained here (its
    BOS and EOS are user symbols, which the runtime tokenizes as text) or none."""
    source = MODELS / "tiny-embed.litertlm"
    data = source.read_bytes()
    parts: dict[str, str] = {}
    for s in read_header(source).sections:
        name = s.model_type or s.data_type
        (tmp / name).write_bytes(data[s.begin : s.end])
        parts[name] = str(tmp / name)
    builder = lb.LitertLmFileBuilder()
    builder.add_embedding_metadata(parts["EmbeddingMetadataProto"])
    if tokenizer == "sp":
        model = io.BytesIO()
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(CORPUS),
            model_writer=model,
            vocab_size=36,
            user_defined_symbols=["<bos>", "<eos>"],
            character_coverage=1.0,
            minloglevel=2,
        )
        (tmp / "sp.model").write_bytes(model.getvalue())
        builder.add_sentencepiece_tokenizer(str(tmp / "sp.model"))
    builder.add_tflite_model(parts["tf_lite_embedder"], lb.TfLiteModelType.EMBEDDER)
    builder.add_tflite_model(parts["tf_lite_text_encoder"], lb.TfLiteModelType.TEXT_ENCODER)
    out = tmp / f"embed-{tokenizer or 'none'}.litertlm"
    with out.open("wb") as f:
        builder.build(f)
    return out


def test_a_file_without_a_tokenizer_has_no_counter(tmp_path: Path) -> None:
    """No tokenizer section of a kind read here: no counter, and the reason says what it
    found, so counts stay absent rather than guessed."""
    with pytest.raises(NoTokenCounter, match="a tokenizer section of kind none"):
        token_counter(rebuilt(tmp_path, None))


async def test_sentencepiece_counts_are_the_runtimes(clean_env: Path) -> None:
    """A SentencePiece file's count (its pieces, and BOS and EOS tokenized as the runtime
    tokenizes them) is the runtime's: a taken input's ``usage`` and a refused input's length
    in the runtime's 413 both equal it."""
    path = rebuilt(clean_env, "sp")
    counter = token_counter(path)
    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "sp-embed", path, registry=registry)
    settings = load_settings(
        home=home, socket=home / "modeld.sock", registry=[registry], main_backend="cpu"
    )
    texts = ["the fox", "hello café zzz 日本!", " ".join(CORPUS[:2]), " ".join(CORPUS[:4])]
    taken = refused = 0
    async with running_daemon(settings) as d, socket_http(d) as http:
        for text, expected in zip(texts, counter.count(texts), strict=True):
            r = await http.post("/v1/embeddings", json={"model": "sp-embed", "input": text})
            if r.status_code == 200:
                taken += 1
                assert r.json()["usage"]["prompt_tokens"] == expected, text
                continue
            refused += 1
            assert r.status_code == 413, r.text
            found = re.search(r"Input sequence length \((\d+)\)", r.json()["error"]["message"])
            assert found and int(found.group(1)) == expected, (text, r.text)
    assert taken >= 2 and refused >= 1
    assert max(counter.count(texts[:2])) <= LONGEST
