"""Reading a ``.litertlm`` file's header without loading the model.

The layout (``litert_lm_builder/litertlm_core.py``): the magic ``LITERTLM``, three
little-endian uint32 version numbers, the header's end offset as a uint64 at byte 24,
then a flatbuffer (``LiteRTLMMetaData``) from byte 32 up to that end offset. Sections
(models, weights, tokenizer, the ``LlmMetadata`` proto) follow, aligned to 16 KiB.

Only the header and the small ``LlmMetadata`` section are read, each with a hard size
cap, so reading costs the same for a 2 GB file as for a 2 MB one. Every failure is a
:class:`~modeld.errors.CorruptModel` that says what is wrong and what to do.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from litert_lm_builder import litertlm_header_schema_py_generated as schema
from litert_lm_builder.runtime.proto import llm_metadata_pb2

from modeld.errors import CorruptModel

MAGIC = b"LITERTLM"
# litert_lm_builder 0.18.1 writes 1.7.0 (litertlm_core.LITERTLM_MAJOR_VERSION); the
# runtime's format changes are additive within a major version.
SUPPORTED_MAJOR_VERSIONS = frozenset({1})
HEADER_BEGIN = 32
HEADER_END_FIELD = 24
# Real headers are a few KiB with a dozen or so sections of a few items each; the caps
# bound the work done on a corrupted or hostile file (its flatbuffer walk: see
# docs/benchmarks.md#header-caps), not a limit any real model comes near.
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_LLM_METADATA_BYTES = 1024 * 1024
MAX_SECTIONS = 256
MAX_ITEMS = 64
# All items together: crafted sections could share one large item vector.
MAX_TOTAL_ITEMS = 1024

MAIN_MODEL_TYPES = ("tf_lite_prefill_decode", "tf_lite_artisan_text_decoder")
# An embedding model's main section: the encoder whose output is the vector.
TEXT_ENCODER_TYPE = "tf_lite_text_encoder"
EMBEDDING_METADATA = "EmbeddingMetadataProto"
VISION_MODEL_TYPE = "tf_lite_vision_encoder"
AUDIO_MODEL_TYPE = "tf_lite_audio_encoder_hw"
Role = Literal["main", "vision", "audio"]
# What the file's engine does: generate text (LiteRT-LM's ``Engine``) or compute embeddings
# (its ``EmbeddingEngine``).
Kind = Literal["text", "embedding"]

_DATA_TYPE_NAMES = {v: k for k, v in vars(schema.AnySectionDataType).items() if isinstance(v, int)}
_VDATA_CLASSES: dict[int, Any] = {
    schema.VData.UInt8: schema.UInt8,
    schema.VData.Int8: schema.Int8,
    schema.VData.UInt16: schema.UInt16,
    schema.VData.Int16: schema.Int16,
    schema.VData.UInt32: schema.UInt32,
    schema.VData.Int32: schema.Int32,
    schema.VData.UInt64: schema.UInt64,
    schema.VData.Int64: schema.Int64,
    schema.VData.Float32: schema.Float32,
    schema.VData.Double: schema.Double,
    schema.VData.Bool: schema.Bool,
    schema.VData.StringValue: schema.StringValue,
}

# Reads ``size`` bytes at ``offset``; may return fewer at the end of the file.
PRead = Callable[[int, int], bytes]


@dataclass(frozen=True)
class Section:
    """One section of the file as the header describes it."""

    index: int
    data_type: str
    begin: int
    end: int
    model_type: str | None
    backend_constraint: frozenset[str] | None
    items: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def size(self) -> int:
        return self.end - self.begin

    def allows(self, backend: str) -> bool:
        """Whether this section may run on ``backend`` (no constraint allows everything)."""
        return self.backend_constraint is None or backend in self.backend_constraint

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "data_type": self.data_type,
            "begin": self.begin,
            "end": self.end,
            "size": self.size,
            "model_type": self.model_type,
            "backend_constraint": (
                sorted(self.backend_constraint) if self.backend_constraint is not None else None
            ),
            "items": dict(self.items),
        }


@dataclass(frozen=True)
class LlmInfo:
    """The fields of the ``LlmMetadata`` proto that modeld shows or acts on."""

    model_type: str | None
    max_num_tokens: int | None
    min_runtime_version: str | None
    supports_thinking: bool | None
    supports_function_calling: bool | None
    has_chat_template: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "max_num_tokens": self.max_num_tokens,
            "min_runtime_version": self.min_runtime_version,
            "supports_thinking": self.supports_thinking,
            "supports_function_calling": self.supports_function_calling,
            "has_chat_template": self.has_chat_template,
        }


@dataclass(frozen=True)
class ModelInfo:
    """What the header of one ``.litertlm`` file says."""

    version: tuple[int, int, int]
    sections: tuple[Section, ...]
    llm_metadata: LlmInfo | None
    file_size: int
    header_end: int
    system: Mapping[str, str] = field(default_factory=dict, hash=False)

    def section_for(self, model_type: str) -> Section | None:
        """The first section whose ``model_type`` is ``model_type``, if any."""
        return next((s for s in self.sections if s.model_type == model_type), None)

    @property
    def kind(self) -> Kind:
        """``embedding`` for an embedding model, else ``text``.

        As the runtime decides (``litert_lm.ModelInfo.model_type``): a file with an
        ``LlmMetadata`` section generates text; one with ``EmbeddingMetadata`` instead, or
        a text encoder and no decoder, is an embedding model.
        """
        if self.llm_metadata is not None or any(
            self.section_for(t) is not None for t in MAIN_MODEL_TYPES
        ):
            return "text"
        if self.section_for(TEXT_ENCODER_TYPE) is not None or any(
            s.data_type == EMBEDDING_METADATA for s in self.sections
        ):
            return "embedding"
        return "text"

    def role_section(self, role: Role) -> Section | None:
        """The section the runtime checks for ``role`` (main, vision or audio).

        An embedding model's main section is its text encoder (the runtime checks that
        section's backend constraint against the main backend).
        """
        if role == "main":
            types = (TEXT_ENCODER_TYPE,) if self.kind == "embedding" else MAIN_MODEL_TYPES
            for model_type in types:
                if (section := self.section_for(model_type)) is not None:
                    return section
            return None
        return self.section_for(VISION_MODEL_TYPE if role == "vision" else AUDIO_MODEL_TYPE)

    def constraint_for(self, role: Role) -> frozenset[str] | None:
        """The backends allowed for ``role``; None when unconstrained or absent."""
        section = self.role_section(role)
        return section.backend_constraint if section is not None else None

    @property
    def has_vision(self) -> bool:
        return self.role_section("vision") is not None

    @property
    def has_audio(self) -> bool:
        return self.role_section("audio") is not None

    @property
    def version_string(self) -> str:
        return ".".join(map(str, self.version))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for ``GET /api/models/{id}`` and ``modeld show``."""
        constraints: dict[str, list[str] | None] = {}
        for role in ("main", "vision", "audio"):
            c = self.constraint_for(role)
            constraints[role] = sorted(c) if c is not None else None
        return {
            "version": self.version_string,
            "kind": self.kind,
            "file_size": self.file_size,
            "header_end": self.header_end,
            "modalities": {"text": True, "vision": self.has_vision, "audio": self.has_audio},
            "backend_constraints": constraints,
            "llm_metadata": self.llm_metadata.to_dict() if self.llm_metadata else None,
            "system": dict(self.system),
            "sections": [s.to_dict() for s in self.sections],
        }


