"""The daemon skeleton: socket safety, health/status/metrics, ordered shutdown."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from modeld.daemon.daemon import bind_socket
from modeld.errors import Conflict, SettingsError
from tests.support.daemon import DaemonProcess, InProcessDaemon, daemon_env


def test_bind_socket_mode_is_0660_right_after_bind(short_tmp: Path) -> None:
    """The socket is never more open than 0660, even with a permissive umask."""
    old = os.umask(0)
    try:
        sock = bind_socket(short_tmp / "s.sock")
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE((short_tmp / "s.sock").stat().st_mode)
        assert mode & ~0o660 == 0
    finally:
        sock.close()


def test_stale_socket_is_replaced(short_tmp: Path) -> None:
    """A socket file left by a dead daemon (nobody listening) is replaced."""
    path = short_tmp / "s.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # file stays, nobody listens
    sock = bind_socket(path)
    try:
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(path))  # the new socket answers at the old path
        client.close()
        assert path.is_socket()
    finally:
        sock.close()


def test_live_socket_is_not_replaced(short_tmp: Path) -> None:
    """A socket with a live listener is refused, not stolen."""
    path = short_tmp / "s.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen()
    try:
        with pytest.raises(Conflict, match="already serving"):
            bind_socket(path)
    finally:
        live.close()


def test_regular_file_at_socket_path_is_kept(short_tmp: Path) -> None:
    """A regular file where the socket should go is never deleted."""
    path = short_tmp / "s.sock"
    path.write_text("precious")
    with pytest.raises(SettingsError, match="not a socket"):
        bind_socket(path)
    assert path.read_text() == "precious"


async def test_health_status_metrics(daemon: InProcessDaemon) -> None:
    """Health, status (version and effective settings) and Prometheus text are served."""
    async with daemon.client() as c:
        assert (await c.health())["status"] == "ok"
        status = await c.status()
        assert status["version"]
        assert status["settings"]["home"] == str(daemon.settings.home)
        assert status["settings"]["main_backend"] == "cpu"
        text = await c.request("GET", "/metrics")
        assert "modeld_http_requests_total" in text


async def test_unknown_route_is_json_404(daemon: InProcessDaemon) -> None:
    """Unknown routes answer 404 in the API's error shape."""
    async with daemon.client() as c:
        resp = await c.session.get("http://modeld/api/nope")
        assert resp.status == 404
        body = await resp.json()
        assert body["error"]["code"] == "not_found"


def test_serve_status_sigterm(daemon_proc: DaemonProcess) -> None:
    """`modeld serve` starts, answers `modeld status`, and stops cleanly on SIGTERM."""
    result = daemon_proc.cli("status")
    assert result.returncode == 0, result.stderr
    assert "modeld" in result.stdout
    assert daemon_proc.stop(signal.SIGTERM) == 0
    assert not daemon_proc.socket.exists()
    assert "stopped" in daemon_proc.log()


def test_second_daemon_on_same_home_is_refused(daemon_proc: DaemonProcess) -> None:
    """A second daemon on the same state dir exits 1 with a clear line."""
    other = daemon_proc.cli("serve", timeout=30)
    assert other.returncode == 1
    assert "already" in other.stderr


@pytest.mark.parametrize("case", ["file", "world-writable", "blobs world-writable"])
def test_a_state_dir_that_is_a_file_or_writable_by_everyone_is_refused(
    short_tmp: Path, case: str
) -> None:
    """`modeld serve` on a state path that is a file, or on a state dir (or one of its
    dirs) every user may write, exits 2 with one line saying what to do; no traceback."""
    home = short_tmp / "home"
    if case == "file":
        home.write_text("")
    else:
        (home / "blobs").mkdir(parents=True)
        (home / "blobs" if case.startswith("blobs") else home).chmod(0o777)
    env = daemon_env(home, MODELD_SOCKET=str(short_tmp / "s.sock"))
    got = subprocess.run(
        [sys.executable, "-m", "modeld", "serve"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 2 and "Traceback" not in got.stderr
    fix = "set MODELD_HOME to a directory" if case == "file" else "run `chmod o-w"
    assert got.stderr.count("\n") == 1 and fix in got.stderr, got.stderr
    assert not (short_tmp / "s.sock").exists()


def test_preload_loads_the_named_models_and_the_marked_entries(short_tmp: Path) -> None:
    """MODELD_PRELOAD and `preload = true` in an entry load those models once the daemon is
    ready (kept: keep-alive never); an id that cannot load is logged and skipped."""
    import hashlib
    import json

    from tests.support.daemon import daemon_env
    from tests.support.state import MODELS, install_fixture, write_entry

    home, registry = short_tmp / "home", short_tmp / "registry"
    tiny = MODELS / "tiny-text.litertlm"
    install_fixture(home, "tiny-text", tiny, registry=registry)
    other = MODELS / "tiny-text-b.litertlm"  # another file: an engine of its own
    install_fixture(home, "marked", other)
    write_entry(
        registry,
        "marked",
        size=other.stat().st_size,
        sha256=hashlib.sha256(other.read_bytes()).hexdigest(),
        extra="preload = true",
    )
    env = daemon_env(home, MODELD_REGISTRY=str(registry), MODELD_PRELOAD="tiny-text,nope")
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        d.wait_log("preloaded model=marked", timeout=120)
        ps = d.cli_json("ps")
        models = sorted(e["model"] for e in ps["engines"])
        assert models == ["marked", "tiny-text"]
        assert all(e["keep_alive"] < 0 for e in ps["engines"])
        # Preloads are for a quick first reply: each warmed up at load.
        assert all(e["warm_up_seconds"] is not None for e in ps["engines"]), ps["engines"]
        assert "preload_failed model=nope code=model_not_found" in d.log()
        assert json.loads(d.cli("status", "--json").stdout)["settings"]["preload"] == [
            "tiny-text",
            "nope",
        ]
    finally:
        d.stop()
