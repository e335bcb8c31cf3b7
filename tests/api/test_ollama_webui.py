"""A real web UI that speaks only Ollama's API, Ollama Chat (``ollama-chat`` on PyPI, MIT),
driven in headless Chromium against a real daemon over TCP: it lists the models, streams a
chat answer, and an admin's pull (its "Update" of an installed model) shows progress.

Marker ``webui``, not in the default run. What it needs, and the command (see docs/ollama.md):

    apt-get install chromium
    python3 -m venv ~/.cache/modeld-tests/ollama-chat && \\
        ~/.cache/modeld-tests/ollama-chat/bin/pip install ollama-chat==1.6.0
    pytest -m webui tests/api/test_ollama_webui.py -s

The UI sends no key (it has no setting for one), so a loopback proxy adds the admin key, as a
reverse proxy in front of modeld would. Playwright's driver (``playwright-core`` from npm) runs
Debian's Chromium; the screenshots stay under the test's tmp dir, whose path is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.daemon.apikeys import KeysFile
from tests.daemon.test_tcp import listening_port
from tests.support.daemon import DaemonProcess, daemon_env, stop_process
from tests.support.keyproxy import KeyProxy
from tests.support.mirror import Faults, LoopThread, Mirror
from tests.support.npm import cache_root, installed, node_script
from tests.support.state import MODELS, install_fixture, write_entry
from tests.support.wait import wait_sync

pytestmark = pytest.mark.webui

# The versions this test passed with.
OLLAMA_CHAT = "ollama-chat==1.6.0"
PLAYWRIGHT = "playwright-core@1.65.2"
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "webui.mjs"


def _ollama_chat() -> Path:
    """The ``ollama-chat`` command of a venv kept beside the npm cache, made the first time."""
    venv = cache_root().parent / "ollama-chat"
    command = venv / "bin" / "ollama-chat"
    if not command.exists():
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True, timeout=300)
        pip = [str(venv / "bin" / "pip"), "install", "--quiet", OLLAMA_CHAT]
        subprocess.run(pip, check=True, timeout=600)
    return command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def stack() -> Iterator[tuple[str, Mirror, KeyProxy]]:
    """A daemon on TCP with tiny-text and ``pulled`` installed, ``pulled``'s entry then naming
    a newer file on a slow loopback mirror; the key proxy; Ollama Chat in front of it."""
    root = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    install_fixture(home, "pulled", MODELS / "tiny-text-b.litertlm", registry=registry)
    _, admin = KeysFile(home / "api-keys").add("webui", "admin")
    env = daemon_env(home, MODELD_LISTEN="127.0.0.1:0", MODELD_REGISTRY=str(registry))
    d = DaemonProcess(home=home, env=env)
    d.start()
    loop = LoopThread()
    newer = (MODELS / "tiny-text.litertlm").read_bytes()
    # Slow enough that the page shows the pull while it runs.
    mirror = loop.run(Mirror(newer, Faults(throttle=60_000, burst=16 * 1024)).start())
    write_entry(registry, "pulled", size=len(newer), sha256=mirror.sha256, urls=[mirror.url])
    proxy = loop.run(KeyProxy(f"http://127.0.0.1:{listening_port(d.log())}", admin).start())
    config = root / "ollama-chat"
    config.mkdir()
    (config / "ollama-chat.json").write_text(
        json.dumps({"conversations": [], "model": "tiny-text:latest"})
    )
    port = _free_port()
    ui_env = {**os.environ, "OLLAMA_HOST": proxy.url}
    ui = subprocess.Popen(
        [str(_ollama_chat()), "-n", "-q", "-p", str(port), "-c", str(config)],
        env=ui_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_sync(lambda: _answers(url), 60.0, "Ollama Chat answering")
        yield url, mirror, proxy
    finally:
        stop_process(ui)
        loop.run(proxy.stop())
        loop.run(mirror.stop())
        loop.close()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_ollama_chat_lists_chats_and_pulls(
    stack: tuple[str, Mirror, KeyProxy], tmp_path: Path
) -> None:
    """The UI lists both models, shows a chat answer from the model, and shows the pull's
    progress (a percentage and Ollama's "pulling <digest>") until the pull ends."""
    url, mirror, proxy = stack
    shots = tmp_path / "screenshots"
    shots.mkdir()
    script = node_script(SCRIPT, installed(PLAYWRIGHT), tmp_path / "node")
    done = subprocess.run(
        ["node", str(script), url, str(shots)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    print(f"\nscreenshots of the web UI: {shots}")
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout)
    assert "tiny-text:latest" in seen["models"] and "pulled:latest" in seen["models"]
    # The answer sits between the model's heading and the conversation's actions.
    answer = seen["chat"].split("Read Aloud", 1)[1].split("Previous", 1)[0].strip()
    assert answer, seen["chat"]
    # It came as Ollama streams it: a record per piece, then the last one.
    chats = [(json.loads(body), lines) for path, body, lines in proxy.seen if path == "/api/chat"]
    assert chats and all(body["stream"] is True and lines >= 2 for body, lines in chats), chats
    assert f"pulling {mirror.sha256[:12]}" in seen["pulling"], seen["pulling"]
    assert "% of" in seen["pulling"]
    assert "Downloading" not in seen["pulled"] and "pulled:latest" in seen["pulled"]
    assert mirror.sent >= len(mirror.data)
    assert sorted(p.name for p in shots.iterdir()) == ["chat.png", "models.png", "pull.png"]