# What to do about a file that is not a readable LiteRT-LM one, where the caller knows no
# better: whether a new copy helps depends on where the file came from (an import, a
# download whose bytes match the entry's sha256), which callers that know say themselves.
DEFAULT_HINT = "use an intact LiteRT-LM model (a .litertlm file)"


def read_header(
    path: Path | str,
    *,
    model_id: str | None = None,
    subject: str | None = None,
    hint: str = DEFAULT_HINT,
) -> ModelInfo:
    """Read and validate the header of the ``.litertlm`` file at ``path``.

    Raises CorruptModel for anything that is not a readable, complete LiteRT-LM file,
    and FileNotFoundError/PermissionError (as they come) when the file cannot be opened.
    Its message starts with ``subject`` (default ``model ID``, else ``file PATH``) and ends
    with ``hint``; its ``problem`` is what is wrong, without the two.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        size = os.fstat(fd).st_size
        return read_header_from(
            lambda offset, n: os.pread(fd, n, offset),
            size,
            subject=subject or (f"model {model_id}" if model_id else f"file {path}"),
            hint=hint,
        )
    finally:
        os.close(fd)


def read_header_from(
    pread: PRead, file_size: int, *, subject: str, hint: str = DEFAULT_HINT
) -> ModelInfo:
    """Parse a header through ``pread``; ``read_header`` with the file access injected.

    ``subject`` starts every error message (``model gemma-4-E2B-it``, ``file /x.litertlm``)
    and ``hint`` ends it, but for an unsupported format version, which has its own.
    """

    def corrupt(what: str) -> CorruptModel:
        return CorruptModel(f"{subject}: {what}; {hint}", problem=what, file_size=file_size)

    if file_size < HEADER_BEGIN:
        raise corrupt(f"file is {file_size} bytes, too short for a LiteRT-LM header")
    prefix = pread(0, HEADER_BEGIN)
    if len(prefix) < HEADER_BEGIN:
        raise corrupt("file ended while reading the first 32 bytes")
    if prefix[:8] != MAGIC:
        raise corrupt(f"not a LiteRT-LM file (starts with {prefix[:8]!r}, expected {MAGIC!r})")
    major, minor, patch = struct.unpack_from("<III", prefix, 8)
    if major not in SUPPORTED_MAJOR_VERSIONS:
        supported = ", ".join(str(v) for v in sorted(SUPPORTED_MAJOR_VERSIONS))
        raise CorruptModel(
            f"{subject}: LiteRT-LM format {major}.{minor}.{patch} is not supported "
            f"(this runtime reads major version {supported}); use a file built for "
            "LiteRT-LM 0.18 or upgrade modeld",
            file_size=file_size,
        )
    (header_end,) = struct.unpack_from("<Q", prefix, HEADER_END_FIELD)
    if header_end <= HEADER_BEGIN + 4 or header_end > file_size:
        raise corrupt(
            f"header end offset {header_end} is outside the file "
            f"(valid: {HEADER_BEGIN + 4}..{file_size}); the file is truncated or damaged"
        )
    if header_end - HEADER_BEGIN > MAX_HEADER_BYTES:
        raise corrupt(f"header of {header_end - HEADER_BEGIN} bytes is larger than any real one")
    buf = pread(HEADER_BEGIN, header_end - HEADER_BEGIN)
    if len(buf) != header_end - HEADER_BEGIN:
        raise corrupt("file ended inside the header")

    try:
        sections, system = _parse_flatbuffer(buf)
    except _Bad as e:
        raise corrupt(f"header is damaged ({e})") from None
    # The generated flatbuffers code indexes raw bytes with offsets taken from the
    # file: garbage surfaces as struct.error, IndexError, UnicodeDecodeError, ... .
    except Exception as e:
        raise corrupt(f"header flatbuffer cannot be parsed ({type(e).__name__})") from None

    _check_bounds(sections, header_end, file_size, corrupt)
    llm = _read_llm_metadata(pread, sections, corrupt)
    return ModelInfo(
        version=(major, minor, patch),
        sections=tuple(sections),
        llm_metadata=llm,
        file_size=file_size,
        header_end=header_end,
        system=MappingProxyType(system),
    )


class _Bad(Exception):
    """A structural problem found while walking the flatbuffer."""


def _vector_len(n: int, buf_len: int, cap: int, what: str) -> int:
    # Each element is a 4-byte offset, so a real vector cannot be longer than buf/4;
    # the cap keeps a plausible-looking but huge count from costing seconds.
    if n < 0 or n * 4 > buf_len or n > cap:
        raise _Bad(f"{what} count {n} is impossible")
    return n


def _kv(kvp: Any) -> tuple[str, str]:
    key_bytes = kvp.Key()
    if key_bytes is None:
        raise _Bad("an item has no key")
    key = bytes(key_bytes).decode("utf-8")
    value_type = kvp.ValueType()
    table = kvp.Value()
    cls = _VDATA_CLASSES.get(value_type)
    if cls is None or table is None:
        return key, ""
    obj = cls()
    obj.Init(table.Bytes, table.Pos)
    value = obj.Value()
    if isinstance(value, bytes | bytearray):
        return key, bytes(value).decode("utf-8")
    if value_type == schema.VData.Bool:
        return key, "true" if value else "false"
    return key, "" if value is None else str(value)


def _parse_flatbuffer(buf: bytes) -> tuple[list[Section], dict[str, str]]:
    root = schema.LiteRTLMMetaData.GetRootAs(buf, 0)
    system: dict[str, str] = {}
    sysmeta = root.SystemMetadata()
    if sysmeta is not None:
        for i in range(_vector_len(sysmeta.EntriesLength(), len(buf), MAX_ITEMS, "system item")):
            key, value = _kv(sysmeta.Entries(i))
            system[key] = value

    sections: list[Section] = []
    secmeta = root.SectionMetadata()
    if secmeta is None:
        return sections, system
    count = _vector_len(secmeta.ObjectsLength(), len(buf), MAX_SECTIONS, "section")
    total_items = len(system)
    for i in range(count):
        obj = secmeta.Objects(i)
        if obj is None:
            raise _Bad(f"section {i} is missing")
        items: dict[str, str] = {}
        n_items = _vector_len(obj.ItemsLength(), len(buf), MAX_ITEMS, "item")
        total_items += n_items
        if total_items > MAX_TOTAL_ITEMS:
            raise _Bad(f"more than {MAX_TOTAL_ITEMS} items in all")
        for j in range(n_items):
            key, value = _kv(obj.Items(j))
            items[key] = value
        model_type = items.pop("model_type", None)
        constraint_raw = items.pop("backend_constraint", None)
        constraint = (
            frozenset(b.strip().lower() for b in constraint_raw.split(",") if b.strip())
            if constraint_raw is not None
            else None
        )
        data_type = obj.DataType()
        sections.append(
            Section(
                index=i,
                data_type=_DATA_TYPE_NAMES.get(data_type, f"Unknown{data_type}"),
                begin=obj.BeginOffset(),
                end=obj.EndOffset(),
                model_type=model_type.strip().lower() if model_type else None,
                # An empty constraint string constrains nothing (builder: remove).
                backend_constraint=constraint or None,
                items=MappingProxyType(items),
            )
        )
    return sections, system


def _check_bounds(
    sections: list[Section],
    header_end: int,
    file_size: int,
    corrupt: Callable[[str], CorruptModel],
) -> None:
    for s in sections:
        what = f"section {s.index} ({s.model_type or s.data_type})"
        if not s.begin <= s.end:
            raise corrupt(f"{what} ends at {s.end} before it begins at {s.begin}")
        if s.end > file_size:
            raise corrupt(
                f"{what} ends at byte {s.end} but the file has only {file_size} bytes; "
                "the file is truncated"
            )
        if s.begin < header_end and s.end > s.begin:
            raise corrupt(f"{what} begins at {s.begin}, inside the header (ends {header_end})")


def _read_llm_metadata(
    pread: PRead, sections: list[Section], corrupt: Callable[[str], CorruptModel]
) -> LlmInfo | None:
    section = next((s for s in sections if s.data_type == "LlmMetadataProto"), None)
    if section is None:
        return None
    if section.size > MAX_LLM_METADATA_BYTES:
        raise corrupt(f"LlmMetadata section of {section.size} bytes is larger than any real one")
    data = pread(section.begin, section.size)
    if len(data) != section.size:
        raise corrupt("file ended inside the LlmMetadata section")
    msg = llm_metadata_pb2.LlmMetadata()
    try:
        msg.ParseFromString(data)
    # protobuf raises DecodeError, but the upb backend also raises RuntimeError and
    # ValueError on some inputs; all of them mean the same damaged section.
    except Exception as e:
        raise corrupt(f"LlmMetadata section cannot be parsed ({type(e).__name__})") from None
    return LlmInfo(
        model_type=msg.llm_model_type.WhichOneof("model_type"),
        # proto3 int32 without presence: 0 means "not set".
        max_num_tokens=msg.max_num_tokens or None,
        min_runtime_version=(
            msg.min_runtime_version if msg.HasField("min_runtime_version") else None
        ),
        supports_thinking=msg.supports_thinking if msg.HasField("supports_thinking") else None,
        supports_function_calling=(
            msg.supports_function_calling if msg.HasField("supports_function_calling") else None
        ),
        has_chat_template=bool(msg.jinja_prompt_template),
    )
