"""The Python client: sync and async, over the socket and TCP, and a socket that never answers."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from modeld import __version__
from modeld.client import AsyncClient, Client
from modeld.errors import (
    DaemonDisconnected,
    DaemonUnavailable,
    Forbidden,
    ModelNotFound,
    NotEmbeddingModel,
    NotTextModel,
    SettingsError,
    Unauthorized,
)
from tests.cli.conftest import EMBED_ID, TINY, Tiny
from tests.support.unix import cut_off_daemon


@pytest.fixture
def silent_socket(short_tmp: Path) -> Iterator[Path]:
    """A listening socket that never accepts: systemd's socket while the service cannot start."""
    path = short_tmp / "backlog.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(16)
        yield path


async def test_a_get_that_gets_no_answer_ends_with_daemon_unavailable(silent_socket: Path) -> None:
    """A GET waits `answer_timeout` for its answer, then says where to look."""
    async with AsyncClient(silent_socket, answer_timeout=0.5) as client:
        with pytest.raises(DaemonUnavailable, match=r"sent no answer in 0\.5 s") as info:
            await client.status()
    assert "journalctl -u modeld" in info.value.message


async def test_long_requests_first_check_that_the_daemon_answers(silent_socket: Path) -> None:
    """A load or a generation may take long, so the client first needs /api/health answered."""
    async with AsyncClient(silent_socket, answer_timeout=0.5) as client:
        with pytest.raises(DaemonUnavailable, match="sent no answer"):
            await client.request("POST", "/api/engines", {"model": "tiny-text"})
        with pytest.raises(DaemonUnavailable, match="sent no answer"):
            async for _ in client.stream("POST", "/api/modeld/generate", {"model": "tiny-text"}):
                pass


async def test_a_daemon_that_answers_gets_the_long_request(daemon_proc) -> None:  # type: ignore[no-untyped-def]
    """Past the health check the request itself reaches the daemon, whose own error comes back."""
    async with AsyncClient(daemon_proc.socket) as client:
        with pytest.raises(ModelNotFound, match="nope"):
            await client.request("POST", "/api/engines", {"model": "nope"})


# --- the sync client and the async one against a real daemon ---------------------------


def test_sync_client_generates_and_chats_over_the_socket(tiny: Tiny) -> None:
    """models, show, load, generate (streamed tokens, then the final record), chat, ps and
    unload, each through the stdlib client on the socket."""
    with Client(tiny.socket) as c:
        assert c.status()["version"] == __version__
        assert "tiny-text" in [m["id"] for m in c.models(installed=True)["models"]]
        assert c.show("tiny-text")["installed"]["size"] == TINY.stat().st_size
        view = c.load("tiny-text", keep_alive="5m")
        assert view["model"] == "tiny-text"
        records = list(c.generate("tiny-text", "hello", max_tokens=4, seed=1, temperature=0.0))
        tokens = [r["token"] for r in records if "token" in r]
        final = records[-1]
        assert tokens and "done" in final and 1 <= final["tokens"] <= 4
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
        chat = list(c.chat("tiny-text", messages, system="be brief", max_tokens=3))
        last = chat[-1]
        assert "done" in last and last["tokens"] >= 1
        assert "tiny-text" in [e["model"] for e in c.engines()["engines"]]
        unloaded = c.unload("tiny-text")["unloaded"]
        assert [e["id"] for e in unloaded] == [view["id"]]
        with pytest.raises(ModelNotFound, match="nope"):
            c.show("nope")
        with pytest.raises(ModelNotFound):
            list(c.generate("nope", "hi"))


def test_sync_pull_yields_progress_until_installed(tiny: Tiny) -> None:
    """pull() is an iterator of progress records whose last one is the installed file."""
    with Client(tiny.socket) as c:
        records = list(c.pull("pulled"))
        assert records[-1]["state"] == "installed"
        digest = hashlib.sha256(TINY.read_bytes()).hexdigest()
        assert c.show("pulled")["installed"]["digest"] == digest
        assert all(r["size"] == TINY.stat().st_size for r in records if "size" in r)
        c.remove("pulled")
        assert c.show("pulled")["installed"] is None


