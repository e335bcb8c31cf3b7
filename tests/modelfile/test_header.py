"""Tests for modeld.modelfile.header: the header reader, on files written by litert_lm_builder."""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litert_lm_builder import litertlm_builder as lb
from litert_lm_builder import litertlm_core
from litert_lm_builder.runtime.proto import llm_metadata_pb2

from modeld.errors import CorruptModel
from modeld.modelfile.header import (
    DEFAULT_HINT,
    HEADER_BEGIN,
    MAX_HEADER_BYTES,
    MAX_LLM_METADATA_BYTES,
    SUPPORTED_MAJOR_VERSIONS,
    ModelInfo,
    PRead,
    read_header,
    read_header_from,
)
from tests.support.state import MODELS as MODELS_DIR

FIXTURES = sorted(MODELS_DIR.glob("*.litertlm"))
MANIFEST = json.loads((MODELS_DIR / "fixtures.json").read_text())["fixtures"]

# (model_type, backend_constraint) per TFLite section.
SectionSpec = tuple[lb.TfLiteModelType, str | None]


def build_litertlm(
    path: Path,
    sections: Sequence[SectionSpec] = ((lb.TfLiteModelType.PREFILL_DECODE, None),),
    *,
    llm_model: str | None = "gemma3n",
    max_num_tokens: int = 1024,
    min_runtime_version: str | None = "0.9.0",
) -> Path:
    """Write a header-complete .litertlm at ``path`` with dummy section bytes."""
    work = path.parent / (path.name + ".parts")
    work.mkdir(exist_ok=True)
    tfl = work / "m.tflite"
    tfl.write_bytes(b"\0\0\0\0TFL3" + bytes(200))
    builder = lb.LitertLmFileBuilder()
    if llm_model is not None:
        msg = llm_metadata_pb2.LlmMetadata()
        msg.max_num_tokens = max_num_tokens
        getattr(msg.llm_model_type, llm_model).SetInParent()
        meta = work / "meta.pb"
        meta.write_bytes(msg.SerializeToString())
        builder.add_llm_metadata(str(meta), min_runtime_version=min_runtime_version)
    for model_type, constraint in sections:
        builder.add_tflite_model(str(tfl), model_type, backend_constraint=constraint)
    with path.open("wb") as f:
        builder.build(f)
    return path


GEMMA3N_LIKE: tuple[SectionSpec, ...] = (
    (lb.TfLiteModelType.PREFILL_DECODE, None),
    (lb.TfLiteModelType.EMBEDDER, None),
    (lb.TfLiteModelType.VISION_ENCODER, "gpu"),
    (lb.TfLiteModelType.VISION_ADAPTER, "cpu"),
    (lb.TfLiteModelType.AUDIO_ENCODER_HW, "cpu, gpu"),
)


@cache
def sample_bytes() -> bytes:
    """A Gemma-3n-shaped file's bytes, built once for the fuzz tests."""
    with tempfile.TemporaryDirectory() as d:
        return build_litertlm(Path(d) / "s.litertlm", GEMMA3N_LIKE).read_bytes()


def header_end_of(data: bytes | bytearray) -> int:
    return int(struct.unpack_from("<Q", data, 24)[0])


def parse_bytes(data: bytes) -> ModelInfo:
    return read_header_from(
        lambda off, n: data[off : off + n], len(data), subject="file fuzz.litertlm"
    )


def test_reads_sections_constraints_and_llm_metadata(tmp_path: Path) -> None:
    """Sections, model types, constraints and LlmMetadata come back as the builder wrote them."""
    info = read_header(build_litertlm(tmp_path / "m.litertlm", GEMMA3N_LIKE))
    assert info.version == (1, 7, 0)
    assert [s.data_type for s in info.sections] == ["LlmMetadataProto"] + ["TFLiteModel"] * 5
    assert info.section_for("tf_lite_vision_encoder") is info.sections[3]
    assert info.constraint_for("main") is None
    assert info.constraint_for("vision") == frozenset({"gpu"})
    assert info.constraint_for("audio") == frozenset({"cpu", "gpu"})
    assert info.has_vision and info.has_audio
    assert info.sections[4].backend_constraint == frozenset({"cpu"})
    assert info.llm_metadata is not None
    assert info.llm_metadata.model_type == "gemma3n"
    assert info.llm_metadata.max_num_tokens == 1024
    assert info.llm_metadata.min_runtime_version == "0.9.0"
    assert info.sections[0].begin >= info.header_end
    assert all(s.begin % litertlm_core.BLOCK_SIZE == 0 for s in info.sections)
    assert "uuid" in info.system


