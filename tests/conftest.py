"""Shared fixtures: real daemons on temporary sockets and state dirs, the CLI in a subprocess."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from modeld.client import Client
from modeld.config import Settings, load_settings
from modeld.store import Store, sha256_file

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "models"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path, so a socket inside stays under the 107-byte limit."""
    path = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, short_tmp: Path) -> Path:
    """No MODELD_* variable or config file from the developer's machine leaks into a test."""
    for key in list(os.environ):
        if key.startswith("MODELD_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(short_tmp / "xdg-config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(short_tmp / "xdg-data"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return short_tmp


def daemon_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for a daemon or CLI subprocess bound to ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELD_")}
    env.pop("XDG_RUNTIME_DIR", None)
    env.update(
        MODELD_HOME=str(home),
        MODELD_SOCKET=str(home / "modeld.sock"),
        MODELD_MAIN_BACKEND="cpu",
        MODELD_LOG_LEVEL="debug",
        XDG_CONFIG_HOME=str(home / "xdg-config"),
        # Anything that is not loopback goes to a dead proxy: tests never reach a real host,
        # even when a bundled catalog entry (huggingface.co URLs) is pulled by mistake.
        HTTP_PROXY="http://127.0.0.1:9",
        HTTPS_PROXY="http://127.0.0.1:9",
        NO_PROXY="127.0.0.1,localhost,::1",
    )
    env.update(extra)
    return env


@dataclass
class DaemonProcess:
    """A real ``modeld serve`` in a subprocess, and a way to run the CLI against it."""

    home: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.home / "daemon.log"

    @property
    def socket(self) -> Path:
        return Path(self.env["MODELD_SOCKET"])

    def spawn(self) -> None:
        """Start ``modeld serve`` without waiting for it."""
        self.proc = spawn_daemon(self.env, self.log_path)

    def start(self, timeout: float = 20.0) -> None:
        """Start it and wait until ``modeld status --json`` succeeds."""
        self._start(
            lambda: self.socket.exists() and self.cli("status", "--json").returncode == 0,
            timeout,
            pause=0.05,
        )

    def start_quick(self, timeout: float = 30.0) -> None:
        """Start it and wait for ``/api/health`` (no CLI subprocess per poll, unlike ``start``)."""

        def healthy() -> bool:
            try:
                return unix_request(self.socket, "GET", "/api/health", timeout=2.0)[0] == 200
            except OSError:
                return False

        self._start(healthy, timeout, pause=0.02)

    def _start(self, ready: Callable[[], bool], timeout: float, pause: float) -> None:
        self.spawn()
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()[-4000:]}")
            if ready():
                return
            time.sleep(pause)
        raise RuntimeError(f"daemon did not start in {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        return stop_process(self.proc, sig, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_log(self, needle: str, count: int = 1, timeout: float = 30.0) -> str:
        """Wait until ``needle`` occurs ``count`` times in the daemon's log; return the log."""
        return wait_log(self.log_path, needle, count=count, timeout=timeout)

    def cli(
        self, *args: str, timeout: float = 60.0, **extra_env: str
    ) -> subprocess.CompletedProcess[str]:
        env = dict(self.env, **extra_env)
        return subprocess.run(
            [sys.executable, "-m", "modeld", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def cli_json(self, *args: str, timeout: float = 60.0) -> Any:
        result = self.cli(*args, "--json", timeout=timeout)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)


@pytest.fixture
def daemon_proc(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A started daemon subprocess (stopped with SIGTERM after the test)."""
    d = DaemonProcess(home=short_tmp / "home", env=daemon_env(short_tmp / "home"))
    d.start()
    yield d
    d.stop()


@dataclass
class InProcessDaemon:
    settings: Settings
    task: asyncio.Task[None]
    stop: asyncio.Event

    def client(self) -> Client:
        return Client(self.settings.socket_path)


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """A daemon running in the test's event loop, for fast API tests."""
    from modeld import daemon as daemon_mod

    home = clean_env / "home"
    settings = load_settings(home=home, socket=home / "modeld.sock", main_backend="cpu")
    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon_mod.run(settings, ready=ready, stop=stop))
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(ready.wait())], timeout=20, return_when=asyncio.FIRST_COMPLETED
    )
    if task in done:
        task.result()
    yield InProcessDaemon(settings, task, stop)
    stop.set()
    await asyncio.wait_for(task, 30)


# --- catalog and store fixtures (catalog/store engineer) --------------------------------

import contextlib as _contextlib  # noqa: E402  (appended section; the file is shared)


def write_entry(
    registry: Path,
    model_id: str,
    *,
    size: int,
    sha256: str | None = None,
    urls: list[str] | None = None,
    extra: str = "",
) -> Path:
    """Write ``registry/<model_id>.toml``; URLs default to a dead loopback port (no download)."""
    import json as _json

    registry.mkdir(parents=True, exist_ok=True)
    urls = urls or [f"http://127.0.0.1:9/{model_id}.litertlm"]
    lines = [
        f'id = "{model_id}"',
        f'display_name = "{model_id}"',
        f'file_name = "{model_id}.litertlm"',
        f"urls = {_json.dumps(urls)}",
        f"size = {size}",
    ]
    if sha256 is not None:
        lines.append(f'sha256 = "{sha256}"')
    path = registry / f"{model_id}.toml"
    # Write then rename, so a live-reloading catalog never reads half a file.
    tmp = registry / f".{model_id}.toml.tmp"
    tmp.write_text("\n".join(lines) + "\n" + extra)
    tmp.replace(path)
    return path


def install_fixture(
    home: Path,
    model_id: str,
    path: Path,
    *,
    verified_by: str | None = "registry sha256",
    registry: Path | None = None,
) -> Any:
    """Install a copy of ``path`` as ``model_id`` into the state dir ``home``, as a pull would.

    Runs the real Store on its own event loop in a thread, so it works from sync and async
    tests alike, BEFORE the daemon starts (one daemon per state dir). With ``registry``,
    also writes a matching entry (real size and sha256). Returns the ``Installed`` record.
    """
    import threading

    digest, size = sha256_file(path)
    if registry is not None:
        write_entry(registry, model_id, size=size, sha256=digest)
    staged = home / "partial" / f"fixture-{model_id}"
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, staged)
    result: list[Any] = []

    async def go() -> None:
        async with open_store(home) as store:
            result.append(await store.install(model_id, staged, digest, size, verified_by))

    def run_it() -> None:
        try:
            asyncio.run(go())
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=run_it)
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


