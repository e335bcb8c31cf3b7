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

MODELS = Path(__file__).resolve().parent / "models"
MANIFEST: dict[str, Any] = json.loads((MODELS / "fixtures.json").read_text())["fixtures"]
VISION = {n: f for n, f in MANIFEST.items() if f["vision_backend_constraint"] is not None}

# Runs in the child: argv = [model, cache_dir, vision backend ("none"/"cpu"/"gpu")].
# Prints one line "RESULT {json}" with the step reached and the reply or the error.
CHILD = r"""
import json, sys
import litert_lm

litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
path, cache_dir, vision = sys.argv[1:4]
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
    chunks = [
        "".join(c.text for c in m.contents) for m in conv.send_message_async("Hello there")
    ]
    out.update(step="done", chunks=chunks, token_count=conv.token_count)
    conv.close()
    engine.close()
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(model: Path, cache_dir: Path, vision: str = "none") -> tuple[dict[str, Any], str]:
    """Run CHILD on a model; return its result and its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(cache_dir), vision],
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


@pytest.mark.parametrize("name", sorted(MANIFEST))
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
