"""Apps across boxes through a real router: LiteLLM's proxy in front of two daemons' TCP
listeners, keys on both sides (the router's own for the app, one ``modeld key`` per daemon
in the router's config).

The daemons run the real runtime on the tiny fixtures; the app is the ``openai`` client.
docs/fleet.md has the config and the prerequisites (LiteLLM's proxy in a venv of its own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.support.daemon import DaemonProcess, stop_process
from tests.support.fleet import START_TIMEOUT, Daemons, free_port, need, wait_port, write_text
from tests.support.state import MODELS, install_fixture

pytestmark = pytest.mark.fleet

ROUTER_KEY = "sk-fleet-router"


@dataclass
class Box:
    daemon: DaemonProcess
    port: int
    key: str

    @property
    def api_base(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def chats(self) -> int:
        """Chat completions this daemon answered (its log's request lines)."""
        return sum(
            1
            for line in self.daemon.log().splitlines()
            if "/v1/chat/completions" in line and "status=200" in line
        )


def _box(daemons: Daemons, root: Path, name: str, models: dict[str, str]) -> Box:
    home, registry = daemons.root / name, root / f"{name}-registry"
    for model_id, fixture in models.items():
        install_fixture(home, model_id, MODELS / f"{fixture}.litertlm", registry=registry)
    port = free_port()
    daemon = daemons.start(
        name,
        MODELD_REGISTRY=str(registry),
        MODELD_LISTEN=f"127.0.0.1:{port}",
        MODELD_KEEP_ALIVE="-1",
    )
    added = daemon.cli("key", "add", "router")
    assert added.returncode == 0, added.stderr
    return Box(daemon, port, added.stdout.strip())


def _router_config(a: Box, b: Box) -> str:
    def deployment(name: str, model: str, box: Box) -> str:
        return (
            f"  - model_name: {name}\n"
            "    litellm_params:\n"
            f"      model: openai/{model}\n"
            f"      api_base: {box.api_base}\n"
            f"      api_key: {box.key}\n"
        )

    return (
        "model_list:\n"
        + deployment("tiny", "tiny-text", a)
        + deployment("tiny", "tiny-text", b)
        + deployment("tiny-b", "tiny-text-b", b)
        + "router_settings:\n"
        "  routing_strategy: simple-shuffle\n"
        "  num_retries: 3\n"
        "  retry_after: 0\n"
        "  allowed_fails: 1\n"
        "  cooldown_time: 60\n"
        "litellm_settings:\n"
        "  request_timeout: 120\n"
        "general_settings:\n"
        f"  master_key: {ROUTER_KEY}\n"
    )


@dataclass
class Fleet:
    a: Box
    b: Box
    router: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.router, api_key=ROUTER_KEY, max_retries=0)


@pytest.fixture
def fleet(short_tmp: Path) -> Iterator[Fleet]:
    binary = need("litellm", "LiteLLM's proxy: pip install 'litellm[proxy]'", "MODELD_TEST_LITELLM")
    daemons = Daemons(short_tmp / "d")
    router: subprocess.Popen[bytes] | None = None
    try:
        a = _box(daemons, short_tmp, "a", {"tiny-text": "tiny-text"})
        b = _box(daemons, short_tmp, "b", {"tiny-text": "tiny-text", "tiny-text-b": "tiny-text-b"})
        config = write_text(short_tmp / "litellm.yaml", _router_config(a, b))
        port = free_port()
        log = short_tmp / "litellm.log"
        env = {k: v for k, v in os.environ.items() if not k.endswith(("_PROXY", "_proxy"))} | {
            # No network: the model price map ships with the package; no telemetry.
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        with log.open("ab") as out:
            router = subprocess.Popen(
                [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        wait_port(port, router, log, 3 * START_TIMEOUT)
        yield Fleet(a, b, f"http://127.0.0.1:{port}/v1")
    finally:
        if router is not None and router.poll() is None:
            stop_process(router, signal.SIGTERM, 20.0)
        daemons.stop()


def _ask(client: openai.OpenAI, model: str = "tiny") -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert reply.choices[0].finish_reason in ("stop", "length"), reply
    return reply.choices[0].message.content or ""


def test_chat_and_streaming_go_through_the_router_to_both_daemons(fleet: Fleet) -> None:
    """Whole and streamed chats through the router, with the router's key; the daemons get
    their own keys from the router and both answer some of them."""
    with fleet.client() as client:
        for _ in range(8):
            _ask(client)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        chunks = list(stream)
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    print(f"chats answered: a {fleet.a.chats()}, b {fleet.b.chats()}")
    assert fleet.a.chats() > 0 and fleet.b.chats() > 0, (fleet.a.chats(), fleet.b.chats())
    # A key other than the router's is refused (401; 400 "No connected db" from a LiteLLM
    # without its database, which looks other keys up there).
    with (
        openai.OpenAI(base_url=fleet.router, api_key="sk-wrong", max_retries=0) as stranger,
        pytest.raises(openai.APIStatusError) as refused,
    ):
        stranger.models.list()
    assert refused.value.status_code in (400, 401)


def test_a_daemon_stopped_mid_run_leaves_the_requests_to_the_others(fleet: Fleet) -> None:
    """Chats keep coming while daemon a stops (SIGTERM): every one succeeds (the router
    retries what a refused connection failed), and those after the stop are b's."""
    done: list[str] = []
    errors: list[BaseException] = []
    stopped = threading.Event()

    def app() -> None:
        with fleet.client() as client:
            for i in range(24):
                if i == 6:
                    stopped.set()
                try:
                    done.append(_ask(client))
                except BaseException as e:  # the test reports every failure
                    errors.append(e)

    thread = threading.Thread(target=app)
    thread.start()
    assert stopped.wait(120)
    fleet.a.daemon.stop()
    before = fleet.b.chats()
    thread.join(300)
    print(f"{len(done)} answered, {len(errors)} failed; b: {before} -> {fleet.b.chats()}")
    assert not errors, errors
    assert len(done) == 24
    assert fleet.b.chats() > before


def test_a_model_on_one_box_only_is_reached_there(fleet: Fleet) -> None:
    """``tiny-b`` is installed on b alone, and the router's config says so: it is answered
    by b, and listed by the router."""
    before = fleet.b.chats()
    with fleet.client() as client:
        _ask(client, "tiny-b")
        listed = {m.id for m in client.models.list()}
    assert fleet.b.chats() == before + 1
    assert "tiny-b" in listed
