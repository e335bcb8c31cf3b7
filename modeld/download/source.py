"""Where a model file comes from: the one seam between the downloader and each kind of source.

A *source* names files and vouches for them: it parses an address (``hf://ORG/REPO/FILE``),
resolves it to a pinned revision with a size and a sha256, says which of its URLs pin a
revision that never changes (the key a vouch is kept under), reads what its answers vouch
for (a header on a redirect), holds the credentials only its own hosts get, and finds a copy
of a file in a local cache of its own. The Hugging Face Hub (``modeld.download.hub.Hub``) is
the first; a second kind is one more class that implements ``Source``.

The mirrors, the job, the fetcher and the services know only this protocol and
``SourceSet``, the ordered set the composition root builds from the settings. A URL no source
knows is a plain HTTP mirror: it gets no credentials and vouches for nothing.

A site cache (``SiteCache``, ``MODELD_SITE_CACHE``) is no source: it names no file and
vouches for nothing. It is a mirror put in front of every pull's own URLs, which stay the
fallback; the sha256 check and the repair make any cache safe to put there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from yarl import URL

from modeld.config import Settings


@dataclass(frozen=True)
class Claim:
    """A sha256 a source vouched for on one answer, for a file of ``size`` bytes (if said).

    ``via`` names how it was said (a header), as messages and ``verified_by`` show it.
    """

    sha256: str
    size: int | None
    via: str


@dataclass(frozen=True)
class Address:
    """A file named by a user in a source's own form, parsed; nothing is asked yet."""

    shown: str  # the canonical form, for messages (``hf://ORG/REPO/FILE@REV``)
    home: str  # where it is resolved: ``scheme://host[:port]``
    file: str  # which file, at any revision (``ORG/REPO/FILE``)
    revision: str  # as asked: a branch, a tag or a commit
    model_id: str | None  # the id made from it; None when none can be (pass one)


@dataclass(frozen=True)
class Resolved:
    """An address resolved: the file at a pinned revision, as its source vouches for it."""

    address: Address
    pinned: str  # the immutable revision the asked one is at (a commit)
    url: str  # the file's URL at ``pinned``: a registry entry's primary URL
    size: int
    sha256: str | None
    file_name: str
    display_name: str
    said: str  # what vouched for size and sha256 (headers), for the entry's comment


class Source(Protocol):
    """A kind of place model files come from (the Hub, another hub)."""

    def parses(self, text: str) -> bool:
        """Whether ``text`` is an address in this source's form (not a model id)."""
        ...

    def address(self, text: str) -> Address:
        """``text`` parsed; ``BadRequest`` that gives the accepted forms otherwise."""
        ...

    async def resolve(self, address: Address, connect_timeout: float) -> Resolved:
        """The pinned revision, size and sha256 of ``address``, asked of the source now."""
        ...

    def same_file(self, url: str, address: Address) -> bool:
        """Whether ``url`` (an entry's primary URL) is ``address``'s file at any revision."""
        ...

    def revision(self, url: str) -> str | None:
        """The revision ``url`` names in this source's URL shape (as asked), else None."""
        ...

    def pinned(self, url: str) -> str | None:
        """The key a vouch for ``url``'s file is kept under: set only when ``url`` pins a
        revision that never changes (a commit), else None."""
        ...

    def owns(self, url: URL) -> bool:
        """Whether ``url`` is this source's own host: only then are its credentials sent
        and its answers read as vouching."""
        ...

    def credentials(self, url: URL) -> dict[str, str]:
        """The request headers that carry this source's credentials to ``url`` (one it owns;
        over https or loopback only), or none."""
        ...

    def claim(self, url: URL, headers: Mapping[str, str]) -> Claim | None:
        """What a redirect from ``url`` (one it owns) vouches for, read from its headers."""
        ...

    def cached_copy(self, url: str, sha256: str) -> Path | None:
        """A copy of ``url``'s file in this source's own local cache, as a real path, else
        None. What it holds is not trusted: the caller checks its sha256."""
        ...


@dataclass(frozen=True)
class SiteCache:
    """An HTTP cache of the site (nginx ``proxy_cache``, Squid, Varnish) that serves
    ``scheme://HOST[:PORT]/PATH?QUERY`` at ``BASE/HOST[:PORT]/PATH?QUERY``: the layout nginx
    configs that proxy by host use. The cache chooses the scheme it asks the origin with."""

    base: URL

    def covers(self, url: URL) -> bool:
        """Whether ``url`` is the cache's own (a redirect the cache made to itself)."""
        here, base = url.human_repr(), self.base.human_repr().rstrip("/")
        return here == base or here.startswith(base + "/")

    def map(self, url: URL) -> URL:
        """``url`` as the cache serves it (a URL of the cache itself is kept)."""
        if self.covers(url):
            return url
        host = url.raw_host or ""
        if url.explicit_port is not None:
            host = f"{host}:{url.explicit_port}"
        query = f"?{url.raw_query_string}" if url.raw_query_string else ""
        base = str(self.base).rstrip("/")
        return URL(f"{base}/{host}{url.raw_path}{query}", encoded=True)


def site_caches(settings: Settings) -> Callable[[], list[SiteCache]]:
    """The site caches ``MODELD_SITE_CACHE`` names, read at each call (it applies live)."""
    return lambda: [SiteCache(URL(base)) for base in settings.site_cache]


class SourceSet:
    """The sources of one daemon, in order; what a URL or an address is asked of goes to the
    first that knows it. ``caches`` gives the site caches in front of every pull, asked at
    each pull (``MODELD_SITE_CACHE`` changes on SIGHUP)."""

    def __init__(
        self, *sources: Source, caches: Callable[[], Sequence[SiteCache]] | None = None
    ) -> None:
        self.all: tuple[Source, ...] = sources
        self._caches = caches

    @property
    def caches(self) -> Sequence[SiteCache]:
        return self._caches() if self._caches is not None else ()

    def for_address(self, text: str) -> Source | None:
        """The source whose form ``text`` has (``hf://...``), else None (a model id)."""
        return next((s for s in self.all if s.parses(text)), None)

    def owner(self, url: URL) -> Source | None:
        """The source that owns ``url``'s host, else None (a plain mirror)."""
        return next((s for s in self.all if s.owns(url)), None)

    def credentials(self, url: URL) -> dict[str, str]:
        owner = self.owner(url)
        return owner.credentials(url) if owner is not None else {}

    def claim(self, url: URL, headers: Mapping[str, str]) -> Claim | None:
        owner = self.owner(url)
        return owner.claim(url, headers) if owner is not None else None

    def vouching_host(self, urls: list[str]) -> str | None:
        """The host among ``urls`` that can vouch for their file (a source owns it), if any."""
        return next((URL(u).host for u in urls if self.owner(URL(u)) is not None), None)

    def revision(self, urls: list[str]) -> str | None:
        """The revision the first of ``urls`` that names one names (a branch or a commit)."""
        named = (s.revision(u) for u in urls for s in self.all)
        return next((r for r in named if r is not None), None)

    def pinned(self, urls: list[str]) -> str | None:
        """The kept-vouch key of an entry's file: its primary URL's pinned revision."""
        if not urls:
            return None
        return next((p for s in self.all if (p := s.pinned(urls[0])) is not None), None)

    def cached_copy(self, url: str, sha256: str) -> Path | None:
        return next((c for s in self.all if (c := s.cached_copy(url, sha256)) is not None), None)
