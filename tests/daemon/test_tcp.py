"""Opt-in TCP: every request needs an API key, keys carry roles, CORS only for listed origins,
keys never reach the log; the real `openai` package works over it. A real daemon on loopback."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ollama
import openai
import pytest

from modeld.config import load_settings
from modeld.daemon.apikeys import KeysFile, hash_key
from modeld.errors import SettingsError
from tests.support.daemon import (
    ACTIVATION_WRAPPER,
    DaemonProcess,
    daemon_env,
    serve_to_exit,
    spawn_daemon,
    stop_process,
    wait_log,
)
from tests.support.state import MODELS, install_fixture
from tests.support.unix import unix_http

APP = "http://app.test:3000"


@dataclass
class Tcp:
    daemon: DaemonProcess
    port: int
    use_key: str
    admin_key: str

    def request(
        self,
        method: str,
        target: str,
        *,
        key: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], Any]:
        """One request over TCP: (status, headers with lower-case names, decoded JSON body)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            sent = dict(headers or {})
            if key is not None:
                sent["Authorization"] = f"Bearer {key}"
            payload = None if body is None else json.dumps(body)
            if payload is not None:
                sent["Content-Type"] = "application/json"
            conn.request(method, target, body=payload, headers=sent)
            resp = conn.getresponse()
            raw = resp.read()
            got = {k.lower(): v for k, v in resp.getheaders()}
            is_json = got.get("content-type", "").startswith("application/json")
            decoded = json.loads(raw) if raw and is_json else raw
            return resp.status, got, decoded
        finally:
            conn.close()

    def key_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.daemon.cli("key", *args)


def listening_port(log: str) -> int:
    match = re.search(r"listening address=127\.0\.0\.1:(\d+)", log)
    assert match, log
    return int(match.group(1))


@pytest.fixture(scope="module")
def tcp() -> Iterator[Tcp]:
    """One daemon for the module: tiny-text installed, a use key and an admin key, TCP on."""
    root = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    keys = KeysFile(home / "api-keys")
    _, use_key = keys.add("webui")
    _, admin_key = keys.add("ops", "admin")
    env = daemon_env(
        home,
        MODELD_LISTEN="127.0.0.1:0",
        MODELD_REGISTRY=str(registry),
        MODELD_CORS_ORIGINS=APP,
    )
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        yield Tcp(d, listening_port(d.log()), use_key, admin_key)
    finally:
        d.stop()
        shutil.rmtree(root, ignore_errors=True)


def assert_401(status: int, headers: dict[str, str], body: Any) -> None:
    assert status == 401, body
    assert headers["www-authenticate"].startswith("Bearer")
    assert body["error"]["code"] == "unauthorized"


