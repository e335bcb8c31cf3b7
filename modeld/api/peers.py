"""Who is on the other end of the socket (``SO_PEERCRED``), whether they may talk to us, and
whether they may administer.

The socket's mode (0660) and group decide who can connect at all; ``allow_uids`` and
``allow_gids`` narrow that further. A peer is allowed when both lists are empty, when its uid
is listed, or when its primary group or any supplementary group (``SO_PEERGROUPS``) is
listed. root gets no exception: list uid 0 to let it in. A peer that cannot be identified
is refused whenever a list is set (fail closed).

An allowed peer may *use* the daemon; it may *administer* it only when its uid is in
``admin_uids`` (by default root and the daemon's own uid) or one of its groups is in
``admin_gids``. The socket's group therefore grants *use* alone.
"""

from __future__ import annotations

import errno
import socket
import struct
from dataclasses import dataclass

from modeld.config import Settings
from modeld.errors import Forbidden

# Linux's SO_PEERGROUPS (since 4.13); the socket module does not export it.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_UCRED = struct.Struct("3i")
_GID = struct.Struct("I")


@dataclass(frozen=True)
class Peer:
    """The credentials the kernel recorded when the peer connected."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}:{self.pid}"


def _supplementary_groups(sock: socket.socket) -> tuple[int, ...]:
    # 64 groups cover nearly everyone; ERANGE means more, so ask once with NGROUPS_MAX room.
    for count in (64, 65536):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, count * _GID.size)
        except OSError as e:
            if e.errno == errno.ERANGE:
                continue
            return ()
        return tuple(g for (g,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size]))
    return ()


def peer_credentials(sock: socket.socket | None) -> Peer | None:
    """The peer of a connected Unix socket, or None for other sockets."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return Peer(pid, uid, gid, _supplementary_groups(sock))


def is_allowed(settings: Settings, peer: Peer | None) -> bool:
    """Apply the allow-lists of ``settings`` to ``peer``."""
    if not settings.allow_uids and not settings.allow_gids:
        return True
    if peer is None:
        return False
    if peer.uid in settings.allow_uids:
        return True
    allowed_gids = set(settings.allow_gids)
    return peer.gid in allowed_gids or not allowed_gids.isdisjoint(peer.groups)


def is_admin(settings: Settings, peer: Peer | None) -> bool:
    """Whether ``peer`` may administer: its uid or one of its groups is an admin one."""
    if peer is None:
        return False
    if peer.uid in settings.admin_uids:
        return True
    admin_gids = set(settings.admin_gids)
    return peer.gid in admin_gids or not admin_gids.isdisjoint(peer.groups)


def enforce(settings: Settings, peer: Peer | None) -> None:
    """Raise Forbidden unless ``peer`` passes the allow-lists."""
    if is_allowed(settings, peer):
        return
    who = (
        f"uid {peer.uid} gid {peer.gid} (pid {peer.pid})"
        if peer is not None
        else "a peer whose credentials cannot be read"
    )
    raise Forbidden(
        f"{who} is not allowed on this socket; add the uid to MODELD_ALLOW_UIDS or one of "
        "its groups to MODELD_ALLOW_GIDS (allow_uids/allow_gids in the config file), then "
        "reload the daemon (SIGHUP)"
    )
