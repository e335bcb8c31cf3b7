"""modeld.proc: a child process dies with its parent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.wait import process_gone, wait_sync


def test_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A child that called ``die_with_parent`` is killed when its parent dies (PDEATHSIG)."""
    pid_file, armed = tmp_path / "pid", tmp_path / "armed"
    grandchild = (
        "from modeld.proc import die_with_parent; die_with_parent(); "
        f"import pathlib; pathlib.Path({str(armed)!r}).touch(); "
        "import time; time.sleep(60)"
    )
    # The middle process exits (without killing its child) once the child is armed.
    middle = (
        "import os, pathlib, subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "deadline = time.monotonic() + 30\n"
        f"while not pathlib.Path({str(armed)!r}).exists() and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", middle], check=True, timeout=60)
    pid = int(pid_file.read_text())
    assert armed.exists(), "the child never called die_with_parent"
    try:
        # Reaped by init once killed; until then it may linger as a zombie.
        wait_sync(lambda: process_gone(pid), 5.0, "the child gone with its parent")
    except AssertionError:
        os.kill(pid, 9)
        raise
