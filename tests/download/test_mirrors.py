"""Mirrors that misbehave on purpose (a trickling probe answer; credentials kept from them), and
the retry policy (tenacity) a mirror's failures follow."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from modeld.download import mirrors as m
from modeld.download.job import DownloadJob, DownloadTarget, Tuning, memory_job
from modeld.errors import DownloadError
from tests.support.mirror import Faults, Mirror

SIZE = 1024 * 1024 + 777
DATA = random.Random(12).randbytes(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


async def pull(home: Path, urls: list[str], **kw: Any) -> DownloadJob:
    base: dict[str, Any] = {"connections": 2, "piece_size": 256 * 1024, "stall_timeout": 1.0}
    base.update(kw)
    job = memory_job(DownloadTarget("m1", urls, SIZE, SHA), home, Tuning(**base))
    job.start()
    await job.wait()
    return job


@contextlib.asynccontextmanager
async def trickling_mirror() -> AsyncIterator[str]:
    """A server that answers every request with one more header line every 0.2 s, forever:
    each read timeout restarts, the answer never completes."""

    writers: list[asyncio.StreamWriter] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 206 Partial Content\r\n")
            n = 0
            while True:
                n += 1
                writer.write(f"X-Line-{n}: x\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.2)

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/m.litertlm"
    finally:
        server.close()
        for writer in writers:
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)


async def test_a_trickling_mirror_does_not_hold_the_pull_in_probing(short_tmp: Path) -> None:
    """One mirror trickles header lines; the probe gives up on it after its answer timeout
    and the other mirror's bytes are installed."""
    good = Mirror(DATA, Faults())
    await good.start()
    try:
        async with trickling_mirror() as slow:
            job = await pull(short_tmp, [slow, good.url], probe_timeout=1.0)
    finally:
        await good.stop()
    assert job.state == "installed", job.error
    assert Path(job.result["path"]).read_bytes() == DATA
    (trickler,) = [m for m in job.mirrors if m.url.human_repr() == slow]
    assert trickler.received == 0
    assert "probe" in str(trickler.snapshot()["reason"]), trickler.snapshot()


def test_hub_token_goes_only_over_https() -> None:
    """The hub host gets the token over https (or its own loopback), never over plain http
    across a network, where an http mirror's redirect could send it."""
    from yarl import URL

    from modeld.download.mirrors import _headers

    assert _headers(URL("https://huggingface.co/f"), "t", {})["Authorization"] == "Bearer t"
    assert "Authorization" not in _headers(URL("http://huggingface.co/f"), "t", {})
    assert "Authorization" not in _headers(URL("https://hf-mirror.com/f"), "t", {})