def test_tcp_with_a_key_from_the_environment(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """MODELD_URL and MODELD_API_KEY take the client to TCP; the key's role holds there."""
    monkeypatch.setenv("MODELD_URL", tiny.url)
    monkeypatch.setenv("MODELD_API_KEY", tiny.use_key)
    monkeypatch.setenv("MODELD_SOCKET", "/nonexistent/modeld.sock")
    with Client() as c:
        assert c.endpoint.url == tiny.url
        assert "tiny-text" in [m["id"] for m in c.models()["models"]]
        records = list(c.generate("tiny-text", "hello", max_tokens=2))
        assert "done" in records[-1]
        with pytest.raises(Forbidden):
            c.prune({"dry_run": True})
    with Client(url=tiny.url, api_key=tiny.admin_key) as admin:
        assert admin.prune({"dry_run": True})["dry_run"] is True
    monkeypatch.delenv("MODELD_API_KEY")
    for key in ("wrong", None):
        with pytest.raises(Unauthorized), Client(url=tiny.url, api_key=key) as c:
            c.status()


async def test_async_client_over_tcp_and_the_socket(tiny: Tiny) -> None:
    """AsyncClient: the same methods, async; generate streams over TCP with a key."""
    async with AsyncClient(url=tiny.url, api_key=tiny.use_key) as c:
        assert "tiny-text" in [m["id"] for m in (await c.models())["models"]]
        records = [r async for r in c.generate("tiny-text", "hello", max_tokens=2)]
        assert "done" in records[-1] and any("token" in r for r in records)
        with pytest.raises(ModelNotFound):
            await c.show("nope")
    async with AsyncClient(tiny.socket) as c:
        chat = [r async for r in c.chat("tiny-text", [{"role": "user", "content": "hi"}])]
        assert "done" in chat[-1]


async def test_embed_sync_async_and_openai_agree_over_the_socket_and_tcp(tiny: Tiny) -> None:
    """``embed`` gives one vector per input, in order, over the socket (sync) and over TCP
    with a key (async), the same vectors the real ``openai`` package gets over TCP; a text
    model's embeddings raise ``NotEmbeddingModel``."""
    texts = ["Hello world", "The quick brown fox"]
    with Client(tiny.socket) as c:
        hello, fox = c.embed(EMBED_ID, texts)
        assert len(hello) == len(fox) == 32 and hello != fox
        assert c.embed(EMBED_ID, "Hello world") == [hello]
        (short,) = c.embed(EMBED_ID, "Hello world", dimensions=8)
        assert len(short) == 8
        with pytest.raises(NotEmbeddingModel, match="model tiny-text is not an embedding model"):
            c.embed("tiny-text", "hi")
    async with AsyncClient(url=tiny.url, api_key=tiny.use_key) as ac:
        assert await ac.embed(EMBED_ID, texts) == [hello, fox]
        with pytest.raises(NotTextModel):
            await ac.request(
                "POST",
                "/v1/chat/completions",
                {"model": EMBED_ID, "messages": [{"role": "user", "content": "hi"}]},
            )
    oa = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key=tiny.use_key, max_retries=0)
    r = oa.embeddings.create(model=EMBED_ID, input=texts)
    assert [d.embedding for d in r.data] == [hello, fox]
    stranger = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="mdk_wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.embeddings.create(model=EMBED_ID, input=texts)


def test_sync_client_gives_up_on_a_silent_socket(silent_socket: Path) -> None:
    """The sync client waits answer_timeout for a GET, and checks health before a long call."""
    with Client(silent_socket, answer_timeout=0.5) as c:
        with pytest.raises(DaemonUnavailable, match=r"sent no answer in 0\.5 s"):
            c.status()
        with pytest.raises(DaemonUnavailable, match="sent no answer"):
            list(c.generate("tiny-text", "hi"))


