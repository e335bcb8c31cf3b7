"""Shared fixtures: real daemons on temporary sockets and state dirs (helpers: tests/support)."""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from modeld.config import load_settings
from tests.support.daemon import DaemonProcess, InProcessDaemon, daemon_env
from tests.support.state import MODELS


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path, so a socket inside stays under the 107-byte limit."""
    path = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, short_tmp: Path) -> Path:
    """No MODELD_* or HF_* variable, config file or Hugging Face token or cache from the
    developer's machine leaks into a test."""
    for key in list(os.environ):
        if key.startswith(("MODELD_", "HF_", "HUGGINGFACE_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HF_HOME", str(short_tmp / "hf-home"))
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


# --- the `gpu` marker: tests that need a GPU adapter the runtime can use --------------------


@functools.cache
def gpu_probe() -> tuple[bool, str]:
    """Run the real GPU probe once on tiny-text: ``(usable, why not / the adapter)``."""
    from modeld.modelfile.probe import probe

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
