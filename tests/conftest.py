"""Shared fixtures: real daemons on temporary sockets and state dirs, the CLI in a subprocess."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from modeld.client import Client
from modeld.config import Settings, load_settings

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

    def start(self, timeout: float = 20.0) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "modeld", "serve"],
                env=self.env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists() and self.cli("status", "--json").returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start in {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

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
