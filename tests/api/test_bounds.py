"""Bounds on what a client can make the daemon hold: bodies, JSON, prompts, images,
connections and a full disk. Each bound answers with a clear 4xx/503/507, never a 500, and
leaves other clients served."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import select
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.support.daemon import DaemonProcess, InProcessDaemon, daemon_env, running_daemon
from tests.support.state import MODELS, install_fixture, registry_settings, write_entry
from tests.support.unix import unix_http, unix_request

MiB = 1024 * 1024


# --- raw HTTP over the socket ----------------------------------------------------------------


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length (the daemon's errors all have one)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data[:200]!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body[:length]


def _connect(path: Path, timeout: float = 30.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Blocking connect: a full backlog makes it wait for accept() rather than fail (EAGAIN).
    s.connect(str(path))
    s.settimeout(timeout)
    return s


def _head(method: str, target: str, length: int | None, *extra: str) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: modeld", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += list(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def http(
    path: Path, method: str, target: str, body: bytes = b"", timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """One request with ``body`` on a fresh connection: ``(status, headers, body)``."""
    with _connect(path, timeout) as s:
        s.sendall(_head(method, target, len(body)) + body)
        return _read_response(s)


def error_of(raw: bytes) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(raw)["error"]
    return err


def _closed(sock: socket.socket) -> bool:
    """True once the daemon has closed ``sock`` (EOF or reset); never blocks."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def daemon_with(short_tmp: Path) -> Iterator[Any]:
    """``start(**env)``: a ``modeld serve`` subprocess with extra settings, stopped after."""
    started: list[DaemonProcess] = []

    def start(**extra: str) -> DaemonProcess:
        home = short_tmp / "home"
        d = DaemonProcess(home=home, env=daemon_env(home, **extra))
        d.start_quick()
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


# --- JSON: depth, values, integers --------------------------------------------------------------

DEEP = b'{"force": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
NESTED_40 = b'{"force": ' + b"[" * 40 + b"]" * 40 + b"}"
LONG_INT = b'{"force": ' + b"7" * 5000 + b"}"


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("POST", "/api/prune"),
        ("DELETE", "/api/models/tiny-text"),
        ("POST", "/api/modeld/generate"),
        ("POST", "/v1/chat/completions"),
    ],
)
async def test_deep_json_and_long_integers_are_400(
    daemon: InProcessDaemon, method: str, target: str
) -> None:
    """Nesting past 32 levels (40 or 100,000) and integers of 4,301+ digits are 400s that
    say so, on every route with a body (prune and rm answered 500)."""
    import asyncio

    sock = daemon.settings.socket_path
    for body, needle in (
        (DEEP, "nests deeper than 32 levels"),
        (NESTED_40, "nests deeper than 32 levels"),
        (LONG_INT, "more than 4300 digits"),
    ):
        status, _, raw = await asyncio.to_thread(http, sock, method, target, body)
        assert status == 400, raw[:300]
        err = error_of(raw)
        assert err["code"] == "bad_request"
        assert needle in err["message"], err


async def test_too_many_json_values_is_413(daemon: InProcessDaemon) -> None:
    """A body of more than 100,000 JSON values is a 413 naming the bound, on any route."""
    import asyncio

    body = b'{"stop": [' + b",".join([b"0"] * 150_000) + b"]}"
    for method, target in (("POST", "/api/modeld/generate"), ("POST", "/api/prune")):
        status, _, raw = await asyncio.to_thread(
            http, daemon.settings.socket_path, method, target, body
        )
        assert status == 413, raw[:300]
        err = error_of(raw)
        assert err["code"] == "too_large"
        assert "more than 100000 JSON values" in err["message"]


def test_json_bomb_is_refused_while_health_answers(daemon_with: Any) -> None:
    """A 21 MB body of ``[]`` (7 million values; parsing it blocked the loop for seconds) is a
    413, and ``/api/health`` answers within 1 s throughout, while it is in flight too."""
    d = daemon_with()
    bomb = b"[" + b"[]," * 7_000_000 + b"[]]"
    stop = threading.Event()
    answers: list[tuple[float, int]] = []
    failures: list[str] = []

    def probe() -> None:
        while not stop.is_set():
            try:
                answers.append((time.monotonic(), unix_http(d.socket, timeout=1.0)[0]))
            except OSError as e:
                failures.append(repr(e))

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        sent = time.monotonic()
        status, _, raw = http(d.socket, "POST", "/api/prune", bomb, timeout=120)
        answered = time.monotonic()
    finally:
        stop.set()
        prober.join()
    assert not failures, failures[:3]
    assert answers and all(code == 200 for _, code in answers)
    assert any(sent <= at <= answered for at, _ in answers), "no health answer while in flight"
    assert status == 413, raw[:300]
    assert "JSON values" in error_of(raw)["message"]


