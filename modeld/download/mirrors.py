"""Mirrors for one download: strict HTTP range requests, redirects, health and error classes.

Every rule here comes from a failure seen in the wild in other downloaders:
a 200 to a Range request is never spliced in, a ``Content-Range`` must match exactly,
redirects are followed by hand (at most 10, never https → http) so that what a source
vouches for on its redirect (``source.Claim``: huggingface.co's ``X-Linked-Etag``) is read,
a source's credentials go only to its own hosts (``source.SourceSet``), and a 403 from a
signed CDN URL sends us back to the original URL for a fresh signature.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import ipaddress
import random
import re
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import aiohttp
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_none,
)
from tenacity.wait import wait_base
from yarl import URL

from modeld import logs
from modeld.download.source import Claim, SiteCache, SourceSet
from modeld.errors import DiskFull, DownloadError

if TYPE_CHECKING:
    from modeld.metrics import Metrics

MAX_REDIRECTS = 10
# A mirror's ``reason`` once it answered a Range request with 200 (the progress shows it).
IGNORES_RANGE = (
    "ignores Range requests (answered 200): used only as one stream from byte 0, and only "
    "when no other mirror is left"
)
# Consecutive transient failures before a mirror is given up for this download.
MAX_STRIKES = 6
# Consecutive stalls before it is given up: a stall uses up no try (it is retried at once),
# but a mirror that only ever stalls must not hold a pull forever.
MAX_STALLS = 2 * MAX_STRIKES
# Tries of the probe (``Range: bytes=0-0``) before its failure is recorded on the mirror.
PROBE_TRIES = 4
# Failed connections (DNS, refused, unreachable) before a mirror that never answered this
# download is given up: offline, every try with back-off is time spent for nothing
# (docs/benchmarks.md#mirrors-and-scheduling).
MAX_UNREACHABLE = 2
# Causes of a failure that call for a fix of the entry or the mirror (``MirrorFailure.cause``):
# the URL has no file (404, 410), or the file there has another size than the entry's.
NOT_FOUND = "not_found"
WRONG_SIZE = "wrong_size"
# The window of a mirror's speed in the progress (``Mirror.shown_speed``), in seconds, as
# curl's: long enough to span the bursts of a throttled mirror, which a shorter window shows
# as 0 between them (docs/benchmarks.md#mirrors-and-scheduling).
SHOWN_WINDOW = 5.0
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class MirrorFailure(Exception):
    """One request to one mirror failed; ``kind`` says what the engine does next.

    kinds: ``transient`` (back off, retry), ``stall`` (retry at once, no strike),
    ``gone`` (drop the mirror for this download), ``no_ranges`` (usable only as a stream
    from byte 0), ``expired`` (signed URL expired: go back to the original URL). ``cause``
    (``NOT_FOUND``, ``WRONG_SIZE``) says what a pull that fails on it advises to fix.
    """

    def __init__(
        self,
        kind: str,
        message: str,
        retry_after: float | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after = retry_after
        self.cause = cause


def check_url(url: URL, came_from: URL | None = None) -> None:
    """Refuse anything but http(s), and any https → http downgrade on a redirect."""
    if url.scheme not in ("http", "https") or not url.host:
        raise MirrorFailure("gone", f"refused URL {url.human_repr()!r}: only http(s) URLs")
    if came_from is not None and came_from.scheme == "https" and url.scheme == "http":
        raise MirrorFailure(
            "gone", f"refused redirect from https to http ({url.human_repr()}); fix the mirror"
        )


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` → (a, b, total); None when absent or malformed."""
    m = _CONTENT_RANGE_RE.match((value or "").strip())
    if m is None:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)), total


def strong_etag(value: str | None) -> str | None:
    """A strong ETag usable with If-Range (weak ones, ``W/"..."``, are not)."""
    if not value or value.startswith("W/"):
        return None
    return value


def retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (at most 120; an HTTP date is not honoured)."""
    try:
        return max(0.0, min(float(value or ""), 120.0))
    except ValueError:
        return None


def classify_status(status: int, resp: aiohttp.ClientResponse | None = None) -> MirrorFailure:
    """The failure for an unexpected HTTP status."""
    after = retry_after(resp.headers.get("Retry-After")) if resp is not None else None
    if status in (404, 410):
        return MirrorFailure(
            "gone", f"HTTP {status}: the file is not on this mirror", cause=NOT_FOUND
        )
    if status in (408, 429) or status >= 500:
        return MirrorFailure("transient", f"HTTP {status}", retry_after=after)
    if status == 416:
        return MirrorFailure(
            "gone", "HTTP 416: the mirror's file is shorter than the entry", cause=WRONG_SIZE
        )
    return MirrorFailure("gone", f"HTTP {status}")


def classify_exception(exc: BaseException) -> MirrorFailure | None:
    """Map a transport or OS error to a failure; None for errors that must stop the pull."""
    if isinstance(exc, MirrorFailure):
        return exc
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return MirrorFailure("stall", "no bytes within the stall timeout")
    if isinstance(exc, aiohttp.TooManyRedirects):
        return MirrorFailure("gone", "too many redirects")
    if isinstance(exc, aiohttp.ClientConnectorError) and not isinstance(
        exc, aiohttp.ClientSSLError
    ):
        return MirrorFailure("unreachable", f"cannot connect: {exc}")
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        return MirrorFailure("transient", f"{exc.__class__.__name__}: {exc}")
    return None


def is_transient(exc: BaseException) -> bool:
    """tenacity predicate: worth another try after a back-off (resets, 408, 429, 5xx, stalls)."""
    failure = classify_exception(exc)
    return failure is not None and failure.kind in ("transient", "stall", "expired")


class wait_mirror(wait_base):
    """A mirror's back-off after a failure: the server's ``Retry-After`` when it sent one,
    none after a stall (retried at once), else doubling (``wait_exponential``, capped) with
    jitter of up to half either way, so that several connections do not come back at the
    same instant."""

    def __init__(self, cap: float = 120.0) -> None:
        self.cap = cap
        self.exponential = wait_exponential(multiplier=0.4, max=30)

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome is not None else None
        failure = classify_exception(exc) if exc is not None else None
        if failure is not None and failure.retry_after is not None:
            return min(self.cap, failure.retry_after)
        if failure is not None and failure.kind == "stall":
            return 0.0
        jitter = random.uniform(0.5, 1.5)  # noqa: S311 (jitter, not crypto)
        return min(self.cap, self.exponential(retry_state) * jitter)


# The one retry policy of a mirror. The probe runs it with tenacity's loop; the piece
# scheduler applies its wait and stop between pieces (``Mirror.fail``), because a failed
# piece goes back to the shared queue for any mirror instead of being retried in place.
MIRROR_WAIT = wait_mirror()


def os_error_to_modeld(exc: OSError, path: str) -> DownloadError:
    """Disk errors stop the pull at once, with a message that says what to do."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"disk full while writing {path}; free space and pull again (it resumes)")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DownloadError(
            f"cannot write {path}: {exc.strerror}; fix the permissions of MODELD_HOME"
        )
    return DownloadError(f"cannot write {path}: {exc}; the partial is kept, pull again to resume")


class MirrorState(enum.StrEnum):
    """Where a mirror stands in one download; the progress shows the value (a plain string)."""

    NEW = "new"  # not asked yet
    PROBING = "probing"  # its probe is out; the pull may already run on other mirrors
    OK = "ok"  # answered; serves ranges
    STREAM_ONLY = "stream_only"  # answered a range request with 200: only a stream from byte 0
    BACKOFF = "backoff"  # failed; waits before its next request (``not_before``)
    DROPPED = "dropped"  # given up for this download (``reason`` says why)
    BANNED = "banned"  # sent wrong bytes (repair found them)


class MirrorSnapshot(TypedDict):
    """One mirror in a pull's progress record (``DownloadJob.snapshot``)."""

    url: str
    host: str
    role: str  # "site_cache", "origin" (behind one: the fallback) or "mirror"
    state: str
    reason: str | None
    received: int
    speed: int
    connections: int


# States in which a mirror may still be sent requests.
USABLE = frozenset({MirrorState.NEW, MirrorState.OK, MirrorState.BACKOFF, MirrorState.STREAM_ONLY})


