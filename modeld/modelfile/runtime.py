"""Creating a LiteRT-LM engine from a runner ``create`` spec, and reading back its options.

One function for the runner child and the probe child, so a probe opens the model exactly
as a runner will. ``litert_lm`` is imported when an engine is made, never at import time:
processes that never create an engine do not pay for the runtime (a large package,
docs/benchmarks.md#engine-memory).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CreateSpec:
    """What an engine is created from: a runner's ``create`` op, and a probe child's spec.

    ``to_json`` is the wire form (the ``create`` frame's fields, the probe's ``--spec``);
    ``from_json`` reads it back and ignores the frame's other fields (``op``, ``id``).
    """

    path: str  # the ``.litertlm`` link: the runtime picks the format by extension
    backend: str = "cpu"
    vision: str | None = None  # None: no vision encoder is loaded
    audio: str | None = None  # None: no audio encoder is loaded
    max_tokens: int | None = None  # None leaves it to the file's metadata
    max_images: int | None = None
    cache_dir: str | None = None  # without it the runtime writes its cache next to the file
    # The entry's [limits] speculative_decoding as is: None leaves it to the runtime.
    speculative: bool | None = None
    # CPU threads: the daemon always sends its chosen count; None leaves it to the runtime.
    threads: int | None = None
    # A runner's ``create`` only: one short generation after the engine is made.
    warm_up: bool = False
    # "text": a ``litert_lm.Engine``; "embedding": a ``litert_lm.EmbeddingEngine`` (the
    # file's kind, ``ModelInfo.kind``: an ``Engine`` aborts the process on an embedding file).
    kind: str = "text"
    # A runner's ``create`` only: how many conversations it keeps after a reply for their
    # next turn (``MODELD_KEPT_CONVERSATIONS``; 0: none).
    kept_conversations: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> CreateSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


def create_engine(spec: CreateSpec) -> Any:
    """The ``litert_lm.Engine`` (or, for kind ``embedding``, ``EmbeddingEngine``) of a spec.

    The runner's ``create`` op and the GPU probe child (``modeld.modelfile.probe``) both call this
    with the same spec, so a probe opens the model exactly as a runner will: same path
    (the ``.litertlm`` link: the runtime picks the format by extension), cache dir and
    engine options.
    """
    import litert_lm

    threads = spec.threads

    def backend(name: str | None) -> Any:
        if name is None:
            return None
        if name not in ("cpu", "gpu"):
            raise ValueError(f"unknown backend {name!r}; use cpu or gpu")
        if name == "gpu":
            return litert_lm.Backend.GPU()
        # None leaves it to the runtime; the daemon always sends its chosen count.
        return litert_lm.Backend.CPU(thread_count=None if threads is None else int(threads))

    cache_dir = spec.cache_dir
    if cache_dir:
        # The runtime refuses a cache dir that does not exist yet.
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    if spec.kind == "embedding":
        # No window, images or decoding: its input lengths are the encoder's signatures.
        return litert_lm.EmbeddingEngine(
            spec.path,
            backend=backend(spec.backend),
            vision_backend=backend(spec.vision),
            audio_backend=backend(spec.audio),
            cache_dir=cache_dir,
        )
    if spec.kind != "text":
        raise ValueError(f"unknown engine kind {spec.kind!r}; use text or embedding")
    speculative = spec.speculative
    return litert_lm.Engine(
        spec.path,
        backend=backend(spec.backend),
        vision_backend=backend(spec.vision),
        audio_backend=backend(spec.audio),
        max_num_tokens=spec.max_tokens,
        max_num_images=spec.max_images,
        cache_dir=cache_dir,
        # Prefill/decode counts and speeds for the phase timings.
        enable_benchmark=True,
        # None leaves it to the runtime (the file's default); False turns it off.
        enable_speculative_decoding=None if speculative is None else bool(speculative),
    )


def _backend_name(backend: Any) -> str | None:
    return str(backend.get_name()) if backend is not None else None


def _cpu_threads(engine: Any) -> int | None:
    """The thread count of the engine's CPU backends (the daemon gives them all the same)."""
    for backend in (engine.backend, engine.vision_backend, engine.audio_backend):
        count = getattr(backend, "thread_count", None)
        if count is not None:
            return int(count)
    return None


def engine_options(engine: Any) -> dict[str, Any]:
    """The settings a ``litert_lm.Engine`` was created with, in the runtime's own names.

    Read from the engine object, which is what the binding hands to the runtime's engine
    settings (litert-lm 0.18.1 ``Engine.__init__``), so a value that got lost on the way
    from the registry entry shows here as what the engine really has.
    """
    common = {
        "model_path": engine.model_path,
        "backend": _backend_name(engine.backend),
        "vision_backend": _backend_name(engine.vision_backend),
        "audio_backend": _backend_name(engine.audio_backend),
        "cache_dir": engine.cache_dir,
        # None: no CPU backend, or the runtime's own default count.
        "cpu_threads": _cpu_threads(engine),
    }
    if not hasattr(engine, "max_num_tokens"):  # an EmbeddingEngine: no window, no decoding
        return common | {
            "max_input_length": engine.max_input_length,
            "min_input_length": engine.min_input_length,
        }
    return common | {
        "max_num_tokens": engine.max_num_tokens,
        "max_num_images": engine.max_num_images,
        "enable_speculative_decoding": engine.enable_speculative_decoding,
    }
