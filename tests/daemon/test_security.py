"""Socket security: SO_PEERCRED allow-lists, the socket's mode at bind, and SIGHUP reloads."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.api.peers import Peer, is_allowed
from modeld.config import load_settings
from modeld.daemon import daemon as daemon_mod
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.unix import unix_http


def request_as(path: Path, uid: int, gid: int, groups: list[int]) -> int:
    """GET /api/health from a forked child running as ``uid``/``gid`` with ``groups``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to the given identity, then talk HTTP with the stdlib only
        code = 255
        try:
            os.close(r)
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            code = unix_http(path)[0]
        except PermissionError:
            code = 254
        finally:
            os.write(w, str(code).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return int(out)


@pytest.fixture
def open_tmp(short_tmp: Path) -> Path:
    """``short_tmp`` traversable by other uids (the socket's own mode still decides)."""
    short_tmp.chmod(0o755)
    return short_tmp


def test_peer_outside_allow_list_gets_403(short_tmp: Path) -> None:
    """root (uid 0) is refused with 403 forbidden when only uid 12345 is allowed; it is logged."""
    home = short_tmp / "home"
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_ALLOW_UIDS="12345"))
    # start() waits on `modeld status`, which is refused here; wait on the log instead.
    d.spawn()
    try:
        d.wait_log(" ready ")
        status, body = unix_http(d.socket, "/api/status")
        assert status == 403
        assert body["error"]["code"] == "forbidden"
        message = body["error"]["message"]
        assert "uid 0" in message and "MODELD_ALLOW_UIDS" in message
        result = d.cli("status")
        assert result.returncode == 1
        assert "not allowed on this socket" in result.stderr
        log = d.wait_log("status=403")
        assert f"peer=0:0:{os.getpid()}" in log
    finally:
        d.stop()


def test_allow_gids_match_supplementary_groups(open_tmp: Path) -> None:
    """A peer is let in by a supplementary group (SO_PEERGROUPS); without it, 403."""
    home = open_tmp / "home"
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_ALLOW_GIDS="4243,0"))
    d.start()
    try:
        # The socket's group decides who can connect at all; the allow-list narrows it.
        os.chown(d.socket, 0, 4242)
        assert request_as(d.socket, 12346, 4242, [4243]) == 200
        assert request_as(d.socket, 12346, 4242, []) == 403
        # Not in the socket's group: the 0660 mode refuses the connection itself.
        assert request_as(d.socket, 12346, 5000, [4243]) == 254
    finally:
        d.stop()


class _RecordingSocket(socket.socket):
    """A real socket that records its path's mode the instant bind() returns."""

    modes: list[int] = []  # noqa: RUF012 - shared on purpose: the test reads it

    def bind(self, address: object) -> None:
        super().bind(address)  # type: ignore[arg-type]
        if isinstance(address, str):
            _RecordingSocket.modes.append(stat.S_IMODE(os.stat(address).st_mode))


