"""The attack suite's watcher: a process of its own that polls a daemon while it is attacked.

``python -m tests.support.watcher SOCKET PID HOME OUT`` appends one JSON line to ``OUT``
about every 0.1 s until it is killed:

- ``health``: seconds ``GET /api/health`` took (``status`` its code, ``error`` when none came
  within 10 s);
- ``rss``: the daemon's ``VmRSS`` in bytes;
- ``writes``: files the daemon holds open for writing outside ``HOME``.

A process of its own, so that the test's own work (hashing blobs, building bodies) cannot
slow the measurement down, as a thread of the test process would (the GIL).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from modeld.client import connect_unix

INTERVAL = 0.1
TIMEOUT = 10.0


def health(sock: str) -> tuple[float, int | None, str | None]:
    started = time.monotonic()
    try:
        # As the CLI connects: waiting while a flood fills the backlog, not failing.
        with connect_unix(sock, TIMEOUT) as s:
            s.sendall(b"GET /api/health HTTP/1.0\r\nHost: modeld\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return time.monotonic() - started, int(data.split(b" ", 2)[1]), None
    except (OSError, IndexError, ValueError) as e:
        return time.monotonic() - started, None, repr(e)


def rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def writes_outside(pid: int, home: str) -> list[str]:
    """Regular files ``pid`` has open for writing that are not under ``home``."""
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith("/") or target.startswith(("/dev/", home + "/")):
                continue
            flags = int(Path(f"/proc/{pid}/fdinfo/{fd}").read_text().split()[3], 8)
        except (OSError, IndexError, ValueError):
            continue  # closed meanwhile
        if flags & (os.O_WRONLY | os.O_RDWR):
            found.append(target)
    return found


def main(argv: list[str]) -> None:
    sock, pid, home, out = argv[0], int(argv[1]), argv[2].rstrip("/"), argv[3]
    with open(out, "a", buffering=1) as f:
        while True:
            took, status, error = health(sock)
            sample = {
                "t": time.monotonic(),
                "health": took,
                "status": status,
                "error": error,
                "rss": rss(pid),
                "writes": writes_outside(pid, home),
            }
            f.write(json.dumps(sample) + "\n")
            time.sleep(max(0.0, INTERVAL - took))


if __name__ == "__main__":
    main(sys.argv[1:])