def test_every_tcp_request_needs_a_valid_key(tcp: Tcp) -> None:
    """Missing, malformed, wrong or digest-for-key: 401 with WWW-Authenticate: Bearer, even on
    /api/health and unknown paths; the Unix socket needs no key."""
    for target in ("/api/health", "/api/models", "/no/such/route"):
        assert_401(*tcp.request("GET", target))
    bad_headers = [
        {"Authorization": f"Basic {tcp.use_key}"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {'x' * 5000}"},
    ]
    for headers in bad_headers:
        assert_401(*tcp.request("GET", "/api/models", headers=headers))
    for wrong in ("mdk_" + "A" * 43, tcp.use_key[:-1], tcp.use_key + "A", hash_key(tcp.use_key)):
        status, headers, body = tcp.request("GET", "/api/models", key=wrong)
        assert_401(status, headers, body)
        assert "modeld key list" in body["error"]["message"]
    status, _, body = tcp.request("GET", "/api/health", key=tcp.use_key)
    assert status == 200 and body["status"] == "ok"
    status, body = unix_http(tcp.daemon.socket, "/api/status")
    assert status == 200
    assert body["tcp"]["listen"] == [f"127.0.0.1:{tcp.port}"] and body["tcp"]["problems"] == []
    assert body["settings"]["listen"] == ["127.0.0.1:0"]


def test_a_keys_role_is_the_peers_role(tcp: Tcp) -> None:
    """A use key lists and generates but gets 403 on admin routes and pin; an admin key passes."""
    status, _, body = tcp.request("GET", "/api/models?installed=1", key=tcp.use_key)
    assert status == 200 and "tiny-text" in [m["id"] for m in body["models"]]
    status, _, records = tcp.request(
        "POST",
        "/api/modeld/generate",
        key=tcp.use_key,
        body={"model": "tiny-text", "prompt": "hi", "max_tokens": 2},
    )
    assert status == 200 and b'"done"' in records
    for method, target, body in [
        ("POST", "/api/models/tiny-text/pull", {}),
        ("DELETE", "/api/models/tiny-text", None),
        ("POST", "/api/models/import", {"path": str(MODELS / "tiny-text.litertlm")}),
        ("POST", "/api/engines", {"model": "tiny-text", "pin": True}),
    ]:
        status, _, answer = tcp.request(method, target, key=tcp.use_key, body=body)
        assert status == 403, (target, answer)
        message = answer["error"]["message"]
        assert "API key 'webui' has the use role" in message
        assert "modeld key add NAME --role admin" in message
    status, _, answer = tcp.request("POST", "/api/models/tiny-text/verify", key=tcp.admin_key)
    assert status == 200, answer
    assert answer["ok"] is True
    log = tcp.daemon.wait_log("peer=key:ops@127.0.0.1")
    assert "peer=key:webui@127.0.0.1" in log


def test_key_rm_and_add_apply_without_restart(tcp: Tcp) -> None:
    """`modeld key add` works on the next request; `modeld key rm` refuses it on the next one."""
    added = tcp.key_cli("add", "laptop")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert tcp.request("GET", "/api/models", key=key)[0] == 200
    removed = tcp.key_cli("rm", "laptop")
    assert removed.returncode == 0, removed.stderr
    assert_401(*tcp.request("GET", "/api/models", key=key))
    assert tcp.request("GET", "/api/models", key=tcp.use_key)[0] == 200


def test_a_keys_file_the_daemon_refuses_is_a_503_not_a_bad_key(tcp: Tcp) -> None:
    """A keys file others may read (mode 0644) is refused, so no key is in force: a client
    with a good key is told the daemon's file is at fault (503 keys_unusable), not that its
    key is bad (401); `modeld status` names the fix; chmod 600 brings the keys back."""
    path = tcp.daemon.home / "api-keys"
    path.chmod(0o644)
    try:
        status, _, body = tcp.request("GET", "/api/models", key=tcp.use_key)
        assert status == 503 and body["error"]["code"] == "keys_unusable", body
        assert "modeld status" in body["error"]["message"]
        assert str(path) not in body["error"]["message"]
        shown = tcp.daemon.cli("status")
        assert "0644" in shown.stdout + shown.stderr, shown
    finally:
        path.chmod(0o600)
    assert tcp.request("GET", "/api/models", key=tcp.use_key)[0] == 200


def test_a_keys_file_that_became_a_directory_is_a_503(tcp: Tcp) -> None:
    """The keys file replaced by a directory: the daemon refuses it as it refuses a file it
    cannot trust (503 keys_unusable, `modeld status` says why), not a 500 per request."""
    path = tcp.daemon.home / "api-keys"
    aside = path.with_name("api-keys.aside")
    path.rename(aside)
    path.mkdir()
    try:
        status, _, body = tcp.request("GET", "/api/models", key=tcp.use_key)
        assert status == 503 and body["error"]["code"] == "keys_unusable", body
        shown = tcp.daemon.cli("status")
        assert "is not a regular file" in shown.stdout + shown.stderr, shown
    finally:
        path.rmdir()
        aside.rename(path)
    assert tcp.request("GET", "/api/models", key=tcp.use_key)[0] == 200


def test_cors_only_for_listed_origins(tcp: Tcp) -> None:
    """A listed origin gets its preflight (no key needed) and CORS headers, on errors too; any
    other origin gets neither."""
    preflight = {
        "Origin": APP,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    status, headers, _ = tcp.request("OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 204
    assert headers["access-control-allow-origin"] == APP
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"]
    evil = dict(preflight, Origin="http://evil.test")
    status, headers, body = tcp.request("OPTIONS", "/v1/chat/completions", headers=evil)
    assert status == 403 and "access-control-allow-origin" not in headers
    assert "MODELD_CORS_ORIGINS" in body["error"]["message"]
    status, headers, _ = tcp.request("GET", "/v1/models", key=tcp.use_key, headers={"Origin": APP})
    assert status == 200 and headers["access-control-allow-origin"] == APP
    assert "Origin" in headers["vary"]
    status, headers, _ = tcp.request("GET", "/v1/models", headers={"Origin": APP})
    assert status == 401 and headers["access-control-allow-origin"] == APP
    status, headers, _ = tcp.request(
        "GET", "/v1/models", key=tcp.use_key, headers={"Origin": "http://evil.test"}
    )
    assert status == 200 and "access-control-allow-origin" not in headers


def test_openai_package_over_tcp_with_a_key(tcp: Tcp) -> None:
    """The real `openai` client lists models and completes a chat over TCP; a bad key is a 401."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key=tcp.use_key, max_retries=0
    )
    assert [m.id for m in client.models.list().data] == ["tiny-text"]
    reply = client.chat.completions.create(
        model="tiny-text", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 4
    stranger = openai.OpenAI(
        base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key="mdk_" + "B" * 43, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_ollama_package_over_tcp_with_a_key(tcp: Tcp) -> None:
    """The real `ollama` client, given the key as its `Authorization` header, lists, shows,
    chats (streamed) and generates over TCP; a use key may not pull (403), a bad key is a 401,
    both in Ollama's error shape."""
    host = f"http://127.0.0.1:{tcp.port}"

    def client(key: str) -> ollama.Client:
        return ollama.Client(host=host, headers={"Authorization": f"Bearer {key}"})

    with client(tcp.use_key) as use:
        assert [m.model for m in use.list().models] == ["tiny-text:latest"]
        assert use.show("tiny-text").capabilities == ["completion"]
        messages = [{"role": "user", "content": "hello"}]
        parts = list(use.chat("tiny-text", messages, stream=True, options={"num_predict": 3}))
        assert parts[-1].done and parts[-1].eval_count == 3
        assert use.generate("tiny-text:latest", "hi", options={"num_predict": 2}).response
        with pytest.raises(ollama.ResponseError) as refused:
            use.pull("tiny-text")
        assert refused.value.status_code == 403 and "admin" in refused.value.error
    with client(tcp.admin_key) as admin:
        assert admin.pull("tiny-text").status == "success"
    with client("mdk_" + "B" * 43) as stranger, pytest.raises(ollama.ResponseError) as bad:
        stranger.list()
    assert bad.value.status_code == 401 and "not valid" in bad.value.error


def test_errors_before_an_openai_handler_are_in_openai_shape(tcp: Tcp) -> None:
    """On /v1 routes, a missing key (401), a use key on no such route (400 unknown_route,
    never a 404 that clients take for an unknown model) or method (405), and a refused origin
    (403) answer in OpenAI's error shape, as the handlers' own errors do; a bad key is
    OpenAI's invalid_api_key; the native routes keep modeld's."""
    evil = {"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"}
    answers = [
        tcp.request("GET", "/v1/models"),
        tcp.request("GET", "/v1/no-such-route", key=tcp.use_key),
        tcp.request("PUT", "/v1/chat/completions", key=tcp.use_key, body={}),
        tcp.request("OPTIONS", "/v1/chat/completions", headers=evil),
    ]
    assert [status for status, _, _ in answers] == [401, 400, 405, 403]
    assert answers[1][2]["error"]["code"] == "unknown_route"
    for _, _, body in answers:
        error = body["error"]
        assert error["type"] == "invalid_request_error" and error["param"] is None, body
        assert error["code"] and error["message"]
    assert answers[0][1]["www-authenticate"].startswith("Bearer")
    stranger = openai.OpenAI(
        base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key="mdk_" + "C" * 43, max_retries=0
    )
    with pytest.raises(openai.AuthenticationError) as raised:
        stranger.models.list()
    assert raised.value.type == "invalid_request_error"
    assert raised.value.code == "invalid_api_key"
    status, _, body = tcp.request("GET", "/api/models")
    assert status == 401 and set(body["error"]) == {"code", "message"}


VERDICT: Any = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "blue"]}},
            "required": ["ok", "color"],
            "additionalProperties": False,
        },
    },
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            # Closed, as OpenAI's strict tools are: random weights never close an open object.
            "additionalProperties": False,
        },
    },
}


