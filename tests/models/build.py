"""Build small but real ``.litertlm`` test models offline.

The fixtures in this folder are random-weight Llama-style decoders exported
with litert-torch's ``export_hf`` pipeline (int8 weights, except
``tiny-text-f32`` whose weights stay float32; a locally trained byte-level BPE
tokenizer, a Gemma-style chat template) and packed with ``litert_lm_builder``.
The real LiteRT-LM runtime loads them and generates (meaningless) tokens. No
hub, no network: configs, tokenizer and weights are made here from fixed seeds.

``tiny-vision`` is the one fixture that takes images: a random Gemma-3-style
image-text model (the same tiny decoder, a 1-layer SigLIP vision tower on
32x32 images and the Gemma-3 projector) exported with ``export_hf``'s
``image_text_to_text`` task, which externalizes the token embedder. The
runtime needs that ``tf_lite_embedder`` section to place image embeddings in
the prompt. ``gemma3n-like`` and ``vision-cpu-ok`` only carry a vision encoder
and adapter for the backend constraints: they have no embedder, so an image
sent to them fails at prefill on cpu (and on an NVIDIA GPU is answered with
output that never saw it).

``tiny-embed`` is the embedding model: no decoder and no ``LlmMetadata``, but an
``EmbeddingMetadata`` section (a generic embedding model with ``<bos>``/``<eos>``),
the same kind of tokenizer, a ``tf_lite_embedder`` (one token id -> its vector) and a
``tf_lite_text_encoder`` whose signatures ``encoder_16``/``encoder_64`` take
``embeddings`` [1, T, 64] and ``input_mask`` [1, T] and give one [1, 32] vector (the
runtime picks the shortest signature that fits, fills the mask and L2-normalises).
Both are small torch modules converted with litert-torch, float32.

Rebuilding
----------
The build needs torch and litert-torch, which the daemon does not; use a
separate virtual environment (install the CPU torch wheel FIRST, explicitly,
so pip never pulls a multi-GB CUDA build)::

    python3.11 -m venv .venv-models
    .venv-models/bin/pip install torch==2.13.0
    .venv-models/bin/pip install -r tests/models/requirements.txt
    .venv-models/bin/python tests/models/build.py            # all fixtures
    .venv-models/bin/python tests/models/build.py --only tiny-text
    .venv-models/bin/python tests/models/build.py --large    # ~40 MB model

(``.venv-models`` at the repository root is ignored by git; any other folder will do.)

Fixtures go to ``--out`` (default: this folder) together with
``fixtures.json``, the manifest (file, sha256, size, sections, constraints,
allowed backends, expected runtime behaviour). ``--large`` builds
``large-text.litertlm`` into ``$MODELD_TEST_MODEL_CACHE`` (default
``~/.cache/modeld-test-models``); it is for memory tests and is not committed.

Builds are seeded: a rebuild gives files of the same shapes and sections and,
with the same package versions, identical bytes (the system metadata's uuid
and timestamp, which the builder would randomise, are fixed here).

litert-torch imports ``tensorflow.lite.python.schema_py_generated`` without
depending on TensorFlow; ``_tf_shim/`` provides that module by re-exporting
``ai_edge_litert.schema_py_generated`` and is put on ``sys.path`` below.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM = HERE / "_tf_shim"
if str(SHIM) not in sys.path:
    sys.path.insert(0, str(SHIM))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(SHIM), os.environ.get("PYTHONPATH", "")) if p
)
# Never reach for a hub, even by accident.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MANIFEST = "fixtures.json"
LARGE_CACHE_ENV = "MODELD_TEST_MODEL_CACHE"
DEFAULT_LARGE_CACHE = Path.home() / ".cache" / "modeld-test-models"
FIXED_TIMESTAMP = "2026-01-01T00:00:00+00:00"
IMAGE_SIZE = 32  # the tiny vision encoders take [1, 32, 32, 3] images
PATCH_SIZE = 8  # tiny-vision: 4x4 patches per image ...
IMAGE_TOKENS = 4  # ... pooled 2x2 into 4 soft tokens (plus <end_of_image>)

SPECIAL_TOKENS = [
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = [
    "Hello world, this is a tiny test model for modeld.",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Paris is the capital of France.",
    "Tell me a story about a robot who learns to paint.",
    "Please summarise the following text in one sentence.",
    "user model system assistant tool image audio text",
    "Write a haiku about the sea, the wind and the stars.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14",
    "How are you today? I am fine, thank you for asking!",
    "Translate to German: good morning, good night, thank you.",
]

NO_EMBEDDER_NOTE = (
    "no tf_lite_embedder section, so an image is never placed in the prompt: on cpu its"
    " prefill fails (EMBEDDING_LOOKUP index -1 out of bounds); on an NVIDIA GPU (an H200,"
    " litert-lm 0.18.1) vision-cpu-ok answered an image anyway, with output that never saw it"
)


@dataclasses.dataclass(frozen=True)
class TextSpec:
    """Shape of a random Llama-style decoder."""

    seed: int
    layers: int = 2
    hidden: int = 64
    intermediate: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    prefill: int = 32
    cache: int = 256
    # "llama" (LlamaForCausalLM, untied) or "gemma3" (Gemma3ForCausalLM: tied embeddings,
    # five sliding-window layers to one global, like the published Gemma-3 files).
    arch: str = "llama"
    head_dim: int | None = None  # None: hidden // heads
    sliding_window: int | None = None  # gemma3 only; None: wider than the cache
    # True: every weight matrix repeats one short seeded pattern, so the file compresses
    # to a few MB (memory and timing are the same as with random weights).
    pattern: bool = False


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """Shape of a SigLIP vision tower and the soft tokens it gives per image."""

    hidden: int = 32
    intermediate: int = 64
    layers: int = 1
    heads: int = 2
    image_size: int = IMAGE_SIZE
    patch_size: int = PATCH_SIZE
    tokens: int = IMAGE_TOKENS


# Gemma-3-1B's text dimensions (google/gemma-3-1b-it config.json): 26 layers, hidden 1152,
# intermediate 6912, 4 heads of 256, 1 KV head, a 512-token sliding window, 262,144 tokens.
GEMMA3_1B = TextSpec(
    seed=11,
    layers=26,
    hidden=1152,
    intermediate=6912,
    heads=4,
    kv_heads=1,
    vocab=262144,
    prefill=256,
    cache=4096,
    arch="gemma3",
    head_dim=256,
    sliding_window=512,
)
# SigLIP-So400m at 896x896 as in Gemma-3-4B and larger (config.json's vision_config):
# 27 layers, hidden 1152, intermediate 4304, 16 heads, 14-pixel patches, 256 soft tokens.
SIGLIP_896 = VisionSpec(
    hidden=1152, intermediate=4304, layers=27, heads=16, image_size=896, patch_size=14, tokens=256
)


@dataclasses.dataclass(frozen=True)
class FixtureSpec:
    """One ``.litertlm`` file to build."""

    name: str
    text: TextSpec
    description: str
    vision_constraint: str | None = None  # None: no vision sections at all.
    large: bool = False
    quantize: bool = True  # False: float32 weights (no int8 quantization).
    # True: a Gemma-3-style image-text model whose sections take an image
    # (embedder + vision encoder + adapter); vision_constraint must be set.
    image: bool = False
    backends: tuple[str, ...] = ("cpu", "gpu")  # main backends the runtime accepts.
    note: str | None = None  # expected runtime behaviour worth recording.
    # True: a real-size model (real dimensions and vocabulary), built by --real-size
    # into the cache, never committed.
    real_size: bool = False
    vision: VisionSpec | None = None  # image=True: the SigLIP tower (default: a tiny one)


FIXTURES: dict[str, FixtureSpec] = {
    s.name: s
    for s in (
        FixtureSpec(
            "tiny-text",
            TextSpec(seed=1),
            "random 2-layer decoder, hidden 64, text only",
        ),
        FixtureSpec(
            "tiny-text-b",
            TextSpec(seed=2),
            "same shape as tiny-text, other seed (other digest)",
        ),
        FixtureSpec(
            "tiny-text-f32",
            TextSpec(seed=6),
            "same shape as tiny-text, float32 weights (not quantized)",
            quantize=False,
            backends=("cpu",),
            note="its EMBEDDING_LOOKUP reads float32 external weights: on an NVIDIA GPU"
            " (an H200, litert-lm 0.18.1) the runtime aborts the process (SIGABRT) while"
            " creating a gpu engine; cpu loads and generates",
        ),
        FixtureSpec(
            "tiny-text-long",
            TextSpec(seed=8, cache=1280),
            "same shape as tiny-text, a 1280-token window (replies of 1,024 tokens)",
            note="for bench/bench_serve.py's long replies; some prompts end early (the bench"
            " picks one that reaches the length)",
        ),
        FixtureSpec(
            "gemma3n-like",
            TextSpec(seed=3),
            "text decoder + tiny vision encoder (backend_constraint=gpu)"
            " + vision adapter, like Gemma-3n",
            vision_constraint="gpu",
            note=NO_EMBEDDER_NOTE,
        ),
        FixtureSpec(
            "vision-cpu-ok",
            TextSpec(seed=4),
            "like gemma3n-like but the vision encoder allows cpu,gpu",
            vision_constraint="cpu,gpu",
            note=NO_EMBEDDER_NOTE,
        ),
        FixtureSpec(
            "tiny-vision",
            TextSpec(seed=7),
            "Gemma-3-style image-text model: 2-layer decoder (hidden 64) with an external"
            " embedder, a 1-layer SigLIP vision encoder (32x32 images,"
            " backend_constraint=cpu,gpu) and adapter (4 soft tokens per image); accepts images",
            vision_constraint="cpu,gpu",
            image=True,
            note="answers an image with main and vision on cpu or gpu, each pairing"
            " (cpu here; gpu seen on an NVIDIA H200, litert-lm 0.18.1)",
        ),
        FixtureSpec(
            "large-text",
            TextSpec(seed=5, layers=6, hidden=768, intermediate=2048, heads=12, kv_heads=4),
            "random 6-layer decoder, hidden 768 (~40 MB), for memory tests;"
            " built on demand into the cache, not committed",
            large=True,
        ),
        FixtureSpec(
            "gemma3-1b-real",
            GEMMA3_1B,
            "random Gemma-3-1B-shaped decoder at its real dimensions (26 layers, hidden 1152,"
            " 262,144-token vocabulary, tied embeddings, 4,096-token window), int8;"
            " built by --real-size into the cache, not committed",
            real_size=True,
        ),
        FixtureSpec(
            "gemma3-1b-real-pattern",
            dataclasses.replace(GEMMA3_1B, seed=12, pattern=True),
            "gemma3-1b-real's shape, every weight matrix one repeated seeded pattern: the same"
            " memory and timing, and a few MB once xz-compressed (for a host without torch)",
            real_size=True,
        ),
        FixtureSpec(
            "gemma3-vision-real",
            dataclasses.replace(GEMMA3_1B, seed=13),
            "Gemma-3-style image-text model: gemma3-1b-real's decoder with an external embedder"
            " and a SigLIP-So400m vision encoder (27 layers, hidden 1152, 896x896 images,"
            " backend_constraint=cpu,gpu) and adapter (256 soft tokens per image), int8;"
            " built by --real-size into the cache, not committed",
            vision_constraint="cpu,gpu",
            image=True,
            vision=SIGLIP_896,
            real_size=True,
            note="not in --real-size's default set: its float32 export did not fit the 24 GiB"
            " dev box (the text model's alone peaks at 13.8 GiB; litert-torch 0.10.0 cannot"
            " trace its embedder in bfloat16); build it with --only where memory allows",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class EmbedSpec:
    """One embedding model: a token embedder and a text encoder, no decoder."""

    name: str
    seed: int
    description: str
    hidden: int = 64  # token embedding width
    dimension: int = 32  # the output vector's length
    vocab: int = 512
    # One encoder signature per input length; the runtime picks the shortest that fits.
    lengths: tuple[int, ...] = (16, 64)
    backends: tuple[str, ...] = ("cpu",)
    note: str | None = None


EMBED_FIXTURES: dict[str, EmbedSpec] = {
    s.name: s
    for s in (
        EmbedSpec(
            "tiny-embed",
            seed=9,
            description="random embedding model: a token embedder (hidden 64) and a text"
            " encoder (positions, one tanh layer, masked mean pooling, a projection to 32)"
            " with signatures for 16 and 64 tokens; no decoder",
            note="an embedding model: litert_lm.EmbeddingEngine loads it (litert_lm.Engine"
            " aborts the process on it: no LlmMetadata); vectors are L2-normalised,"
            " output_size truncates (then normalises), and an input over 64 tokens is"
            " refused by default",
        ),
    )
}


def sha256_of(path: Path) -> str:
    """Return the hex sha256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def train_tokenizer(vocab: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab`` entries trained on CORPUS (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    if vocab > TRAINED_VOCAB:
        return _extend_tokenizer(tok, vocab, seed=vocab)
    return tok


# The corpus above yields a few hundred merges; a real-size vocabulary is filled up with
# seeded synthetic merges on top of them (English prompts still tokenize on the trained ones).
TRAINED_VOCAB = 4096


def _extend_tokenizer(tok: Any, vocab: int, *, seed: int) -> Any:
    """Return ``tok`` grown to ``vocab`` entries by seeded merges of existing tokens."""
    import random

    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    table: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = data["model"]["merges"]
    special = set(SPECIAL_TOKENS)
    pieces = [t for t, _ in sorted(table.items(), key=lambda kv: kv[1]) if t not in special]
    rng = random.Random(seed)
    while len(table) < vocab:
        # Short pieces are picked more often, so most new tokens stay a few bytes long.
        a = pieces[int(rng.random() ** 3 * len(pieces))]
        b = pieces[int(rng.random() ** 3 * len(pieces))]
        if a + b in table:
            continue
        table[a + b] = len(table)
        merges.append([a, b])
        pieces.append(a + b)
    return Tokenizer.from_str(json.dumps(data))


def file_entry(dest: Path, kind: str, description: str) -> dict[str, Any]:
    """The first fields of a manifest entry: the built file, its kind and description."""
    return {
        "file": dest.name,
        "sha256": sha256_of(dest),
        "size": dest.stat().st_size,
        "kind": kind,
        "description": description,
    }


def make_source_model(
    spec: TextSpec, out_dir: Path, *, image: bool = False, vision: VisionSpec | None = None
) -> None:
    """Write a random model, its config and a BPE tokenizer.

    A LlamaForCausalLM (or a Gemma3ForCausalLM for ``arch="gemma3"``), or with
    ``image`` a Gemma3ForConditionalGeneration plus its image processor config.
    """
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    tok = train_tokenizer(spec.vocab)
    # The Gemma-3 exporter reads the image delimiters from these names.
    image_tokens = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        **({"extra_special_tokens": image_tokens} if image else {}),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))

    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if image:
        _save_gemma3_image_model(spec, vision or VisionSpec(), ids, out_dir)
        return
    if spec.arch == "gemma3":
        _save_gemma3_text_model(spec, ids, out_dir)
        return
    config = LlamaConfig(
        **_decoder_fields(spec, ids),
        # Untied: with tied random embeddings greedy decoding just echoes the
        # last prompt token ("\n") forever.
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"],
        eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
        pad_token_id=ids["<pad>"],
    )
    _fill_pattern(spec, model)
    model.save_pretrained(str(out_dir))


