"""Probing whether a backend plan works for a file, in a throwaway child process.

A GPU that the runtime cannot use can abort the process (SIGABRT) and a damaged file
can crash it (SIGSEGV), so the runtime is never tried in the daemon itself: the child
(``python -m modeld.modelfile.probe --spec JSON``, or ``PATH BACKEND CACHE_DIR [--vision B]
[--audio B] [--image]`` by hand) creates an engine and a conversation, asks for a few tokens and
prints one JSON line. The daemon hands the child the very ``create`` spec a runner would
get, and the child creates its engine with the runner's own ``create_engine``: a probe
that passes means a runner's engine is created the same way (the same ``.litertlm``
path, since the runtime picks the format by extension; the same cache dir and options).
With ``--image`` (``probe_image`` in the spec) the message also carries one small image: a
vision plan fails at the first image prefill (a GPU delegate, an encoder that does not fit
the decoder), not at ``Engine()``, so only an image finds it.

The runtime writes its real reason for a failure only to fd 2 (Python sees a generic
``RuntimeError: Failed to create LiteRT-LM engine``), so the parent keeps the child's
stderr, picks the meaningful lines out of it, and reads the GPU adapter the runtime
selected (``Selected adapter: ...``) for bug reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeld.errors import CorruptModel
from modeld.modelfile.header import read_header
from modeld.modelfile.runtime import CreateSpec, create_engine
from modeld.proc import die_with_parent

PROBE_PROMPT = "Hi"
PROBE_MAX_TOKENS = 4
PROBE_IMAGE_PROMPT = "Describe this image."
# The image probe's picture: small, so the probe stays cheap, and a JPEG like the ones
# requests send (``modeld.services.inference.prepare_image``); vision encoders resize it anyway.
PROBE_IMAGE_SIDE = 64
# The key of a ``create`` spec that asks the probe child to send one image too.
IMAGE_KEY = "probe_image"
_STDERR_CAP = 256 * 1024
# glog/absl prefix: "E0000 00:00:1730000000.123456   12345 engine_impl.cc:123] ".
_LOG_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:. ]+\s+\d+ [\w./-]+:\d+\] ")
# "└ ERROR: [third_party/.../compiled_model.cc:1036]": a stack of locations, no words.
_LOCATION_ONLY = re.compile(r"^(?:└\s*)?ERROR: \[[^\]]+\]\s*$|^third_party/|^=== Source Location")
_LOCATION_PREFIX = re.compile(r"^ERROR: \[[\w./-]+:\d+\] ")
_MEANINGFUL = re.compile(r"mismatch|error|failed|invalid|not found in|unsupported|abort", re.I)
# Case-sensitive: absl's stack frames name `log_internal`, which is not a status code.
_STATUS_CODE = re.compile(r"\bINTERNAL\b")
# A fatal check prints a stack trace (`@ 0x7f… symbol`) after its message: frames are noise.
_STACK_FRAME = re.compile(r"^@\s+0x[0-9a-f]+|^\*\*\* Check failure stack trace")
_MAX_REASON_LINES = 3
_MAX_LINE = 400
# Dawn, once it has picked a device: "Selected adapter: NVIDIA H200 ... backend=Vulkan".
# The wording around the name has varied; anything after "Selected adapter" is the name.
_ADAPTER = re.compile(r"Selected (?:GPU )?adapter\b[\s:=]*(?P<adapter>\S.*)$", re.I)
_MAX_ADAPTER = 200


@dataclass(frozen=True)
class ProbeResult:
    """The outcome of one probe; ``reason`` is the runtime's own words when it failed."""

    ok: bool
    backend: str
    reason: str | None
    seconds: float
    signal: str | None = None
    vision: str | None = None
    audio: str | None = None
    image: bool = False
    # Where the child failed: "engine" (Engine()), "image" (the image prefill) or "reply".
    stage: str | None = None
    # The GPU adapter the runtime selected (only for a probe that passed on gpu).
    adapter: str | None = None
    # The child's stderr (the last ``_STDERR_CAP`` bytes): what a bug report quotes.
    log: str = field(default="", compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "backend": self.backend,
            "vision": self.vision,
            "audio": self.audio,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "signal": self.signal,
            "stage": self.stage,
            "image": self.image,
            "adapter": self.adapter,
        }


