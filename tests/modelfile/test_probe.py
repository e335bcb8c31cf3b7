"""Tests for modeld.modelfile.probe: the runtime tried in a child process, on the real tiny
fixtures.
"""

from __future__ import annotations

import asyncio
import io
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from modeld.modelfile import probe as probe_mod
from modeld.modelfile.header import read_header
from modeld.modelfile.probe import ProbeResult, extract_adapter, extract_reason, probe
from tests.support.state import MODELS
from tests.support.wait import wait_until

TINY = MODELS / "tiny-text.litertlm"
GEMMA3N_LIKE = MODELS / "gemma3n-like.litertlm"
VISION_CPU_OK = MODELS / "vision-cpu-ok.litertlm"
# The runtime reaches a GPU through WebGPU (Vulkan or Metal underneath).
HAS_GPU = Path("/dev/dri").exists() or Path("/dev/nvidia0").exists()

needs_tiny = pytest.mark.skipif(not TINY.exists(), reason="tests/models/tiny-text.litertlm missing")

# Captured from litert-lm 0.18.1 on a host without a GPU.
GPU_FAILURE_STDERR = "\n".join(
    [
        "WARNING: Logging before InitGoogle() is written to STDERR",
        "WARNING: [npu_registry.cc:34] NPU accelerator could not be loaded and registered: "
        "kLiteRtStatusErrorNotFound.",
        "Warning: Couldn't load Vulkan: libvulkan.so.1: cannot open shared object file",
        "ERROR: [delegate_webgpu.cc:359] Failed to initialize WebGPU environment: INTERNAL: "
        "No adapters found",
        "E0000 00:00:1796002975.203557    7420 engine.cc:854] Failed to create engine: UNKNOWN: "
        "ERROR: [third_party/odml/litert_lm/runtime/executor/"
        "llm_litert_compiled_model_executor_factory.cc:236]",
        "\u2514 ERROR: [third_party/odml/litert/litert/runtime/compiled_model.cc:1036]",
        "=== Source Location Trace: ===",
        "third_party/odml/litert_lm/runtime/core/engine_advanced_impl.cc:460",
    ]
)
MISMATCH_STDERR = "\n".join(
    [
        "W0000 00:00:1796002975.1 12 litert_lm_loader.cc:391] Section not found: SP_Tokenizer",
        "E0000 00:00:1796002975.350658    7429 engine.cc:854] Failed to create engine: "
        "INVALID_ARGUMENT: Vision backend constraint mismatch. Model requires one of [gpu] "
        "but Vision backend is CPU",
        "=== Source Location Trace: ===",
        "third_party/odml/litert_lm/runtime/engine/engine_settings.cc:98",
    ]
)


def test_reason_skips_warnings_and_locations() -> None:
    """From a GPU failure, the reason keeps the WebGPU error lines, not NPU/Vulkan warnings."""
    reason = extract_reason(GPU_FAILURE_STDERR)
    assert reason is not None
    assert reason.startswith("Failed to initialize WebGPU environment: INTERNAL: No adapters found")
    assert "Failed to create engine" in reason
    assert "NPU" not in reason and "Vulkan" not in reason and "Source Location" not in reason


def test_reason_puts_mismatch_first() -> None:
    """A backend constraint mismatch is the reason's first line, without the log prefix."""
    reason = extract_reason(MISMATCH_STDERR, "RuntimeError: Failed to create LiteRT-LM engine")
    assert reason is not None
    assert reason.startswith("Failed to create engine: INVALID_ARGUMENT: Vision backend constraint")
    assert reason.endswith("RuntimeError: Failed to create LiteRT-LM engine")


# What a float32 model printed on an H200 before SIGABRT (main=gpu).
ABORT_STDERR = "\n".join(
    [
        "F0000 00:00:1764470000.000000    12 embedding_lookup.cc:88] EMBEDDING_LOOKUP: "
        "Unsupported external weights type: 1",
        "*** Check failure stack trace: ***",
        "    @     0x7f24bd20dae4  absl::log_internal::LogMessage::SendToLog()",
        "    @     0x7f24bd20daa8  absl::log_internal::LogMessage::Flush()",
        "    @     0x7f24bc712a8b  LiteRtCreateCompiledModel",
    ]
)


def test_reason_of_an_abort_keeps_message_and_signal_not_stack_frames() -> None:
    """A fatal check's stack frames are dropped and the signal text always stays."""
    reason = extract_reason(ABORT_STDERR, "probe child killed by SIGABRT")
    assert reason == (
        "EMBEDDING_LOOKUP: Unsupported external weights type: 1 | probe child killed by SIGABRT"
    )