def test_a_full_backlog_is_waited_on_not_refused(short_tmp: Path) -> None:
    """A flood can fill the daemon's backlog for a moment: the client waits for room (up to
    its connect timeout) instead of failing at once with EAGAIN, as a connect under
    ``settimeout`` does."""
    import threading

    from modeld.client import connect_unix
    from tests.support.wait import wait_sync

    path = short_tmp / "full.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        listener.listen(0)
        queued = []
        while True:  # fill the backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(str(path))
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plain:
            plain.settimeout(5.0)
            with pytest.raises(BlockingIOError):
                plain.connect(str(path))
        with pytest.raises(DaemonUnavailable, match=r"sent no answer in 0\.2 s"):
            Client(path, connect_timeout=0.2).health()
        got: list[socket.socket | BaseException] = []

        def connect() -> None:
            try:
                got.append(connect_unix(path, 30.0))
            except BaseException as e:
                got.append(e)

        waiter = threading.Thread(target=connect)
        waiter.start()
        # Once it waits in the kernel for room, make some: it connects.
        wchan = Path(f"/proc/self/task/{_native_id(waiter)}/wchan")
        wait_sync(lambda: wchan.read_text() == "unix_wait_for_peer" or bool(got), 10, "waiting")
        listener.accept()[0].close()
        waiter.join(10)
        for s in queued:
            s.close()
    assert len(got) == 1 and isinstance(got[0], socket.socket), got
    got[0].close()


def _native_id(thread: object) -> int:
    native = getattr(thread, "native_id", None)
    assert isinstance(native, int)
    return native


async def test_a_daemon_gone_mid_answer_is_daemon_disconnected(short_tmp: Path) -> None:
    """Both clients raise `DaemonDisconnected` (a `DaemonUnavailable`, and still a
    ConnectionResetError) for an answer cut off: a stream after its first chunk, a GET's body."""
    record = b'{"token": "hel"}\n'
    ndjson = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
    streamed = ndjson + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(record), record)
    with cut_off_daemon(short_tmp / "stream.sock", streamed) as sock:
        with Client(sock) as c, pytest.raises(DaemonDisconnected, match="closed the connection"):
            list(c.generate("tiny-text", "hi"))
        async with AsyncClient(sock) as ac:
            with pytest.raises(DaemonDisconnected, match="closed the connection"):
                async for _ in ac.generate("tiny-text", "hi"):
                    pass
    json_head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 900\r\n"
    with cut_off_daemon(short_tmp / "get.sock", json_head + b'\r\n{"ver') as sock:
        with Client(sock) as c, pytest.raises(ConnectionResetError, match="closed the connection"):
            c.request("GET", "/api/status")
        async with AsyncClient(sock) as ac:
            with pytest.raises(DaemonDisconnected, match="closed the connection"):
                await ac.request("GET", "/api/status")


def test_a_bad_url_is_a_settings_error() -> None:
    """MODELD_URL must be http://HOST:PORT; anything else says so before any request."""
    with pytest.raises(SettingsError, match="HOST:PORT"):
        Client(url="https://example.org")


def test_importing_the_client_loads_no_heavy_package() -> None:
    """`import modeld.client` and a CLI call load neither aiohttp nor pydantic, nor click
    (argparse parses), nor typing or shutil (run with -S: site's own imports left out)."""
    code = (
        "import sys, modeld.client, modeld.cli, modeld.cli.models, modeld.cli.system, "
        "modeld.cli.engines, modeld.cli.downloads\n"
        "try:\n    modeld.cli.main(['--socket', '/nonexistent/modeld.sock', 'status'])\n"
        "except SystemExit:\n    pass\n"
        "heavy = ('aiohttp', 'pydantic', 'rich', 'click', 'typing', 'shutil')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=repo,
    )
    assert out.stdout.strip() == "[]", out.stderr