def test_openai_package_over_tcp_with_schema_and_tools(tcp: Tcp) -> None:
    """Over TCP with a key, the `openai` client gets schema-constrained JSON and a required
    tool call, each streamed and not."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key=tcp.use_key, max_retries=0
    )
    kw: Any = {"model": "tiny-text", "messages": [{"role": "user", "content": "w?"}]}
    kw["max_tokens"] = 80
    whole = client.chat.completions.create(**kw, response_format=VERDICT)
    assert set(json.loads(whole.choices[0].message.content or "")) == {"ok", "color"}
    stream = client.chat.completions.create(**kw, response_format=VERDICT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text)["color"] in ("red", "blue")
    called = client.chat.completions.create(**kw, tools=[WEATHER], tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls"
    call: Any = (called.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather"
    stream = client.chat.completions.create(
        **kw, tools=[WEATHER], tool_choice="required", stream=True
    )
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or []]
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert deltas[0].function and deltas[0].function.name == "get_weather"
    assert json.loads(args)["city"] in ("Paris", "Rome")


def test_langchain_over_tcp_with_a_key(tcp: Tcp) -> None:
    """LangChain's ``ChatOpenAI`` over TCP with a key: a reply and a stream, a structured
    output and a tool call; a wrong key is refused."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, SecretStr

    class Verdict(BaseModel):
        ok: bool
        color: Literal["red", "blue"]

    def chat(key: str) -> ChatOpenAI:
        return ChatOpenAI(
            model="tiny-text",
            base_url=f"http://127.0.0.1:{tcp.port}/v1",
            api_key=SecretStr(key),
            max_retries=0,
            max_completion_tokens=80,
        )

    llm = chat(tcp.use_key)
    assert llm.invoke("hello", max_completion_tokens=3).content
    assert "".join(str(c.content) for c in llm.stream("hello", max_completion_tokens=3))
    structured = llm.with_structured_output(Verdict, method="json_schema")
    assert isinstance(structured.invoke("w?"), Verdict)
    ai = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("w?")
    assert ai.tool_calls[0]["name"] == "get_weather"
    with pytest.raises(openai.AuthenticationError):
        chat("mdk_" + "D" * 43).invoke("hello")