def test_text_only_file_has_no_vision_or_audio(tmp_path: Path) -> None:
    """A file with only a prefill/decode section reports text only and no constraints."""
    info = read_header(build_litertlm(tmp_path / "t.litertlm", llm_model=None))
    assert not info.has_vision and not info.has_audio
    assert info.llm_metadata is None
    assert info.role_section("main") is info.sections[0]
    assert info.constraint_for("vision") is None


def test_artisan_text_decoder_is_the_main_section(tmp_path: Path) -> None:
    """A web-style file's artisan text decoder counts as the main section with its constraint."""
    path = build_litertlm(
        tmp_path / "w.litertlm", [(lb.TfLiteModelType.ARTISAN_TEXT_DECODER, "gpu_artisan")]
    )
    assert read_header(path).constraint_for("main") == frozenset({"gpu_artisan"})


def test_embedding_model_is_its_own_kind(tmp_path: Path) -> None:
    """A text encoder and no decoder or LlmMetadata is an embedding model; its encoder is the
    main section (with its constraint). A decoder file stays a text model even with one."""
    embedding = build_litertlm(
        tmp_path / "e.litertlm",
        [(lb.TfLiteModelType.EMBEDDER, None), (lb.TfLiteModelType.TEXT_ENCODER, "cpu")],
        llm_model=None,
    )
    info = read_header(embedding)
    assert info.kind == "embedding"
    assert info.role_section("main") is info.sections[1]
    assert info.constraint_for("main") == frozenset({"cpu"})
    assert info.to_dict()["kind"] == "embedding"
    text = build_litertlm(tmp_path / "t.litertlm", GEMMA3N_LIKE)
    assert read_header(text).kind == "text"
    both = build_litertlm(
        tmp_path / "b.litertlm",
        [(lb.TfLiteModelType.PREFILL_DECODE, None), (lb.TfLiteModelType.TEXT_ENCODER, None)],
    )
    mixed = read_header(both)
    assert mixed.kind == "text"
    assert mixed.role_section("main") is mixed.sections[1]  # the decoder (after LlmMetadata)


def test_to_dict_is_json(tmp_path: Path) -> None:
    """to_dict is plain JSON with sorted constraint lists and per-section items."""
    info = read_header(build_litertlm(tmp_path / "m.litertlm", GEMMA3N_LIKE))
    doc = json.loads(json.dumps(info.to_dict()))
    assert doc["version"] == "1.7.0"
    assert doc["backend_constraints"] == {"main": None, "vision": ["gpu"], "audio": ["cpu", "gpu"]}
    assert doc["modalities"] == {"text": True, "vision": True, "audio": True}
    assert doc["llm_metadata"]["model_type"] == "gemma3n"
    assert doc["sections"][3]["model_type"] == "tf_lite_vision_encoder"
    assert doc["sections"][3]["size"] == doc["sections"][3]["end"] - doc["sections"][3]["begin"]


def test_supported_major_matches_the_builder() -> None:
    """The reader accepts the major version that the bundled builder writes."""
    assert litertlm_core.LITERTLM_MAJOR_VERSION in SUPPORTED_MAJOR_VERSIONS


def test_bad_magic_names_the_problem_and_the_callers_fix(tmp_path: Path) -> None:
    """A file without the magic is refused naming what it starts with; the message ends with
    the caller's advice (by default: use an intact file, never a pull that may not help), and
    ``problem`` holds what is wrong alone, for a caller that words its own advice."""
    path = tmp_path / "x.litertlm"
    path.write_bytes(b"<html>404 not found</html>" + bytes(100))
    with pytest.raises(CorruptModel) as plain:
        read_header(path, model_id="gemma-x")
    problem = "not a LiteRT-LM file (starts with b'<html>40', expected b'LITERTLM')"
    assert plain.value.message == f"model gemma-x: {problem}; {DEFAULT_HINT}"
    assert plain.value.problem == problem
    with pytest.raises(CorruptModel) as told:
        read_header(path, subject="file x.litertlm", hint="choose another")
    assert told.value.message == f"file x.litertlm: {problem}; choose another"


