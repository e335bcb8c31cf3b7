"""The raw range reader (``modeld.download.rangeio``): against the fault mirror, over TLS, and
nginx.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from modeld.download import fetch
from modeld.download.hub import Hub
from modeld.download.job import DownloadJob, DownloadTarget, Tuning, memory_job
from modeld.download.mirrors import MirrorFailure
from modeld.download.rangeio import RangeClient, RangeFallback
from modeld.download.source import SourceSet
from modeld.errors import IntegrityError
from tests.support.mirror import Faults, Mirror, start_mirrors
from tests.support.wait import wait_until

SIZE = 3 * 1024 * 1024 + 12345
PIECE = 256 * 1024
DATA = random.Random(5).randbytes(SIZE)
SHA = hashlib.sha256(DATA).hexdigest()


@pytest.fixture
async def stop_later() -> AsyncIterator[list[Mirror]]:
    started: list[Mirror] = []
    yield started
    for m in started:
        await m.stop()


async def pull(home: Path, mirrors: list[Mirror], **kw: Any) -> DownloadJob:
    base: dict[str, Any] = {"connections": 4, "piece_size": PIECE, "stall_timeout": 1.0}
    base.update(kw)
    base.setdefault("sources", SourceSet(Hub()))
    job = memory_job(
        DownloadTarget("m1", [m.url for m in mirrors], SIZE, SHA), home, Tuning(**base)
    )
    job.start()
    await job.wait()
    return job


def installed(job: DownloadJob) -> bytes:
    return Path(job.result["path"]).read_bytes()


def fetched(job: DownloadJob) -> fetch.Fetcher:
    assert job.fetcher is not None
    return job.fetcher


class Collect:
    """A sink that keeps what it is given (for the reader alone)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def __call__(self, view: memoryview) -> bool:
        self.data += view
        return True


async def test_pieces_go_through_the_raw_reader_with_keep_alive(
    short_tmp: Path, stop_later: list[Mirror]
) -> None:
    """Every piece is read by the raw reader over a few kept-alive connections."""
    ms = await start_mirrors(DATA)
    stop_later.extend(ms)
    job = await pull(short_tmp, ms)
    f = fetched(job)
    assert installed(job) == DATA
    assert f.raw_pieces >= SIZE // PIECE and f.fallbacks == 0
    assert f.rangeio.connects <= 4  # one per connection, reused for every later piece
    ranged = [r for r in ms[0].requests if r.get("Range") not in (None, "bytes=0-0")]
    assert ranged and all(r["Accept-Encoding"] == "identity" for r in ranged)
    assert all(r.get("If-Range") for r in ranged)  # the strong ETag seen at the probe


@pytest.mark.parametrize(
    ("fault", "states"),
    [
        (Faults(ignore_range=True), {"stream_only"}),
        (Faults(short=True), {"ok"}),
        (Faults(wrong_content_range=True), {"dropped"}),
        # Transient faults: still in use (its last attempt may have been a failure).
        (Faults(drop_after=100_000, drop_times=4), {"ok", "backoff"}),
        (Faults(fail_first=2, retry_after="0"), {"ok", "backoff"}),
    ],
    ids=["200", "short206", "wrong-content-range", "drops", "500-then-ok"],
)
async def test_raw_reader_faults_beside_a_good_mirror(
    short_tmp: Path, stop_later: list[Mirror], fault: Faults, states: set[str]
) -> None:
    """Each fault on the raw path: the file arrives whole; the mirror ends in the right state."""
    ms = await start_mirrors(DATA, fault, Faults(throttle=3_000_000))
    stop_later.extend(ms)
    job = await pull(short_tmp, ms)
    assert installed(job) == DATA
    assert fetched(job).raw_pieces > 0
    bad = job.mirrors[0]
    assert bad.state in states, bad.snapshot()
    if fault.short:
        # Each short 206 re-queued the rest: more range requests than pieces it finished.
        assert sum(1 for r in ms[0].requests if "Range" in r) > 2


async def test_raw_reader_stall_is_a_stall(short_tmp: Path, stop_later: list[Mirror]) -> None:
    """A mirror that goes silent mid-body fails the piece after the stall timeout; the other
    mirror finishes the file."""
    ms = await start_mirrors(DATA, Faults(stall_after=400_000), Faults(throttle=4_000_000))
    stop_later.extend(ms)
    job = await pull(short_tmp, ms, stall_timeout=0.5)
    assert installed(job) == DATA
    stalled, f = job.mirrors[0], fetched(job)
    # Its silent pieces ended by the stall timeout (or were taken over by the endgame first).
    assert "stall timeout" in (stalled.reason or "") or f.splits + f.takeovers > 0


