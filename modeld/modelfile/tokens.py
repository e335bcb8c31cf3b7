"""Counting the tokens an embedding engine consumes, with the file's own tokenizer.

LiteRT-LM 0.18.1's ``EmbeddingEngine`` reports no token counts and exposes no tokenizer,
so the runner reads the tokenizer section the runtime reads (an ``HF_Tokenizer_Zlib``
tokenizer.json through ``tokenizers``, or an ``SP_Tokenizer`` model through
``sentencepiece``) and adds the special tokens the runtime puts around each input (the
``EmbeddingMetadata`` section's BOS and EOS). tests/api/test_openai_embeddings.py (HF) and
tests/modelfile/test_tokens.py (SentencePiece) hold the count to the runtime's: it crosses
the encoder's longest signature exactly where the runtime refuses an input.

Both packages are imported here only, and this module only by embedding runners.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from litert_lm_builder.runtime.proto import embedding_metadata_pb2

from modeld.modelfile.header import EMBEDDING_METADATA, Section, read_header

HF_TOKENIZER = "HF_Tokenizer_Zlib"
SP_TOKENIZER = "SP_Tokenizer"
# Bounds on what a damaged or hostile file makes the runner read and inflate; real
# tokenizers stay far below them.
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024
MAX_EMBEDDING_METADATA_BYTES = 1024 * 1024


class NoTokenCounter(Exception):
    """The file's tokenizer cannot be read here; the message says why."""


@dataclass(frozen=True)
class TokenCounter:
    """The tokens each input costs an embedding engine: its text's, plus ``special``."""

    encode: Callable[[list[str]], list[int]]  # the text tokens of each input, in order
    special: int  # BOS and EOS, the tokens the runtime adds to every input

    def count(self, texts: Sequence[str]) -> tuple[int, ...]:
        return tuple(n + self.special for n in self.encode(list(texts)))


def token_counter(path: str | Path) -> TokenCounter:
    """The counter of the embedding model at ``path``; NoTokenCounter when its tokenizer is
    of a kind not read here, or damaged."""
    info = read_header(path)
    by_type = {s.data_type: s for s in info.sections}
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        meta = embedding_metadata_pb2.EmbeddingMetadata()
        if (section := by_type.get(EMBEDDING_METADATA)) is not None:
            meta.ParseFromString(_read(fd, section, MAX_EMBEDDING_METADATA_BYTES))
        if (section := by_type.get(HF_TOKENIZER)) is not None:
            encode = _hf(_read(fd, section, MAX_TOKENIZER_BYTES))
        elif (section := by_type.get(SP_TOKENIZER)) is not None:
            encode = _sp(_read(fd, section, MAX_TOKENIZER_BYTES))
        else:
            kinds = sorted(t for t in by_type if "Tokenizer" in t) or ["none"]
            raise NoTokenCounter(f"a tokenizer section of kind {', '.join(kinds)}")
    finally:
        os.close(fd)
    special = 0
    for name in ("bos_token", "eos_token"):
        token = getattr(meta, name)
        if not meta.HasField(name):
            continue
        if token.WhichOneof("token_union") == "token_ids":
            special += len(token.token_ids.ids)
        else:
            # The runtime tokenizes a token given by its string like any text: a SentencePiece
            # model can make two pieces of it (a word-start piece, then the symbol).
            special += encode([token.token_str])[0]
    return TokenCounter(encode, special)


def _read(fd: int, section: Section, cap: int) -> bytes:
    if section.size > cap:
        raise NoTokenCounter(f"a {section.data_type} section of {section.size} bytes")
    data = os.pread(fd, section.size, section.begin)
    if len(data) != section.size:
        raise NoTokenCounter(f"the file ends inside its {section.data_type} section")
    return data


def _hf(data: bytes) -> Callable[[list[str]], list[int]]:
    """A tokenizer.json as litert_lm_builder writes it: its length as a little-endian
    uint64, then its zlib stream."""
    from tokenizers import Tokenizer

    length = int.from_bytes(data[:8], "little")
    if length > MAX_TOKENIZER_BYTES:
        raise NoTokenCounter(f"an {HF_TOKENIZER} section that inflates to {length} bytes")
    inflater = zlib.decompressobj()
    text = inflater.decompress(data[8:], length)
    if len(text) != length:
        raise NoTokenCounter(f"an {HF_TOKENIZER} section shorter than its stated length")
    tokenizer = Tokenizer.from_str(text.decode("utf-8"))

    def encode(texts: list[str]) -> list[int]:
        # The runtime adds its special tokens itself (EmbeddingMetadata), not the tokenizer's.
        return [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    return encode


def _sp(data: bytes) -> Callable[[list[str]], list[int]]:
    import sentencepiece

    processor = sentencepiece.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)

    def encode(texts: list[str]) -> list[int]:
        return [len(ids) for ids in processor.EncodeAsIds(texts)]

    return encode