@pytest.mark.parametrize("size", [0, 1, 8, 31])
def test_too_short_file(tmp_path: Path, size: int) -> None:
    """A file shorter than the fixed prefix is corrupt, not an IndexError."""
    path = tmp_path / "short.litertlm"
    path.write_bytes(sample_bytes()[:size])
    with pytest.raises(CorruptModel, match="too short"):
        read_header(path)


def test_unsupported_major_version(tmp_path: Path) -> None:
    """A future major format version is refused with its number in the message."""
    data = bytearray(sample_bytes())
    data[8:12] = (2).to_bytes(4, "little")
    path = tmp_path / "v2.litertlm"
    path.write_bytes(data)
    with pytest.raises(CorruptModel, match=r"format 2\.7\.0 is not supported"):
        read_header(path)


@pytest.mark.parametrize("end", [0, 32, 36, 10**12])
def test_header_end_out_of_range(tmp_path: Path, end: int) -> None:
    """A header end offset before the flatbuffer or past the file is refused."""
    data = bytearray(sample_bytes())
    data[24:32] = end.to_bytes(8, "little")
    path = tmp_path / "he.litertlm"
    path.write_bytes(data)
    with pytest.raises(CorruptModel, match="header end offset"):
        read_header(path)


def test_truncated_download_is_named_truncated(tmp_path: Path) -> None:
    """A file cut inside its last section says which section and that it is truncated."""
    data = sample_bytes()
    path = tmp_path / "cut.litertlm"
    path.write_bytes(data[: len(data) - 50])
    with pytest.raises(CorruptModel, match=r"section 5 \(tf_lite_audio_encoder_hw\).*truncated"):
        read_header(path, model_id="m")


def test_truncated_inside_header(tmp_path: Path) -> None:
    """A file cut inside the header itself is refused."""
    data = sample_bytes()
    path = tmp_path / "cut.litertlm"
    path.write_bytes(data[: header_end_of(data) - 1])
    with pytest.raises(CorruptModel):
        read_header(path)


def test_section_inside_header_is_refused() -> None:
    """A section whose data would overlap the header is corrupt."""
    data = bytearray(sample_bytes())
    info = parse_bytes(bytes(data))
    begin = info.sections[1].begin
    pos = data.find(struct.pack("<Q", begin), HEADER_BEGIN, info.header_end)
    assert pos > 0
    data[pos : pos + 8] = struct.pack("<Q", 40)
    with pytest.raises(CorruptModel, match="inside the header"):
        parse_bytes(bytes(data))


def test_sparse_2gb_file_reads(tmp_path: Path) -> None:
    """A 2 GB (sparse) file's header reads with the file's full size.

    How little of the file is read is pinned by the next test (bytes, not seconds: no
    timed asserts on shared machines); bench/bench_litertlm.py has the timings.
    """
    path = build_litertlm(tmp_path / "big.litertlm", GEMMA3N_LIKE)
    with path.open("r+b") as f:
        f.truncate(2 * 1024**3)
    info = read_header(path)
    assert info.file_size == 2 * 1024**3
    assert info.role_section("main") is not None


def test_reads_only_the_header_and_llm_metadata() -> None:
    """The reader touches the header and the LlmMetadata section, never model bytes."""
    data = sample_bytes()
    reads: list[tuple[int, int]] = []

    def pread(off: int, n: int) -> bytes:
        reads.append((off, n))
        return data[off : off + n]

    info = read_header_from(pread, len(data), subject="t")
    meta = info.sections[0]
    allowed = [(0, info.header_end), (meta.begin, meta.end)]
    for off, n in reads:
        assert any(lo <= off and off + n <= hi for lo, hi in allowed), (off, n)


def _bounded_pread(data: bytes, reads: list[int]) -> PRead:
    def pread(off: int, n: int) -> bytes:
        assert off >= 0
        assert n >= 0
        reads.append(n)
        return data[off : off + n]

    return pread


def _check_fuzzed(data: bytes) -> None:
    reads: list[int] = []
    try:
        read_header_from(_bounded_pread(data, reads), len(data), subject="f")
    except CorruptModel as e:
        assert e.message.startswith("f: ")
        assert e.message.endswith(DEFAULT_HINT) or "upgrade" in e.message
    assert sum(reads) <= HEADER_BEGIN + MAX_HEADER_BYTES + MAX_LLM_METADATA_BYTES