async def test_raw_reader_flipped_byte_is_repaired(
    short_tmp: Path, stop_later: list[Mirror]
) -> None:
    """Bytes from the raw reader are journaled per mirror: repair still finds the liar."""
    ms = await start_mirrors(DATA, Faults(flip_byte=300_000), Faults(throttle=4_000_000))
    stop_later.extend(ms)
    job = await pull(short_tmp, ms)
    assert installed(job) == DATA
    assert job.repaired == 1 and job.mirrors[0].state == "banned"
    assert fetched(job).raw_pieces > 0


async def test_raw_reader_single_liar_is_an_integrity_error(
    short_tmp: Path, stop_later: list[Mirror]
) -> None:
    """With one lying mirror and the raw path, the pull fails with integrity, as before."""
    ms = await start_mirrors(DATA, Faults(flip_byte=10))
    stop_later.extend(ms)
    with pytest.raises(IntegrityError):
        await pull(short_tmp, ms)


async def test_aiohttp_path_still_serves_when_switched_off(
    short_tmp: Path, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the raw reader off, aiohttp reads every piece (the benchmark's comparison)."""
    monkeypatch.setattr(fetch, "RAW_RANGES", False)
    ms = await start_mirrors(DATA, Faults(short=True), Faults(drop_after=90_000, drop_times=3))
    stop_later.extend(ms)
    job = await pull(short_tmp, ms)
    assert installed(job) == DATA
    assert fetched(job).raw_pieces == 0


async def test_a_proxied_mirror_is_left_to_aiohttp(
    short_tmp: Path, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY applies unless NO_PROXY covers the host: then aiohttp (trust_env) talks to
    the proxy and the raw reader keeps out."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost,::1")
    ms = await start_mirrors(DATA)
    stop_later.extend(ms)
    job = await pull(short_tmp, ms)
    f = fetched(job)
    assert f.raw_pieces > 0  # loopback is excluded from the proxy: raw
    piece = fetch.Piece(0, PIECE, 0)
    assert f._raw_ok(piece, job.mirrors[0])
    monkeypatch.setenv("NO_PROXY", "example.org")
    assert not f._raw_ok(piece, job.mirrors[0])


async def test_expired_signed_url_falls_back_and_refreshes(
    short_tmp: Path, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 403 from the cached CDN URL hands that piece to aiohttp, which signs a fresh one."""
    from modeld.download import hub as hub_mod

    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    hub = Mirror(DATA, Faults(hf=True, sign_ttl=0.3, throttle=3_000_000), host="localhost")
    await hub.start()
    stop_later.append(hub)
    job = await pull(short_tmp, [hub], connections=2)
    f = fetched(job)
    assert installed(job) == DATA
    assert f.raw_pieces > 0 and f.fallbacks > 0
    assert not any("Authorization" in r for r in hub.requests if r["path"].startswith("/cdn"))


# --- the reader alone ---------------------------------------------------------------------


async def test_reader_answers_map_to_failure_classes(stop_later: list[Mirror]) -> None:
    """200, a wrong Content-Range, 404, 503 + Retry-After and a redirect map to the classes
    the fetcher acts on."""
    ms = await start_mirrors(
        DATA,
        Faults(ignore_range=True),
        Faults(wrong_content_range=True),
        Faults(status=404),
        Faults(fail_first=5, retry_after="3"),
        Faults(hf=True),
        Faults(wrong_size=True),
    )
    stop_later.extend(ms)
    client = RangeClient(connect_timeout=5, stall_timeout=5)
    kinds: list[str] = []
    for m in ms:
        try:
            await client.fetch(URL(m.url), {}, 0, 1000, SIZE, Collect())
            kinds.append("ok")
        except MirrorFailure as e:
            kinds.append(e.kind + (f"/{e.retry_after:g}" if e.retry_after else ""))
        except RangeFallback:
            kinds.append("fallback")
    client.close()
    assert kinds == ["no_ranges", "gone", "gone", "transient/3", "fallback", "gone"]


async def test_reader_short_answer_and_keep_alive(stop_later: list[Mirror]) -> None:
    """A short 206 returns the end it served; the next request reuses the connection."""
    (m,) = await start_mirrors(DATA, Faults(short=True))
    stop_later.append(m)
    client = RangeClient(connect_timeout=5, stall_timeout=5)
    got = Collect()
    end = await client.fetch(URL(m.url), {}, 1000, 201_000, SIZE, got)
    assert end == 1000 + 100_000 and bytes(got.data) == DATA[1000:end]
    got2 = Collect()
    end2 = await client.fetch(URL(m.url), {}, end, end + 2, SIZE, got2)
    assert bytes(got2.data) == DATA[end:end2]
    assert client.connects == 1
    client.close()


async def test_reader_drop_and_stall(stop_later: list[Mirror]) -> None:
    """A connection dropped mid-body is a transient failure that keeps the bytes before it;
    silence past the stall timeout is a TimeoutError (the fetcher's stall)."""
    dropper, staller = await start_mirrors(DATA, Faults(drop_after=200_000), Faults())
    stop_later += [dropper, staller]
    client = RangeClient(connect_timeout=5, stall_timeout=0.4)
    got = Collect()
    with pytest.raises(MirrorFailure, match="body ended") as exc:
        await client.fetch(URL(dropper.url), {}, 0, 1_000_000, SIZE, got)
    assert exc.value.kind == "transient"
    assert 0 < len(got.data) <= 200_000 and bytes(got.data) == DATA[: len(got.data)]
    staller.faults.stall_after = staller.sent + 100_000
    t = time.monotonic()
    with pytest.raises(TimeoutError):
        await client.fetch(URL(staller.url), {}, 0, 1_000_000, SIZE, Collect())
    assert time.monotonic() - t < 3
    client.close()


async def test_reader_cancel_closes_the_connection(stop_later: list[Mirror]) -> None:
    """Cancelling a fetch closes its connection at once (nothing keeps reading)."""
    (m,) = await start_mirrors(DATA, Faults(throttle=200_000))
    stop_later.append(m)
    client = RangeClient(connect_timeout=5, stall_timeout=30)
    task = asyncio.create_task(client.fetch(URL(m.url), {}, 0, SIZE, SIZE, Collect()))
    await wait_until(lambda: m.sent > 0)  # the body is flowing
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    sent = m.sent
    # A time in which the throttled mirror would go on sending were the connection still
    # open: that nothing more comes is what is tested, so there is no state to wait for.
    await asyncio.sleep(0.4)
    assert m.sent - sent < 200_000  # the server noticed the close within a chunk or two
    assert not client._idle.get(("http", "127.0.0.1", m.port))


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl CLI)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_reader_over_tls_honours_ssl_cert_file(
    stop_later: list[Mirror], tls_files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """https works with the CA from SSL_CERT_FILE; without it the certificate is refused
    (a transient mirror failure, never a crash)."""
    cert, key = tls_files
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    m = await Mirror(DATA, tls=ctx).start()
    stop_later.append(m)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    plain = RangeClient(connect_timeout=5, stall_timeout=5)
    with pytest.raises(MirrorFailure, match=r"(?i)certificate") as exc:
        await plain.fetch(URL(m.url), {}, 0, 10, SIZE, Collect())
    assert exc.value.kind == "transient"
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    client = RangeClient(connect_timeout=5, stall_timeout=5)
    got = Collect()
    end = await client.fetch(URL(m.url), {}, 5, 700_005, SIZE, got)
    assert end == 700_005 and bytes(got.data) == DATA[5:end]
    await client.fetch(URL(m.url), {}, 0, 3, SIZE, Collect())
    assert client.connects == 1
    client.close()


# --- nginx ---------------------------------------------------------------------------------


NGINX_CONF = """
{user}
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    sendfile on;
    server {{ listen 127.0.0.1:{fast}; root {d}/www; }}
    server {{ listen 127.0.0.1:{slow}; root {d}/www; limit_rate 4m; }}
}}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def nginx(short_tmp: Path) -> Iterator[tuple[str, str]]:
    """nginx on loopback serving DATA: a fast server and one limited to 4 MB/s."""
    exe = shutil.which("nginx")
    if exe is None:
        pytest.skip("nginx is not installed (apt-get install nginx-light to run this test)")
    d = short_tmp / "nginx"
    (d / "www").mkdir(parents=True)
    (d / "www" / "f").write_bytes(DATA)
    fast, slow = _free_port(), _free_port()
    # As root, nginx's workers would run as nobody, who cannot read the test's tmp dir.
    user = "user root;" if os.geteuid() == 0 else ""
    (d / "nginx.conf").write_text(NGINX_CONF.format(user=user, d=d, fast=fast, slow=slow))
    proc = subprocess.Popen(
        [exe, "-c", str(d / "nginx.conf"), "-p", str(d), "-e", str(d / "error.log")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", slow), 0.2).close()
                socket.create_connection(("127.0.0.1", fast), 0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"nginx did not start: {(d / 'error.log').read_text()}")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{fast}/f", f"http://127.0.0.1:{slow}/f"
    finally:
        proc.terminate()
        proc.wait(10)


async def test_raw_reader_against_nginx(short_tmp: Path, nginx: tuple[str, str]) -> None:
    """Against a real nginx (fast + rate-limited): every piece raw, kept alive, verified."""
    fast, slow = nginx
    target = DownloadTarget("m1", [fast, slow], SIZE, SHA)
    job = memory_job(target, short_tmp / "h", Tuning(4, PIECE, 5.0))
    job.start()
    await job.wait()
    f = fetched(job)
    assert installed(job) == DATA
    assert job.verified_by == "registry sha256"
    assert f.raw_pieces >= SIZE // PIECE and f.fallbacks == 0
    # Kept alive: at most one connection per worker and mirror, plus one per piece given up.
    assert f.rangeio.connects <= 2 * 4 + f.splits + f.takeovers < f.raw_pieces


# --- the parser, against a scripted server ------------------------------------------------


async def scripted(replies: list[list[bytes]]) -> tuple[asyncio.Server, int]:
    """A loopback server answering the n-th request on a connection with ``replies[n]``,
    sent as separate writes with a pause between them (heads split across reads)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for parts in replies:
                await reader.readuntil(b"\r\n\r\n")
                for part in parts:
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(0.02)  # heads split across reads: the case tested
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def head(status: str, *headers: str) -> bytes:
    return ("\r\n".join([f"HTTP/1.1 {status}", *headers]) + "\r\n\r\n").encode()


async def test_parser_heads_split_alone_or_after_103() -> None:
    """A head in pieces, a head alone before its body, and a 103 before the 206: the body
    (and only the body) reaches the sink; the connection is then reused."""
    body = DATA[100:400]
    cr = f"Content-Range: bytes 100-399/{SIZE}".encode()
    hints = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
    replies = [
        [b"HTTP/1.1 206 Par", b"tial\r\nContent-Length: 300\r", b"\n" + cr + b"\r\n\r\n", body],
        [hints + head("206 OK", "Content-Length: 300", cr.decode()) + body[:10], body[10:]],
    ]
    server, port = await scripted(replies)
    async with server:
        client = RangeClient(connect_timeout=5, stall_timeout=5)
        for _ in replies:
            got = Collect()
            assert (
                await client.fetch(URL(f"http://127.0.0.1:{port}/f"), {}, 100, 400, SIZE, got)
                == 400
            )
            assert bytes(got.data) == body
        assert client.connects == 1
        client.close()


CR10 = f"Content-Range: bytes 0-9/{SIZE}"
L10 = "Content-Length: 10"


@pytest.mark.parametrize(
    ("reply", "expect"),
    [
        (head("206 P", "Transfer-Encoding: chunked", CR10), "fallback"),
        (head("206 P", CR10), "fallback"),
        (head("206 P", "Content-Length: 11", CR10), "gone"),
        (head("206 P", L10, "Content-Encoding: gzip", CR10), "gone"),
        (head("206 P", L10, "Content-Length: 12", CR10), "transient"),
        (b"HTTP/2 206 P\r\n\r\n", "transient"),
        (head("307 R", "Location: /g"), "fallback"),
        (head("206 P", L10, CR10) + b"short", "transient"),
    ],
    ids=["chunked", "no-length", "length-mismatch", "gzip", "2-lengths", "http2", "307", "short"],
)
async def test_parser_refuses_what_it_cannot_frame(reply: bytes, expect: str) -> None:
    """Bodies it cannot frame go to aiohttp; broken framing is the mirror's failure."""
    server, port = await scripted([[reply]])
    async with server:
        client = RangeClient(connect_timeout=5, stall_timeout=5)
        try:
            await client.fetch(URL(f"http://127.0.0.1:{port}/f"), {}, 0, 10, SIZE, Collect())
            kind = "ok"
        except RangeFallback:
            kind = "fallback"
        except MirrorFailure as e:
            kind = e.kind
        client.close()
    assert kind == expect