def test_keys_never_reach_the_log_and_nothing_in_it_opens_the_api(tcp: Tcp) -> None:
    """After good and bad requests (the openai client's too), no key, presented or issued, and
    no digest is in the daemon's log; no word of the log works as a key."""
    wrong = "mdk_" + "C" * 43
    tcp.request("GET", "/api/models", key=tcp.use_key)
    tcp.request("GET", "/api/models?api_key=" + wrong, key=wrong)
    tcp.request("POST", "/api/models/tiny-text/pull", key=tcp.use_key, body={})
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key=wrong, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    log = tcp.daemon.wait_log("reason=unknown_key")
    assert "status=401" in log and "status=403" in log
    for secret in (tcp.use_key, tcp.admin_key, wrong):
        assert secret not in log
        assert secret[4:20] not in log
        assert hash_key(secret) not in log
    assert "Bearer" not in log and "mdk_" not in log
    words = set(re.split(r"[\s=]+", log)) - {""}
    for word in sorted(words, key=len, reverse=True)[:200]:
        status = tcp.request("GET", "/api/health", key=word)[0]
        assert status == 401, word


def test_a_public_address_needs_explicit_consent(short_tmp: Path) -> None:
    """MODELD_LISTEN on a non-loopback address stops start-up (one line, exit 2) that says to put
    TLS in front and set MODELD_LISTEN_PUBLIC=1; with it, the setting loads."""
    result = serve_to_exit(daemon_env(short_tmp / "home", MODELD_LISTEN="0.0.0.0:11500"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "MODELD_LISTEN=0.0.0.0:11500" in lines[0]
    assert "TLS" in lines[0] and "MODELD_LISTEN_PUBLIC=1" in lines[0]
    assert not (short_tmp / "home" / "modeld.sock").exists()
    settings = load_settings(listen="0.0.0.0:11500,[::]:11501", listen_public=True)
    assert settings.listen_addresses == [("0.0.0.0", 11500), ("::", 11501)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("localhost:8080", [("127.0.0.1", 8080)]),
        ("127.0.0.1:0, [::1]:9", [("127.0.0.1", 0), ("::1", 9)]),
        ("", []),
    ],
)
def test_listen_values(clean_env: Path, value: str, expected: list[tuple[str, int]]) -> None:
    """MODELD_LISTEN takes IP:port pairs and localhost, separated by commas or spaces."""
    assert load_settings(listen=value).listen_addresses == expected


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("listen", "example.org:80", "IP address or localhost"),
        ("listen", "127.0.0.1:99999", "the port must be from 0 .any free one. to 65535"),
        ("listen", "127.0.0.1", "not host:port"),
        ("cors_origins", "app.test", "not an origin"),
        ("cors_origins", "https://app.test/path", "not an origin"),
    ],
)
def test_bad_listen_and_origins_name_the_rule(
    clean_env: Path, key: str, value: str, needle: str
) -> None:
    """A bad address or origin is a settings error that says what is allowed."""
    with pytest.raises(SettingsError, match=needle):
        load_settings(**{key: value})


