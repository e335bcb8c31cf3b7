"""Socket activation: take the listening socket a service manager passed (``sd_listen_fds``).

systemd passes sockets as fds 3, 4, ... with ``LISTEN_FDS`` (their count), ``LISTEN_PID``
(the pid they are meant for; checked against ``getpid()`` so that a child that inherited the
variables by accident does not steal fds) and optionally ``LISTEN_FDNAMES`` (``:``-separated
names, ``FileDescriptorName=``). Like ``sd_listen_fds(1)``, the variables are unset once read,
whatever the outcome. They are the service manager's protocol, not settings, so they are read
here rather than in ``config.py``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
from collections.abc import MutableMapping
from pathlib import Path

from modeld import logs

SD_LISTEN_FDS_START = 3
_ENV_KEYS = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
# Names modeld looks for first when several sockets are passed; else the first usable one.
_PREFERRED_NAMES = ("modeld", "modeld.socket")


def _usable(sock: socket.socket) -> bool:
    """A listening stream socket on a Unix path: the only kind the API serves on."""
    try:
        accepting = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    return sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM and bool(accepting)


def inherited_sockets(
    environ: MutableMapping[str, str] | None = None, *, unset: bool = True
) -> list[tuple[str, socket.socket]]:
    """The ``(name, socket)`` pairs passed to this process; empty when none were meant for it."""
    env = os.environ if environ is None else environ
    raw_fds, raw_pid = env.get("LISTEN_FDS", ""), env.get("LISTEN_PID", "")
    names = env.get("LISTEN_FDNAMES", "").split(":")
    if unset:
        for key in _ENV_KEYS:
            env.pop(key, None)
    if not raw_fds:
        return []
    if not raw_fds.isdigit() or not raw_pid.isdigit():
        logs.event("activation_ignored", logging.WARNING, reason="malformed LISTEN_FDS/LISTEN_PID")
        return []
    if int(raw_pid) != os.getpid():
        logs.event(
            "activation_ignored",
            logging.WARNING,
            reason="LISTEN_PID is another process",
            listen_pid=raw_pid,
            pid=os.getpid(),
        )
        return []
    out: list[tuple[str, socket.socket]] = []
    for i in range(int(raw_fds)):
        fd = SD_LISTEN_FDS_START + i
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except OSError:
            continue
        # Passed fds arrive without close-on-exec; runner processes must not inherit them.
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)
        name = names[i] if i < len(names) and names[i] else "unknown"
        out.append((name, socket.socket(fileno=fd)))
    return out


def inherited_listener(environ: MutableMapping[str, str] | None = None) -> socket.socket | None:
    """The listening Unix socket systemd passed for the API, or None to bind our own."""
    candidates = inherited_sockets(environ)
    usable = []
    for name, s in candidates:
        if _usable(s):
            usable.append((name, s))
        else:
            logs.event("activation_skipped_fd", logging.WARNING, fd=s.fileno(), fd_name=name)
    if not usable:
        return None
    usable.sort(key=lambda pair: pair[0] not in _PREFERRED_NAMES)
    name, sock = usable[0]
    sock.setblocking(False)
    path = sock.getsockname()
    mode: str | None = None
    if isinstance(path, str) and path.startswith("/"):
        try:
            bits = stat.S_IMODE(Path(path).stat().st_mode)
        except OSError:
            bits = None
        if bits is not None:
            mode = f"{bits:04o}"
            if bits & ~0o660:
                # The unit's SocketMode= decides; say loudly when it is more open than ours.
                logs.event(
                    "socket_too_open",
                    logging.WARNING,
                    path=path,
                    mode=mode,
                    fix="set SocketMode=0660 in modeld.socket",
                )
    logs.event("socket_inherited", fd_name=name, fd=sock.fileno(), path=str(path), mode=mode)
    return sock
