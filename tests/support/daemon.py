"""Real daemons for tests: ``modeld serve`` subprocesses and daemons in the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modeld.client import AsyncClient
from modeld.config import Settings
from tests.support.unix import unix_request
from tests.support.wait import until

if TYPE_CHECKING:
    import httpx
    import openai


def checkout_pythonpath() -> str:
    """PYTHONPATH for a child that runs this checkout: the checkout first, then whatever
    PYTHONPATH the caller set (packages installed outside a venv)."""
    repo = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)


def daemon_env(home: Path, **extra: str) -> dict[str, str]:
    """Environment for a daemon or CLI subprocess bound to ``home``."""
    # No token, endpoint, offline switch or cache of the developer's Hugging Face setup.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("MODELD_", "HF_", "HUGGINGFACE_"))
    }
    env.pop("XDG_RUNTIME_DIR", None)
    env.update(
        HF_HOME=str(home / "hf-home"),
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


@dataclass
class InProcessDaemon:
    settings: Settings
    task: asyncio.Task[None]
    stop: asyncio.Event

    def client(self) -> AsyncClient:
        return AsyncClient(self.settings.socket_path)


@contextlib.asynccontextmanager
async def running_daemon(settings: Settings) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with the given settings (e.g. a ``registry`` dir), stopped after."""
    from modeld.daemon import daemon as daemon_mod

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


@contextlib.asynccontextmanager
async def daemon_with_models(root: Path, names: Sequence[str]) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon (main backend cpu) with the named tests/models fixtures installed,
    each with a registry entry, under ``root``."""
    from modeld.config import load_settings
    from tests.support.state import MODELS, install_fixture

    home, registry = root / "home", root / "registry"
    for name in names:
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    settings = load_settings(
        home=home, socket=home / "modeld.sock", registry=[registry], main_backend="cpu"
    )
    async with running_daemon(settings) as d:
        yield d


@contextlib.asynccontextmanager
async def socket_http(daemon: InProcessDaemon) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client on the daemon's Unix socket (what the ``openai`` package is given)."""
    import httpx

    transport = httpx.AsyncHTTPTransport(uds=str(daemon.settings.socket_path))
    async with httpx.AsyncClient(
        transport=transport, base_url="http://modeld", timeout=60
    ) as client:
        yield client


async def engine_turns(http: httpx.AsyncClient, model: str) -> dict[str, Any]:
    """How the generations on ``model``'s engine began (``ps``'s ``conversations``: kept,
    continued, restarted by reason)."""
    engines = (await http.get("/api/engines")).json()["engines"]
    (turns,) = [e["conversations"] for e in engines if e["model"] == model]
    return dict(turns)


async def streamed_chat(http: httpx.AsyncClient, model: str, prompt: str, tokens: int) -> Any:
    """One streamed chat completion of ``tokens`` tokens at most, and what its client saw:
    ``status``, the error's ``code`` and ``Retry-After`` (before or inside the stream),
    and the reply's ``tokens`` (its usage) when it finished."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": tokens,
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        seen: dict[str, Any] = {
            "status": r.status_code,
            "retry_after": r.headers.get("Retry-After"),
        }
        if r.status_code != 200:
            error = json.loads(await r.aread())["error"]
            return seen | {"code": error["code"], "message": error["message"], "tokens": None}
        seen |= {"code": None, "message": None, "tokens": None}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                seen |= {"code": chunk["error"]["code"], "message": chunk["error"]["message"]}
            elif chunk.get("usage"):
                seen["tokens"] = chunk["usage"]["completion_tokens"]
        return seen


# tiny-text-long's reply to this prompt runs past 1,024 tokens.
LONG_PROMPT = "Write a long story about the sea."


async def queue_chats(
    c: AsyncClient, http: httpx.AsyncClient, model: str, tokens: list[int]
) -> list[asyncio.Task[Any]]:
    """Streamed chat completions of ``model`` (loaded, idle), one per token count, each in
    its engine's line (running, or queued behind) before the next is sent."""

    async def arrived() -> int:
        (e,) = (await c.request("GET", "/api/engines"))["engines"]
        return int(e["requests"]) + int(e["queued"])

    tasks: list[asyncio.Task[Any]] = []
    for n in tokens:
        seen = await arrived()
        tasks.append(asyncio.create_task(streamed_chat(http, model, LONG_PROMPT, n)))
        await until(functools.partial(_arrived_since, arrived, seen, tasks[-1]), 30.0)
    return tasks


async def _arrived_since(
    arrived: Callable[[], Awaitable[int]], seen: int, task: asyncio.Task[Any]
) -> bool:
    assert not task.done() or task.result()["status"] == 200, task.result()
    return await arrived() > seen


def openai_over(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    """The real ``openai`` client over ``http`` (the socket needs no key; any will do)."""
    import openai

    return openai.AsyncOpenAI(
        base_url="http://modeld/v1",
        api_key="x",
        http_client=http,  # type: ignore[arg-type]  # openai types name its own httpx copy
        max_retries=0,
    )


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


def serve_to_exit(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``modeld serve`` expected to stop at start-up: its exit status and output."""
    return subprocess.run(
        [sys.executable, "-m", "modeld", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
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


def default_backend_env(home: Path, **extra: str) -> dict[str, str]:
    """``daemon_env`` with the daemon's default backends (main=gpu), as a user has them."""
    env = daemon_env(home, **extra)
    env.pop("MODELD_MAIN_BACKEND")
    return env


# Runs `modeld serve` as systemd would after socket activation: the listener as fd 3 and
# LISTEN_PID set (argv: the fd to pass, then "self" or another pid).
ACTIVATION_WRAPPER = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
if sys.argv[2] == "self":
    os.environ["LISTEN_PID"] = str(os.getpid())
else:
    os.environ["LISTEN_PID"] = sys.argv[2]
os.execv(sys.executable, [sys.executable, "-m", "modeld", "serve"])
"""
