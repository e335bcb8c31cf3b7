"""The GPU through the real daemon, as a user meets it (``pytest -m gpu``; skipped elsewhere).

One daemon with the default settings (main=gpu) imports the fixtures over its socket, then:
a default load puts the int8 model on the GPU, the float32 model falls back to cpu with its
SIGABRT recorded, the gemma3n-like file loads with vision=gpu and is refused with vision=cpu,
one generation runs on the GPU, streamed and not, and the embedding model embeds on it.
Every test is skipped, with the probe's reason, where the runtime finds no GPU adapter
(tests/conftest.py, ``pytest_runtest_setup``).
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.hostinfo import runtime_version
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, default_backend_env
from tests.support.state import MODELS, write_entry
from tests.support.unix import unix_request

pytestmark = pytest.mark.gpu

TINY = MODELS / "tiny-text.litertlm"  # int8 weights: the GPU backend takes it
GEMMA3N_LIKE = MODELS / "gemma3n-like.litertlm"  # vision encoder requires gpu
F32 = MODELS / "tiny-text-f32.litertlm"  # float32 embeddings: the GPU backend aborts
VISION = MODELS / "tiny-vision.litertlm"  # takes an image; its encoder allows cpu,gpu
EMBED = MODELS / "tiny-embed.litertlm"  # an embedding model (text encoder, no decoder)
needs_f32 = pytest.mark.skipif(
    not F32.exists(),
    reason="tests/models/tiny-text-f32.litertlm (a float32 export of tiny-text) is not built",
)


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[DaemonProcess]:
    """A daemon with default backends that imported every fixture through the CLI."""
    tmp = Path(tempfile.mkdtemp(prefix="md-gpu-", dir="/tmp"))
    registry, home = tmp / "registry", tmp / "home"
    models = {
        "tiny-text": TINY,
        "gemma3n-like": GEMMA3N_LIKE,
        "tiny-vision": VISION,
        "tiny-embed": EMBED,
    }
    if F32.exists():
        models["tiny-text-f32"] = F32
    for model_id, path in models.items():
        digest, size = sha256_file(path)
        write_entry(registry, model_id, size=size, sha256=digest)
    d = DaemonProcess(home=home, env=default_backend_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        for model_id, path in models.items():
            imported = d.cli_json("import", str(path), model_id)
            assert imported["installed"]["verified_by"] == "registry sha256"
        yield d
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_default_load_puts_the_int8_model_on_the_gpu(
    gpu_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """main=gpu from the settings: the probe passes, the engine runs on the GPU, named."""
    d = gpu_daemon
    loaded = d.cli_json("load", "tiny-text")
    assert loaded["id"] == "tiny-text:gpu"
    assert (loaded["plan"]["main"], loaded["plan"]["fell_back"]) == ("gpu", False)
    adapter = loaded["adapter"]
    assert adapter and loaded["runtime"] == runtime_version()
    gpu = d.cli_json("show", "tiny-text")["probes"]["gpu"]
    assert (gpu["ok"], gpu["current"], gpu["adapter"]) == (True, True, adapter)
    assert d.cli_json("status")["runtime"]["adapter"] == adapter
    assert [e["adapter"] for e in d.cli_json("ps")["engines"] if e["model"] == "tiny-text"] == [
        adapter
    ]
    report = tmp_path / "report.md"
    assert d.cli("bug-report", "tiny-text", "--output", str(report)).returncode == 0
    assert f"| GPU adapter | {adapter.replace('|', chr(92) + '|')} |" in report.read_text()


def test_one_generation_runs_on_the_gpu(gpu_daemon: DaemonProcess) -> None:
    """A default request is answered by the GPU engine, with its phase timings."""
    ran = gpu_daemon.cli_json("run", "tiny-text", "hello", "--max-tokens", "4")
    assert ran["engine"] == "tiny-text:gpu"
    assert ran["tokens"] == 4 and ran["text"]
    assert ran["timings"]["first_token"] > 0 and ran["timings"]["total"] > 0


@needs_f32
def test_float32_model_falls_back_to_cpu_with_its_sigabrt_recorded(
    gpu_daemon: DaemonProcess,
) -> None:
    """The runtime aborts on its float32 embeddings on the GPU: recorded, and cpu runs it."""
    d = gpu_daemon
    loaded = d.cli_json("load", "tiny-text-f32")
    assert loaded["id"] == "tiny-text-f32:cpu"
    assert (loaded["plan"]["main"], loaded["plan"]["fell_back"]) == ("cpu", True)
    gpu = d.cli_json("show", "tiny-text-f32")["probes"]["gpu"]
    assert (gpu["ok"], gpu["current"], gpu["adapter"]) == (False, True, None)
    assert "SIGABRT" in gpu["reason"], gpu["reason"]
    # One file's failure does not hide the host's adapter (int8 tiny-text passed on it).
    int8 = d.cli_json("load", "tiny-text")
    assert d.cli_json("status")["runtime"]["adapter"] == int8["adapter"]
    # Asked for explicitly, gpu is refused with the probe's verdict, never swapped for cpu.
    status, body = unix_request(
        d.socket, "POST", "/api/engines", {"model": "tiny-text-f32", "backends": {"main": "gpu"}}
    )
    assert (status, body["error"]["code"]) == (422, "backend_constraint")
    assert "GPU probe" in body["error"]["message"]


def test_gemma3n_like_vision_runs_on_gpu_and_is_refused_on_cpu(
    gpu_daemon: DaemonProcess,
) -> None:
    """Its vision encoder requires gpu: vision=gpu loads, vision=cpu is backend_constraint."""
    d = gpu_daemon
    loaded = d.cli_json("load", "gemma3n-like", "--vision", "gpu")
    assert (loaded["plan"]["main"], loaded["plan"]["vision"]) == ("gpu", "gpu")
    assert loaded["state"] == "ready" and loaded["adapter"]
    refused = d.cli("load", "gemma3n-like", "--vision", "cpu")
    assert refused.returncode == 1
    assert "Vision backend constraint mismatch" in refused.stderr
    status, body = unix_request(
        d.socket, "POST", "/api/engines", {"model": "gemma3n-like", "backends": {"vision": "cpu"}}
    )
    assert (status, body["error"]["code"]) == (422, "backend_constraint")
    ids = {e["id"] for e in d.cli_json("ps")["engines"]}
    assert "gemma3n-like:gpu+vision-gpu" in ids
    assert not any("vision-cpu" in i for i in ids)


def _jpeg() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 30, 30)).save(out, format="JPEG")
    return base64.b64encode(out.getvalue()).decode()


def test_an_image_runs_through_vision_on_the_gpu(gpu_daemon: DaemonProcess) -> None:
    """vision=gpu is probed with an image on this GPU, passes, and answers an image request."""
    d = gpu_daemon
    body = {
        "model": "tiny-vision",
        "prompt": "What is in the picture?",
        "images": [_jpeg()],
        "max_tokens": 3,
        "backends": {"main": "gpu", "vision": "gpu"},
    }
    status, records = unix_request(d.socket, "POST", "/api/modeld/generate", body, timeout=300)
    final = records[-1] if isinstance(records, list) else records
    assert status == 200, final
    assert "error" not in final, final
    assert final["timings"]["image_prepare"] > 0
    probes = d.cli_json("show", "tiny-vision")["image_probes"]
    probe = probes["main=gpu,vision=gpu,audio=none"]
    assert (probe["ok"], probe["reason"]) == (True, None), probes
    engines = {e["id"]: e for e in d.cli_json("ps")["engines"]}
    engine = engines["tiny-vision:gpu+vision-gpu"]
    assert engine["engine_options"]["vision_backend"] == "gpu"
    assert engine["adapter"]


def test_a_streamed_reply_runs_on_the_gpu(gpu_daemon: DaemonProcess) -> None:
    """The runner's stream callback on the GPU engine: SSE deltas, the finish, usage, [DONE].

    The GPU's decoding of these random weights is not reproducible for a seed (two whole
    replies with the same seed differ), so the text is not compared with a whole reply.
    """
    import httpx

    body = {
        "model": "tiny-text",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    transport = httpx.HTTPTransport(uds=str(gpu_daemon.socket))
    with httpx.Client(transport=transport, base_url="http://modeld", timeout=120) as http:
        streamed = http.post("/v1/chat/completions", json=body)
    assert streamed.status_code == 200, streamed.text
    events = [e[6:] for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    engines = [e for e in gpu_daemon.cli_json("ps")["engines"] if e["model"] == "tiny-text"]
    assert [e["id"] for e in engines] == ["tiny-text:gpu"]


def test_embeddings_run_on_the_gpu(gpu_daemon: DaemonProcess) -> None:
    """The embedding model's default load (main=gpu) runs its text encoder on the GPU, and
    /v1/embeddings answers from that engine with the cpu engine's vector, within float
    tolerance."""
    d = gpu_daemon
    loaded = d.cli_json("load", "tiny-embed")
    assert (loaded["id"], loaded["plan"]["main"]) == ("tiny-embed:gpu", "gpu"), loaded
    body = {"model": "tiny-embed", "input": ["hello there", "the sea"]}
    status, gpu = unix_request(d.socket, "POST", "/v1/embeddings", body)
    assert status == 200, gpu
    assert gpu["modeld"]["engine"] == "tiny-embed:gpu"
    vectors = [item["embedding"] for item in gpu["data"]]
    assert [len(v) for v in vectors] == [32, 32] and vectors[0] != vectors[1]
    status, cpu = unix_request(
        d.socket, "POST", "/v1/embeddings", {**body, "backends": {"main": "cpu"}}
    )
    assert status == 200, cpu
    assert cpu["modeld"]["engine"] == "tiny-embed:cpu"
    for a, b in zip(vectors, [item["embedding"] for item in cpu["data"]], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-2
