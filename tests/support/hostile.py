"""A hostile local app: the attack suite's side of the socket, run as a second uid.

``python -m tests.support.hostile ATTACK SOCKET ARG`` (``ARG`` is JSON) prints one JSON
document: what the daemon answered. ``tests/api/test_attack.py`` starts it under ``setpriv``,
so the daemon sees another uid's credentials, and files are opened with that uid's rights.
Bodies come from files the test wrote (``null`` for none): the attacker only sends them.

Attacks:
- ``send``: ``[[method, target, body_path], ...]`` one after the other, each on its own
  connection; the answer is ``[[status, body, retry_after], ...]`` (``body`` decoded JSON,
  or text; ``retry_after`` the header's value, or null).
- ``together``: the same requests all at once, one thread each.
- ``import_fd``: ``{"path", "name", "id"}``: open ``path`` as this uid (``O_NONBLOCK``, so a
  FIFO does not block the opener either) and pass the descriptor over the socket.
- ``flood``: ``n``: open ``n`` connections and send nothing; print ``{"opened": n}``, hold
  them until stdin closes, then print how many the daemon had closed meanwhile.
- ``swap``: ``{"path", "to": [...]}``: replace ``path`` by each of ``to`` in turn (a file, or
  symbolic links), atomically, as fast as possible, from ``{"swapping": true}`` until stdin
  closes; then print how many swaps were made.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from modeld.client import connect_unix

Answer = tuple[int, Any, str | None]


def _read_all(s: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def request(sock: str, method: str, target: str, body_path: str | None) -> Answer:
    """One request on a fresh connection (HTTP/1.0: the answer ends when the daemon closes)."""
    body = Path(body_path).read_bytes() if body_path else b""
    head = (
        f"{method} {target} HTTP/1.0\r\nHost: modeld\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with connect_unix(sock, 120) as s:
        # Answered (and closed) before the whole body was read: read that answer.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head + body)
        data = _read_all(s)
    return parse(data)


def parse(data: bytes) -> Answer:
    head, _, raw = data.partition(b"\r\n\r\n")
    if not head:
        return 0, "closed without an answer", None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    text = raw.decode(errors="replace")
    body: Any
    try:
        if "ndjson" in headers.get("content-type", ""):
            body = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            body = json.loads(text) if text else None
    except ValueError:
        body = text[:300]
    return status, body, headers.get("retry-after")


def together(sock: str, requests: list[list[Any]]) -> list[Answer]:
    answers: list[Answer] = [(0, "not sent", None)] * len(requests)

    def one(i: int, method: str, target: str, body_path: str | None) -> None:
        try:
            answers[i] = request(sock, method, target, body_path)
        except OSError as e:
            answers[i] = (0, repr(e), None)

    threads = [threading.Thread(target=one, args=(i, *r)) for i, r in enumerate(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def import_fd(sock: str, arg: dict[str, str]) -> tuple[int, Any]:
    from modeld.client import _send_with_fd

    fd = os.open(arg["path"], os.O_RDONLY | os.O_NONBLOCK)
    try:
        return _send_with_fd(Path(sock), {"fd": True, "name": arg["name"], "id": arg["id"]}, fd, 30)
    finally:
        os.close(fd)


def flood(sock: str, n: int) -> dict[str, int]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held: list[socket.socket] = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)  # blocking: a full backlog waits for the daemon's accept()
        held.append(s)
    print(json.dumps({"opened": len(held)}), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    closed = 0
    for s in held:
        s.setblocking(False)  # select() cannot take descriptors past 1024
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass  # still open
        except ConnectionResetError:
            closed += 1
        s.close()
    return {"opened": len(held), "closed_by_daemon": closed}


def swap(arg: dict[str, Any]) -> dict[str, int]:
    path = Path(arg["path"])
    staged = []
    for i, target in enumerate(arg["to"]):
        link = path.with_name(f".{path.name}.{i}")
        link.unlink(missing_ok=True)
        if Path(target).is_file() and not Path(target).is_symlink():
            os.link(target, link)  # the file itself, under another name
        else:
            link.symlink_to(target)
        staged.append(link)
    done = threading.Event()
    swaps = 0

    def wait_for_stdin() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_stdin, daemon=True).start()
    print(json.dumps({"swapping": True}), flush=True)
    while not done.is_set():
        for link in staged:
            tmp = link.with_name(link.name + ".tmp")
            os.link(link, tmp, follow_symlinks=False)
            os.replace(tmp, path)
            swaps += 1
    return {"swaps": swaps}


def main(argv: list[str]) -> None:
    attack, sock, arg = argv[0], argv[1], json.loads(argv[2])
    out: Any
    if attack == "send":
        out = [request(sock, *r) for r in arg]
    elif attack == "together":
        out = together(sock, arg)
    elif attack == "import_fd":
        out = import_fd(sock, arg)
    elif attack == "flood":
        out = flood(sock, int(arg))
    elif attack == "swap":
        out = swap(arg)
    else:
        raise SystemExit(f"unknown attack {attack!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
