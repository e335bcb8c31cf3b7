"""Roles on the socket: every route has one; a peer of the socket's group may *use*, not administer.

The real daemon runs as root; the peer is a second uid, the real CLI under ``setpriv`` (and
stdlib HTTP from a forked child that dropped to that uid).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeld.api import make_app
from modeld.api.access import ROUTES, Role
from modeld.api.peers import Peer, is_admin
from modeld.config import load_settings
from modeld.daemon.root import Root
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.peer import PEER_GID, PEER_UID, needs_root, peer_cli, requests_as_peer
from tests.support.state import MODELS, install_fixture
from tests.support.unix import unix_request


def test_every_route_has_a_role(clean_env: Path) -> None:
    """Each registered route (method, path) is in the role table, and the table names no other."""
    app = make_app(Root(load_settings(home=clean_env / "home")).services)
    registered = {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }
    assert registered == set(ROUTES), (registered - set(ROUTES), set(ROUTES) - registered)
    admin = {path for (_, path), rule in ROUTES.items() if rule.role is Role.ADMIN}
    assert "/api/models/{id}/pull" in admin and "/api/models/import" in admin


def test_admin_rules(clean_env: Path) -> None:
    """Admins by default are root and the daemon's own uid; uids, gids and groups may be added."""
    defaults = load_settings()
    assert set(defaults.admin_uids) == {0, os.getuid()} and defaults.admin_gids == []
    alice = Peer(pid=2, uid=1000, gid=1000, groups=(1000, 27))
    assert is_admin(defaults, Peer(pid=1, uid=0, gid=0))
    assert not is_admin(defaults, alice)
    assert is_admin(load_settings(admin_uids="1000"), alice)
    assert is_admin(load_settings(admin_gids=[27]), alice)
    assert not is_admin(load_settings(admin_gids=[28]), alice)
    # Naming admins replaces the defaults: root is then an admin only if listed.
    assert not is_admin(load_settings(admin_uids=[1000]), Peer(pid=1, uid=0, gid=0))
    assert not is_admin(defaults, None)


