"""Mirrors that misbehave on purpose (slow probe answers; credentials kept from them), and
the retry policy (tenacity) a mirror's failures follow."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from modeld.download import hub as hub_mod
from modeld.download import mirrors as m
from modeld.download.hub import Hub
from modeld.download.job import DownloadJob, DownloadTarget, Tuning, memory_job
from modeld.download.source import SourceSet
from modeld.errors import DigestConflict, DownloadError
from tests.support.mirror import Faults, Mirror, SlowHeadMirror
from tests.support.wait import wait_until

SIZE = 1024 * 1024 + 777
DATA = random.Random(12).randbytes(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


async def pull(home: Path, urls: list[str], **kw: Any) -> DownloadJob:
    base: dict[str, Any] = {"connections": 2, "piece_size": 256 * 1024, "stall_timeout": 1.0}
    base.update(kw)
    base["sources"] = SourceSet(Hub(token=base.pop("hf_token", None)))
    job = memory_job(DownloadTarget("m1", urls, SIZE, SHA), home, Tuning(**base))
    job.start()
    await job.wait()
    return job


async def test_a_trickling_mirror_does_not_hold_the_pull_in_probing(short_tmp: Path) -> None:
    """One mirror trickles header lines for ever; its probe gives up after the header
    timeout, the mirror is dropped saying so, and the other mirror's bytes are installed."""
    # Throttled so that the fetch outlasts the timeout (a file complete and verified first
    # would drop the trickler for that reason instead).
    good = await Mirror(DATA, Faults(throttle=250_000)).start()
    slow = await SlowHeadMirror(DATA, interval=0.2).start()
    try:
        job = await pull(short_tmp, [slow.url, good.url], probe_header_timeout=1.0)
    finally:
        slow.release.set()
        await slow.stop()
        await good.stop()
    assert job.state == "installed", job.error
    assert Path(job.result["path"]).read_bytes() == DATA
    (trickler,) = [m for m in job.mirrors if m.url.human_repr() == slow.url]
    assert trickler.received == 0 and trickler.state == "dropped"
    assert "probe: no answer headers" in str(trickler.snapshot()["reason"]), trickler.snapshot()