@pytest.mark.parametrize(
    "line",
    [
        "INFO: [delegate_webgpu.cc:401] Selected adapter: NVIDIA H200 (discrete) backend=Vulkan",
        "I0000 00:00:1796002975.1  12 delegate_webgpu.cc:401] Selected adapter: "
        "NVIDIA H200 (discrete) backend=Vulkan",
        "Selected adapter = NVIDIA H200 (discrete) backend=Vulkan",
    ],
)
def test_adapter_is_read_from_the_runtime_log(line: str) -> None:
    """The adapter the runtime selected is the text after "Selected adapter", prefix gone."""
    stderr = "\n".join([GPU_FAILURE_STDERR.splitlines()[1], line, "INFO: [x.cc:1] done"])
    assert extract_adapter(stderr) == "NVIDIA H200 (discrete) backend=Vulkan"
    assert extract_adapter(GPU_FAILURE_STDERR) is None


def test_reason_falls_back_to_last_line() -> None:
    """With nothing telling on stderr, the last non-empty line stands in; empty gives None."""
    assert extract_reason("starting\nsomething odd happened\n\n") == "something odd happened"
    assert extract_reason("") is None
    assert extract_reason("", "exit 3") == "exit 3"


@needs_tiny
async def test_cpu_probe_succeeds(tmp_path: Path) -> None:
    """The tiny fixture creates an engine and answers on cpu."""
    result = await probe(TINY, "cpu", tmp_path / "cache")
    assert result == ProbeResult(ok=True, backend="cpu", reason=None, seconds=result.seconds)
    assert 0 < result.seconds < 30


@needs_tiny
async def test_a_probe_child_gets_no_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe child starts with the scrubbed environment of a runner: the hub token (and
    any other secret or systemd variable) in the daemon's environment never reaches it."""
    for name, value in (
        ("MODELD_HF_TOKEN", "hf_modeldsecret"),
        ("HF_TOKEN", "hf_hubsecret"),
        ("NOTIFY_SOCKET", "/run/systemd/notify"),
    ):
        monkeypatch.setenv(name, value)
    envs: list[dict[str, str] | None] = []
    real = asyncio.create_subprocess_exec

    async def recording(*args: Any, **kw: Any) -> asyncio.subprocess.Process:
        envs.append(kw.get("env"))  # observed, then the real call
        return await real(*args, **kw)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording)
    result = await probe(TINY, "cpu", tmp_path / "cache")
    assert result.ok, result.reason
    (env,) = envs
    assert env is not None and "PATH" in env  # not inherited whole
    assert not [v for v in env.values() if "secret" in v or "notify" in v], env


@needs_tiny
@pytest.mark.skipif(HAS_GPU, reason="this host has a GPU device; the failure case needs none")
async def test_gpu_probe_fails_without_gpu(tmp_path: Path) -> None:
    """On a host without a GPU, the gpu probe fails with the runtime's WebGPU reason."""
    result = await probe(TINY, "gpu", tmp_path / "cache")
    assert not result.ok
    assert result.signal is None
    assert result.reason is not None
    assert "WebGPU" in result.reason or "adapter" in result.reason


@pytest.mark.skipif(not GEMMA3N_LIKE.exists(), reason="tests/models/gemma3n-like.litertlm missing")
async def test_vision_mismatch_reason(tmp_path: Path) -> None:
    """vision=cpu on a gpu-only vision encoder fails with the runtime's mismatch message."""
    result = await probe(GEMMA3N_LIKE, "cpu", tmp_path / "cache", vision="cpu")
    assert not result.ok
    assert result.reason is not None
    assert "Vision backend constraint mismatch" in result.reason
    assert result.to_dict()["vision"] == "cpu"


@pytest.mark.skipif(not VISION_CPU_OK.exists(), reason="tests/models/vision-cpu-ok missing")
async def test_image_probe_records_the_runtime_reason_of_a_failed_image_prefill(
    tmp_path: Path,
) -> None:
    """A file that loads with vision but cannot take an image fails at the image stage.

    vision-cpu-ok has a vision encoder and adapter but no embedder for image tokens: its
    engine is created and answers text, and the first image prefill fails in the runtime.
    """
    text = await probe(VISION_CPU_OK, "cpu", tmp_path / "cache", vision="cpu")
    assert text.ok, text.reason
    result = await probe(VISION_CPU_OK, "cpu", tmp_path / "cache", vision="cpu", image=True)
    assert (result.ok, result.stage, result.signal, result.image) == (False, "image", None, True)
    assert result.reason is not None
    # The runtime's own words from its stderr first, then what Python saw.
    *runtime, python = result.reason.split(" | ")
    assert runtime, result.reason
    assert python.startswith("RuntimeError: litert_lm_conversation_send_message failed")
    assert result.to_dict()["stage"] == "image"