def _fill_pattern(spec: TextSpec, model: Any) -> None:
    """With ``spec.pattern``, make every row of each weight matrix one short seeded pattern
    repeated, a pattern of its own per matrix.

    The pattern's length divides the row's, so each row quantizes to the same int8 bytes and
    xz shrinks the file to its tokenizer and metadata; shapes, and so memory and timing,
    stay. One pattern for every matrix would not do: the converter stores equal constants
    once, which made the file smaller than the random one.
    """
    if not spec.pattern:
        return
    import math

    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                width = param.shape[-1]
                pattern = torch.randn(math.gcd(width, 256), generator=gen) * 0.02
                param.copy_(pattern.repeat(width // pattern.numel()).expand_as(param))


def _decoder_fields(spec: TextSpec, ids: dict[str, int]) -> dict[str, Any]:
    """The config fields every decoder here shares: its shape and its special tokens."""
    return {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": max(spec.cache, 512),
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<eos>"], ids["<end_of_turn>"]],
        "pad_token_id": ids["<pad>"],
    }


def _gemma3_text_config(spec: TextSpec, ids: dict[str, int], *, tie: bool) -> Any:
    """The Gemma3TextConfig of ``spec`` (its sliding window, else one wider than the cache)."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_decoder_fields(spec, ids),
        head_dim=spec.head_dim or spec.hidden // spec.heads,
        sliding_window=spec.sliding_window or max(spec.cache, 512),
        tie_word_embeddings=tie,
    )


def _save_gemma3_text_model(spec: TextSpec, ids: dict[str, int], out_dir: Path) -> None:
    """Write a random Gemma3ForCausalLM (tied embeddings, like the published Gemma-3 files)."""
    from transformers import Gemma3ForCausalLM, GenerationConfig

    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    config = _gemma3_text_config(spec, ids, tie=True)
    model = _new_model(Gemma3ForCausalLM, config, spec)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"], eos_token_id=eos, pad_token_id=ids["<pad>"]
    )
    _fill_pattern(spec, model)
    _save(spec, model, out_dir)


def _new_model(cls: Any, config: Any, spec: TextSpec) -> Any:
    """A random ``cls(config)``: transformers' own init, or for a real-size model a plain
    seeded one that never holds more than the weights.

    transformers' init of a billion-parameter model took over 14 GiB here; a real-size
    model is made on the meta device instead and filled in place (matrices N(0, 0.02),
    LayerNorm scales 1, every other vector 0: Gemma's RMSNorm scales by 1 + w).
    """
    import torch

    if spec.vocab <= TRAINED_VOCAB:
        torch.manual_seed(spec.seed)
        return cls(config)
    with torch.device("meta"):
        model = cls(config)
    model.to_empty(device="cpu")
    model.tie_weights()  # made on meta, the output head is a copy until tied again
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if param.dim() >= 2:
                    param.normal_(0.0, 0.02, generator=gen)
                elif isinstance(module, torch.nn.LayerNorm) and name == "weight":
                    param.fill_(1.0)
                else:
                    param.zero_()
    return model


def _save(spec: TextSpec, model: Any, out_dir: Path) -> None:
    """Save ``model`` as transformers does; a real-size one shard by shard.

    ``save_pretrained`` took three times the model's size in memory for a
    billion-parameter model here; writing ~500 MB safetensors shards (and the index that
    names them) holds one shard at a time beside the weights.
    """
    if spec.vocab <= TRAINED_VOCAB:
        model.save_pretrained(str(out_dir))
        return
    from safetensors.torch import save_file

    model.config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    seen: set[int] = set()
    shards: list[dict[str, Any]] = [{}]
    sizes = [0]
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen or tensor.data_ptr() in seen:  # a tied weight is saved once
            continue
        seen.update((id(tensor), tensor.data_ptr()))
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > 500 * 2**20:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor
        sizes[-1] += nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(
            {k: v.contiguous() for k, v in shard.items()}, str(out_dir / file), {"format": "pt"}
        )
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _save_gemma3_image_model(
    spec: TextSpec, vspec: VisionSpec, ids: dict[str, int], out_dir: Path
) -> None:
    """Write a random Gemma3ForConditionalGeneration and its image processor."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        GenerationConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    eos = [ids["<eos>"], ids["<end_of_turn>"]]
    # A real-size model ties its embeddings, as Gemma 3 does (a second 262,144-row table
    # would not fit the build's memory); the tiny one keeps its untied bytes.
    tie = spec.vocab > TRAINED_VOCAB
    text = _gemma3_text_config(spec, ids, tie=tie)
    vision = SiglipVisionConfig(
        hidden_size=vspec.hidden,
        intermediate_size=vspec.intermediate,
        num_hidden_layers=vspec.layers,
        num_attention_heads=vspec.heads,
        image_size=vspec.image_size,
        patch_size=vspec.patch_size,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=vspec.tokens,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
        tie_word_embeddings=tie,
    )
    model = _new_model(Gemma3ForConditionalGeneration, config, spec)
    # transformers leaves the projector at zeros, which would make every image
    # the same (zero) embeddings: give it random weights so pixels matter.
    with torch.no_grad():
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0.0, 0.5)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<bos>"], eos_token_id=eos, pad_token_id=ids["<pad>"]
    )
    _fill_pattern(spec, model)
    _save(spec, model, out_dir)
    size = {"height": vspec.image_size, "width": vspec.image_size}
    Gemma3ImageProcessorPil(size=size).save_pretrained(str(out_dir))


def export_text(
    spec: TextSpec,
    work: Path,
    *,
    quantize: bool,
    image: bool = False,
    vision: VisionSpec | None = None,
) -> Path:
    """Run litert-torch export_hf; return the folder with its artifacts.

    The decoder is ``model_quantized.tflite`` (int8 weights) when ``quantize``,
    else ``model.tflite`` (float32 weights). With ``image`` the task is
    ``image_text_to_text``: the folder also holds the embedder, vision encoder
    and vision adapter (``*_quantized.tflite``).
    """
    from litert_torch.generative.export_hf import export as export_lib

    src = work / "hf"
    src.mkdir()
    make_source_model(spec, src, image=image, vision=vision)
    gc.collect()  # the source model's weights: the exporter loads its own copy
    out = work / "export"
    export_lib.export(
        model=str(src),
        output_dir=str(out),
        **({"task": "image_text_to_text"} if image else {}),
        prefill_lengths=[spec.prefill],
        cache_length=spec.cache,
        keep_temporary_files=True,
        **({} if quantize else {"quantization_recipe": "none"}),
    )
    return out


def make_vision_models(seed: int, hidden: int, work: Path) -> tuple[Path, Path]:
    """Export a tiny conv 'vision encoder' and a linear 'vision adapter'."""
    import litert_torch
    import torch

    class Encoder(torch.nn.Module):
        """[1, 32, 32, 3] NHWC image -> [1, 16, hidden] soft tokens (8x8 patches)."""

        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, hidden, kernel_size=8, stride=8)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            x = self.conv(images.permute(0, 3, 1, 2))
            return x.flatten(2).transpose(1, 2)

    class Adapter(torch.nn.Module):
        """[1, 16, hidden] -> [1, 16, hidden]."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(hidden, hidden)

        def forward(self, soft_tokens: torch.Tensor) -> torch.Tensor:
            return self.lin(soft_tokens)

    torch.manual_seed(seed)
    enc_path, ad_path = work / "vision_encoder.tflite", work / "vision_adapter.tflite"
    litert_torch.convert(Encoder().eval(), (torch.zeros(1, IMAGE_SIZE, IMAGE_SIZE, 3),)).export(
        str(enc_path)
    )
    litert_torch.convert(Adapter().eval(), (torch.zeros(1, 16, hidden),)).export(str(ad_path))
    return enc_path, ad_path


def _deterministic_system_metadata(name: str) -> Any:
    """Return a replacement for the builder's random uuid/timestamp filler."""
    import uuid

    from litert_lm_builder import litertlm_builder as lb

    def populate(system_metadata: list[Any]) -> list[Any]:
        kept = [m for m in system_metadata if m.key not in ("uuid", "creation_timestamp")]
        kept.append(
            lb.Metadata(
                key="uuid",
                value=str(uuid.uuid5(uuid.NAMESPACE_URL, f"modeld/{name}")),
                dtype=lb.DType.STRING,
            )
        )
        kept.append(
            lb.Metadata(key="creation_timestamp", value=FIXED_TIMESTAMP, dtype=lb.DType.STRING)
        )
        return kept

    return populate


