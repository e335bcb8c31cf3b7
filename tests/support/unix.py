"""Talking to the daemon with the stdlib only (no event loop, no subprocess)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from modeld.client import connect_unix


def _request_bytes(method: str, target: str, body: Any = None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {target} HTTP/1.0\r\nHost: modeld\r\nContent-Length: {len(payload)}\r\n"
    if body is not None:
        head += "Content-Type: application/json\r\n"
    return (head + "\r\n").encode() + payload


def unix_request(
    path: Path | str, method: str, target: str, body: Any = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """One request over a Unix socket: ``(status, decoded JSON body)``; NDJSON is a list."""
    # connect_unix waits while a flood fills the backlog (a plain timeout fails at once).
    with connect_unix(path, timeout) as s:
        s.sendall(_request_bytes(method, target, body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, raw = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"application/x-ndjson" in head:
        return status, [json.loads(line) for line in raw.splitlines() if line.strip()]
    return status, json.loads(raw) if raw else None


def unix_http(
    path: Path | str, target: str = "/api/health", timeout: float = 10.0
) -> tuple[int, Any]:
    """One ``GET`` over a Unix socket: ``(status, decoded JSON body)``."""
    return unix_request(path, "GET", target, timeout=timeout)


def unix_fire(path: Path | str, method: str, target: str, body: Any = None) -> socket.socket:
    """Send a request and do not wait for its answer (the caller closes the socket)."""
    s = connect_unix(path, 5.0)
    s.sendall(_request_bytes(method, target, body))
    return s


@contextlib.contextmanager
def cut_off_daemon(path: Path, answer: bytes) -> Iterator[Path]:
    """A fake daemon on ``path``: it answers ``/api/health``, sends ``answer`` (the start of
    an answer) to any other request, then closes the connection, as a daemon killed mid-answer.
    """
    health = b'{"status": "ok", "version": "0"}'
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was closed: the test is over
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    request += chunk
                head, _, body = request.partition(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        # Read the whole body: closing with bytes unread would be a reset.
                        while len(body) < int(value) and (chunk := conn.recv(65536)):
                            body += chunk
                if request.startswith(b"GET /api/health "):
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(health), health)
                    )
                else:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)