def extract_adapter(stderr: str) -> str | None:
    """The GPU adapter the runtime reports having selected, from its stderr, or None."""
    for line in stderr.splitlines():
        text = _LOG_PREFIX.sub("", line.strip())
        m = _ADAPTER.search(text)
        if m is not None:
            return m.group("adapter").strip()[:_MAX_ADAPTER] or None
    return None


def _rank(line: str) -> int | None:
    """How telling a stderr line is (lower is better); None for noise."""
    if "mismatch" in line:
        return 0
    if line.startswith(("WARNING", "Warning", "W0", "I0", "INFO")):
        return None
    if _LOCATION_ONLY.match(_LOG_PREFIX.sub("", line)) or _STACK_FRAME.match(line):
        return None
    if line.startswith(("E0", "F0", "ERROR")):
        return 1
    return 2 if _MEANINGFUL.search(line) or _STATUS_CODE.search(line) else None


def extract_reason(stderr: str, fallback: str | None = None) -> str | None:
    """The lines of the runtime's stderr that say why it failed, joined by `` | ``.

    Constraint mismatches come first, then error-severity log lines, then other lines
    that mention a failure; warnings (NPU/Vulkan not found) and bare source locations
    are noise. With nothing telling, the last non-empty line stands in.
    """
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    ranked = sorted(
        ((r, i) for i, ln in enumerate(lines) if (r := _rank(ln)) is not None),
    )
    picked: list[str] = []
    # The fallback (e.g. "killed by SIGABRT") always keeps its place at the end.
    room = _MAX_REASON_LINES - (1 if fallback else 0)
    for _, i in ranked:
        text = _LOG_PREFIX.sub("", lines[i]).removeprefix("└").strip()
        text = _LOCATION_PREFIX.sub("", text)[:_MAX_LINE]
        if text not in picked:
            picked.append(text)
        if len(picked) == room:
            break
    if not picked and lines:
        picked = [lines[-1][:_MAX_LINE]]
    if fallback:
        picked.append(fallback)
    return " | ".join(picked) or None


def child_argv(spec: dict[str, Any]) -> list[str]:
    """The probe child's command line for a runner ``create`` spec."""
    argv = [sys.executable, "-m", "modeld.modelfile.probe", "--spec", json.dumps(spec)]
    return [*argv, "--parent", str(os.getpid())]


def spec_for(
    path: Path, backend: str, cache_dir: Path, vision: str | None = None, audio: str | None = None
) -> CreateSpec:
    """A minimal ``create`` spec: the file, the backends, the cache dir, the file's kind.

    A file whose header cannot be read is probed as a text model: the child then reports
    what the runtime makes of it.
    """
    try:
        kind = read_header(path).kind
    except (CorruptModel, OSError):
        kind = "text"
    return CreateSpec(str(path), backend, vision, audio, cache_dir=str(cache_dir), kind=kind)


async def probe(
    path: Path,
    backend: str,
    cache_dir: Path,
    timeout: float = 60,  # noqa: ASYNC109 - a timeout is a result (ok False), not an error
    *,
    vision: str | None = None,
    audio: str | None = None,
    image: bool = False,
) -> ProbeResult:
    """Try ``backend`` (and optionally vision/audio backends) on ``path`` in a child.

    With ``image`` the child also sends one small image (it needs a ``vision`` backend).
    """
    spec = spec_for(path, backend, cache_dir, vision, audio)
    return await probe_spec(spec, timeout, image=image)


async def probe_spec(
    spec: CreateSpec,
    timeout: float = 60,  # noqa: ASYNC109 - a timeout is a result (ok False), not an error
    *,
    image: bool = False,
    env: dict[str, str] | None = None,
) -> ProbeResult:
    """Create the engine of a runner ``create`` spec in a child, and ask it for a reply.

    With ``image`` the child also sends one small image (it needs a ``vision`` backend)."""
    backend, vision, audio = spec.backend, spec.vision, spec.audio
    report: dict[str, Any] = {}
    start = time.monotonic()
    # Imported here: this module is also the child's main, which needs no settings.
    from modeld.config import child_environ

    proc = await asyncio.create_subprocess_exec(
        *child_argv({**spec.to_json(), IMAGE_KEY: True} if image else spec.to_json()),
        close_fds=True,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=child_environ() if env is None else env,
        # Its own session: a terminal's Ctrl-C reaches the daemon, not the probe, so a
        # foreground `modeld serve` stopped mid-probe never records a false GPU failure.
        start_new_session=True,
    )

    def result(ok: bool, reason: str | None, sig: str | None = None, log: str = "") -> ProbeResult:
        return ProbeResult(
            ok=ok,
            backend=backend,
            reason=reason,
            seconds=time.monotonic() - start,
            signal=sig,
            vision=vision,
            audio=audio,
            image=image,
            stage=None if ok else report.get("stage"),
            adapter=extract_adapter(log) if ok and "gpu" in (backend, vision, audio) else None,
            log=log,
        )

    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return result(False, f"timed out after {timeout:g} s")
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise

    stderr = err[-_STDERR_CAP:].decode("utf-8", "replace")
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                report = json.loads(line)
                break
    rc = proc.returncode if proc.returncode is not None else -1
    if rc < 0:
        sig = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
        reason = extract_reason(stderr, f"probe child killed by {sig}")
        return result(False, reason, sig, stderr)
    if rc == 0 and report.get("ok") is True:
        return result(True, None, log=stderr)
    fallback = report.get("error") or f"probe exited with {rc}"
    return result(False, extract_reason(stderr, fallback), log=stderr)


