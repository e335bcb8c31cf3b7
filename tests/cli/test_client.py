"""The Python client: a socket that takes connections but never answers."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.client import AsyncClient
from modeld.errors import DaemonUnavailable, ModelNotFound


@pytest.fixture
def silent_socket(short_tmp: Path) -> Iterator[Path]:
    """A listening socket that never accepts: systemd's socket while the service cannot start."""
    path = short_tmp / "backlog.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(16)
        yield path


async def test_a_get_that_gets_no_answer_ends_with_daemon_unavailable(silent_socket: Path) -> None:
    """A GET waits `answer_timeout` for its answer, then says where to look."""
    async with AsyncClient(silent_socket, answer_timeout=0.5) as client:
        with pytest.raises(DaemonUnavailable, match=r"sent no answer in 0\.5 s") as info:
            await client.status()
    assert "journalctl -u modeld" in info.value.message


async def test_long_requests_first_check_that_the_daemon_answers(silent_socket: Path) -> None:
    """A load or a generation may take long, so the client first needs /api/health answered."""
    async with AsyncClient(silent_socket, answer_timeout=0.5) as client:
        with pytest.raises(DaemonUnavailable, match="sent no answer"):
            await client.request("POST", "/api/engines", {"model": "tiny-text"})
        with pytest.raises(DaemonUnavailable, match="sent no answer"):
            async for _ in client.stream("POST", "/api/generate", {"model": "tiny-text"}):
                pass


async def test_a_daemon_that_answers_gets_the_long_request(daemon_proc) -> None:  # type: ignore[no-untyped-def]
    """Past the health check the request itself reaches the daemon, whose own error comes back."""
    async with AsyncClient(daemon_proc.socket) as client:
        with pytest.raises(ModelNotFound, match="nope"):
            await client.request("POST", "/api/engines", {"model": "nope"})
