"""The CLI's own behaviour: version, usage errors, no daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_version() -> None:
    """`modeld --version` prints the version and exits 0."""
    result = _run("--version")
    assert result.returncode == 0
    assert "modeld" in result.stdout


def test_bad_usage_exits_2() -> None:
    """An unknown verb is a usage error: exit 2."""
    assert _run("frobnicate").returncode == 2


def test_no_daemon_one_line_exit_1(short_tmp: Path) -> None:
    """With no daemon on the socket, the CLI says how to start one in one line and exits 1."""
    env = dict(os.environ, MODELD_SOCKET=str(short_tmp / "none.sock"))
    result = _run("status", env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "modeld serve" in lines[0]


def test_ids_with_slashes_get_a_400_not_a_missing_route(daemon_proc) -> None:  # type: ignore[no-untyped-def]
    """The CLI escapes ids in URLs, so `pull a/b` is refused as a bad id (exit 1, one line)."""
    for args in (["pull", "a/b", "--detach"], ["pull", "../x", "--cancel"], ["unload", "a/b"]):
        result = daemon_proc.cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1
        assert "no route" not in line, line


def test_cli_finds_the_socket_named_in_the_config_file(short_tmp: Path) -> None:
    """A `socket` set only in the config file is where both `serve` binds and the CLI looks."""
    from tests.support.daemon import DaemonProcess, daemon_env

    home = short_tmp / "h"
    sock = short_tmp / "cfg.sock"
    cfg = short_tmp / "modeld.toml"
    cfg.write_text(f'socket = "{sock}"\n')
    env = daemon_env(home, MODELD_CONFIG=str(cfg))
    env.pop("MODELD_SOCKET")
    d = DaemonProcess(home=home, env=env)
    d.env["MODELD_SOCKET"] = str(sock)  # only for the fixture's own readiness check
    d.start()
    try:
        cli_env = {k: v for k, v in env.items() if k != "MODELD_SOCKET"}
        result = subprocess.run(
            [sys.executable, "-m", "modeld", "status", "--json"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert str(sock) in result.stdout
    finally:
        d.stop()
