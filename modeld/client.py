"""The socket client that the CLI (and Python apps) use to talk to a daemon."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp

from modeld.errors import DaemonUnavailable, ModeldError, error_from_body

# Host part of the URL is ignored on a Unix socket; it only has to be a valid name.
_BASE = "http://modeld"


class Client:
    """An async client for one daemon socket; use as ``async with Client(path) as c``."""

    def __init__(self, socket_path: Path, *, connect_timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
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
        return DaemonUnavailable(
            f"no modeld answers on {self.socket_path} ({err.__class__.__name__}); "
            "start one with `modeld serve` or pass --socket"
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use Client as an async context manager")
        return self._session

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON, or raise the daemon's error."""
        try:
            async with self.session.request(method, _BASE + path, json=body) as resp:
                data = await resp.read()
                status = resp.status
                ctype = resp.content_type
        except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
            raise self._unavailable(e) from e
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
        try:
            resp = await self.session.request(method, _BASE + path, json=body)
        except (aiohttp.ClientConnectionError, FileNotFoundError) as e:
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

    async def prune(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /api/prune`` with ``dry_run``, ``partials``, ``orphans``, ``unused_for``..."""
        result: dict[str, Any] = await self.request("POST", "/api/prune", body or {})
        return result