@dataclass
class Mirror:
    """One URL of the entry and what this download learnt about it."""

    url: URL
    primary: bool = False
    # The site cache this mirror is (its ``url`` the primary URL as the cache serves it): its
    # redirects are followed through the cache too.
    via: SiteCache | None = None
    # An origin behind a site cache: it gets work only once no cache can serve ranges.
    fallback: bool = False
    state: MirrorState = MirrorState.NEW
    reason: str | None = None
    cause: str | None = None  # the last failure's ``MirrorFailure.cause``
    resolved: URL | None = None  # cached redirect target (a signed CDN URL)
    # Through a site cache: the URL ``url`` stands for, and the one ``resolved`` stands for.
    origin: URL | None = None
    resolved_origin: URL | None = None
    # Whether the entry's own URL is on a loopback, link-local or private address: only
    # then may its redirects lead there (None until the first redirect asks).
    local: bool | None = None
    # The daemon's sources: whose hosts get credentials and vouch on their redirects.
    sources: SourceSet = field(default_factory=SourceSet, repr=False, compare=False)
    etag: str | None = None
    claim: Claim | None = None  # what the source that owns this URL vouched for, if any
    active: int = 0
    received: int = 0  # bytes received from it, counted as they arrive (``Fetcher._consume``)
    strikes: int = 0  # transient failures in a row
    stalls: int = 0  # stalls in a row (they use up no strike)
    answered: bool = False  # some request of this download got an HTTP answer from it
    not_before: float = 0.0
    # Per-connection throughput (EWMA, bytes/s) judged on recent chunks.
    conn_rate: float | None = None
    _window_start: float = field(default_factory=time.monotonic)
    _window_bytes: int = 0
    speed: float = 0.0  # aggregate bytes/s over the last window (the scheduler's measure)
    # (when, ``received`` then), taken by the progress's snapshots: its speed's window.
    _samples: deque[tuple[float, int]] = field(
        default_factory=lambda: deque([(time.monotonic(), 0)])
    )
    # Errors by class and per-mirror speed are reported here, where they are known.
    metrics: Metrics | None = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        host = self.url.host or str(self.url)
        return f"{host}:{self.url.explicit_port}" if self.url.explicit_port else host

    @property
    def usable(self) -> bool:
        return self.state in USABLE

    @property
    def ranges(self) -> bool:
        return self.state is not MirrorState.STREAM_ONLY

    def count(self, n: int, seconds: float) -> None:
        """Account ``n`` bytes that took ``seconds`` on one connection, for the scheduler's
        rates (``received`` counts them as they arrive)."""
        self._window_bytes += n
        if seconds > 0 and n >= 64 * 1024:
            rate = n / seconds
            self.conn_rate = rate if self.conn_rate is None else 0.7 * self.conn_rate + 0.3 * rate
        now = time.monotonic()
        if now - self._window_start >= 0.5:
            self.speed = self._window_bytes / (now - self._window_start)
            self._window_start, self._window_bytes = now, 0
            if self.metrics is not None:
                self.metrics.download_mirror_speed.labels(self.label).set(self.speed)

    def current_speed(self) -> float:
        now = time.monotonic()
        if now - self._window_start > 2.0:
            self.speed = self._window_bytes / (now - self._window_start)
        return self.speed

    def shown_speed(self) -> float:
        """The bytes/s the progress shows: what ``received`` gained over the last
        ``SHOWN_WINDOW`` seconds (or since the snapshot before, when they come further
        apart). Taken at each snapshot, so the bytes' path pays nothing for it."""
        now = time.monotonic()
        samples = self._samples
        if now - samples[-1][0] >= 0.25:
            samples.append((now, self.received))
            while len(samples) > 2 and now - samples[1][0] >= SHOWN_WINDOW:
                samples.popleft()
        t0, r0 = samples[0]
        return (self.received - r0) / (now - t0) if now - t0 >= 0.5 else 0.0

    def fail(self, failure: MirrorFailure) -> None:
        """Record a failure: a back-off with jitter, or the mirror dropped."""
        self.reason, self.cause = str(failure), failure.cause
        if failure.kind not in ("unreachable", "stall"):
            self.answered = True  # an HTTP answer, if not the one hoped for
        if self.metrics is not None:
            self.metrics.download_errors.labels(self.label, failure.kind).inc()
        if failure.kind == "gone":
            self.state = MirrorState.DROPPED
            return
        if failure.kind == "no_ranges":
            self.state, self.reason = MirrorState.STREAM_ONLY, IGNORES_RANGE
            return
        if failure.kind == "expired":
            self.resolved = None
            return
        if (
            failure.kind == "unreachable"
            and not self.answered
            and self.strikes + 1 >= MAX_UNREACHABLE
        ):
            self.strikes += 1
            self.state = MirrorState.DROPPED
            self.reason = f"{failure} ({self.strikes} tries; never reached)"
            return
        # tenacity's view of this mirror's tries: the attempt number counts strikes only.
        if failure.kind == "stall":
            self.stalls += 1
            tries, limit = self.stalls, MAX_STALLS
        else:
            self.strikes += 1
            self.stalls = 0
            tries, limit = self.strikes, MAX_STRIKES
        if stop_after_attempt(limit)(_call_state(tries, failure)):
            self.state = MirrorState.DROPPED
            self.reason = f"{failure} ({tries} times in a row)"
            return
        self.not_before = time.monotonic() + MIRROR_WAIT(_call_state(self.strikes, failure))
        if self.state is not MirrorState.STREAM_ONLY:
            self.state = MirrorState.BACKOFF

    def succeed(self) -> None:
        self.answered = True
        self.strikes = self.stalls = 0
        if self.state in (MirrorState.NEW, MirrorState.BACKOFF):
            self.state = MirrorState.OK

    def snapshot(self) -> MirrorSnapshot:
        return {
            # Progress is for every peer: a URL's credentials or signature are not.
            "url": logs.redact_url(self.url.human_repr()),
            "host": self.label,
            "role": "site_cache" if self.via else "origin" if self.fallback else "mirror",
            "state": self.state.value,
            "reason": self.reason,
            "received": self.received,
            "speed": round(self.shown_speed()),
            "connections": self.active,
        }


