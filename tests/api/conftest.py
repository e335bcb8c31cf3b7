"""Fixtures of the API dialect tests: a module defines ``daemon`` (an ``InProcessDaemon``
with the models it needs); these give an httpx client on its socket and the real ``openai``
client over that, and a daemon on loopback TCP with a key (``keyed_tcp``)."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from modeld.daemon.apikeys import KeysFile
from tests.support.daemon import (
    DaemonProcess,
    InProcessDaemon,
    daemon_env,
    openai_over,
    socket_http,
)
from tests.support.state import MODELS, install_fixture


@pytest.fixture
async def http(daemon: InProcessDaemon) -> AsyncIterator[httpx.AsyncClient]:
    async with socket_http(daemon) as client:
        yield client


@pytest.fixture
def oa(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_over(http)


@dataclass(frozen=True)
class KeyedTcp:
    """A daemon subprocess listening on loopback TCP, and a *use* key for it."""

    base_url: str
    key: str


@pytest.fixture(scope="module")
def keyed_tcp() -> Iterator[KeyedTcp]:
    """One daemon for the module: tiny-text and tiny-embed installed, TCP on, one use key."""
    root = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    for name in ("tiny-text", "tiny-embed"):
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    _, key = KeysFile(home / "api-keys").add("client")
    env = daemon_env(home, MODELD_LISTEN="127.0.0.1:0", MODELD_REGISTRY=str(registry))
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        found = re.search(r"listening address=127\.0\.0\.1:(\d+)", d.log())
        assert found, d.log()
        yield KeyedTcp(f"http://127.0.0.1:{found.group(1)}", key)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
