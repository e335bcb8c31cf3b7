"""The sd_notify protocol against a real NOTIFY_SOCKET datagram socket and a real daemon."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from modeld.daemon.notify import Notifier
from tests.support.daemon import daemon_env, spawn_daemon, stop_process
from tests.support.unix import unix_http


@dataclass
class NotifyListener:
    """The service manager's end: a bound datagram socket that records each message."""

    sock: socket.socket
    address: str
    messages: list[tuple[float, dict[str, str]]] = field(default_factory=list)

    def wait_for(self, key: str, timeout: float = 30.0) -> dict[str, str]:
        """Receive until a message carries ``key``; return that message."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                raw = self.sock.recv(4096)
            except TimeoutError:
                break
            fields = dict(line.split("=", 1) for line in raw.decode().splitlines() if line)
            self.messages.append((time.monotonic(), fields))
            if key in fields:
                return fields
        raise AssertionError(f"no {key} within {timeout}s; got {self.messages}")

    def drain(self, seconds: float) -> None:
        """Record every message that arrives during ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                raw = self.sock.recv(4096)
            except TimeoutError:
                return
            fields = dict(line.split("=", 1) for line in raw.decode().splitlines() if line)
            self.messages.append((time.monotonic(), fields))

    def times_of(self, key: str) -> list[float]:
        return [t for t, m in self.messages if key in m]


@pytest.fixture
def listener(short_tmp: Path) -> Iterator[NotifyListener]:
    """A datagram socket bound on a filesystem path, as systemd's is."""
    path = short_tmp / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    yield NotifyListener(sock, str(path))
    sock.close()


def start_daemon(home: Path, **env: str) -> subprocess.Popen[bytes]:
    return spawn_daemon(daemon_env(home, **env), home / "daemon.log")


def test_ready_only_when_serving_then_stopping(short_tmp: Path, listener: NotifyListener) -> None:
    """READY=1 follows STATUS=starting once the socket answers; SIGTERM sends STOPPING=1."""
    home = short_tmp / "home"
    proc = start_daemon(home, NOTIFY_SOCKET=listener.address)
    try:
        ready = listener.wait_for("READY")
        # No retry: READY promises that the socket accepts and the start hooks ran.
        status, body = unix_http(home / "modeld.sock")
        assert status == 200 and body["status"] == "ok"
        assert ready["READY"] == "1"
        assert ready["STATUS"].startswith("serving on ")
        assert ready["STATUS"].endswith(str(home / "modeld.sock"))
        statuses = [m["STATUS"] for _, m in listener.messages if "STATUS" in m]
        assert statuses[0].startswith("starting")
        proc.send_signal(signal.SIGTERM)
        stopping = listener.wait_for("STOPPING")
        assert stopping["STOPPING"] == "1" and "stopping" in stopping["STATUS"]
        assert proc.wait(30) == 0
    finally:
        stop_process(proc)


def test_watchdog_cadence_is_half_the_timeout(short_tmp: Path, listener: NotifyListener) -> None:
    """With WATCHDOG_USEC=2s and our WATCHDOG_PID, WATCHDOG=1 comes about every second."""
    home = short_tmp / "home"
    # WATCHDOG_PID must name the daemon; `exec` keeps the shell's pid for the daemon.
    env = daemon_env(home, NOTIFY_SOCKET=listener.address, WATCHDOG_USEC="2000000")
    home.mkdir(parents=True)
    with (home / "daemon.log").open("ab") as log:
        proc = subprocess.Popen(
            [
                "/bin/sh",
                "-c",
                f'WATCHDOG_PID=$$ exec "{sys.executable}" -m modeld serve',
            ],
            env=env,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        listener.wait_for("READY")
        listener.drain(4.5)
        pings = listener.times_of("WATCHDOG")
        assert len(pings) >= 3, listener.messages
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        # Every gap under WATCHDOG_USEC (else systemd would kill us); not spamming either.
        assert max(gaps) < 2.0, gaps
        assert statistics.median(gaps) > 0.5, gaps
    finally:
        stop_process(proc)


def test_watchdog_for_another_pid_is_ignored(short_tmp: Path, listener: NotifyListener) -> None:
    """WATCHDOG_PID naming another process means the variables were inherited: no pings."""
    home = short_tmp / "home"
    proc = start_daemon(
        home,
        NOTIFY_SOCKET=listener.address,
        WATCHDOG_USEC="200000",
        WATCHDOG_PID=str(os.getpid()),
    )
    try:
        listener.wait_for("READY")
        listener.drain(1.0)
        assert listener.times_of("WATCHDOG") == []
    finally:
        stop_process(proc)


def test_abstract_socket_and_reload_messages(short_tmp: Path) -> None:
    """An ``@name`` NOTIFY_SOCKET works; SIGHUP sends RELOADING=1, MONOTONIC_USEC, then READY=1."""
    name = f"modeld-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    listener = NotifyListener(sock, "@" + name)
    proc = start_daemon(short_tmp / "home", NOTIFY_SOCKET=listener.address)
    try:
        listener.wait_for("READY")
        proc.send_signal(signal.SIGHUP)
        reloading = listener.wait_for("RELOADING")
        usec = int(reloading["MONOTONIC_USEC"])
        assert abs(usec / 1e6 - time.clock_gettime(time.CLOCK_MONOTONIC)) < 30
        again = listener.wait_for("READY")
        assert again["STATUS"].startswith("serving on ")
        assert proc.poll() is None
    finally:
        stop_process(proc)
        sock.close()


def test_start_failure_is_reported_in_status(short_tmp: Path, listener: NotifyListener) -> None:
    """A daemon that cannot start says why in STATUS= and never sends READY=1."""
    home = short_tmp / "home"
    home.mkdir()
    blocker = home / "not-a-socket"
    blocker.write_text("x")
    proc = start_daemon(home, NOTIFY_SOCKET=listener.address, MODELD_SOCKET=str(blocker))
    assert proc.wait(30) != 0
    listener.drain(0.2)
    statuses = [m.get("STATUS", "") for _, m in listener.messages]
    assert any(s.startswith("failed: ") and "not a socket" in s for s in statuses), statuses
    assert listener.times_of("READY") == []


def test_notifier_reads_and_unsets_its_variables() -> None:
    """The protocol variables are taken out of the environment so children never inherit them."""
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(os.getpid())}
    n = Notifier.from_environ(env)
    assert env == {}
    assert n.enabled and n.watchdog_interval == 2.5
    assert not Notifier.from_environ({}).enabled
    assert Notifier.from_environ({}).ready() is False
