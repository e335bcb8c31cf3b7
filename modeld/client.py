"""The socket client that the CLI (and Python apps) use to talk to a daemon."""

from __future__ import annotations

import asyncio
import errno
import grp
import json
import os
import pwd
import socket
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp

from modeld.errors import (
    BadRequest,
    DaemonUnavailable,
    ModeldError,
    SocketDenied,
    error_from_body,
)

# Host part of the URL is ignored on a Unix socket; it only has to be a valid name.
_BASE = "http://modeld"

# How long a request that the daemon answers at once (GET: status, list, show, ps, health)
# may wait for its answer. systemd accepts connections on modeld.socket even while the
# service fails to start; without a limit a client would wait in the backlog forever. A
# cold start through socket activation takes a few seconds.
ANSWER_TIMEOUT = 30.0


class Client:
    """An async client for one daemon socket; use as ``async with Client(path) as c``.

    GET requests must be answered within ``answer_timeout``. Other requests may rightly take
    long (a load, a verify), so before the first of them the client checks that the daemon
    answers ``/api/health`` within that time.
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        connect_timeout: float = 5.0,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self.socket_path = socket_path
        self.answer_timeout = answer_timeout
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
        self._answer = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=answer_timeout
        )
        self._answered = False
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        connector = aiohttp.UnixConnector(path=str(self.socket_path))
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()

    def _unavailable(self, err: Exception) -> DaemonUnavailable:
        os_error = err.os_error if isinstance(err, aiohttp.ClientConnectorError) else err
        if isinstance(os_error, OSError) and os_error.errno in (errno.EACCES, errno.EPERM):
            return socket_denied(self.socket_path)
        if isinstance(err, aiohttp.ServerTimeoutError):
            return DaemonUnavailable(
                f"modeld on {self.socket_path} took the connection but sent no answer in "
                f"{self.answer_timeout:g} s; the service may be failing to start: see "
                "`systemctl status modeld` and `journalctl -u modeld` (add --user for "
                "your own unit)"
            )
        return DaemonUnavailable(
            f"no modeld answers on {self.socket_path} ({err.__class__.__name__}); "
            "start one with `modeld serve` or pass --socket"
        )

    async def _ensure_answering(self) -> None:
        """Before a request that may take long: the daemon answers a quick one in time."""
        if not self._answered:
            await self.request("GET", "/api/health")

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use Client as an async context manager")
        return self._session

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON, or raise the daemon's error."""
        quick = method == "GET"
        if not quick:
            await self._ensure_answering()
        timeout = self._answer if quick else self._timeout
        try:
            async with self.session.request(
                method, _BASE + path, json=body, timeout=timeout
            ) as resp:
                data = await resp.read()
                status = resp.status
                ctype = resp.content_type
        except (aiohttp.ClientConnectionError, FileNotFoundError, PermissionError) as e:
            raise self._unavailable(e) from e
        self._answered = True
        decoded: Any = None
        if ctype == "application/json" and data:
            decoded = json.loads(data)
        if status >= 400:
            raise error_from_body(status, decoded)
        return decoded if decoded is not None else data.decode(errors="replace")

    async def stream(
        self, method: str, path: str, body: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Send one request and yield its NDJSON records; an error record is raised."""
        await self._ensure_answering()
        try:
            resp = await self.session.request(method, _BASE + path, json=body)
        except (aiohttp.ClientConnectionError, FileNotFoundError, PermissionError) as e:
            raise self._unavailable(e) from e
        try:
            if resp.status >= 400:
                payload = await resp.json(content_type=None) if await resp.read() else None
                raise error_from_body(resp.status, payload)
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                record = json.loads(line)
                if isinstance(record, dict) and "error" in record and len(record) == 1:
                    raise error_from_body(500, record)
                yield record
        except aiohttp.ClientPayloadError as e:
            raise ModeldError(f"the daemon closed the stream early ({e}); see its log") from e
        finally:
            resp.release()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/api/health")
        return result

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/api/status")
        return result

    async def models(self, installed: bool = False) -> dict[str, Any]:
        """``GET /api/models``: the catalog with install state."""
        path = "/api/models?installed=1" if installed else "/api/models"
        result: dict[str, Any] = await self.request("GET", path)
        return result

    async def model(self, model_id: str) -> dict[str, Any]:
        """``GET /api/models/{id}``: entry, install state, sections, plans, probes."""
        result: dict[str, Any] = await self.request(
            "GET", f"/api/models/{quote(model_id, safe='')}"
        )
        return result

    async def bug_report(self, model_id: str) -> dict[str, Any]:
        """``GET /api/models/{id}/bug-report``: host, runtime, file, probes, stderr, events."""
        result: dict[str, Any] = await self.request(
            "GET", f"/api/models/{quote(model_id, safe='')}/bug-report"
        )
        return result

    async def verify(self, model_id: str) -> dict[str, Any]:
        """``POST /api/models/{id}/verify``: re-hash the installed file."""
        result: dict[str, Any] = await self.request(
            "POST", f"/api/models/{quote(model_id, safe='')}/verify"
        )
        return result

    async def remove(self, model_id: str, *, force: bool = False) -> dict[str, Any]:
        """``DELETE /api/models/{id}``: remove the install and its partial (``force`` unloads)."""
        path = f"/api/models/{quote(model_id, safe='')}" + ("?force=1" if force else "")
        result: dict[str, Any] = await self.request("DELETE", path)
        return result

    async def import_file(self, path: Path, model_id: str | None = None) -> dict[str, Any]:
        """``POST /api/models/import``: open ``path`` as this process and pass the open file
        to the daemon (``SCM_RIGHTS``), so it reads exactly what this user may read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise BadRequest(f"{path}: {e.strerror}; give a file you can read") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise BadRequest(f"{path} is not a regular file; import reads model files only")
            await self._ensure_answering()
            body = {"fd": True, "name": Path(path).name, "id": model_id}
            try:
                status, decoded = await asyncio.to_thread(
                    _send_with_fd, self.socket_path, body, fd, self.answer_timeout
                )
            except (ConnectionError, FileNotFoundError, PermissionError, TimeoutError) as e:
                raise self._unavailable(e) from e
        finally:
            os.close(fd)
        if status >= 400:
            raise error_from_body(status, decoded)
        result: dict[str, Any] = decoded
        return result

    async def prune(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /api/prune`` with ``dry_run``, ``partials``, ``orphans``, ``unused_for``..."""
        result: dict[str, Any] = await self.request("POST", "/api/prune", body or {})
        return result


def _send_with_fd(
    socket_path: Path, body: dict[str, Any], fd: int, answer_timeout: float
) -> tuple[int, Any]:
    """One HTTP/1.1 request whose file descriptor follows the daemon's ``100 Continue``.

    The descriptor rides on one byte sent after the 100, never with the request itself: the
    daemon pauses its HTTP reader first, so the byte reaches its ``recvmsg``. A final answer
    instead of the 100 (a refusal) is returned as it is. The import itself may take as long
    as copying the file does, so only the 100 has a deadline.
    """
    payload = json.dumps(body).encode()
    head = (
        "POST /api/models/import HTTP/1.1\r\nHost: modeld\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(answer_timeout)
        s.connect(str(socket_path))
        s.sendall(head + payload)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the daemon closed the connection without an answer")
            data += chunk
        if data.startswith(b"HTTP/1.1 100"):
            data = data.partition(b"\r\n\r\n")[2]
            socket.send_fds(s, [b"\0"], [fd])
            s.settimeout(None)
        while chunk := s.recv(65536):
            data += chunk
    head_raw, _, raw = data.partition(b"\r\n\r\n")
    status = int(head_raw.split(b" ", 2)[1])
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def socket_denied(socket_path: Path) -> SocketDenied:
    """Why this process may not open the daemon's socket, and what to do about it."""
    for directory in reversed(socket_path.parents):
        if not os.access(directory, os.X_OK):
            try:
                st = directory.stat()
                how = (
                    f"{_user_name(st.st_uid)}:{_group_name(st.st_gid)} "
                    f"{stat.S_IMODE(st.st_mode):04o}"
                )
            except OSError:
                how = "not searchable"
            return SocketDenied(
                f"permission denied on {socket_path}: its directory {directory} ({how}) is "
                "closed to you; the socket's directories must be searchable (0755): ask the "
                "admin to check where the service puts its socket"
            )
    try:
        st = socket_path.stat()
    except OSError as e:
        return SocketDenied(f"permission denied on {socket_path} ({e.strerror})")
    owner = _user_name(st.st_uid)
    group = _group_name(st.st_gid)
    mode = stat.S_IMODE(st.st_mode)
    user = _user_name(os.getuid())
    where = f"permission denied on {socket_path} ({owner}:{group} {mode:04o})"
    if st.st_gid in os.getgroups() or st.st_gid == os.getgid():
        return SocketDenied(f"{where}: the group may not write it; make it 0660")
    try:
        members = grp.getgrgid(st.st_gid).gr_mem
    except KeyError:
        members = []
    if user in members:
        return SocketDenied(
            f"{where}: you are in group {group}, but this login session is not yet: log in "
            f"again (or run `newgrp {group}`)"
        )
    return SocketDenied(
        f"{where}: join group {group} (`sudo usermod -aG {group} {user}`), then log in again"
    )