# --- the child ---------------------------------------------------------------------------


def _report(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def probe_image() -> bytes:
    """A small JPEG with some structure (a gradient), for the image probe."""
    import io

    from PIL import Image

    side = PROBE_IMAGE_SIDE
    img = Image.new("RGB", (side, side))
    img.putdata([(x * 4 % 256, y * 4 % 256, 128) for y in range(side) for x in range(side)])
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=88)
    return out.getvalue()


def _message(image: bool) -> Any:
    if not image:
        return PROBE_PROMPT
    import base64

    blob = base64.b64encode(probe_image()).decode()
    # The runner sends images in this same form (``engine.runner.generate``).
    content = [{"type": "text", "text": PROBE_IMAGE_PROMPT}, {"type": "image", "blob": blob}]
    return {"role": "user", "content": content}


def run_child(doc: dict[str, Any]) -> int:
    """Create the spec's engine, a conversation and one short reply; print one JSON line."""
    start = time.monotonic()
    image = bool(doc.get(IMAGE_KEY))
    spec = CreateSpec.from_json(doc)
    if image and not spec.max_images:
        # One image, as a runner for a vision plan gets by default.
        spec = dataclasses.replace(spec, max_images=1)
    stage = "engine"
    try:
        # The runner's own engine creation: same path, cache dir and options.
        engine = create_engine(spec)
        embedding = spec.kind == "embedding"
        if not embedding:
            conversation = engine.create_conversation(max_output_tokens=PROBE_MAX_TOKENS)
        stage = "image" if image else "reply"
        # Said before it starts: a child killed from here on (a GPU delegate's SIGABRT at
        # the first image prefill) leaves this as its last line.
        _report({"stage": stage})
        if embedding:
            # An embedding model's reply: one vector.
            reply: Any = engine.compute_embedding(PROBE_PROMPT).embedding
        else:
            reply = conversation.send_message(_message(image), max_output_tokens=PROBE_MAX_TOKENS)
    except Exception as e:
        _report({"ok": False, "stage": stage, "error": f"{type(e).__name__}: {e}"})
        return 1
    _report({"ok": True, "seconds": time.monotonic() - start, "reply_chars": len(str(reply))})
    # Engine teardown has crashed in some runtime builds; the answer is already out.
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modeld.modelfile.probe")
    parser.add_argument("path", nargs="?")
    parser.add_argument("backend", nargs="?", choices=["cpu", "gpu"])
    parser.add_argument("cache_dir", nargs="?")
    parser.add_argument("--vision", choices=["cpu", "gpu"])
    parser.add_argument("--audio", choices=["cpu", "gpu"])
    parser.add_argument("--image", action="store_true", help="also send one small image")
    parser.add_argument("--spec", help="a runner create spec as JSON (what the daemon passes)")
    parser.add_argument("--parent", type=int, help="the pid that must stay our parent")
    args = parser.parse_args(argv)
    doc: dict[str, Any]
    if args.spec is not None:
        doc = json.loads(args.spec)
    elif args.path and args.backend and args.cache_dir:
        doc = spec_for(
            Path(args.path), args.backend, Path(args.cache_dir), args.vision, args.audio
        ).to_json()
    else:
        parser.error("give --spec JSON, or PATH BACKEND CACHE_DIR")
    if args.image:
        doc[IMAGE_KEY] = True
    die_with_parent(args.parent)
    return run_child(doc)


if __name__ == "__main__":
    sys.exit(main())