def _activated(home: Path, sock: socket.socket, **extra: str) -> subprocess.Popen[bytes]:
    env = daemon_env(home, LISTEN_FDS="1", LISTEN_FDNAMES="modeld-tcp", **extra)
    return spawn_daemon(
        env,
        home / "daemon.log",
        [sys.executable, "-c", ACTIVATION_WRAPPER, str(sock.fileno()), "self"],
        pass_fds=(sock.fileno(),),
    )


def test_socket_activation_of_a_tcp_socket(short_tmp: Path) -> None:
    """A TCP socket passed by the service manager is served with keys; MODELD_LISTEN then is not
    bound; the daemon still binds its own Unix socket."""
    home = short_tmp / "home"
    _, key = KeysFile(home / "api-keys").add("webui")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    proc = _activated(home, listener, MODELD_LISTEN="127.0.0.1:0")
    try:
        log = wait_log(home / "daemon.log", " ready ", proc=proc)
        assert f"socket_inherited fd_name=modeld-tcp fd=3 address=127.0.0.1:{port}" in log
        assert "listen_ignored" in log and log.count("listening address=") == 1
        served = Tcp(DaemonProcess(home=home, env={}), port, key, key)
        assert_401(*served.request("GET", "/api/health"))
        assert served.request("GET", "/api/health", key=key)[0] == 200
        assert unix_http(home / "modeld.sock")[0] == 200
        assert stop_process(proc) == 0
    finally:
        stop_process(proc)
        listener.close()


def test_an_inherited_public_tcp_socket_needs_consent(short_tmp: Path) -> None:
    """A passed TCP socket on a non-loopback address stops start-up with exit 2 and the fix."""
    home = short_tmp / "home"
    # Never accepted from: the daemon must refuse it before it serves anything.
    listener = socket.create_server(("0.0.0.0", 0))
    proc = _activated(home, listener)
    try:
        assert proc.wait(60) == 2
        log = (home / "daemon.log").read_text()
        assert "MODELD_LISTEN_PUBLIC=1" in log and "TLS" in log
        assert " ready " not in log
    finally:
        stop_process(proc)
        listener.close()


def test_a_kept_conversation_is_continued_only_with_the_key_it_was_kept_for(tcp: Tcp) -> None:
    """A chat's next turn continues the conversation its engine kept only when it comes with
    the same API key: the same history sent with another key gets a fresh one (``ps`` counts
    it as one with nothing kept for that caller)."""

    def chat(key: str, messages: list[Any]) -> str:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{tcp.port}/v1", api_key=key, max_retries=0
        )
        reply = client.chat.completions.create(
            model="tiny-text", messages=messages, max_tokens=4, temperature=0
        )
        return reply.choices[0].message.content or ""

    def turns() -> dict[str, Any]:
        _, _, doc = tcp.request("GET", "/api/engines", key=tcp.use_key)
        (engine,) = doc["engines"]
        return dict(engine["conversations"])

    messages: list[Any] = [{"role": "user", "content": "a secret of the web UI's user"}]
    text = chat(tcp.use_key, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    before = turns()
    chat(tcp.admin_key, messages)
    after = turns()
    assert after["restarted"].get("unknown", 0) == before["restarted"].get("unknown", 0) + 1
    assert after["continued"] == before["continued"]
    chat(tcp.use_key, messages)
    assert turns()["continued"] == before["continued"] + 1