_POLICY = AsyncRetrying(wait=MIRROR_WAIT)


def _call_state(tries: int, failure: MirrorFailure) -> RetryCallState:
    """A tenacity call state for a mirror that has failed ``tries`` times, last with
    ``failure`` (what ``Mirror.fail`` hands to the policy's wait and stop)."""
    state = RetryCallState(_POLICY, None, (), {})
    state.attempt_number = max(1, tries)
    state.set_exception((type(failure), failure, None))
    return state


class _Expired(Exception):
    """A 403 from a cached redirect target (a signed URL that expired)."""


def base_headers(extra: dict[str, str] | None = None) -> dict[str, str]:
    """What every request of a download sends (no compression: bytes are hashed as sent)."""
    return {"Accept-Encoding": "identity", "User-Agent": "modeld", **(extra or {})}


def request_headers(url: URL, extra: dict[str, str], sources: SourceSet) -> dict[str, str]:
    """``base_headers`` and the credentials of the source that owns ``url``, if any."""
    return base_headers(extra) | sources.credentials(url)


def _is_local_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return (
        address.is_loopback
        or address.is_link_local
        or address.is_private
        or address.is_unspecified
        or address.is_reserved
        or address.is_multicast
    )


async def is_local_host(host: str) -> bool:
    """Whether ``host`` is, or resolves to, a loopback, link-local or private address."""
    host = host.strip("[]").lower()
    try:
        return _is_local_address(ipaddress.ip_address(host.split("%")[0]))
    except ValueError:
        pass
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
    except OSError:
        return False  # not resolvable here (a proxy resolves it): not a local address
    return any(_is_local_address(ipaddress.ip_address(str(i[4][0]).split("%")[0])) for i in infos)


async def check_redirect_target(mirror: Mirror, url: URL) -> None:
    """Refuse a redirect into loopback, link-local or private addresses (the metadata
    service at 169.254.169.254, a local admin port) unless the entry's own URL is there
    too, so that a mirror on the local network keeps working."""
    if mirror.local is None:
        mirror.local = await is_local_host(mirror.url.host or "")
    if mirror.local or not await is_local_host(url.host or ""):
        return
    raise MirrorFailure(
        "gone",
        f"refused redirect to {url.host}, a local or private address, from "
        f"{mirror.label}, which is not; fix or remove that mirror",
    )


