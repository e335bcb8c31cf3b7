"""End to end: the real daemon, the CLI in a subprocess, the test mirror and a tiny real model.

pull → list → show → run → (the openai client, streamed and not) → ps → unload → rm →
prune --dry-run → prune, checking each verb's ``--json`` document and exit status.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.mirror import Faults, Mirror
from tests.support.state import write_entry

MODEL = Path(__file__).resolve().parent / "models" / "tiny-text.litertlm"


@pytest.fixture
def mirror() -> Iterator[Mirror]:
    """The test mirror on 127.0.0.1, served from its own event loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    m = asyncio.run_coroutine_threadsafe(Mirror(MODEL.read_bytes(), Faults()).start(), loop)
    started = m.result(10)
    yield started
    asyncio.run_coroutine_threadsafe(started.stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def daemon_e2e(short_tmp: Path, mirror: Mirror) -> Iterator[DaemonProcess]:
    """A daemon subprocess whose registry has tiny-text on the test mirror, with its sha256."""
    registry = short_tmp / "registry"
    digest, size = sha256_file(MODEL)
    write_entry(registry, "tiny-text", size=size, sha256=digest, urls=[mirror.url])
    home = short_tmp / "home"
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def openai_client(d: DaemonProcess) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)))
    # openai types name its own httpx copy; a plain httpx.Client works at run time.
    return openai.OpenAI(base_url="http://modeld/v1", api_key="x", http_client=http)  # type: ignore[arg-type]


def test_lifecycle_through_the_cli(daemon_e2e: DaemonProcess, mirror: Mirror) -> None:
    """Every admin verb works against the real daemon and leaves the state it promises."""
    d = daemon_e2e
    digest, size = sha256_file(MODEL)

    pulled = d.cli_json("pull", "tiny-text")
    assert pulled["state"] == "installed"
    assert pulled["digest"] == digest
    assert pulled["verified_by"] == "registry sha256"
    assert mirror.sent >= size

    listed = {m["id"]: m for m in d.cli_json("list")["models"]}
    assert listed["tiny-text"]["state"] == "installed"
    assert listed["tiny-text"]["installed"]["verified"] is True
    assert listed["tiny-text"]["installed"]["size"] == size
    human = d.cli("list", "--installed")
    assert human.returncode == 0 and "tiny-text" in human.stdout

    shown = d.cli_json("show", "tiny-text")
    assert shown["id"] == "tiny-text" and shown["state"] == "installed"
    assert shown["plans"]["text"]["plan"]["main"] == "cpu"

    ran = d.cli_json("run", "tiny-text", "hello", "--max-tokens", "4")
    assert ran["text"]
    final = ran.get("final", ran)
    assert final["tokens"] == 4 and final["finish"] == "length"
    plain = d.cli("run", "tiny-text", "hello", "--max-tokens", "2")
    assert plain.returncode == 0 and plain.stdout and "tokens" in plain.stderr

    # The openai client, unchanged, over the Unix socket.
    client = openai_client(d)
    assert "tiny-text" in {m.id for m in client.models.list().data}
    done = client.chat.completions.create(
        model="tiny-text", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert done.choices[0].message.content and done.usage is not None
    assert done.usage.completion_tokens == 3
    chunks = list(
        client.chat.completions.create(
            model="tiny-text",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks)

    engines = d.cli_json("ps")["engines"]
    assert [e["model"] for e in engines] == ["tiny-text"]
    assert engines[0]["requests"] >= 4
    unloaded = d.cli_json("unload", "tiny-text")
    assert [e["id"] for e in unloaded["unloaded"]] == [engines[0]["id"]]
    assert d.cli_json("ps")["engines"] == []

    blob = d.home / "blobs" / f"sha256-{digest}"
    assert blob.is_file()
    removed = d.cli_json("rm", "tiny-text")
    assert removed["id"] == "tiny-text" and removed["freed"] >= size
    assert not blob.exists()
    assert {m["id"]: m for m in d.cli_json("list")["models"]}["tiny-text"]["state"] == (
        "not_installed"
    )
    again = d.cli("rm", "tiny-text")
    assert again.returncode == 1 and len(again.stderr.strip().splitlines()) == 1

    # A quarantined file (what `verify` leaves) goes; a blob placed a moment ago with no row
    # may be an install in progress, so it is kept (ctime-based grace).
    failed = d.home / "blobs" / ("sha256-" + "ab" * 32 + ".FAILED")
    failed.write_bytes(b"x" * 4096)
    fresh = d.home / "blobs" / ("sha256-" + "cd" * 32)
    fresh.write_bytes(b"y" * 100)
    dry = d.cli_json("prune", "--dry-run")
    assert dry["dry_run"] is True
    assert [(i["kind"], i["size"]) for i in dry["items"]] == [("quarantined", 4096)]
    assert [(k["kind"], k["size"]) for k in dry["kept"]] == [("orphan_blob", 100)]
    assert dry["total"] == 4096
    assert failed.exists()
    human = d.cli("prune", "--dry-run")
    assert human.returncode == 0 and "FAILED" in human.stdout
    pruned = d.cli_json("prune")
    assert pruned["freed"] == 4096 and pruned["errors"] == []
    assert not failed.exists() and fresh.exists()
    assert d.cli_json("prune", "--dry-run")["items"] == []
