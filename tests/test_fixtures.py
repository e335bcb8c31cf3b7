"""The committed test models are intact and the real LiteRT-LM runtime runs them.

Every runtime call happens in a child process: the runtime can abort or crash
the process, and a crash must fail one test, not kill the run.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

MODELS = Path(__file__).resolve().parent / "models"
MANIFEST: dict[str, Any] = json.loads((MODELS / "fixtures.json").read_text())["fixtures"]
TEXT = {n: f for n, f in MANIFEST.items() if f["kind"] == "text"}
EMBEDDING = {n: f for n, f in MANIFEST.items() if f["kind"] == "embedding"}
VISION = {n: f for n, f in MANIFEST.items() if f["vision_backend_constraint"] is not None}
IMAGES = {n: f for n, f in VISION.items() if f["accepts_images"]}

# Runs in the child: argv = [model, cache_dir, vision backend ("none"/"cpu"/"gpu"),
# image paths sent before the text, ...].
# Prints one line "RESULT {json}" with the step reached and the reply or the error.
CHILD = r"""
import json, sys
import litert_lm

litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
path, cache_dir, vision, *images = sys.argv[1:]
backends = {"none": None, "cpu": litert_lm.Backend.CPU(), "gpu": litert_lm.Backend.GPU()}
out = {"step": "engine"}
try:
    engine = litert_lm.Engine(
        path, backend=litert_lm.Backend.CPU(), vision_backend=backends[vision],
        cache_dir=cache_dir,
    )
    out["step"] = "conversation"
    conv = engine.create_conversation(
        sampler_config=litert_lm.SamplerConfig(top_k=1, seed=0), max_output_tokens=8,
    )
    out["step"] = "message"
    message = "Hello there"
    if images:
        parts = [litert_lm.Content.ImageFile(p) for p in images]
        parts.append(litert_lm.Content.Text(message))
        message = litert_lm.Message(litert_lm.Role.USER, litert_lm.Contents.of(*parts))
    chunks = ["".join(c.text for c in m.contents) for m in conv.send_message_async(message)]
    out.update(step="done", chunks=chunks, token_count=conv.token_count)
    conv.close()
    engine.close()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(
    model: Path, cache_dir: Path, vision: str = "none", images: tuple[Path, ...] = ()
) -> tuple[dict[str, Any], str]:
    """Run CHILD on a model; return its result and its stderr."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(cache_dir), vision, *map(str, images)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, (
        f"child exited {proc.returncode} (negative: killed by signal)\n{proc.stderr[-4000:]}"
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result from child\nstdout: {proc.stdout}\nstderr: {proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT ")), proc.stderr


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture_matches_manifest(name: str) -> None:
    """Each committed fixture has the size and sha256 that fixtures.json records."""
    entry = MANIFEST[name]
    data = (MODELS / entry["file"]).read_bytes()
    assert len(data) == entry["size"]
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]


def test_every_committed_model_is_in_the_manifest() -> None:
    """Each .litertlm in tests/models has a manifest entry, so the tests below cover it."""
    on_disk = sorted(p.name for p in MODELS.glob("*.litertlm"))
    assert on_disk == sorted(e["file"] for e in MANIFEST.values())


def test_fixture_digests_are_distinct() -> None:
    """No two fixtures are the same file, so digest-keyed code can tell them apart."""
    digests = [e["sha256"] for e in MANIFEST.values()]
    assert len(set(digests)) == len(digests)


@pytest.mark.parametrize("name", sorted(TEXT))
def test_fixture_generates_on_cpu(name: str, tmp_path: Path) -> None:
    """The real runtime loads each fixture on cpu, text only, and streams back tokens."""
    result, stderr = run_child(MODELS / MANIFEST[name]["file"], tmp_path)
    assert result["step"] == "done", f"{result}\n{stderr[-4000:]}"
    assert result["chunks"], "no token came back"
    assert "".join(result["chunks"]), "the reply is empty"
    assert result["token_count"] > 0


@pytest.mark.parametrize("name", sorted(VISION))
def test_vision_backend_constraint_is_enforced(name: str, tmp_path: Path) -> None:
    """A cpu vision backend is refused at Engine() exactly when the constraint excludes cpu."""
    result, stderr = run_child(MODELS / MANIFEST[name]["file"], tmp_path, vision="cpu")
    if "cpu" in MANIFEST[name]["vision_backends"]:
        assert result["step"] == "done", f"{result}\n{stderr[-4000:]}"
        assert "".join(result["chunks"])
    else:
        assert result["step"] == "engine"
        assert result["error"].startswith("RuntimeError: Failed to create LiteRT-LM engine")
        assert "Vision backend constraint mismatch" in stderr


def solid_png(path: Path, rgb: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> Path:
    """Write a one-colour PNG (not the model's 32x32, so the runtime resizes it)."""
    Image.new("RGB", size, rgb).save(path)
    return path


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_fixture_answers_an_image_on_cpu(name: str, tmp_path: Path) -> None:
    """An image goes through the vision encoder, adapter and embedder into the prompt."""
    model = MODELS / MANIFEST[name]["file"]
    text, stderr = run_child(model, tmp_path / "a", vision="cpu")
    assert text["step"] == "done", f"{text}\n{stderr[-4000:]}"
    red = solid_png(tmp_path / "red.png", (200, 30, 30))
    result, stderr = run_child(model, tmp_path / "b", vision="cpu", images=(red,))
    assert result["step"] == "done", f"{result}\n{stderr[-4000:]}"
    assert "".join(result["chunks"]), "the reply to an image is empty"
    # The image's soft tokens (and its delimiters) took places in the context.
    assert result["token_count"] > text["token_count"]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_image_fixture_reply_depends_on_the_pixels(name: str, tmp_path: Path) -> None:
    """Two images that differ only in colour get different greedy replies: pixels reach it."""
    model = MODELS / MANIFEST[name]["file"]
    red = solid_png(tmp_path / "red.png", (200, 30, 30))
    blue = solid_png(tmp_path / "blue.png", (20, 30, 220))
    replies = []
    for i, image in enumerate((red, blue)):
        result, stderr = run_child(model, tmp_path / str(i), vision="cpu", images=(image,))
        assert result["step"] == "done", f"{result}\n{stderr[-4000:]}"
        replies.append("".join(result["chunks"]))
    assert replies[0] != replies[1]


@pytest.mark.parametrize(
    "name", sorted(n for n in VISION if n not in IMAGES and "cpu" in VISION[n]["vision_backends"])
)
def test_embedderless_vision_fixture_fails_an_image_at_prefill(name: str, tmp_path: Path) -> None:
    """Without an embedder section the runtime loads the engine but fails the image prefill.

    That is cpu's behaviour; on an NVIDIA GPU the same request is answered (output that never
    saw the image), so ``accepts_images: false`` is what the manifest records for them.
    """
    red = solid_png(tmp_path / "red.png", (200, 30, 30))
    result, stderr = run_child(
        MODELS / MANIFEST[name]["file"], tmp_path, vision="cpu", images=(red,)
    )
    assert result["step"] == "message", f"{result}\n{stderr[-4000:]}"
    assert "EMBEDDING_LOOKUP" in stderr


# Runs in the child: argv = [model, cache_dir]. Prints "RESULT {json}": what the runtime's
# model info says, and the vectors of a few inputs (one batch, then one by one).
EMBED_CHILD = r"""
import json, sys
import litert_lm

litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
path, cache_dir = sys.argv[1:]
info = litert_lm.ModelInfo(path)
out = {
    "embedding_model": info.is_embedding_model,
    "llm_model": info.is_llm_model,
    "dimension": info.embedding.dimension,
    "lengths": info.embedding.signature_selection,
}
engine = litert_lm.EmbeddingEngine(path, backend=litert_lm.Backend.CPU(), cache_dir=cache_dir)
texts = ["Hello world", "The quick brown fox", "Hello world"]
out["batch"] = [r.embedding for r in engine.compute_embedding_batch(texts)]
out["single"] = [engine.compute_embedding(t).embedding for t in texts]
short = litert_lm.EmbeddingOptions(output_size=8)
out["short"] = engine.compute_embedding("Hello world", short).embedding
try:
    engine.compute_embedding(" ".join(["word"] * 100))
    out["long"] = "embedded"
except RuntimeError as e:
    out["long"] = str(e)
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("name", sorted(EMBEDDING))
def test_embedding_fixture_embeds_on_cpu(name: str, tmp_path: Path) -> None:
    """The runtime sees an embedding model and its EmbeddingEngine gives seeded vectors:
    normalised, the same for the same text, different for another, batch order kept."""
    entry = MANIFEST[name]
    proc = subprocess.run(
        [sys.executable, "-c", EMBED_CHILD, str(MODELS / entry["file"]), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line.removeprefix("RESULT "))
    shape = entry["embedding"]
    assert out["embedding_model"] and not out["llm_model"]
    assert out["dimension"] == shape["dimension"]
    assert out["lengths"] == shape["lengths"]
    hello, fox, again = out["batch"]
    assert len(hello) == shape["dimension"]
    assert sum(x * x for x in hello) == pytest.approx(1.0, abs=1e-5)
    assert hello == again != fox
    assert out["single"] == out["batch"]
    assert len(out["short"]) == 8
    assert sum(x * x for x in out["short"]) == pytest.approx(1.0, abs=1e-5)
    # Over the longest signature the runtime's default is to refuse, not to cut.
    assert out["long"] == "Failed to compute embedding."
    assert "exceeds maximum supported signature length (64)" in proc.stderr