def package(spec: FixtureSpec, export_dir: Path, work: Path, dest: Path) -> list[dict[str, Any]]:
    """Pack the exported artifacts (plus vision sections) into ``dest``."""
    from litert_lm_builder import litertlm_builder as lb
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    meta = llm_metadata_pb2.LlmMetadata()
    meta.ParseFromString((export_dir / "llm_metadata.pb").read_bytes())
    meta.supports_thinking = False
    meta.supports_function_calling = False
    # export_hf collects stop tokens in a set: sort them for stable bytes.
    stops = sorted(t.SerializeToString() for t in meta.stop_tokens)
    del meta.stop_tokens[:]
    for raw in stops:
        meta.stop_tokens.add().ParseFromString(raw)
    if spec.vision_constraint is not None:
        # Gemma-3n's model type: image items in a message then go through the
        # vision encoder/adapter (a generic model silently drops them).
        g3n = meta.llm_model_type.gemma3n
        g3n.start_of_image_token.token_str = "<start_of_image>"
        g3n.end_of_image_token.token_str = "<end_of_image>"
        size = (spec.vision or VisionSpec()).image_size if spec.image else IMAGE_SIZE
        g3n.image_tensor_height = size
        g3n.image_tensor_width = size
    meta_path = work / "llm_metadata.pb"
    meta_path.write_bytes(meta.SerializeToString())

    builder = lb.LitertLmFileBuilder()
    builder.add_system_metadata(
        lb.Metadata(key="Authors", value="modeld test fixtures", dtype=lb.DType.STRING)
    )
    builder.add_system_metadata(lb.Metadata(key="fixture", value=spec.name, dtype=lb.DType.STRING))
    builder.add_llm_metadata(str(meta_path))
    builder.add_executor_metadata(str(export_dir / "executor_metadata.pb"))
    builder.add_hf_tokenizer(str(export_dir / "tokenizer.json"))
    decoder = "model_quantized.tflite" if spec.quantize else "model.tflite"
    builder.add_tflite_model(str(export_dir / decoder), lb.TfLiteModelType.PREFILL_DECODE)
    sections: list[dict[str, Any]] = [
        {"type": "LlmMetadata"},
        {"type": "ExecutorMetadata"},
        {"type": "HF_Tokenizer_Zlib"},
        {"type": "TFLiteModel", "model_type": "tf_lite_prefill_decode"},
    ]
    if spec.image:
        assert spec.vision_constraint is not None and spec.quantize
        builder.add_tflite_model(
            str(export_dir / "embedder_quantized.tflite"), lb.TfLiteModelType.EMBEDDER
        )
        sections.append({"type": "TFLiteModel", "model_type": "tf_lite_embedder"})
        enc = export_dir / "vision_encoder_quantized.tflite"
        ad = export_dir / "vision_adapter_quantized.tflite"
    elif spec.vision_constraint is not None:
        enc, ad = make_vision_models(spec.text.seed, spec.text.hidden, work)
    if spec.vision_constraint is not None:
        builder.add_tflite_model(
            str(enc), lb.TfLiteModelType.VISION_ENCODER, backend_constraint=spec.vision_constraint
        )
        builder.add_tflite_model(str(ad), lb.TfLiteModelType.VISION_ADAPTER)
        sections += [
            {
                "type": "TFLiteModel",
                "model_type": "tf_lite_vision_encoder",
                "backend_constraint": spec.vision_constraint,
            },
            {"type": "TFLiteModel", "model_type": "tf_lite_vision_adapter"},
        ]

    write_deterministic(builder, spec.name, dest)
    return sections


