"""Files on the Hugging Face Hub: ``hf://`` references, resolving a revision, the local cache.

``pull hf://ORG/REPO/FILE[@REV]`` (or ``https://ENDPOINT/ORG/REPO/resolve/REV/FILE``) becomes a
registry entry pinned to a commit. ``resolve`` asks the Hub as its own client does: a HEAD of
the resolve URL, redirects not followed (the 302 to the CDN carries ``X-Repo-Commit``,
``X-Linked-Size`` and ``X-Linked-Etag``, the file's sha256); where no ``X-Repo-Commit`` comes,
``GET /api/models/ORG/REPO/revision/REV`` gives the commit (``sha``). ``cached_copy`` finds the
file in the Hub's own cache (``HF_HUB_CACHE``) so a pull can adopt it, verified, instead of
downloading it again.

``Hub`` is the Hub as a ``modeld.download.source.Source``: the downloader and the services
reach all of this through that protocol only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import aiohttp
from yarl import URL

from modeld.config import Settings
from modeld.download.mirrors import MAX_REDIRECTS, base_headers, check_url, is_loopback, proxy_for
from modeld.download.source import Address, Claim, Resolved
from modeld.errors import BadRequest, DownloadError, HubAccessDenied, HubFileNotFound
from modeld.layout import model_id_from, repo_part_problem, revision_problem

COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
SUFFIX = ".litertlm"
SCHEME = "hf://"
HUB_TIMEOUT = 30.0
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# Hosts that get the HF token and whose redirects carry X-Linked-Etag (tests add loopback).
# ``HF_ENDPOINT``'s HOST:PORT (``Settings.hub_hosts``) joins them in ``Hub.from_settings``.
HF_HOSTS: tuple[str, ...] = ("huggingface.co",)
# The header a hub's redirect vouches with (``Claim.via``).
LINKED_ETAG = "X-Linked-Etag"


def is_hf_host(url: URL, hosts: tuple[str, ...], endpoints: tuple[str, ...] = ()) -> bool:
    """One of ``hosts`` (huggingface.co itself, not its CDN hosts) or a subdomain of one, or
    the hub named by ``HF_ENDPOINT`` (``endpoints``, ``HOST:PORT``: that host at that port
    only; another port of the same host is another server, maybe another user's): the only
    places the HF token may go."""
    host = (url.host or "").lower()
    if any(host == h or host.endswith("." + h) for h in hosts):
        return True
    for hub in endpoints:
        name, _, port = hub.rpartition(":")
        if name and port.isdigit() and host == name and url.port == int(port):
            return True
    return False


def linked_sha256(value: str | None) -> str | None:
    """Hugging Face's ``X-Linked-Etag`` is the file's sha256, quoted."""
    text = (value or "").strip().removeprefix("W/").strip('"').lower()
    return text if _SHA256_RE.fullmatch(text) else None


def is_source(text: str) -> bool:
    """Whether ``text`` names a Hub file (``hf://`` or an http(s) URL), not a model id."""
    return text.startswith(SCHEME) or text.startswith(("https://", "http://"))


@dataclass(frozen=True)
class HubRef:
    """A file of a model repository on a Hub endpoint, at a revision (a branch, tag or commit)."""

    endpoint: str  # scheme://host[:port], no trailing slash
    repo: str  # ORG/REPO
    file: str  # path in the repository
    revision: str = "main"

    def resolve_url(self, revision: str | None = None) -> str:
        rev = quote(revision or self.revision, safe="")
        return f"{self.endpoint}/{self.repo}/resolve/{rev}/{quote(self.file)}"

    @property
    def shown(self) -> str:
        return f"hf://{self.repo}/{self.file}@{self.revision}"

    def model_id(self) -> str:
        """An id from REPO and FILE: the file's stem, prefixed with the repository's name
        unless the stem starts with it; cut to the one id pattern (``modeld.layout``)."""
        name = self.repo.split("/", 1)[1]
        stem = self.file.rsplit("/", 1)[-1].removesuffix(SUFFIX)
        raw = stem if stem.lower().startswith(name.lower()) else f"{name}-{stem}"
        model_id = model_id_from(raw)
        if model_id is None:
            raise BadRequest(f"no model id can be made from {self.shown}; pass one with --id")
        return model_id


def parse_source(text: str, endpoint: str) -> HubRef:
    """``hf://ORG/REPO/FILE[@REV]`` (on ``endpoint``), or a ``.../ORG/REPO/resolve/REV/FILE``
    URL (on its own host); BadRequest saying the forms otherwise."""
    forms = (
        "give hf://ORG/REPO/FILE.litertlm[@REVISION] or "
        "https://huggingface.co/ORG/REPO/resolve/REVISION/FILE.litertlm"
    )
    if text.startswith(SCHEME):
        path, _, rev = text.removeprefix(SCHEME).partition("@")
        parts = path.split("/")
        if len(parts) < 3 or ("@" in text and not rev):
            raise BadRequest(f"{text!r} names no file or an empty revision; {forms}")
        ref = HubRef(endpoint, "/".join(parts[:2]), "/".join(parts[2:]), rev or "main")
    elif text.startswith(("https://", "http://")):
        url = urlsplit(text)
        parts = [unquote(p) for p in url.path.split("/") if p]
        if "resolve" not in parts or parts.index("resolve") != 2 or len(parts) < 5:
            raise BadRequest(f"{text!r} is not a Hub file URL; {forms}")
        repo, rev, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        ref = HubRef(f"{url.scheme}://{url.netloc}", repo, file, rev)
    else:
        raise BadRequest(f"{text!r} is not a Hub file; {forms}")
    pieces = [*ref.repo.split("/"), *ref.file.split("/")]
    if any(repo_part_problem(p) for p in pieces):
        raise BadRequest(f"{text!r}: a repository or file name is not valid; {forms}")
    why = revision_problem(ref.revision)
    if why is not None:
        raise BadRequest(f"{text!r}: the revision {ref.revision!r} {why}; {forms}")
    if not ref.file.endswith(SUFFIX):
        raise BadRequest(f"{text!r} is not a {SUFFIX} file; modeld serves LiteRT-LM files only")
    return ref


@dataclass(frozen=True)
class HubFile:
    """A Hub file at a commit, with what the Hub vouched for (size, sha256)."""

    ref: HubRef
    commit: str
    size: int
    sha256: str | None

    @property
    def url(self) -> str:
        """The file's URL pinned at its commit (the entry's primary URL)."""
        return self.ref.resolve_url(self.commit)


@dataclass
class _Head:
    commit: str | None
    size: int | None
    sha256: str | None


def _refused(ref: HubRef, status: int, token: bool, sent: bool, why: str) -> Exception:
    where = f"{ref.endpoint} ({ref.repo})"
    if status == 404:
        return HubFileNotFound(
            f"{where} has no {ref.file} at revision {ref.revision}{why}; check the repository, "
            "file and revision on the Hub"
        )
    if not token:
        return HubAccessDenied(
            f"{where} answered HTTP {status}{why}: the repository is gated or private (or does "
            "not exist). Accept its terms on the Hub, then give the daemon a token: HF_TOKEN, "
            "MODELD_HF_TOKEN, or `hf auth login` (HF_HOME/token)"
        )
    if not sent:
        return HubAccessDenied(
            f"{where} answered HTTP {status}{why}, and the token was not sent: it goes only to "
            "huggingface.co or the HF_ENDPOINT host, over https"
        )
    return HubAccessDenied(
        f"{where} refused the token (HTTP {status}){why}: accept the repository's terms on "
        "the Hub with that account, or give the token read access to it (HF_TOKEN)"
    )


async def _head(session: aiohttp.ClientSession, ref: HubRef, revision: str, hub: Hub) -> _Head:
    """HEAD of the resolve URL; same-host redirects (a renamed repository) followed, the
    redirect to another host (the CDN) read, not followed."""
    url = URL(ref.resolve_url(revision), encoded=True)
    start = url
    for _ in range(MAX_REDIRECTS + 1):
        check_url(url)
        headers = base_headers() | hub.credentials(url)
        async with session.head(
            url, headers=headers, allow_redirects=False, proxy=proxy_for(url)
        ) as resp:
            h = resp.headers
            linked = linked_sha256(h.get("X-Linked-Etag")) or linked_sha256(h.get("ETag"))
            size_text = h.get("X-Linked-Size") or ""
            if resp.status in (301, 302, 303, 307, 308):
                target = url.join(URL(h.get("Location", "")))
                if target.host == url.host and target.port == url.port and not size_text:
                    url = target  # a renamed repository: the same hub, another path
                    continue
            elif resp.status != 200:
                why = f" ({h['X-Error-Message']})" if h.get("X-Error-Message") else ""
                sent = "Authorization" in headers
                raise _refused(ref, resp.status, bool(hub.token), sent, why)
            else:
                size_text = size_text or h.get("Content-Length") or ""
            return _Head(
                h.get("X-Repo-Commit"), int(size_text) if size_text.isdigit() else None, linked
            )
    raise DownloadError(f"{start.human_repr()}: more than {MAX_REDIRECTS} redirects")


async def _api_commit(session: aiohttp.ClientSession, ref: HubRef, hub: Hub) -> str:
    """``GET /api/models/ORG/REPO/revision/REV``: the commit (``sha``) of a branch or tag."""
    url = URL(
        f"{ref.endpoint}/api/models/{ref.repo}/revision/{quote(ref.revision, safe='')}",
        encoded=True,
    )
    check_url(url)
    headers = base_headers({"Accept": "application/json"}) | hub.credentials(url)
    async with session.get(url, headers=headers, proxy=proxy_for(url)) as resp:
        if resp.status != 200:
            sent = "Authorization" in headers
            raise _refused(ref, resp.status, bool(hub.token), sent, "")
        doc = await resp.json(content_type=None)
    sha = doc.get("sha") if isinstance(doc, dict) else None
    if not isinstance(sha, str) or not COMMIT_RE.fullmatch(sha):
        raise DownloadError(
            f"{ref.endpoint} gave no commit for {ref.repo}@{ref.revision}; is HF_ENDPOINT a Hub?"
        )
    return sha


async def resolve(ref: HubRef, hub: Hub, connect_timeout: float) -> HubFile:
    """The commit of ``ref``'s revision, and the size and sha256 the Hub vouches for there."""
    timeout = aiohttp.ClientTimeout(total=HUB_TIMEOUT, sock_connect=connect_timeout)
    try:
        async with aiohttp.ClientSession(
            timeout=timeout, trust_env=False, auto_decompress=False
        ) as session:
            pinned = ref.revision if COMMIT_RE.fullmatch(ref.revision) else None
            head = await _head(session, ref, ref.revision, hub)
            commit = pinned or head.commit
            if commit is None:
                # No X-Repo-Commit: the API names the commit, and the file is asked there,
                # so that size and sha256 are those of that commit (a branch moves).
                commit = await _api_commit(session, ref, hub)
                head = await _head(session, ref, commit, hub)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        raise DownloadError(
            f"cannot reach {ref.endpoint} to resolve {ref.shown} ({type(e).__name__}: {e}); "
            "check the network (and HTTPS_PROXY), or set HF_ENDPOINT to a reachable mirror"
        ) from e
    if not COMMIT_RE.fullmatch(commit):
        raise DownloadError(f"{ref.endpoint} named no commit for {ref.shown} ({commit!r})")
    if head.size is None or head.size <= 0:
        raise DownloadError(
            f"{ref.endpoint} did not say the size of {ref.shown} (no X-Linked-Size); "
            "is HF_ENDPOINT a Hub?"
        )
    return HubFile(ref, commit, head.size, head.sha256)


def cached_copy(cache: Path, repo: str, commit: str, file: str, sha256: str | None) -> Path | None:
    """The file in the Hub's cache (``models--ORG--REPO/snapshots/COMMIT/FILE``, a link into
    ``blobs/``; or ``blobs/SHA256``, an LFS file's blob), as a real path; None if absent.

    What it holds is not trusted: the caller checks its sha256 before it is installed.
    """
    folder = cache / f"models--{repo.replace('/', '--')}"
    candidates = [folder / "snapshots" / commit / file]
    if sha256 is not None:
        candidates.append(folder / "blobs" / sha256)
    for candidate in candidates:
        try:
            real = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            continue
        if real.is_file():
            return real
    return None


def pinned_parts(url: str) -> tuple[str, str, str] | None:
    """(ORG/REPO, COMMIT, FILE) of a ``.../ORG/REPO/resolve/COMMIT/FILE`` URL, else None."""
    parts = [unquote(p) for p in urlsplit(url).path.split("/") if p]
    if len(parts) < 5 or parts[2] != "resolve" or not COMMIT_RE.fullmatch(parts[3]):
        return None
    return "/".join(parts[:2]), parts[3], "/".join(parts[4:])


def _resolve_parts(url: str) -> list[str]:
    return [unquote(p) for p in urlsplit(url).path.split("/") if p]


class Hub:
    """The Hugging Face Hub (or the hub ``HF_ENDPOINT`` names) as a ``Source``.

    Its URL shape (``.../ORG/REPO/resolve/REV/FILE``) is known on any host, mirrors of the
    Hub included: a revision read from it keys what is kept. Its token goes only to its own
    hosts (``hosts``), whose redirects alone vouch (``X-Linked-Etag``).
    """

    def __init__(
        self,
        endpoint: str = "https://huggingface.co",
        *,
        hosts: tuple[str, ...] | None = None,
        endpoints: tuple[str, ...] = (),
        token: str | Callable[[], str | None] | None = None,
        cache: Path | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.hosts = hosts if hosts is not None else HF_HOSTS
        self.endpoints = endpoints  # HF_ENDPOINT's HOST:PORT (``Settings.hub_hosts``)
        # A callable is asked at each use: the daemon's token changes on SIGHUP.
        self._token = token
        self.cache = cache  # the Hub's own download cache (HF_HUB_CACHE)

    @classmethod
    def from_settings(cls, settings: Settings) -> Hub:
        def token() -> str | None:
            return settings.hf_token.get_secret_value() if settings.hf_token else None

        return cls(
            settings.hf_endpoint,
            hosts=HF_HOSTS,
            endpoints=settings.hub_hosts,
            token=token,
            cache=settings.hub_cache,
        )

    @property
    def token(self) -> str | None:
        return self._token() if callable(self._token) else self._token

    def parses(self, text: str) -> bool:
        return is_source(text)

    def address(self, text: str) -> Address:
        ref = parse_source(text, self.endpoint)
        try:
            model_id: str | None = ref.model_id()
        except BadRequest:
            model_id = None
        return Address(
            ref.shown, ref.endpoint, f"{ref.repo}/{ref.file}", ref.revision, model_id=model_id
        )

    @staticmethod
    def _ref(address: Address) -> HubRef:
        org, repo, file = address.file.split("/", 2)
        return HubRef(address.home, f"{org}/{repo}", file, address.revision)

    async def resolve(self, address: Address, connect_timeout: float) -> Resolved:
        found = await resolve(self._ref(address), self, connect_timeout)
        ref = found.ref
        name = ref.file.rsplit("/", 1)[-1]
        return Resolved(
            address=address,
            pinned=found.commit,
            url=found.url,
            size=found.size,
            sha256=found.sha256,
            file_name=name,
            display_name=f"{name.removesuffix(SUFFIX)} ({ref.repo})",
            said=f"X-Linked-Size, {LINKED_ETAG}",
        )

    def same_file(self, url: str, address: Address) -> bool:
        parts = pinned_parts(url)
        ref = self._ref(address)
        return (
            parts is not None
            and url.startswith(ref.endpoint + "/")
            and (parts[0], parts[2]) == (ref.repo, ref.file)
        )

    def revision(self, url: str) -> str | None:
        m = _REVISION_RE.search(unquote(urlsplit(url).path))
        return m.group("rev") if m is not None else None

    def pinned(self, url: str) -> str | None:
        """``ORG/REPO@COMMIT/FILE`` for a ``.../ORG/REPO/resolve/COMMIT/FILE`` URL."""
        parts = _resolve_parts(url)
        if "resolve" not in parts:
            return None
        i = parts.index("resolve")
        if i == 0 or len(parts) < i + 3 or not COMMIT_RE.fullmatch(parts[i + 1]):
            return None
        return f"{'/'.join(parts[:i])}@{parts[i + 1]}/{'/'.join(parts[i + 2 :])}"

    def owns(self, url: URL) -> bool:
        return is_hf_host(url, self.hosts, self.endpoints)

    def credentials(self, url: URL) -> dict[str, str]:
        # Only over https (or to this host's own loopback, where no network carries it): an
        # http mirror that redirects to a hub host must not get the token sent in clear.
        if self.token and self.owns(url) and (url.scheme == "https" or is_loopback(url)):
            return {"Authorization": f"Bearer {self.token}"}
        return {}

    def claim(self, url: URL, headers: Mapping[str, str]) -> Claim | None:
        sha = linked_sha256(headers.get(LINKED_ETAG))
        if sha is None or not self.owns(url):
            return None
        size = headers.get("X-Linked-Size", "")
        return Claim(sha, int(size) if size.isdigit() else None, LINKED_ETAG)

    def cached_copy(self, url: str, sha256: str) -> Path | None:
        parts = pinned_parts(url)
        if parts is None or self.cache is None:
            return None
        return cached_copy(self.cache, *parts, sha256)


# ".../resolve/<revision>/<file>": Hugging Face, its mirrors, and entries from hf:// pulls.
_REVISION_RE = re.compile(r"/resolve/(?P<rev>[^/]+)/")