def test_socket_mode_right_after_bind_under_umask_0(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even with umask 0 the socket is never more open than 0660, not even before listen()."""
    monkeypatch.setattr(socket, "socket", _RecordingSocket)
    _RecordingSocket.modes.clear()
    old = os.umask(0)
    try:
        sock = daemon_mod.bind_socket(short_tmp / "m.sock")
    finally:
        os.umask(old)
    try:
        assert _RecordingSocket.modes, "bind() was not observed"
        assert all(mode & ~0o660 == 0 for mode in _RecordingSocket.modes), [
            oct(m) for m in _RecordingSocket.modes
        ]
        assert stat.S_IMODE((short_tmp / "m.sock").stat().st_mode) == 0o660
    finally:
        sock.close()


def test_daemon_socket_is_0660_when_started_with_umask_0(short_tmp: Path) -> None:
    """A real `modeld serve` started under umask 0 still leaves its socket at 0660."""
    old = os.umask(0)
    try:
        # Made here for the daemon's log; a 0777 one would be refused as the socket's dir.
        (short_tmp / "home").mkdir(mode=0o700)
        d = DaemonProcess(home=short_tmp / "home", env=daemon_env(short_tmp / "home"))
        d.start()
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o660
    finally:
        d.stop()


class KeepAlive:
    """One HTTP/1.1 connection reused for several requests."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.buf = b""

    def get(self, target: str) -> int:
        self.sock.sendall(f"GET {target} HTTP/1.1\r\nHost: modeld\r\n\r\n".encode())
        while b"\r\n\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed"
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            assert chunk, "connection closed"
            rest += chunk
        self.buf = rest[length:]
        return int(head.split(b" ", 2)[1])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def configured(short_tmp: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon whose log level and keep-alive come from a config file (not the environment)."""
    home = short_tmp / "home"
    home.mkdir()
    config = short_tmp / "modeld.toml"
    config.write_text('log_level = "info"\nkeep_alive = "5m"\n')
    env = daemon_env(home, MODELD_CONFIG=str(config))
    del env["MODELD_LOG_LEVEL"]
    d = DaemonProcess(home=home, env=env)
    d.start()
    yield d, config
    d.stop()


def test_sighup_reload_applies_live_settings_and_keeps_serving(
    configured: tuple[DaemonProcess, Path],
) -> None:
    """SIGHUP applies log level and keep-alive, keeps open connections, defers restart-only keys."""
    d, config = configured
    assert d.proc is not None
    conn = KeepAlive(d.socket)
    try:
        check_reload(d, config, conn)
    finally:
        conn.close()


def check_reload(d: DaemonProcess, config: Path, conn: KeepAlive) -> None:
    assert d.proc is not None
    assert conn.get("/api/health") == 200
    # At info level the health check (a debug line) is not logged.
    assert "path=/api/health" not in d.log()
    budget = d.cli_json("status")["settings"]["memory_budget"]
    config.write_text('log_level = "debug"\nkeep_alive = "30s"\nmemory_budget = "1GiB"\n')
    d.proc.send_signal(signal.SIGHUP)
    log = d.wait_log(" reloaded ")
    assert "changed=log_level,keep_alive" in log and "restart_needed=memory_budget" in log
    # Same connection, same process: nothing was dropped.
    assert conn.get("/api/health") == 200
    assert d.proc.poll() is None
    d.wait_log("path=/api/health")
    doc = d.cli_json("status")
    settings = doc["settings"]
    assert settings["log_level"] == "debug" and settings["keep_alive"] == 30
    assert settings["memory_budget"] == budget
    # The deferred key is a status problem until the config no longer changes it.
    (problem,) = doc["reload"]["problems"]
    assert "memory_budget" in problem and "systemctl restart modeld" in problem, problem
    assert f"! reload: {problem}" in d.cli("status").stdout
    config.write_text('log_level = "debug"\nkeep_alive = "30s"\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ", count=2)
    assert d.cli_json("status")["reload"]["problems"] == []


def test_bad_config_on_sighup_keeps_old_settings(
    configured: tuple[DaemonProcess, Path],
) -> None:
    """A config that fails to load on SIGHUP is logged; the old settings stay, serving goes on."""
    d, config = configured
    assert d.proc is not None
    config.write_text('keep_alive = "soon"\n')
    d.proc.send_signal(signal.SIGHUP)
    log = d.wait_log("reload_failed")
    assert "keep_alive" in log
    config.write_text("log_level = [unclosed\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("reload_failed", count=2)
    assert d.proc.poll() is None
    status, body = unix_http(d.socket, "/api/status")
    assert status == 200
    assert body["settings"]["keep_alive"] == 300 and body["settings"]["log_level"] == "info"


def test_a_failed_reload_is_a_status_problem_until_a_reload_succeeds(
    configured: tuple[DaemonProcess, Path],
) -> None:
    """A config that fails to load on SIGHUP shows in `modeld status` (and --json): what is
    wrong, that the old settings stay, how to fix it; a reload that succeeds clears it."""
    d, config = configured
    assert d.proc is not None
    config.write_text('keep_alive = "forever"\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log("reload_failed")
    doc = d.cli_json("status")
    assert doc["settings"]["keep_alive"] == 300
    (problem,) = doc["reload"]["problems"]
    assert "keep_alive" in problem and "forever" in problem, problem
    assert "keeps the settings it had" in problem and str(config) in problem, problem
    assert f"kill -HUP {d.proc.pid}" in problem, problem
    human = d.cli("status").stdout
    assert f"! reload: {problem}" in human, human

    config.write_text('keep_alive = "1m"\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ")
    doc = d.cli_json("status")
    assert doc["reload"]["problems"] == [] and doc["settings"]["keep_alive"] == 60
    assert "! reload" not in d.cli("status").stdout


def test_sighup_applies_allow_lists_live(configured: tuple[DaemonProcess, Path]) -> None:
    """An allow-list added by SIGHUP takes effect on the next request, and so does its removal."""
    d, config = configured
    assert d.proc is not None
    config.write_text("allow_uids = [12345]\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ")
    assert unix_http(d.socket)[0] == 403
    config.write_text("allow_uids = [12345, 0]\n")
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ", count=2)
    status, body = unix_http(d.socket, "/api/status")
    assert status == 200 and body["settings"]["allow_uids"] == [12345, 0]


def test_allow_list_rules() -> None:
    """Empty lists allow all; otherwise uid, primary gid or a supplementary gid must match."""
    root = Peer(pid=1, uid=0, gid=0)
    alice = Peer(pid=2, uid=1000, gid=1000, groups=(1000, 27))
    assert is_allowed(load_settings(), root)
    assert not is_allowed(load_settings(allow_uids=[1000]), root)
    assert is_allowed(load_settings(allow_uids=[1000]), alice)
    assert is_allowed(load_settings(allow_gids=[27]), alice)
    assert not is_allowed(load_settings(allow_gids=[28]), alice)
    # A peer whose credentials cannot be read is refused once any list is set.
    assert not is_allowed(load_settings(allow_gids=[28]), None)
    assert is_allowed(load_settings(), None)


def test_allow_lists_from_env_and_toml(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Env takes ':' or ',' separated ids, TOML takes lists; bad ids name the key."""
    monkeypatch.setenv("MODELD_ALLOW_UIDS", "1000:1001,1002")
    assert load_settings().allow_uids == [1000, 1001, 1002]
    config = clean_env / "c.toml"
    config.write_text("allow_gids = [27, 44]\n")
    monkeypatch.setenv("MODELD_CONFIG", str(config))
    settings = load_settings()
    assert settings.allow_gids == [27, 44]
    assert json.loads(json.dumps(settings.effective()))["allow_gids"] == [27, 44]
    monkeypatch.setenv("MODELD_ALLOW_UIDS", "alice")
    from modeld.errors import SettingsError

    with pytest.raises(SettingsError, match="MODELD_ALLOW_UIDS"):
        load_settings()


def _entry(model_id: str) -> str:
    return (
        f'id = "{model_id}"\ndisplay_name = "{model_id}"\nfile_name = "{model_id}.litertlm"\n'
        f'urls = ["http://127.0.0.1:9/{model_id}.litertlm"]\nsize = 1234\n'
    )


def test_sighup_points_the_catalog_at_new_registry_dirs(
    configured: tuple[DaemonProcess, Path], short_tmp: Path
) -> None:
    """Changing `registry` and sending SIGHUP swaps the registry dirs without a restart."""
    d, config = configured
    assert d.proc is not None
    old_dir, new_dir = short_tmp / "reg-a", short_tmp / "reg-b"
    old_dir.mkdir()
    new_dir.mkdir()
    (old_dir / "svc-a.toml").write_text(_entry("svc-a"))
    (new_dir / "svc-b.toml").write_text(_entry("svc-b"))
    config.write_text(f'log_level = "info"\nregistry = ["{old_dir}"]\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ")
    ids = {m["id"] for m in unix_http(d.socket, "/api/models")[1]["models"]}
    assert "svc-a" in ids and "svc-b" not in ids
    config.write_text(f'log_level = "info"\nregistry = ["{new_dir}"]\n')
    d.proc.send_signal(signal.SIGHUP)
    d.wait_log(" reloaded ", count=2)
    ids = {m["id"] for m in unix_http(d.socket, "/api/models")[1]["models"]}
    assert "svc-b" in ids and "svc-a" not in ids
    assert d.proc.poll() is None