def write_deterministic(builder: Any, name: str, dest: Path) -> None:
    """Write ``builder``'s file to ``dest`` with a fixed uuid and timestamp."""
    from litert_lm_builder import litertlm_builder as lb

    original = lb.populate_system_metadata
    lb.populate_system_metadata = _deterministic_system_metadata(name)
    try:
        tmp = dest.with_suffix(".litertlm.tmp")
        with tmp.open("wb") as f:
            builder.build(f)
        tmp.replace(dest)
    finally:
        lb.populate_system_metadata = original


def shape_of(spec: FixtureSpec) -> dict[str, Any]:
    """The manifest's shape: the decoder's fields (those left at their default only where
    they are the Llama ones), and the vision tower's where it is not the tiny one."""
    shape = dataclasses.asdict(spec.text)
    for field in dataclasses.fields(TextSpec):
        extra = field.name in ("arch", "head_dim", "sliding_window", "pattern")
        if extra and shape[field.name] == field.default:
            del shape[field.name]
    if spec.vision is not None:
        shape["vision"] = dataclasses.asdict(spec.vision)
    return shape


def peak_rss_bytes() -> int:
    """The largest resident set this process or any child it waited for has had."""
    import resource

    return 1024 * max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )


def compress_xz(path: Path) -> Path:
    """Write ``path`` + ``.xz`` (written beside, then renamed) and return it."""
    import lzma

    dest = path.with_name(path.name + ".xz")
    tmp = dest.with_name(dest.name + ".tmp")
    with path.open("rb") as src, lzma.open(tmp, "wb", preset=6) as out:
        for block in iter(lambda: src.read(1 << 24), b""):
            out.write(block)
    tmp.replace(dest)
    return dest


