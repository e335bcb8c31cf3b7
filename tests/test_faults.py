"""Faults with real processes: kill -9 of the daemon at random points of its start-up.

The pull/load parts of the fault suite (kill -9 mid-pull and mid-load, ENOSPC, a runner's
SIGSEGV) come once the downloader and the pool are wired into the daemon's routes.
"""

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import DaemonProcess, daemon_env, unix_http


def test_kill9_at_random_points_of_startup_recovers(short_tmp: Path) -> None:
    """After SIGKILL anywhere in start-up, the next start serves with an intact db."""
    home = short_tmp / "home"
    home.mkdir()
    env = daemon_env(home)
    rng = random.Random(7)  # fixed seed: a failure can be replayed
    for _ in range(4):
        with (home / "daemon.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "modeld", "serve"],
                env=env,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        time.sleep(rng.uniform(0.0, 1.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        assert unix_http(d.socket)[0] == 200
        with sqlite3.connect(home / "modeld.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        assert d.stop() == 0
    assert not d.socket.exists()