# --- bodies: size, memory at once, time ---------------------------------------------------------


def test_body_over_max_body_is_413_unread(daemon_with: Any) -> None:
    """A declared length over MODELD_MAX_BODY is refused before the body is sent; a chunked
    body that grows past it is refused too. The advice fits a long prompt as well as images."""
    d = daemon_with(MODELD_MAX_BODY="1MiB", MODELD_BODY_MEMORY="2MiB")
    with _connect(d.socket) as s:
        s.sendall(_head("POST", "/api/modeld/generate", 2 * MiB) + b'{"model": ')
        status, _, raw = _read_response(s)
    assert status == 413
    err = error_of(raw)
    assert err["code"] == "too_large" and "MODELD_MAX_BODY (1.0 MiB)" in err["message"]
    assert "a shorter prompt" in err["message"], err["message"]

    chunk = b"x" * 65536
    with _connect(d.socket) as s:
        s.sendall(_head("POST", "/api/modeld/generate", None, "Transfer-Encoding: chunked"))
        try:
            for _ in range(24):  # 1.5 MiB
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed once past the bound
        status, _, raw = _read_response(s)
    assert status == 413 and error_of(raw)["code"] == "too_large"
    assert "a shorter prompt" in error_of(raw)["message"]
    assert unix_http(d.socket)[0] == 200