def build_one(spec: FixtureSpec, dest: Path) -> dict[str, Any]:
    """Build one fixture into ``dest`` and return its manifest entry."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"modeld-{spec.name}-") as tmp:
        work = Path(tmp)
        export_dir = export_text(
            spec.text, work, quantize=spec.quantize, image=spec.image, vision=spec.vision
        )
        sections = package(spec, export_dir, work, dest)
    seconds = time.monotonic() - start
    vision = spec.vision_constraint
    entry: dict[str, Any] = file_entry(dest, "text", spec.description) | {
        "sections": sections,
        "shape": shape_of(spec),
        "llm_model_type": "generic_model" if vision is None else "gemma3n",
        "max_num_tokens": spec.text.cache,
        "weights": "int8" if spec.quantize else "float32",
        "backends": list(spec.backends),
        "vision_backends": ([] if vision is None else [b.strip() for b in vision.split(",")]),
        "vision_backend_constraint": vision,
        "accepts_images": spec.image,
    }
    if spec.note is not None:
        entry["note"] = spec.note
    if spec.real_size:
        entry["build"] = {"seconds": round(seconds, 1), "peak_rss": peak_rss_bytes()}
    print(
        f"built {dest} ({entry['size']} bytes, {seconds:.1f} s,"
        f" peak RSS so far {peak_rss_bytes() / 2**30:.1f} GiB)",
        flush=True,
    )
    if spec.text.pattern:
        packed = compress_xz(dest)
        entry["xz"] = {"file": packed.name, "size": packed.stat().st_size}
        print(f"packed {packed} ({entry['xz']['size']} bytes)", flush=True)
    return entry


def make_embedding_models(spec: EmbedSpec, work: Path) -> tuple[Path, Path]:
    """Export the token embedder and the text encoder LiteRT-LM's embedding engine runs.

    The embedder maps one token id ([1, 1] int32) to its vector ([1, 1, hidden]); the
    runtime calls it per token to fill the encoder's input. The encoder has one signature
    per input length, named ``encoder_<length>`` (the runtime looks for the ``encoder``
    prefix), taking ``embeddings`` [1, length, hidden] and ``input_mask`` [1, length]
    (1.0 for the input's tokens, 0.0 for the padding) and giving [1, dimension].
    """
    import litert_torch
    import torch

    torch.manual_seed(spec.seed)

    class Embedder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(spec.vocab, spec.hidden)

        def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
            return self.table(token_ids)

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.positions = torch.nn.Parameter(0.5 * torch.randn(max(spec.lengths), spec.hidden))
            self.mix = torch.nn.Linear(spec.hidden, spec.hidden)
            self.out = torch.nn.Linear(spec.hidden, spec.dimension)

        def forward(self, embeddings: torch.Tensor, input_mask: torch.Tensor) -> torch.Tensor:
            length = embeddings.shape[1]
            h = torch.tanh(self.mix(embeddings + self.positions[:length]))
            mask = input_mask.unsqueeze(-1)
            pooled = (h * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            return self.out(pooled)

    embedder, encoder = Embedder().eval(), Encoder().eval()
    emb_path, enc_path = work / "embedder.tflite", work / "text_encoder.tflite"
    litert_torch.convert(embedder, (torch.zeros((1, 1), dtype=torch.int32),)).export(str(emb_path))
    converter: Any = litert_torch
    for length in spec.lengths:
        converter = converter.signature(
            f"encoder_{length}",
            encoder,
            sample_kwargs={
                "embeddings": torch.zeros(1, length, spec.hidden),
                "input_mask": torch.ones(1, length),
            },
        )
    converter.convert().export(str(enc_path))
    return emb_path, enc_path


def build_embed(spec: EmbedSpec, dest: Path) -> dict[str, Any]:
    """Build one embedding fixture into ``dest`` and return its manifest entry."""
    from litert_lm_builder import litertlm_builder as lb
    from litert_lm_builder.runtime.proto import embedding_metadata_pb2

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"modeld-{spec.name}-") as tmp:
        work = Path(tmp)
        tokenizer = work / "tokenizer.json"
        train_tokenizer(spec.vocab).save(str(tokenizer))
        emb_path, enc_path = make_embedding_models(spec, work)
        meta = embedding_metadata_pb2.EmbeddingMetadata()
        meta.embedding_model_type.generic_model.SetInParent()
        meta.bos_token.token_str = "<bos>"
        meta.eos_token.token_str = "<eos>"
        meta_path = work / "embedding_metadata.pb"
        meta_path.write_bytes(meta.SerializeToString())

        builder = lb.LitertLmFileBuilder()
        builder.add_system_metadata(
            lb.Metadata(key="Authors", value="modeld test fixtures", dtype=lb.DType.STRING)
        )
        builder.add_system_metadata(
            lb.Metadata(key="fixture", value=spec.name, dtype=lb.DType.STRING)
        )
        builder.add_embedding_metadata(str(meta_path))
        builder.add_hf_tokenizer(str(tokenizer))
        builder.add_tflite_model(str(emb_path), lb.TfLiteModelType.EMBEDDER)
        builder.add_tflite_model(str(enc_path), lb.TfLiteModelType.TEXT_ENCODER)
        write_deterministic(builder, spec.name, dest)
    seconds = time.monotonic() - start
    entry: dict[str, Any] = file_entry(dest, "embedding", spec.description) | {
        "sections": [
            {"type": "EmbeddingMetadata"},
            {"type": "HF_Tokenizer_Zlib"},
            {"type": "TFLiteModel", "model_type": "tf_lite_embedder"},
            {"type": "TFLiteModel", "model_type": "tf_lite_text_encoder"},
        ],
        "embedding": {
            "seed": spec.seed,
            "hidden": spec.hidden,
            "dimension": spec.dimension,
            "vocab": spec.vocab,
            "lengths": list(spec.lengths),
        },
        "weights": "float32",
        "backends": list(spec.backends),
        "vision_backends": [],
        "vision_backend_constraint": None,
        "accepts_images": False,
    }
    if spec.note is not None:
        entry["note"] = spec.note
    print(f"built {dest} ({entry['size']} bytes, {seconds:.1f} s)", flush=True)
    return entry


def large_cache_dir() -> Path:
    """Return where on-demand large models go."""
    return Path(os.environ.get(LARGE_CACHE_ENV) or DEFAULT_LARGE_CACHE).expanduser()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE,
        help="folder for the committed fixtures (default: %(default)s)",
    )
    parser.add_argument(
        "--only",
        action="append",
        choices=sorted(FIXTURES.keys() | EMBED_FIXTURES.keys()),
        help="build only this fixture (repeatable)",
    )
    parser.add_argument(
        "--large",
        action="store_true",
        help=f"also build the large model into ${LARGE_CACHE_ENV} (default {DEFAULT_LARGE_CACHE})",
    )
    parser.add_argument(
        "--real-size",
        action="store_true",
        help="build only the real-size text models (about 1 GB each, minutes each) into"
        f" ${LARGE_CACHE_ENV}; --only gemma3-vision-real builds the image-text one",
    )
    args = parser.parse_args(argv)

    committed = [n for n, s in FIXTURES.items() if not (s.large or s.real_size)]
    names = list(args.only or [*committed, *EMBED_FIXTURES])
    if args.real_size and not args.only:
        # The image-text model needs more memory to build than a 24 GiB machine has.
        names = [n for n, s in FIXTURES.items() if s.real_size and not s.image]
    if args.large and "large-text" not in names:
        names.append("large-text")
    args.out.mkdir(parents=True, exist_ok=True)
    manifest_path = args.out / MANIFEST
    manifest: dict[str, Any] = (
        json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    )
    fixtures: dict[str, Any] = manifest.setdefault("fixtures", {})

    for name in names:
        if name in EMBED_FIXTURES:
            fixtures[name] = build_embed(EMBED_FIXTURES[name], args.out / f"{name}.litertlm")
            continue
        spec = FIXTURES[name]
        if spec.large or spec.real_size:
            cache = large_cache_dir()
            cache.mkdir(parents=True, exist_ok=True)
            entry = build_one(spec, cache / f"{name}.litertlm")
            (cache / f"{name}.json").write_text(json.dumps(entry, indent=2) + "\n")
        else:
            fixtures[name] = build_one(spec, args.out / f"{name}.litertlm")

    manifest["generator"] = "tests/models/build.py"
    manifest["runtime_tested"] = "litert-lm==0.18.1"
    manifest["fixtures"] = dict(sorted(fixtures.items()))
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
