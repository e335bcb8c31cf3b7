"""A reverse proxy on loopback that adds ``Authorization: Bearer <key>`` to each request, as an
nginx in front of modeld does for an app that has no setting for a key (test support)."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

# Hop-by-hop and framing headers: each side sets its own.
_DROPPED = frozenset(
    ("host", "content-length", "transfer-encoding", "connection", "keep-alive", "authorization")
)


class KeyProxy:
    """Forwards every request to ``upstream`` with ``key``, streaming the answer back."""

    def __init__(self, upstream: str, key: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.key = key
        self.port = 0
        self.runner: web.AppRunner | None = None
        self.session: aiohttp.ClientSession | None = None
        # Each request forwarded: (path, its body, the lines of the answer), for the test.
        self.seen: list[tuple[str, bytes, int]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> KeyProxy:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server: Any = site._server
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        headers["Authorization"] = f"Bearer {self.key}"
        body = await request.read()
        async with self.session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body or None
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in _DROPPED:
                    response.headers[name] = value
            await response.prepare(request)
            lines = 0
            async for chunk in upstream.content.iter_any():
                lines += chunk.count(b"\n")
                await response.write(chunk)
            await response.write_eof()
            self.seen.append((request.path, body, lines))
            return response

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()
