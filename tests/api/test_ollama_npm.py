"""The npm ``ollama`` client under node against a real daemon: over TCP with keys made by
``modeld key add``, and over the Unix socket (undici's ``socketPath``). Marker ``npm``: it
installs the packages from the npm registry (once, into a cache dir), so it is not in the
default run (``pytest -m npm``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeld.api.ollama import OLLAMA_VERSION
from tests.daemon.test_tcp import listening_port
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.npm import installed, node_script
from tests.support.state import MODELS, install_fixture

pytestmark = pytest.mark.npm

# The versions these tests passed with.
PACKAGES = ("ollama@0.6.4", "undici@6.29.1")
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "ollama_client.mjs"


@pytest.fixture(scope="module")
def tcp_daemon() -> Iterator[tuple[DaemonProcess, int]]:
    """tiny-text and tiny-embed installed, TCP on loopback."""
    # A short path: the socket inside stays under the 107 bytes a socket path may hold.
    root = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    for name in ("tiny-text", "tiny-embed"):
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    env = daemon_env(home, MODELD_LISTEN="127.0.0.1:0", MODELD_REGISTRY=str(registry))
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        yield d, listening_port(d.log())
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def _key(d: DaemonProcess, name: str, *role: str) -> str:
    added = d.cli("key", "add", name, *role)
    assert added.returncode == 0, added.stderr
    return added.stdout.strip()


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    where = installed(*PACKAGES)
    script = node_script(SCRIPT, where, tmp_path / "node")
    done = subprocess.run(
        ["node", str(script), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _check(out: dict[str, Any], *, use_is_admin: bool) -> None:
    assert out["version"]["version"] == OLLAMA_VERSION
    assert out["tags"] == ["tiny-embed:latest", "tiny-text:latest"]
    assert out["capabilities"] == ["completion"] and out["context_length"] == 256
    assert out["chat_parts"] >= 2 and out["chat_text"]
    last = out["chat_last"]
    assert last["done"] and last["eval_count"] == 3 and last["total_duration"] > 0
    assert out["generate"]["response"] and out["generate"]["eval_count"] == 2
    assert out["embed"] == 2 and "tiny-text:latest" in out["ps"]
    if use_is_admin:
        assert out["pull_as_use"] is None
    else:
        assert out["pull_as_use"]["status"] == 403, out["pull_as_use"]
        assert "admin" in out["pull_as_use"]["error"]
    assert out["pull_statuses"][-1] == "success", out["pull_statuses"]
    assert out["unknown"]["status"] == 404 and "no-such-model" in out["unknown"]["error"]


def test_npm_client_over_tcp_with_a_key(
    tcp_daemon: tuple[DaemonProcess, int], tmp_path: Path
) -> None:
    """Over TCP with a use key (``modeld key add``): list, show, streamed chat, generate,
    embed and ps work; a pull needs the admin key; a bad key is refused."""
    d, port = tcp_daemon
    use, admin = _key(d, "npm-use"), _key(d, "npm-admin", "--role", "admin")
    out = _run(tmp_path, f"http://127.0.0.1:{port}", use, admin, "-")
    _check(out, use_is_admin=False)


def test_npm_client_over_the_socket(tcp_daemon: tuple[DaemonProcess, int], tmp_path: Path) -> None:
    """Over the Unix socket, no key: the daemon's own uid is an admin there."""
    d, _ = tcp_daemon
    out = _run(tmp_path, "http://modeld", "-", "-", str(d.socket))
    _check(out, use_is_admin=True)