@pytest.fixture
def shared_daemon(short_tmp: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    """A root daemon with tiny-text installed; its socket's group is the peer's (as a
    ``SocketGroup=`` would make it); its admin lists come from a config file."""
    short_tmp.chmod(0o755)
    home, registry, run = short_tmp / "home", short_tmp / "registry", short_tmp / "run"
    run.mkdir(mode=0o755)
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    install_fixture(home, "tiny-embed", MODELS / "tiny-embed.litertlm", registry=registry)
    config = short_tmp / "modeld.toml"
    config.write_text("")
    env = daemon_env(
        home,
        MODELD_SOCKET=str(run / "modeld.sock"),
        MODELD_REGISTRY=str(registry),
        MODELD_CONFIG=str(config),
        HOME=str(short_tmp),
    )
    d = DaemonProcess(home=home, env=env)
    d.start()
    os.chown(d.socket, 0, PEER_GID)
    try:
        yield d, config
    finally:
        d.stop()


def _path(canonical: str) -> str:
    return canonical.replace("{id}", "tiny-text").replace("{model}", "tiny-text")


@needs_root
def test_socket_group_grants_use_not_admin(shared_daemon: tuple[DaemonProcess, Path]) -> None:
    """A peer that reaches the socket through its group lists and generates, but every admin
    route, and pin/allow_unverified, is a 403 naming the role and MODELD_ADMIN_UIDS."""
    d, _ = shared_daemon
    listed = peer_cli(d, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert "tiny-text" in listed.stdout
    ran = peer_cli(d, "run", "tiny-text", "hello", "--max-tokens", "3")
    assert ran.returncode == 0, ran.stderr
    assert peer_cli(d, "ps").returncode == 0

    refused = {
        "pull": ["pull", "tiny-text"],
        "rm": ["rm", "tiny-text"],
        "import": ["import", str(MODELS / "tiny-text.litertlm"), "tiny-text"],
        "load with pin": ["load", "tiny-text", "--pin"],
        "load with allow_unverified": ["load", "tiny-text", "--allow-unverified"],
    }
    for what, args in refused.items():
        result = peer_cli(d, *args)
        assert result.returncode == 1, (what, result.stdout, result.stderr)
        line = result.stderr.strip()
        assert f"{what} needs the admin role" in line, line
        assert f"uid {PEER_UID}" in line and "MODELD_ADMIN_UIDS" in line, line

    # Every admin route of the table, straight over HTTP: none slips through.
    admin_routes: list[tuple[str, str, dict[str, Any]]] = [
        (method, _path(canonical), {})
        for (method, canonical), rule in ROUTES.items()
        if rule.role is Role.ADMIN
    ]
    fields = [
        ("POST", "/api/engines", {"model": "tiny-text", "pin": True}),
        (
            "POST",
            "/api/modeld/generate",
            {"model": "tiny-text", "prompt": "x", "allow_unverified": True},
        ),
        (
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny-text",
                "messages": [{"role": "user", "content": "x"}],
                "allow_unverified": True,
            },
        ),
    ]
    # Ollama's way to unload (keep_alive 0 and nothing to answer) is an admin's too.
    fields += [
        ("POST", "/api/generate", {"model": "tiny-text", "keep_alive": 0}),
        ("POST", "/api/chat", {"model": "tiny-text", "messages": [], "keep_alive": "0s"}),
    ]
    use = [
        ("GET", "/api/status", None),
        ("GET", "/api/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/api/tags", None),
        ("GET", "/api/version", None),
        ("GET", "/api/ps", None),
    ]
    answers = requests_as_peer(d.socket, admin_routes + fields + use)
    for (method, target, _), (status, body) in zip(admin_routes + fields, answers, strict=False):
        assert status == 403, (method, target, status, body)
        # Ollama's routes answer in Ollama's shape: the message alone.
        error = body["error"] if isinstance(body["error"], dict) else {"message": body["error"]}
        assert error.get("code", "forbidden") == "forbidden"
        assert "needs the admin role" in error["message"], (target, error)
    assert [status for status, _ in answers[-len(use) :]] == [200] * len(use)
    # Still installed: nothing the peer asked for was done.
    status, body = unix_request(d.socket, "GET", "/api/models/tiny-text")
    assert status == 200 and body["installed"] is not None
    assert f"peer={PEER_UID}:{PEER_GID}:" in d.wait_log("status=403")


def _keep_alive(d: DaemonProcess) -> dict[str, float]:
    """Each loaded model's keep_alive, as root's ``ps`` shows it."""
    return {e["model"]: e["keep_alive"] for e in d.cli_json("ps")["engines"]}


@needs_root
def test_a_use_peer_keep_alive_lengthens_an_engine_never_shortens_it(
    shared_daemon: tuple[DaemonProcess, Path],
) -> None:
    """Engines root loaded for ever and for 1 h are not cut short by a use peer's
    keep_alive 0 (the CLI's run and load, the native, chat and embeddings routes): the
    requests are served and the engines keep root's keep-alive; a longer one applies, and
    root's keep_alive 0 still stops an engine."""
    d, _ = shared_daemon
    assert d.cli("load", "tiny-text", "--keep-alive", "-1").returncode == 0
    assert d.cli("load", "tiny-embed", "--keep-alive", "1h").returncode == 0
    assert _keep_alive(d) == {"tiny-text": -1, "tiny-embed": 3600}

    ran = peer_cli(d, "run", "tiny-text", "hi", "--keep-alive", "0", "--max-tokens", "3")
    assert ran.returncode == 0, ran.stderr
    loaded = peer_cli(d, "load", "tiny-text", "--keep-alive", "0", "--json")
    assert loaded.returncode == 0, loaded.stderr
    # The load's answer is the engine as it is: root's keep-alive, not the peer's 0.
    assert json.loads(loaded.stdout)["keep_alive"] == -1
    chat = {"model": "tiny-text", "messages": [{"role": "user", "content": "hi"}]}
    answers = requests_as_peer(
        d.socket,
        [
            (
                "POST",
                "/api/modeld/generate",
                {"model": "tiny-text", "prompt": "hi", "max_tokens": 3, "keep_alive": 0},
            ),
            ("POST", "/v1/chat/completions", {**chat, "max_tokens": 3, "keep_alive": "0"}),
            ("POST", "/v1/embeddings", {"model": "tiny-embed", "input": "hi", "keep_alive": "0"}),
            ("POST", "/v1/embeddings", {"model": "tiny-embed", "input": "hi", "keep_alive": "1m"}),
        ],
    )
    assert [status for status, _ in answers] == [200] * 4, answers
    assert _keep_alive(d) == {"tiny-text": -1, "tiny-embed": 3600}

    # Longer is the peer's to ask for.
    longer = peer_cli(d, "load", "tiny-embed", "--keep-alive", "2h", "--json")
    assert longer.returncode == 0, longer.stderr
    assert json.loads(longer.stdout)["keep_alive"] == 7200
    # An admin may shorten: root's keep_alive 0 stops the engine after its request.
    assert d.cli("run", "tiny-text", "hi", "--keep-alive", "0", "--max-tokens", "3").returncode == 0
    d.wait_log('reason="keep_alive 0"')
    assert _keep_alive(d) == {"tiny-embed": 7200}


@needs_root
def test_admin_uid_administers_after_sighup(shared_daemon: tuple[DaemonProcess, Path]) -> None:
    """Listed in admin_uids (applied by SIGHUP), the same peer may pin, remove and import."""
    d, config = shared_daemon
    assert d.proc is not None
    assert peer_cli(d, "load", "tiny-text", "--pin").returncode == 1
    config.write_text(f"admin_uids = [0, {PEER_UID}]\n")
    d.proc.send_signal(signal.SIGHUP)
    assert "changed=admin_uids" in d.wait_log(" reloaded ")
    for args in (
        ["load", "tiny-text", "--pin"],
        ["rm", "tiny-text", "--force"],
        ["import", str(MODELS / "tiny-text.litertlm"), "tiny-text"],
    ):
        result = peer_cli(d, *args)
        assert result.returncode == 0, (args, result.stderr)
    status, body = unix_request(d.socket, "GET", "/api/models/tiny-text")
    assert status == 200 and body["installed"]["verified_by"]


@needs_root
def test_a_kept_conversation_is_continued_only_by_its_own_uid(
    shared_daemon: tuple[DaemonProcess, Path],
) -> None:
    """On the socket a chat's next turn continues the conversation its engine kept only when
    it comes from the same uid: the same history from another uid gets a fresh one."""
    d, _ = shared_daemon

    def chat(messages: list[Any]) -> tuple[str, str, Any]:
        return (
            "POST",
            "/v1/chat/completions",
            {
                "model": "tiny-text",
                "messages": messages,
                "max_tokens": 4,
                "temperature": 0,
            },
        )

    def turns() -> dict[str, Any]:
        (engine,) = d.cli_json("ps")["engines"]
        return dict(engine["conversations"])

    messages: list[Any] = [{"role": "user", "content": "root's secret"}]
    status, body = unix_request(d.socket, *chat(messages))
    assert status == 200, body
    text = body["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    ((status, _),) = requests_as_peer(d.socket, [chat(messages)])
    assert status == 200
    assert turns() == {"kept": 2, "continued": 0, "restarted": {"first": 1, "unknown": 1}}
    status, _ = unix_request(d.socket, *chat(messages))
    assert status == 200 and turns()["continued"] == 1