async def test_netrc_credentials_are_never_sent(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~/.netrc credentials for a mirror's host (and the hub token beside them) never turn
    into a Basic Authorization header: the pull ignores netrc and still uses proxies."""
    from modeld.download import mirrors as mirrors_mod

    monkeypatch.setattr(mirrors_mod, "HF_HOSTS", ("localhost",))
    netrc = short_tmp / "netrc"
    netrc.write_text(
        "machine localhost login someone password netrc-secret\n"
        "machine 127.0.0.1 login someone password netrc-secret\n"
    )
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    hub = Mirror(DATA, Faults(hf=True), host="localhost")
    await hub.start()
    try:
        job = await pull(short_tmp, [hub.url], hf_token="hf_secret")
    finally:
        await hub.stop()
    assert job.state == "installed", job.error
    assert hub.requests
    sent = [r.get("Authorization") for r in hub.requests]
    assert not [a for a in sent if a and not a.startswith("Bearer hf_secret")], sent
    assert not [r for r in hub.requests if r["path"].startswith("/cdn") and "Authorization" in r]


@pytest.fixture
def proxied(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route every http URL through a loopback server acting as the proxy (as a proxy would),
    so entries can name public addresses that this test never leaves the host for."""

    def route(port: int) -> None:
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{port}")
        for name in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy"):
            monkeypatch.delenv(name, raising=False)

    return route


@pytest.mark.parametrize(
    ("target", "ok"),
    [
        ("http://127.0.0.1:{port}/cdn/f", False),
        ("http://169.254.169.254/cdn/f", False),
        ("http://10.1.2.3/cdn/f", False),
        ("http://93.184.216.35/cdn/f", True),
    ],
)
async def test_redirects_into_local_addresses_are_refused(
    short_tmp: Path, proxied: Any, target: str, ok: bool
) -> None:
    """A mirror on a public address may redirect to another public one, never into
    loopback, link-local (cloud metadata) or private ranges."""
    mirror = Mirror(DATA, Faults())
    await mirror.start()
    proxied(mirror.port)
    mirror.faults.redirect_to = target.format(port=mirror.port)
    try:
        if ok:
            job = await pull(short_tmp, ["http://93.184.216.34/f"])
            assert Path(job.result["path"]).read_bytes() == DATA
        else:
            with pytest.raises(DownloadError, match="local or private address"):
                await pull(short_tmp, ["http://93.184.216.34/f"])
    finally:
        await mirror.stop()
    assert any(r["path"] == "/f" for r in mirror.requests)
    assert any(r["path"].startswith("/cdn") for r in mirror.requests) is ok


# --- the retry policy ---------------------------------------------------------------


def _mirror() -> m.Mirror:
    return m.Mirror(URL("http://127.0.0.1:1/f"), primary=True)


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (m.MirrorFailure("transient", "HTTP 503"), True),
        (m.MirrorFailure("stall", "no bytes"), True),
        (TimeoutError(), True),
        (aiohttp.ClientConnectionError("reset"), True),
        (ConnectionResetError(), True),
        (m.MirrorFailure("gone", "HTTP 404"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (asyncio.CancelledError(), False),
    ],
)
def test_only_transient_failures_are_retried(exc: BaseException, transient: bool) -> None:
    """Resets, 5xx and stalls are retried; a gone file, a full disk and a cancel stop at once."""
    assert m.is_transient(exc) is transient


def test_retry_after_is_read_in_seconds_and_capped() -> None:
    """``Retry-After`` in seconds, capped at 120 s; a date or junk is not honoured."""
    assert m.retry_after("3") == 3.0
    assert m.retry_after("9999") == 120.0
    assert m.retry_after("-5") == 0.0
    assert m.retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert m.retry_after(None) is None


def test_a_mirror_backs_off_as_the_server_asks() -> None:
    """A 503 with ``Retry-After: 7`` puts the mirror off for 7 s, whatever its strikes."""
    import time

    mir = _mirror()
    before = time.monotonic()
    mir.fail(m.MirrorFailure("transient", "HTTP 503", retry_after=7.0))
    assert mir.state == "backoff" and mir.strikes == 1
    assert 7.0 <= mir.not_before - before <= 7.0 + (time.monotonic() - before)


def test_back_off_grows_with_strikes_and_the_mirror_goes_after_max_strikes() -> None:
    """Without Retry-After the wait grows exponentially (with jitter); m.MAX_STRIKES failures in a
    row drop the mirror, and a success in between starts the count again."""
    import time

    mir = _mirror()
    waits = []
    for _ in range(m.MAX_STRIKES - 1):
        now = time.monotonic()
        mir.fail(m.MirrorFailure("transient", "HTTP 500"))
        waits.append(mir.not_before - now)
    assert mir.state == "backoff"
    # 0.4 s * 2^(n-1), each within ±50 %: the last is well past the first's upper bound.
    assert 0.2 <= waits[0] <= 0.6 + 0.05
    assert waits[-1] >= 0.5 * 0.4 * 2 ** (m.MAX_STRIKES - 2) > 0.6
    mir.succeed()
    assert mir.strikes == 0 and mir.state == "ok"
    for _ in range(m.MAX_STRIKES):
        mir.fail(m.MirrorFailure("transient", "HTTP 500"))
    assert mir.state == "dropped"
    assert f"({m.MAX_STRIKES} times in a row)" in (mir.reason or "")


def test_a_stall_is_retried_at_once_without_using_up_a_try() -> None:
    """Stalls cost no strike and no wait; only m.MAX_STALLS of them in a row drop the mirror."""
    import time

    mir = _mirror()
    mir.fail(m.MirrorFailure("transient", "HTTP 500"))
    for _ in range(m.MAX_STALLS - 1):
        now = time.monotonic()
        mir.fail(m.MirrorFailure("stall", "no bytes within the stall timeout"))
        assert mir.not_before <= now + 0.01
    assert mir.strikes == 1 and mir.state == "backoff"
    mir.fail(m.MirrorFailure("stall", "no bytes within the stall timeout"))
    assert mir.state == "dropped"
    assert f"({m.MAX_STALLS} times in a row)" in (mir.reason or "")


def test_mirror_state_is_typed_and_shown_as_a_plain_string() -> None:
    """``Mirror.state`` is a ``MirrorState``; the progress record carries its plain value,
    which JSON writes as before (``"backoff"``)."""
    import json

    mir = _mirror()
    seen: list[tuple[m.MirrorState, bool, bool]] = [(mir.state, mir.usable, mir.ranges)]
    for failure in ("transient", "no_ranges", "gone"):
        mir.fail(m.MirrorFailure(failure, "why"))
        seen.append((mir.state, mir.usable, mir.ranges))
        if failure == "transient":
            record = json.loads(json.dumps(mir.snapshot()))
            assert record["state"] == "backoff" and type(mir.snapshot()["state"]) is str
    assert seen == [
        (m.MirrorState.NEW, True, True),
        (m.MirrorState.BACKOFF, True, True),
        (m.MirrorState.STREAM_ONLY, True, False),
        (m.MirrorState.DROPPED, False, True),
    ]
    assert all(type(state) is m.MirrorState for state, _, _ in seen)
