"""Shared fixtures: real daemons on temporary sockets and state dirs (helpers: tests/support)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from modeld.config import load_settings
from tests.support.daemon import DaemonProcess, InProcessDaemon, daemon_env


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


@pytest.fixture
def daemon_proc(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A started daemon subprocess (stopped with SIGTERM after the test)."""
    d = DaemonProcess(home=short_tmp / "home", env=daemon_env(short_tmp / "home"))
    d.start()
    yield d
    d.stop()


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """A daemon running in the test's event loop, for fast API tests."""
    from modeld.daemon import daemon as daemon_mod

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