async def test_the_pull_starts_on_the_first_answer_and_a_late_one_joins(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub sends one header line a second and answers only when released: the good
    mirror's probe starts the pull, every block lands while the hub's probe is still out,
    and the pull then waits for it: the late X-Linked-Etag joins and verifies the file
    (an entry without sha256 is never installed unverified while a source may answer)."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("127.0.0.1",))
    good = await Mirror(DATA, Faults()).start()
    slow = await SlowHeadMirror(DATA, interval=1.0, redirect_to=good.url).start()
    tuning = Tuning(
        2, 256 * 1024, stall_timeout=5.0, probe_header_timeout=300.0, sources=SourceSet(Hub())
    )
    job = memory_job(DownloadTarget("m1", [slow.url, good.url], SIZE, None), short_tmp, tuning)
    try:
        job.start()
        await wait_until(lambda: job.fetcher is not None and job.fetcher.done_bytes > 0, 30)
        hub_mirror = job.mirrors[0]
        assert hub_mirror.state == "probing" and slow.waiting == 1  # the first block is in
        assert job.snapshot()["mirrors"][0]["state"] == "probing"
        await wait_until(lambda: job.fetcher is not None and job.fetcher.done_bytes == SIZE, 30)
        assert hub_mirror.state == "probing" and slow.waiting == 1  # every block is in
        assert job.state == "downloading"  # not verified before every probe has ended
        slow.release.set()
        await job.wait()
    finally:
        slow.release.set()
        await slow.stop()
        await good.stop()
    assert job.state == "installed", job.error
    assert hub_mirror.state == "ok" and hub_mirror.received == 0
    assert job.verified_by == f"x-linked-etag (127.0.0.1:{slow.port})"
    assert Path(job.result["path"]).read_bytes() == DATA
    assert len(slow.requests) == 1  # the probe


async def test_a_pinned_entry_installs_without_waiting_for_a_probe_still_out(
    short_tmp: Path,
) -> None:
    """The entry pins the sha256 and every block came from the good mirror while the other
    mirror's probe is still out (its header timeout is 300 s): the file is verified and
    installed at once, and the silent mirror is dropped saying why."""
    good = await Mirror(DATA, Faults()).start()
    slow = await SlowHeadMirror(DATA, interval=1.0).start()
    tuning = Tuning(
        2, 256 * 1024, stall_timeout=5.0, probe_header_timeout=300.0, sources=SourceSet(Hub())
    )
    job = memory_job(DownloadTarget("m1", [slow.url, good.url], SIZE, SHA), short_tmp, tuning)
    try:
        job.start()
        await job.wait()
        assert slow.waiting == 1 and not slow.release.is_set()  # its probe never ended
    finally:
        slow.release.set()
        await slow.stop()
        await good.stop()
    assert job.state == "installed", job.error
    assert job.verified_by == "registry sha256"
    assert Path(job.result["path"]).read_bytes() == DATA
    silent = job.mirrors[0]
    assert (silent.state, silent.received) == ("dropped", 0)
    assert "no answer before the file was complete and verified" in str(silent.reason)


async def test_a_late_contradicting_hub_still_fails_the_pull(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull runs on the good mirror while a hub's probe is out; the hub's late
    X-Linked-Etag contradicts the entry's sha256: the pull fails naming both, nothing is
    installed."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("127.0.0.1",))
    bogus = "e" * 64
    good = await Mirror(DATA, Faults(throttle=2_000_000)).start()
    slow = await SlowHeadMirror(
        DATA, interval=1.0, redirect_to=good.url, linked_sha256=bogus
    ).start()
    tuning = Tuning(
        2, 256 * 1024, stall_timeout=5.0, probe_header_timeout=300.0, sources=SourceSet(Hub())
    )
    job = memory_job(DownloadTarget("m1", [slow.url, good.url], SIZE, SHA), short_tmp, tuning)
    try:
        job.start()
        await wait_until(lambda: job.fetcher is not None and job.fetcher.done_bytes > 0, 30)
        assert job.mirrors[0].state == "probing"
        slow.release.set()
        with pytest.raises(DigestConflict) as exc:
            await job.wait()
    finally:
        slow.release.set()
        await slow.stop()
        await good.stop()
    assert exc.value.code == "digest_conflict"
    assert SHA in exc.value.message and bogus in exc.value.message
    assert f"127.0.0.1:{slow.port}" in exc.value.message
    assert job.state == "failed"
    assert not (short_tmp / "blobs").exists() or not any((short_tmp / "blobs").iterdir())


async def test_a_probe_without_a_first_byte_is_dropped_with_a_logged_reason(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A mirror sends its answer's head at once but never a body byte: after the first-byte
    timeout it is dropped, the log says why, and the other mirror's bytes are installed."""
    good = await Mirror(DATA, Faults(throttle=250_000)).start()  # outlasts the timeout
    mute = await SlowHeadMirror(DATA, hold_body=True, interval=0.2).start()
    try:
        with caplog.at_level(logging.INFO, logger="modeld"):
            job = await pull(short_tmp, [mute.url, good.url], probe_first_byte_timeout=0.5)
    finally:
        mute.release.set()
        await mute.stop()
        await good.stop()
    assert job.state == "installed", job.error
    assert Path(job.result["path"]).read_bytes() == DATA
    silent = job.mirrors[0]
    assert silent.state == "dropped" and silent.received == 0
    assert silent.reason == "probe: no first byte of the probe's answer within 0.5 s"
    lines = [r.getMessage() for r in caplog.records if "mirror_dropped" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"mirror=127.0.0.1:{mute.port}" in lines[0] and "first byte" in lines[0]


def test_hub_token_goes_only_over_https() -> None:
    """The hub host gets the token over https (or its own loopback), never over plain http
    across a network, where an http mirror's redirect could send it."""
    from yarl import URL

    from modeld.download.mirrors import request_headers

    hub = SourceSet(Hub(token="t"))
    assert request_headers(URL("https://huggingface.co/f"), {}, hub)["Authorization"] == "Bearer t"
    assert "Authorization" not in request_headers(URL("http://huggingface.co/f"), {}, hub)
    assert "Authorization" not in request_headers(URL("https://hf-mirror.com/f"), {}, hub)


async def test_netrc_credentials_are_never_sent(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~/.netrc credentials for a mirror's host (and the hub token beside them) never turn
    into a Basic Authorization header: the pull ignores netrc and still uses proxies."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
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
