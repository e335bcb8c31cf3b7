"""A second kind of source, written as one class: a build shelf on loopback and its ``Source``.

The shelf keeps model files by name and build, as an artifact store does:

- ``GET /api/NAME/REV``: ``{"build": "build-N", "file": ..., "size": ...}``
  (``latest`` is the newest build; a build id names itself);
- ``GET /files/NAME/BUILD/FILE``: a 302 to ``/blobs/SHA256`` carrying ``X-Shelf-Sha256``
  and ``X-Shelf-Size`` (what the shelf vouches for), only with ``X-Shelf-Key: KEY``;
- ``/blobs/SHA256``: the bytes, with ranges (the ``tests.support.mirror`` server).

``ShelfSource`` is all modeld needs to pull ``shelf://NAME[@REV]`` through it: nothing in
``modeld/`` names the shelf. A build never changes, so a URL that names one is pinned.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from yarl import URL

from modeld.download.source import Address, Claim, Resolved
from modeld.errors import BadRequest, DownloadError
from tests.support.mirror import Faults, Mirror

SCHEME = "shelf://"
KEY_HEADER = "X-Shelf-Key"
VOUCH_HEADER = "X-Shelf-Sha256"
_PINNED = re.compile(r"^/files/(?P<name>[\w.-]+)/(?P<build>build-\d+)/(?P<file>[\w.-]+)$")


@dataclass
class Shelf(Mirror):
    """A running shelf: builds of each name, newest last; requests need ``key``."""

    builds: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    key: str = "shelf-key"

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def add(self, name: str, file: str, data: bytes) -> str:
        """A new build of ``name`` holding ``file``; returns its id."""
        builds = self.builds.setdefault(name, [])
        builds.append((file, data))
        return f"build-{len(builds)}"

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/api/{name}/{rev}", self._api)
        app.router.add_get("/files/{name}/{build}/{file}", self._file)
        app.router.add_get("/blobs/{sha}", self._blob)

    def _build(self, name: str, rev: str) -> tuple[str, str, bytes] | None:
        builds = self.builds.get(name) or []
        index = len(builds) if rev == "latest" else int(rev.removeprefix("build-") or 0)
        if not 0 < index <= len(builds):
            return None
        return (f"build-{index}", *builds[index - 1])

    async def _api(self, request: web.Request) -> web.Response:
        found = self._build(request.match_info["name"], request.match_info["rev"])
        if found is None:
            return web.Response(status=404)
        build, file, data = found
        # No digest here: the file's redirect vouches for it (``X-Shelf-Sha256``).
        return web.json_response({"build": build, "file": file, "size": len(data)})

    async def _file(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"path": request.path_qs, **dict(request.headers)})
        if request.headers.get(KEY_HEADER) != self.key:
            return web.Response(status=403)
        found = self._build(request.match_info["name"], request.match_info["build"])
        if found is None or found[1] != request.match_info["file"]:
            return web.Response(status=404)
        sha = hashlib.sha256(found[2]).hexdigest()
        raise web.HTTPFound(
            f"/blobs/{sha}",
            headers={VOUCH_HEADER: sha, "X-Shelf-Size": str(len(found[2]))},
        )

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"path": request.path_qs, **dict(request.headers)})
        for builds in self.builds.values():
            for _, data in builds:
                if hashlib.sha256(data).hexdigest() == request.match_info["sha"]:
                    return await self._serve(request, data=data)
        return web.Response(status=404)


async def start_shelf() -> Shelf:
    shelf = Shelf(b"", Faults())
    await shelf.start()
    return shelf


class ShelfSource:
    """The shelf as a ``modeld.download.source.Source``: the whole of a second source kind."""

    def __init__(self, endpoint: str, key: str, cache: Path | None = None) -> None:
        self.endpoint, self.key, self.cache = endpoint, key, cache
        self.home = URL(endpoint)

    def parses(self, text: str) -> bool:
        return text.startswith(SCHEME)

    def address(self, text: str) -> Address:
        name, _, rev = text.removeprefix(SCHEME).partition("@")
        if not re.fullmatch(r"[\w.-]+", name):
            raise BadRequest(f"{text!r}: give shelf://NAME[@BUILD]")
        return Address(
            f"{SCHEME}{name}@{rev or 'latest'}", self.endpoint, name, rev or "latest", name
        )

    async def resolve(self, address: Address, connect_timeout: float) -> Resolved:
        url = f"{self.endpoint}/api/{address.file}/{address.revision}"
        timeout = aiohttp.ClientTimeout(total=30, sock_connect=connect_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            if resp.status != 200:
                raise DownloadError(f"the shelf has no {address.shown} (HTTP {resp.status})")
            doc = await resp.json()
        return Resolved(
            address=address,
            pinned=doc["build"],
            url=f"{self.endpoint}/files/{address.file}/{doc['build']}/{doc['file']}",
            size=doc["size"],
            sha256=doc.get("sha256"),
            file_name=doc["file"],
            display_name=f"{address.file} ({doc['build']})",
            said="the shelf's API",
        )

    def same_file(self, url: str, address: Address) -> bool:
        m = _PINNED.match(URL(url).path)
        return url.startswith(self.endpoint + "/") and m is not None and m["name"] == address.file

    def revision(self, url: str) -> str | None:
        m = _PINNED.match(URL(url).path)
        return m["build"] if m is not None else None

    def pinned(self, url: str) -> str | None:
        m = _PINNED.match(URL(url).path)
        return f"{m['name']}@{m['build']}/{m['file']}" if m is not None else None

    def owns(self, url: URL) -> bool:
        return (url.host, url.port) == (self.home.host, self.home.port)

    def credentials(self, url: URL) -> dict[str, str]:
        return {KEY_HEADER: self.key} if self.owns(url) else {}

    def claim(self, url: URL, headers: Mapping[str, str]) -> Claim | None:
        sha = headers.get(VOUCH_HEADER)
        if sha is None or not self.owns(url):
            return None
        size = headers.get("X-Shelf-Size", "")
        return Claim(sha, int(size) if size.isdigit() else None, VOUCH_HEADER)

    def cached_copy(self, url: str, sha256: str) -> Path | None:
        if self.cache is None or self.pinned(url) is None:
            return None
        found = self.cache / sha256
        return found if found.is_file() else None
