"""Socket activation: take the listening sockets a service manager passed (``sd_listen_fds``).

One Unix socket serves the API (the one named ``modeld`` when several are passed); TCP
sockets (``AF_INET``/``AF_INET6``, e.g. ``ListenStream=127.0.0.1:11500``) are opt-in TCP
listeners, like ``MODELD_LISTEN``, with the same API-key rule.

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
from dataclasses import dataclass, field
from pathlib import Path

from modeld import logs
from modeld.config import format_address

SD_LISTEN_FDS_START = 3
_ENV_KEYS = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")
# Names modeld looks for first when several sockets are passed; else the first usable one.
_PREFERRED_NAMES = ("modeld", "modeld.socket")


def _listening_stream(sock: socket.socket) -> bool:
    """A listening stream socket: the only kind the API serves on."""
    try:
        accepting = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False
    return sock.type == socket.SOCK_STREAM and bool(accepting)


@dataclass
class Inherited:
    """What was passed: the API's Unix socket (None: bind our own) and TCP listeners."""

    unix: socket.socket | None = None
    tcp: list[socket.socket] = field(default_factory=list)


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


def inherited_listeners(environ: MutableMapping[str, str] | None = None) -> Inherited:
    """The listening sockets systemd passed for the API, sorted by kind."""
    unix: list[tuple[str, socket.socket]] = []
    out = Inherited()
    for name, s in inherited_sockets(environ):
        if _listening_stream(s) and s.family == socket.AF_UNIX:
            unix.append((name, s))
        elif _listening_stream(s) and s.family in (socket.AF_INET, socket.AF_INET6):
            s.setblocking(False)
            address = format_address(*s.getsockname()[:2])
            logs.event("socket_inherited", fd_name=name, fd=s.fileno(), address=address)
            out.tcp.append(s)
        else:
            logs.event("activation_skipped_fd", logging.WARNING, fd=s.fileno(), fd_name=name)
    if unix:
        out.unix = _api_socket(unix)
    return out


def _api_socket(usable: list[tuple[str, socket.socket]]) -> socket.socket:
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
