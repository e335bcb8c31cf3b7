"""A stand-in for huggingface.co on loopback: repositories, revisions, gated repos, a CDN.

It answers as the real Hub does:

- ``GET``/``HEAD /ORG/REPO/resolve/REV/FILE``: a 302 to a signed CDN URL (on the other
  loopback name, as the CDN is another host), carrying ``X-Repo-Commit`` (the commit REV is
  at; ``repo_commit_header=False`` leaves it out), ``X-Linked-Etag`` (the file's sha256,
  quoted; ``faults.linked_sha256`` lies) and ``X-Linked-Size``; 404 with ``X-Error-Code``
  for an unknown repository, revision or file;
- ``GET /api/models/ORG/REPO/revision/REV``: ``{"id": ..., "sha": COMMIT}``;
- a gated repository: 401 without ``Authorization``, 403 with a token other than ``token``;
- ``/cdn/SHA256?sig=...``: the file with range support; with ``faults.sign_ttl`` a signature
  older than that is refused with 403 ("Request has expired"), as the real CDN does.

modeld trusts a hub's X-Linked-Etag and sends it the token only when its host is a hub host:
``HF_ENDPOINT`` pointing at this stand-in does that, or add its host to
``modeld.download.hub.HF_HOSTS``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from aiohttp import web

from tests.support.mirror import COMMIT, Faults, Mirror, pinned_path


@dataclass
class HubRepo:
    """One model repository: files by commit, and branches or tags naming commits."""

    files: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    linked_sha256: str | None = None  # what its X-Linked-Etag claims (default: the truth)

    def commit(self, rev: str) -> str | None:
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.files else None


@dataclass
class Hub(Mirror):
    """A running stand-in hub; ``url`` is ``path`` on it (the single file of ``hub()``)."""

    repos: dict[str, HubRepo] = field(default_factory=dict)
    token: str | None = None  # the token that opens gated repositories
    repo_commit_header: bool = True
    api_requests: int = 0
    expired: int = 0  # CDN requests refused for an expired signature
    _blobs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> the file

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cdn_host(self) -> str:
        return "127.0.0.1" if self.host == "localhost" else "localhost"

    def add(self, repo: str, commit: str, files: dict[str, bytes], *refs: str) -> None:
        """Put ``files`` at ``commit`` of ``repo``; each of ``refs`` (a branch) points there."""
        r = self.repos.setdefault(repo, HubRepo())
        r.files[commit] = files
        # Hashed once here, not on each request: a real-size file's sha256 on the hub's loop
        # at every slice a cache asks for would stall it.
        self._blobs.update({hashlib.sha256(d).hexdigest(): d for d in files.values()})
        for ref in refs:
            r.refs[ref] = commit

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/api/models/{org}/{repo}/revision/{rev:.+}", self._revision)
        app.router.add_get("/{org}/{repo}/resolve/{rev}/{file:.+}", self._resolve)
        app.router.add_get("/cdn/{sha}", self._cdn_blob)

    def _access(
        self, request: web.Request, name: str
    ) -> tuple[HubRepo | None, web.Response | None]:
        repo = self.repos.get(name)
        if repo is None:
            return None, _error(404, "RepoNotFound", f"Repository Not Found for url: {name}.")
        if repo.gated:
            auth = request.headers.get("Authorization")
            if auth is None:
                return None, _error(
                    401, "GatedRepo", f"Access to model {name} is restricted. Please log in."
                )
            if auth != f"Bearer {self.token}":
                return None, _error(
                    403, "GatedRepo", f"Access to model {name} is restricted: not authorized."
                )
        return repo, None

    def _find(self, request: web.Request) -> tuple[HubRepo, str] | web.Response:
        """The repository and commit a request names, or the hub's refusal."""
        name = f"{request.match_info['org']}/{request.match_info['repo']}"
        repo, refused = self._access(request, name)
        if repo is None:
            assert refused is not None
            return refused
        commit = repo.commit(request.match_info["rev"])
        if commit is None:
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo, commit

    async def _revision(self, request: web.Request) -> web.Response:
        self.api_requests += 1
        found = self._find(request)
        if isinstance(found, web.Response):
            return found
        name = f"{request.match_info['org']}/{request.match_info['repo']}"
        return web.json_response({"id": name, "sha": found[1]})

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        f = self.faults
        self.requests.append(
            {"path": request.path_qs, "method": request.method, **dict(request.headers)}
        )
        if f.status is not None:
            return web.Response(status=f.status)
        if f.fail_first > 0:
            f.fail_first -= 1
            return web.Response(status=500)
        found = self._find(request)
        if isinstance(found, web.Response):
            return found
        repo, commit = found
        data = repo.files[commit].get(request.match_info["file"])
        if data is None:
            return _error(404, "EntryNotFound", "Entry not found")
        known = (sha for sha, blob in self._blobs.items() if blob is data)
        truth = next(known, None) or hashlib.sha256(data).hexdigest()
        claimed = repo.linked_sha256 or f.linked_sha256 or truth
        headers = {
            "X-Linked-Etag": f'"{claimed}"',
            "X-Linked-Size": str(len(data)),
            "ETag": f'"{claimed}"',
        }
        if self.repo_commit_header:
            headers["X-Repo-Commit"] = commit
        raise web.HTTPFound(
            f"http://{self.cdn_host}:{self.port}/cdn/{truth}?sig={time.monotonic()}",
            headers=headers,
        )

    def _blob(self, sha: str) -> bytes | None:
        return self._blobs.get(sha)

    async def _cdn_blob(self, request: web.Request) -> web.StreamResponse:
        self.requests.append({"path": request.path_qs, **dict(request.headers)})
        ttl = self.faults.sign_ttl
        if ttl is not None and time.monotonic() - float(request.query.get("sig", "0")) > ttl:
            self.expired += 1
            return web.Response(status=403, text="Request has expired")
        data = self._blob(request.match_info["sha"])
        if data is None:
            return web.Response(status=404)
        return await self._serve(request, etag='"cdn-etag-differs"', data=data)


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(
        status=status, text=message, headers={"X-Error-Code": code, "X-Error-Message": message}
    )


async def start_hub(host: str = "127.0.0.1", faults: Faults | None = None) -> Hub:
    """A started, empty stand-in hub on ``host`` (``add`` puts repositories in it)."""
    h = Hub(b"", faults or Faults(), host=host)
    await h.start()
    return h


async def hub(data: bytes, faults: Faults | None = None) -> Hub:
    """A started stand-in for huggingface.co on ``localhost`` holding one file, ``data``, as
    ``org/repo``'s ``m.litertlm`` at ``COMMIT`` (branch ``main``); ``url`` is its pinned URL.
    Add ``localhost`` to ``HF_HOSTS`` so that modeld trusts its X-Linked-Etag."""
    h = Hub(data, faults or Faults(), host="localhost", path=pinned_path())
    h.add("org/repo", COMMIT, {"m.litertlm": data}, "main")
    await h.start()
    return h