FUZZ = settings(
    max_examples=400, deadline=200, suppress_health_check=[HealthCheck.too_slow], database=None
)


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes(data: bytes) -> None:
    """Random bytes never raise anything but CorruptModel, with or without the magic."""
    _check_fuzzed(data)
    _check_fuzzed(b"LITERTLM" + data)


@FUZZ
@given(st.data())
def test_fuzz_mutated_header(data: st.DataObject) -> None:
    """Bytes flipped anywhere in a real header give a ModelInfo or CorruptModel, quickly."""
    raw = bytearray(sample_bytes())
    end = header_end_of(raw)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, end - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    _check_fuzzed(bytes(raw))


@FUZZ
@given(st.data())
def test_fuzz_overwritten_words(data: st.DataObject) -> None:
    """Header words overwritten with extreme values (huge counts, offsets) stay bounded."""
    raw = bytearray(sample_bytes())
    end = header_end_of(raw)
    pos = data.draw(st.integers(HEADER_BEGIN, end - 4))
    word = data.draw(st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, end, len(raw)]))
    raw[pos : pos + 4] = word.to_bytes(4, "little")
    _check_fuzzed(bytes(raw))


@FUZZ
@given(st.integers(0, 60_000))
def test_fuzz_truncation(cut: int) -> None:
    """Every truncation of a valid file is either still complete or CorruptModel."""
    data = sample_bytes()
    _check_fuzzed(data[:cut])
    if cut < len(data):
        with pytest.raises(CorruptModel):
            parse_bytes(data[:cut])


@pytest.mark.skipif(not FIXTURES, reason="no fixtures in tests/models/ yet")
@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_committed_fixtures_read(path: Path) -> None:
    """Every committed fixture has a valid header with a main section inside the file."""
    info = read_header(path)
    assert info.role_section("main") is not None
    assert all(s.end <= path.stat().st_size for s in info.sections)
    assert info.kind == MANIFEST[path.stem]["kind"]
    if path.name.startswith("gemma3n-like"):
        assert info.constraint_for("vision") == frozenset({"gpu"})


def pack_header(n_sections: int, n_items: int) -> bytes:
    """A header-only file with many empty sections, each carrying ``n_items`` string items."""
    import flatbuffers
    from litert_lm_builder import litertlm_header_schema_py_generated as schema

    def kv(key: str, value: str) -> schema.KeyValuePairT:
        return schema.KeyValuePairT(
            key=key, value=schema.StringValueT(value), valueType=schema.VData.StringValue
        )

    def pack(offset: int) -> bytes:
        objects = [
            schema.SectionObjectT(
                items=[kv(f"k{j}", "v") for j in range(n_items)],
                dataType=schema.AnySectionDataType.GenericBinaryData,
                beginOffset=offset,
                endOffset=offset,
            )
            for _ in range(n_sections)
        ]
        meta = schema.LiteRTLMMetaDataT(
            systemMetadata=schema.SystemMetadataT(entries=[]),
            sectionMetadata=schema.SectionMetadataT(objects=objects),
        )
        b = flatbuffers.Builder(1024)
        b.Finish(meta.Pack(b))
        return bytes(b.Output())

    fb = pack(1)
    end = HEADER_BEGIN + len(fb)
    fb = pack(end)
    prefix = b"LITERTLM" + struct.pack("<III", 1, 7, 0) + bytes(4) + struct.pack("<Q", end)
    return prefix + fb


def test_many_sections_within_limits_parse() -> None:
    """A header with hundreds of small sections is still a valid file."""
    info = parse_bytes(pack_header(200, 5))
    assert len(info.sections) == 200
    assert info.sections[0].items["k4"] == "v"


@pytest.mark.timeout(30)
def test_item_flood_is_refused() -> None:
    """A header whose sections carry more items in all than any real file is refused.

    The refusal comes from the item count, before the items are read; the timeout only
    catches a parser that walks the whole flood (no timed assert: the machines are shared).
    """
    data = pack_header(200, 60)
    with pytest.raises(CorruptModel, match="items in all"):
        parse_bytes(data)
