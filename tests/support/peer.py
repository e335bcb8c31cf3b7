"""A second local uid for tests: the real CLI under ``setpriv``, stdlib HTTP from a child."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess
from tests.support.unix import unix_request

PEER_UID = PEER_GID = 4242

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="a second uid needs root and setpriv",
)


def as_peer(*argv: str) -> list[str]:
    return ["setpriv", f"--reuid={PEER_UID}", f"--regid={PEER_GID}", "--clear-groups", *argv]


def requests_as_peer(sock: Path, requests: list[tuple[str, str, Any]]) -> list[tuple[int, Any]]:
    """Send ``requests`` from a forked child running as the peer uid; their (status, body)."""
    import json

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to the peer's identity, then talk HTTP with the stdlib only
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(PEER_GID, PEER_GID, PEER_GID)
            os.setresuid(PEER_UID, PEER_UID, PEER_UID)
            out: Any = [unix_request(sock, m, t, b) for m, t, b in requests]
        except BaseException as e:
            out = repr(e)
        try:
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        raw = f.read()
    os.waitpid(pid, 0)
    answers = json.loads(raw)
    assert isinstance(answers, list), answers
    return [(status, body) for status, body in answers]


def peer_cli(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        as_peer(sys.executable, "-m", "modeld", *args),
        env=d.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