def is_loopback(url: URL) -> bool:
    host = (url.host or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def proxy_for(url: URL) -> str | None:
    """The proxy the environment names for ``url`` (``*_PROXY``, ``NO_PROXY``), if any.

    Sessions are made with ``trust_env=False``: aiohttp's ``trust_env`` also reads
    ``~/.netrc`` and would send its credentials to every mirror and redirect target. The
    proxy settings, the only part of the environment a download should honour, come here.
    """
    proxy = urllib.request.getproxies().get(url.scheme)
    if not proxy or urllib.request.proxy_bypass(url.host or ""):
        return None
    return proxy


async def request(
    session: aiohttp.ClientSession, mirror: Mirror, headers: dict[str, str]
) -> aiohttp.ClientResponse:
    """GET following redirects by hand; returns the final (non-redirect) response.

    Reads what a source vouches for on its redirect (``Mirror.claim``), caches the final URL,
    and on a 403 from a cached redirect target goes back to the original URL once.
    """
    # Once more from the origin after an expired signed URL, at once; a second 403 is final.
    retrying = AsyncRetrying(
        retry=retry_if_exception_type(_Expired), stop=stop_after_attempt(2), wait=wait_none()
    )
    try:
        async for attempt in retrying:
            with attempt:
                last = attempt.retry_state.attempt_number == 2
                return await _follow(session, mirror, headers, last)
    except RetryError:
        pass
    raise MirrorFailure("gone", "HTTP 403 even after a fresh redirect; the URL needs access")


async def _follow(
    session: aiohttp.ClientSession, mirror: Mirror, headers: dict[str, str], last: bool
) -> aiohttp.ClientResponse:
    """One GET of the mirror, its redirects followed; ``_Expired`` on a stale signed URL."""
    url = mirror.resolved or mirror.url
    from_cache = mirror.resolved is not None
    came_from: URL | None = None
    # Through a site cache: the URL the cache stands for, against which a redirect's
    # Location is read before it goes through the cache again.
    origin = mirror.resolved_origin if mirror.resolved is not None else mirror.origin
    for _ in range(MAX_REDIRECTS + 1):
        check_url(url, came_from)
        resp = await session.get(
            url,
            headers=request_headers(url, headers, mirror.sources),
            allow_redirects=False,
            proxy=proxy_for(url),
        )
        if resp.status not in (301, 302, 303, 307, 308):
            if resp.status == 403 and (from_cache or came_from is not None) and not last:
                resp.release()
                mirror.resolved = None  # signed URL expired: ask the origin again
                raise _Expired
            if came_from is not None:
                mirror.resolved = url
            return resp
        claim = mirror.sources.claim(url, resp.headers)
        if claim is not None:
            mirror.claim = claim
        location = resp.headers.get("Location")
        resp.release()
        if not location:
            raise MirrorFailure("gone", f"HTTP {resp.status} without a Location")
        came_from, target = url, URL(location)
        to_cache = target.is_absolute() and mirror.via is not None and mirror.via.covers(target)
        if mirror.via is None or origin is None or to_cache:
            url = url.join(target)
        else:  # the origin's redirect, passed on by the cache: through the cache again
            origin = origin.join(target)
            url = mirror.via.map(origin)
            mirror.resolved_origin = origin
        await check_redirect_target(mirror, url)
    raise MirrorFailure("gone", f"more than {MAX_REDIRECTS} redirects")


async def open_range(
    session: aiohttp.ClientSession, mirror: Mirror, start: int, end: int, total: int
) -> aiohttp.ClientResponse:
    """Open ``[start, end)`` and check the answer is exactly that range of a ``total`` file."""
    extra = {"Range": f"bytes={start}-{end - 1}"}
    if mirror.etag:
        extra["If-Range"] = mirror.etag
    resp = await request(session, mirror, extra)
    if resp.status == 206:
        encoding = resp.headers.get("Content-Encoding", "identity").lower()
        if encoding not in ("identity", ""):
            resp.release()
            raise MirrorFailure("gone", f"sent Content-Encoding {encoding} despite identity")
        parsed = parse_content_range(resp.headers.get("Content-Range"))
        if parsed is None or parsed[0] != start or parsed[1] >= end or parsed[1] < start:
            resp.release()
            raise MirrorFailure(
                "gone", f"wrong Content-Range {resp.headers.get('Content-Range')!r}"
            )
        if parsed[2] is not None and parsed[2] != total:
            resp.release()
            raise MirrorFailure(
                "gone", f"file is {parsed[2]} bytes, the entry says {total}", cause=WRONG_SIZE
            )
        return resp
    resp.release()
    if resp.status == 200:
        # Never spliced in: the body starts at byte 0 (or the file changed: If-Range).
        raise MirrorFailure("no_ranges", "answered a Range request with 200")
    raise classify_status(resp.status, resp)


class ProbeTimeout(MirrorFailure):
    """A probe's answer did not come in time (its headers, or its first body byte): the
    mirror is dropped for this download, while the others go on (a probe never retries it)."""


def _read_probe_answer(resp: aiohttp.ClientResponse, mirror: Mirror, size: int) -> None:
    """The probe's answer: a 206 of byte 0 (or a 200: the mirror ignores Range) of a file
    of ``size`` bytes; its strong ETag is kept for If-Range."""
    if resp.status == 206:
        parsed = parse_content_range(resp.headers.get("Content-Range"))
        if parsed is None or parsed[:2] != (0, 0) or parsed[2] is None:
            raise MirrorFailure("gone", f"bad Content-Range {resp.headers.get('Content-Range')!r}")
        total = parsed[2]
    elif resp.status == 200:
        total = resp.content_length if resp.content_length is not None else -1
        mirror.state, mirror.reason = MirrorState.STREAM_ONLY, IGNORES_RANGE
    else:
        raise classify_status(resp.status, resp)
    if total != size:
        raise MirrorFailure(
            "gone", f"file is {total} bytes, the entry says {size}", cause=WRONG_SIZE
        )
    mirror.etag = strong_etag(resp.headers.get("ETag"))


async def probe(
    session: aiohttp.ClientSession,
    mirror: Mirror,
    size: int,
    header_timeout: float = 10.0,
    first_byte_timeout: float = 10.0,
) -> None:
    """``Range: bytes=0-0``: learn the size, ETag and range support; drop a wrong size.

    The answer's headers (redirects included) must all arrive within ``header_timeout``,
    then its first body byte within ``first_byte_timeout`` (read timeouts alone restart with
    every header line a slow mirror trickles). The mirror is ``probing`` meanwhile, and
    ``ok``, ``stream_only``, ``backoff`` or ``dropped`` (``reason`` says why) after.
    """

    async def once() -> None:
        try:
            async with asyncio.timeout(header_timeout):
                resp = await request(session, mirror, {"Range": "bytes=0-0"})
        except TimeoutError:
            raise ProbeTimeout(
                "gone", f"no answer headers to the probe within {header_timeout:g} s"
            ) from None
        try:
            try:
                async with asyncio.timeout(first_byte_timeout):
                    if resp.status in (200, 206):
                        await resp.content.read(1)
            except TimeoutError:
                mirror.answered = True
                raise ProbeTimeout(
                    "gone", f"no first byte of the probe's answer within {first_byte_timeout:g} s"
                ) from None
            _read_probe_answer(resp, mirror, size)
        finally:
            resp.release()

    # Other mirrors may already serve the pull, but the probe still waits at most 5 s between
    # its tries; a longer Retry-After is honoured by the mirror's back-off once the probe gave
    # up (Mirror.fail).
    retrying = AsyncRetrying(
        retry=retry_if_exception(lambda e: is_transient(e) and not isinstance(e, ProbeTimeout)),
        wait=wait_mirror(cap=5.0),
        stop=stop_after_attempt(PROBE_TRIES),
        reraise=True,
    )
    mirror.state = MirrorState.PROBING
    try:
        async for attempt in retrying:
            with attempt:
                await once()
    except ProbeTimeout as e:
        if mirror.via is not None:
            # A site cache that took the connection but answers late is filling the slice
            # from the origin (another pull's request holds its lock): a stall, retried at
            # once; dropping it would send this pull to the origin for the whole file.
            mirror.fail(MirrorFailure("stall", f"probe: {e}"))
            return
        mirror.state, mirror.reason = MirrorState.DROPPED, f"probe: {e}"
        return
    except (TimeoutError, MirrorFailure, aiohttp.ClientError, ConnectionError) as e:
        failure = classify_exception(e) or MirrorFailure("gone", str(e))
        if failure.kind == "gone":
            mirror.answered, mirror.cause = True, failure.cause
            mirror.state, mirror.reason = MirrorState.DROPPED, f"probe failed: {failure}"
        else:
            # Still worth trying later: every range answer is checked against the size anyway.
            mirror.fail(failure)
            if mirror.state is MirrorState.PROBING:  # ``expired`` changes no state
                mirror.state = MirrorState.BACKOFF
        return
    mirror.answered = True
    if mirror.state is MirrorState.PROBING:
        mirror.state = MirrorState.OK