async def test_a_child_killed_at_the_image_prefill_is_reported_at_that_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that dies (SIGABRT) after saying it reached the image names that stage."""
    code = (
        "import json, os, signal, sys; print(json.dumps({'stage': 'image'}), flush=True); "
        "print('F0000 00:00:1.0 1 delegate.cc:1] GPU delegate failed', file=sys.stderr, "
        "flush=True); os.kill(os.getpid(), signal.SIGABRT)"
    )
    monkeypatch.setattr(probe_mod, "child_argv", lambda *a, **k: [sys.executable, "-c", code])
    result = await probe(tmp_path / "x.litertlm", "gpu", tmp_path / "cache", vision="gpu")
    assert (result.ok, result.signal, result.stage) == (False, "SIGABRT", "image")
    assert result.reason == "GPU delegate failed | probe child killed by SIGABRT"


async def test_image_flag_reaches_the_child_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``image=True`` puts ``probe_image`` in the child's spec only when asked."""
    seen: list[dict[str, object]] = []

    def argv(spec: dict[str, object]) -> list[str]:
        seen.append(spec)
        return [sys.executable, "-c", "print('{\"ok\": true}')"]

    monkeypatch.setattr(probe_mod, "child_argv", argv)
    await probe(tmp_path / "m.litertlm", "cpu", tmp_path, vision="gpu", image=True)
    await probe(tmp_path / "m.litertlm", "cpu", tmp_path)
    assert seen[0][probe_mod.IMAGE_KEY] is True
    assert seen[0]["vision"] == "gpu"
    assert probe_mod.IMAGE_KEY not in seen[1]


def test_probe_image_is_a_small_jpeg() -> None:
    """The image the probe sends is a decodable 64 px JPEG."""
    from PIL import Image

    with Image.open(io.BytesIO(probe_mod.probe_image())) as img:
        assert (img.format, img.size, img.mode) == ("JPEG", (64, 64), "RGB")


@needs_tiny
async def test_corrupted_model_fails_in_the_child(tmp_path: Path) -> None:
    """Random bytes in the model section make the probe fail, never the test process."""
    path = tmp_path / "corrupt.litertlm"
    shutil.copyfile(TINY, path)
    main = read_header(path).role_section("main")
    assert main is not None
    with path.open("r+b") as f:
        f.seek(main.begin)
        f.write(random.Random(3).randbytes(main.size))
    result = await probe(path, "cpu", tmp_path / "cache")
    assert not result.ok
    assert result.reason


async def test_missing_file_fails_with_reason(tmp_path: Path) -> None:
    """A path that does not exist is a failed probe naming the open() failure."""
    result = await probe(tmp_path / "nope.litertlm", "cpu", tmp_path / "cache")
    assert not result.ok
    assert result.reason is not None and "No such file" in result.reason


async def test_child_killed_by_signal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that dies of SIGSEGV is reported as a failure with the signal's name."""
    code = (
        "import os, signal, sys; print('boom', file=sys.stderr, flush=True); "
        "os.kill(os.getpid(), signal.SIGSEGV)"
    )
    monkeypatch.setattr(probe_mod, "child_argv", lambda *a, **k: [sys.executable, "-c", code])
    result = await probe(tmp_path / "x.litertlm", "gpu", tmp_path / "cache")
    assert (result.ok, result.signal) == (False, "SIGSEGV")
    assert result.reason == "boom | probe child killed by SIGSEGV"


async def test_timeout_kills_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that hangs is killed at the timeout and reported as timed out."""
    marker = tmp_path / "alive"
    code = (
        f"import time, pathlib; time.sleep(0.2); pathlib.Path({str(marker)!r}).touch(); "
        "time.sleep(60)"
    )
    monkeypatch.setattr(probe_mod, "child_argv", lambda *a, **k: [sys.executable, "-c", code])
    t = time.monotonic()
    result = await probe(tmp_path / "x.litertlm", "cpu", tmp_path / "cache", timeout=1.0)
    assert time.monotonic() - t < 5
    assert not result.ok
    assert result.reason == "timed out after 1 s"
    assert marker.exists()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


async def test_cancelled_probe_kills_the_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling a probe (daemon shutdown) kills its child rather than leaking it."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    monkeypatch.setattr(probe_mod, "child_argv", lambda *a, **k: [sys.executable, "-c", code])
    task = asyncio.create_task(probe(tmp_path / "x.litertlm", "cpu", tmp_path / "cache"))
    await wait_until(lambda: pid_file.exists() and bool(pid_file.read_text()))
    pid = int(pid_file.read_text())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert _gone(pid)
