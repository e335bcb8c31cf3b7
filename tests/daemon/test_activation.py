"""Socket activation: a real listening socket inherited as fd 3 by a real ``modeld serve``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.daemon.activation import inherited_sockets
from tests.support.daemon import (
    ACTIVATION_WRAPPER,
    daemon_env,
    spawn_daemon,
    stop_process,
    wait_log,
)
from tests.support.unix import unix_http

# What systemd does between fork and exec: put the socket on fd 3 and name this very process
# in LISTEN_PID (only known after the fork, hence a wrapper that execs the daemon).


@pytest.fixture
def listening(short_tmp: Path) -> Iterator[tuple[socket.socket, Path]]:
    """The socket a ``.socket`` unit would create: bound, 0660, listening."""
    path = short_tmp / "act.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    path.chmod(0o660)
    sock.listen(16)
    yield sock, path
    sock.close()


def spawn(home: Path, sock: socket.socket, listen_pid: str) -> subprocess.Popen[bytes]:
    return spawn_daemon(
        daemon_env(home, LISTEN_FDS="1", LISTEN_FDNAMES="modeld"),
        home / "daemon.log",
        [sys.executable, "-c", ACTIVATION_WRAPPER, str(sock.fileno()), listen_pid],
        pass_fds=(sock.fileno(),),
    )


def test_inherited_socket_is_served_and_left_in_place(
    short_tmp: Path, listening: tuple[socket.socket, Path]
) -> None:
    """A connection queued before the daemon starts is answered; the path survives shutdown."""
    sock, path = listening
    home = short_tmp / "home"
    # A client that arrives while the service is still starting (what activation is for).
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(30)
    early.connect(str(path))
    early.sendall(b"GET /api/health HTTP/1.0\r\nHost: modeld\r\n\r\n")
    proc = spawn(home, sock, "self")
    try:
        reply = b""
        while chunk := early.recv(65536):
            reply += chunk
        assert reply.split(b" ", 2)[1] == b"200", reply
        log = wait_log(home / "daemon.log", "socket_inherited", proc=proc)
        assert "fd_name=modeld" in log and "fd=3" in log
        # Its own MODELD_SOCKET was never bound: the inherited socket replaces it.
        assert not (home / "modeld.sock").exists()
        assert unix_http(path)[0] == 200
        assert stop_process(proc) == 0
        # The path belongs to the .socket unit; removing it would break the next activation.
        assert path.exists()
    finally:
        early.close()
        stop_process(proc)


def test_listen_pid_of_another_process_binds_its_own(
    short_tmp: Path, listening: tuple[socket.socket, Path]
) -> None:
    """LISTEN_PID naming another process: the fds are not ours; the daemon binds its own."""
    sock, _ = listening
    home = short_tmp / "home"
    proc = spawn(home, sock, str(os.getpid()))
    try:
        log = wait_log(home / "daemon.log", " ready ", proc=proc)
        assert "activation_ignored" in log and "LISTEN_PID is another process" in log
        assert "inherited=False" in log
        assert unix_http(home / "modeld.sock")[0] == 200
        assert stop_process(proc) == 0
        assert not (home / "modeld.sock").exists()
    finally:
        stop_process(proc)


def test_activation_variables_are_unset_whatever_the_outcome() -> None:
    """LISTEN_* are removed once read, so runner processes never see them."""
    env = {"LISTEN_FDS": "1", "LISTEN_PID": "1", "LISTEN_FDNAMES": "modeld", "OTHER": "x"}
    assert inherited_sockets(env) == []
    assert env == {"OTHER": "x"}
    env = {"LISTEN_FDS": "x", "LISTEN_PID": str(os.getpid())}
    assert inherited_sockets(env) == []
    assert env == {}