def test_bodies_read_at_once_are_bounded(daemon_with: Any) -> None:
    """Two 1 MiB bodies held half-sent fill MODELD_BODY_MEMORY=2MiB: a third is a 503 busy
    with Retry-After, small requests still pass, and room comes back when one finishes."""
    d = daemon_with(MODELD_MAX_BODY="1MiB", MODELD_BODY_MEMORY="2MiB")
    body = json.dumps({"model": "tiny-text", "prompt": "a" * (MiB - 100)}).encode()
    body = body[:-1] + b" " * (MiB - len(body)) + b"}"
    assert len(body) == MiB

    def third() -> tuple[int, dict[str, str], bytes]:
        return http(d.socket, "POST", "/api/modeld/generate", body)

    held = [_connect(d.socket) for _ in range(2)]
    try:
        for s in held:
            # Expect: 100-continue: the daemon says "continue" once the handler reads the body.
            s.sendall(_head("POST", "/api/modeld/generate", MiB, "Expect: 100-continue"))
            assert s.recv(64).startswith(b"HTTP/1.1 100")
            s.sendall(body[: MiB // 2])
        status, headers, raw = third()
        assert status == 503, raw[:300]
        assert error_of(raw)["code"] == "busy" and "MODELD_BODY_MEMORY" in error_of(raw)["message"]
        assert headers.get("retry-after") == "1"
        # Small bodies do not count against the bound.
        small = http(
            d.socket, "POST", "/api/modeld/generate", b'{"model": "tiny-text", "prompt": "hi"}'
        )
        assert small[0] == 404, small
        held[0].sendall(body[MiB // 2 :])
        assert _read_response(held[0])[0] == 404
        status, _, raw = third()
        assert status == 404, raw[:300]
    finally:
        for s in held:
            s.close()
    assert "reason=body_memory" in d.wait_log("body_refused")


# --- connections ---------------------------------------------------------------------------------


def test_idle_connections_are_bounded_and_closed(daemon_with: Any) -> None:
    """300 idle connections with MODELD_MAX_CONNECTIONS=40: a fresh client is still served,
    the daemon holds at most ~40 of them, and each is closed after MODELD_IDLE_TIMEOUT."""
    d = daemon_with(MODELD_MAX_CONNECTIONS="40", MODELD_IDLE_TIMEOUT="3s")
    assert d.proc is not None
    before = _fd_count(d.proc.pid)
    idle = [_connect(d.socket) for _ in range(300)]
    try:
        # A blocking connect, as a client's: the daemon may still be accepting the flood.
        assert http(d.socket, "GET", "/api/health")[0] == 200
        deadline = time.monotonic() + 30
        while _fd_count(d.proc.pid) > before + 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _fd_count(d.proc.pid) <= before + 50
        open_ = list(idle)
        deadline = time.monotonic() + 60
        while open_ and time.monotonic() < deadline:
            select.select(open_, [], [], 1.0)
            open_ = [s for s in open_ if not _closed(s)]
        assert not open_, f"{len(open_)} idle connections still open"
    finally:
        for s in idle:
            s.close()
    assert "connections_bounded" in d.log()
    assert http(d.socket, "GET", "/api/health")[0] == 200


def test_connections_all_running_get_503_busy(daemon_with: Any) -> None:
    """When all MODELD_MAX_CONNECTIONS connections run a request, a new one gets a 503 busy
    with Retry-After (none of theirs is dropped); once one ends, new clients get through."""
    d = daemon_with(MODELD_MAX_CONNECTIONS="4")
    body = b'{"model": "tiny-text", "prompt": "hi"}'
    busy = [_connect(d.socket) for _ in range(4)]
    try:
        for s in busy:
            s.sendall(_head("POST", "/api/modeld/generate", len(body), "Expect: 100-continue"))
            assert s.recv(64).startswith(b"HTTP/1.1 100")
        status, headers, raw = http(d.socket, "GET", "/api/health")
        assert status == 503 and headers.get("retry-after") == "1"
        assert error_of(raw)["code"] == "busy"
        assert not any(_closed(s) for s in busy)
        busy[0].sendall(body)
        assert _read_response(busy[0])[0] == 404
        busy[0].close()
        deadline = time.monotonic() + 30
        while http(d.socket, "GET", "/api/health")[0] != 200:
            assert time.monotonic() < deadline, "no connection freed"
    finally:
        for s in busy:
            s.close()


def test_slow_head_and_slow_body_are_dropped(daemon_with: Any) -> None:
    """A client sending one header line a second is dropped at MODELD_HEADER_TIMEOUT; one
    that stops half way through its body gets a 408 at MODELD_BODY_TIMEOUT."""
    d = daemon_with(
        MODELD_HEADER_TIMEOUT="2s",
        MODELD_BODY_TIMEOUT="2s",
        MODELD_IDLE_TIMEOUT="120s",
        MODELD_LISTEN="127.0.0.1:0",
    )
    port = int(d.wait_log("listening address=127.0.0.1:").split("127.0.0.1:")[1].split()[0])
    # Over TCP, the log line names the peer's address (it said peer=-).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /api/health HTTP/1.1\r\nHost: modeld\r\n")
        s.settimeout(30)
        with contextlib.suppress(ConnectionResetError):
            assert s.recv(1024) == b""
    lines = [x for x in d.wait_log("header_timeout").splitlines() if "header_timeout" in x]
    assert "peer=ip:127.0.0.1" in lines[0], lines
    with _connect(d.socket) as s:
        s.sendall(b"GET /api/health HTTP/1.1\r\nHost: modeld\r\n")
        dropped = False
        for i in range(60):
            s.settimeout(1.0)  # the attack's pace: a line whenever a second passes quietly
            try:
                dropped = s.recv(1024) == b""
            except TimeoutError:
                pass
            except ConnectionResetError:
                dropped = True
            if dropped:
                break
            try:
                s.sendall(f"X-Slow-{i}: y\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                # Dropped between the read and this line: the send finds it closed.
                dropped = True
                break
        assert dropped, "a head sent one line a second was never dropped"
    assert "header_timeout" in d.wait_log("header_timeout", count=2)

    with _connect(d.socket) as s:
        s.sendall(_head("POST", "/api/modeld/generate", 100) + b'{"model": "tiny')
        status, _, raw = _read_response(s)
    assert status == 408 and error_of(raw)["code"] == "request_timeout"
    assert "MODELD_BODY_TIMEOUT" in error_of(raw)["message"]
    assert unix_http(d.socket)[0] == 200


# --- the prompt, bounded by the engine's window ------------------------------------------------


async def test_prompt_past_the_window_is_refused_before_any_engine(clean_env: Path) -> None:
    """tiny-text's window is 256 tokens: a prompt over 256 x 32 bytes (in one message or
    spread over several) is a 400 context_length_exceeded in OpenAI's words that says the
    bound (only a bound is known: it was not tokenized), and no engine is loaded for it."""
    import asyncio

    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    async with running_daemon(registry_settings(home, registry)) as d:
        sock = d.settings.socket_path
        native = {"model": "tiny-text", "prompt": "é" * 4097}  # 8,194 bytes, 4,097 characters
        chat = {
            "model": "tiny-text",
            "messages": [
                {"role": "system", "content": "s" * 3000},
                {"role": "assistant", "content": "a" * 3000},
                {"role": "user", "content": "u" * 3000},
            ],
        }
        for target, body in (("/api/modeld/generate", native), ("/v1/chat/completions", chat)):
            status, _, raw = await asyncio.to_thread(
                http, sock, "POST", target, json.dumps(body).encode()
            )
            assert status == 400, raw[:300]
            err = error_of(raw)
            assert err["code"] == "context_length_exceeded"
            assert err["message"].startswith("This model's maximum context length is 256 tokens")
            assert "your messages are over 8192 bytes" in err["message"], err
        status, engines = await asyncio.to_thread(unix_request, sock, "GET", "/api/engines")
        assert status == 200 and engines["engines"] == []


async def test_prompt_under_the_byte_bound_but_past_the_window_is_refused(
    clean_env: Path,
) -> None:
    """A prompt under 256 x 32 bytes that still holds more than 256 tokens reaches the
    runtime, which refuses it: a 400 context_length_exceeded with the window and the
    runtime's own count in OpenAI's words, not a 500 engine_error."""
    import asyncio

    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    async with running_daemon(registry_settings(home, registry)) as d:
        body = json.dumps({"model": "tiny-text", "prompt": "zq " * 2700}).encode()  # 8,100 B
        status, _, raw = await asyncio.to_thread(
            http, d.settings.socket_path, "POST", "/api/modeld/generate", body
        )
        assert status == 400, raw[:300]
        err = error_of(raw)
        assert err["code"] == "context_length_exceeded", err
        assert re.match(
            r"This model's maximum context length is 256 tokens\. However, your messages "
            r"resulted in \d+ tokens\.",
            err["message"],
        ), err
        ok = json.dumps({"model": "tiny-text", "prompt": "hello", "max_tokens": 2}).encode()
        status, _, raw = await asyncio.to_thread(
            http, d.settings.socket_path, "POST", "/api/modeld/generate", ok
        )
        assert status == 200, raw[:300]


# --- images: pixels from the header, and only for a model that takes them ------------------------


def _png_bomb() -> str:
    """A ~20 KB PNG that decodes to 13000 x 13000 (169 megapixels)."""
    out = io.BytesIO()
    Image.new("1", (13000, 13000)).save(out, format="PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode()


def test_image_bomb_is_refused_from_its_header(short_tmp: Path) -> None:
    """A 13000 x 13000 PNG is never decoded: for a model not installed (404), for one whose
    plan takes no images (422) and for one that takes them (413 naming the pixel bound);
    the daemon's peak RSS stays within 100 MiB of where it was."""
    home, registry = short_tmp / "home", short_tmp / "registry"
    for name in ("tiny-text", "tiny-vision"):
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    write_entry(registry, "absent", size=1000)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.start_quick()
    try:
        assert d.proc is not None
        bomb = _png_bomb()
        peak = _peak_rss(d.proc.pid)
        for model, status, code in (
            ("absent", 404, "model_not_installed"),
            ("tiny-text", 422, "refused"),
            ("tiny-vision", 413, "too_large"),
        ):
            body = {"model": model, "prompt": "what is this?", "images": [bomb]}
            got, _, raw = http(d.socket, "POST", "/api/modeld/generate", json.dumps(body).encode())
            grown = _peak_rss(d.proc.pid) - peak
            assert grown < 100 * MiB, f"{model}: peak RSS grew {grown / MiB:.0f} MiB"
            assert (got, error_of(raw)["code"]) == (status, code), raw[:300]
        assert "13000x13000" in error_of(raw)["message"]
        assert "MODELD_MAX_IMAGE_PIXELS" in error_of(raw)["message"]
        assert unix_http(d.socket)[0] == 200
    finally:
        d.stop()


# --- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(short_tmp: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (root only: tests run as root elsewhere too), unmounted after."""
    mnt = short_tmp / "disk"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(directory: Path) -> None:
    """Write zeros into ``directory`` until its file system is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, bytes(65536))
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)


def test_full_disk_is_507_on_import_and_rm(small_disk: Path, short_tmp: Path) -> None:
    """With the state dir's disk full, importing a file (ENOSPC) and removing a model
    ("database or disk is full") are 507 disk_full saying what to do, not 500s."""
    home, registry = small_disk / "home", short_tmp / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    write_entry(registry, "tiny-text-b", size=(MODELS / "tiny-text-b.litertlm").stat().st_size)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.log_path = short_tmp / "daemon.log"
    d.start_quick()
    try:
        _fill(small_disk)
        body = {"path": str(MODELS / "tiny-text-b.litertlm"), "id": "tiny-text-b"}
        status, doc = unix_request(d.socket, "POST", "/api/models/import", body)
        assert status == 507, doc
        assert doc["error"]["code"] == "disk_full"
        assert "modeld prune" in doc["error"]["message"]  # it says what frees space
        assert not list((home / "partial").iterdir())
        status, doc = unix_request(d.socket, "DELETE", "/api/models/tiny-text")
        assert status == 507, doc
        assert doc["error"]["code"] == "disk_full"
        assert "free space" in doc["error"]["message"]
        (small_disk / "filler").unlink()
        status, doc = unix_request(d.socket, "DELETE", "/api/models/tiny-text")
        assert status == 200, doc
    finally:
        d.stop()
