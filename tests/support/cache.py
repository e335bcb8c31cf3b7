"""A stand-in site cache on loopback: ``/HOST[:PORT]/PATH?QUERY`` passed on to the origin.

It stores nothing: each request goes to ``http://HOST[:PORT]/PATH?QUERY`` with its
``Range``, and the answer comes back as the origin gave it (a redirect too, its Location
untouched, as nginx with ``proxy_redirect off`` does). ``flip`` serves the byte at that
offset of the file XOR 0xFF, as a cache entry gone bad would. The real cache (nginx) is in
the ``fleet`` tests; this one keeps the site cache's paths in the default run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from modeld.download.mirrors import parse_content_range

_PASSED = ("Content-Range", "Content-Length", "ETag", "Location", "Accept-Ranges")


@dataclass
class PassCache:
    port: int = 0
    flip: int | None = None
    requests: list[str] = field(default_factory=list)
    runner: web.AppRunner | None = None
    session: aiohttp.ClientSession | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> PassCache:
        app = web.Application()
        app.router.add_get("/{origin}/{path:.*}", self._pass)
        self.session = aiohttp.ClientSession(auto_decompress=False)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        sockets: Any = getattr(site._server, "sockets", None)
        self.port = sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        self.requests.append(request.path_qs)
        origin = f"http://{request.match_info['origin']}/{request.match_info['path']}"
        headers = {k: v for k, v in request.headers.items() if k in ("Range", "If-Range")}
        async with self.session.get(
            origin, params=request.query, headers=headers, allow_redirects=False
        ) as up:
            resp = web.StreamResponse(status=up.status)
            for name in _PASSED:
                if name in up.headers:
                    resp.headers[name] = up.headers[name]
            await resp.prepare(request)
            parsed = parse_content_range(up.headers.get("Content-Range"))
            pos = parsed[0] if parsed is not None else 0
            async for chunk in up.content.iter_any():
                data = bytearray(chunk)
                if self.flip is not None and pos <= self.flip < pos + len(data):
                    data[self.flip - pos] ^= 0xFF
                await resp.write(bytes(data))
                pos += len(data)
            await resp.write_eof()
            return resp