@_contextlib.asynccontextmanager
async def running_daemon(settings: Settings) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with the given settings (e.g. a ``registry`` dir), stopped after."""
    from modeld import daemon as daemon_mod

    ready, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon_mod.run(settings, ready=ready, stop=stop))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait([task, waiter], timeout=20, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if task in done:
        task.result()
    try:
        yield InProcessDaemon(settings, task, stop)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


# --- talking to the daemon with the stdlib only (no event loop, no subprocess) ---------------


def _request_bytes(method: str, target: str, body: Any = None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {target} HTTP/1.0\r\nHost: modeld\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    return (head + "\r\n").encode() + payload


def unix_request(
    path: Path | str, method: str, target: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """One request over a Unix socket: ``(status, decoded JSON body)``; NDJSON is a list."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(_request_bytes(method, target, body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"application/x-ndjson" in head:
        return status, [json.loads(line) for line in raw.splitlines() if line.strip()]
    return status, json.loads(raw) if raw else None


def unix_http(
    path: Path | str, target: str = "/api/health", timeout: float = 10.0
) -> tuple[int, Any]:
    """One ``GET`` over a Unix socket: ``(status, decoded JSON body)``."""
    return unix_request(path, "GET", target, timeout=timeout)


def unix_fire(path: Path | str, method: str, target: str, body: Any = None) -> socket.socket:
    """Send a request and do not wait for its answer (the caller closes the socket)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    s.connect(str(path))
    s.sendall(_request_bytes(method, target, body))
    return s


# --- daemon subprocesses without DaemonProcess (activation, notify) -------------------------


def spawn_daemon(
    env: dict[str, str],
    log_path: Path,
    argv: Sequence[str] | None = None,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``modeld serve`` (or ``argv``) in its own session, output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv or [sys.executable, "-m", "modeld", "serve"]),
            env=env,
            stdout=log,
            stderr=log,
            pass_fds=pass_fds,
            start_new_session=True,
        )


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> int:
    """Send ``sig`` (SIGKILL after ``timeout``) and return the exit status."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def wait_log(
    log_path: Path,
    needle: str,
    *,
    count: int = 1,
    proc: subprocess.Popen[bytes] | None = None,
    timeout: float = 30.0,
) -> str:
    """Wait until ``needle`` occurs ``count`` times in the log (or ``proc`` exits); the log."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        if text.count(needle) >= count:
            return text
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.05)
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    raise AssertionError(f"{needle!r} x{count} not in the log:\n{text}")


# --- in-process helpers for API tests -------------------------------------------------------


def registry_settings(home: Path, registry: Path, **extra: Any) -> Settings:
    """Settings for a daemon on ``home`` with the ``registry`` dir, on the CPU backend."""
    values: dict[str, Any] = {"main_backend": "cpu", **extra}
    return load_settings(home=home, socket=home / "modeld.sock", registry=[registry], **values)


async def until(cond: Callable[[], Awaitable[Any]], limit: float = 10.0) -> None:
    """Poll the async ``cond`` until it is true; fail after ``limit`` seconds."""
    started = time.monotonic()
    while not await cond():
        if time.monotonic() - started > limit:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


@_contextlib.asynccontextmanager
async def open_store(home: Path) -> AsyncIterator[Store]:
    """The real ``Store`` of ``home``, opened, and closed afterwards (no daemon running)."""
    store = Store(home)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


# --- the `gpu` marker: tests that need a GPU adapter the runtime can use --------------------


@functools.cache
def gpu_probe() -> tuple[bool, str]:
    """Run the real GPU probe once on tiny-text: ``(usable, why not / the adapter)``."""
    from modeld.probe import probe

    cache = Path(tempfile.mkdtemp(prefix="md-gpu-", dir="/tmp"))
    try:
        result = asyncio.run(probe(MODELS / "tiny-text.litertlm", "gpu", cache))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if result.ok:
        return True, result.adapter or "an unnamed adapter"
    return False, result.reason or "the GPU probe failed without a reason"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``@pytest.mark.gpu`` tests where the runtime finds no GPU adapter, saying why."""
    if item.get_closest_marker("gpu") is None:
        return
    usable, detail = gpu_probe()
    if not usable:
        pytest.skip(f"no GPU adapter the LiteRT-LM runtime can use here: {detail}")


def default_backend_env(home: Path, **extra: str) -> dict[str, str]:
    """``daemon_env`` with the daemon's default backends (main=gpu), as a user has them."""
    env = daemon_env(home, **extra)
    env.pop("MODELD_MAIN_BACKEND")
    return env
