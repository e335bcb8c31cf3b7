"""Talking to the daemon with the stdlib only (no event loop, no subprocess)."""

from __future__ import annotations

import json
import socket
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
