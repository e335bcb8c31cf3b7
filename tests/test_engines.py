"""Entry limits through a real daemon, real runners and the tiny real models.

What the runner created its engine with is read back from the runtime's ``Engine`` object
(``engine_options`` in ``GET /api/engines`` and ``ps --json``), so these tests check what
reached the runtime, not what the daemon meant to send.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from modeld.client import Client
from modeld.config import load_settings
from modeld.errors import EngineError
from modeld.store import sha256_file
from tests.conftest import InProcessDaemon, install_fixture, running_daemon, write_entry

MODELS = Path(__file__).resolve().parent / "models"


def _entry(registry: Path, model_id: str, fixture: str, limits: str = "") -> None:
    digest, size = sha256_file(MODELS / f"{fixture}.litertlm")
    write_entry(registry, model_id, size=size, sha256=digest, extra=limits)


@pytest.fixture
async def limited(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    """A daemon whose entries set (or leave out) each [limits] key the runtime takes."""
    home, registry = clean_env / "home", clean_env / "registry"
    models = {
        "spec-off": ("tiny-text", "[limits]\nmax_tokens = 200\nspeculative_decoding = false\n"),
        "spec-default": ("tiny-text-b", ""),
        "spec-on": ("tiny-text", "[limits]\nspeculative_decoding = true\n"),
        "vision": (
            "vision-cpu-ok",
            "[limits]\nmax_tokens = 200\nvision_max_tokens = 128\nmax_images = 2\n"
            "speculative_decoding = false\n",
        ),
    }
    for model_id, (fixture, limits) in models.items():
        install_fixture(home, model_id, MODELS / f"{fixture}.litertlm")
        _entry(registry, model_id, fixture, limits)
    settings = load_settings(
        home=home, socket=home / "modeld.sock", registry=[registry], main_backend="cpu"
    )
    async with running_daemon(settings) as d:
        yield d


async def _load(c: Client, model: str, **backends: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if backends:
        body["backends"] = backends
    view: dict[str, Any] = await c.request("POST", "/api/engines", body)
    return view


async def _ps_json(d: InProcessDaemon) -> dict[str, Any]:
    """``modeld ps --json`` in a subprocess (not blocking the daemon's event loop)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modeld",
        "--socket",
        str(d.settings.socket_path),
        "ps",
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    doc: dict[str, Any] = json.loads(out)
    return doc


async def test_entry_limits_reach_the_runtime(limited: InProcessDaemon) -> None:
    """false stays False, absent stays the runtime's default, vision limits reach the engine."""
    async with limited.client() as c:
        off = (await _load(c, "spec-off"))["engine_options"]
        default = (await _load(c, "spec-default"))["engine_options"]
        vision_view = await _load(c, "vision", vision="cpu")
        text_view = await _load(c, "vision")
        ps = await _ps_json(limited)
    assert off["enable_speculative_decoding"] is False
    assert off["max_num_tokens"] == 200
    assert (off["backend"], off["vision_backend"], off["max_num_images"]) == ("cpu", None, None)
    assert off["model_path"].endswith("/model.litertlm")
    store_cache = limited.settings.home / "cache"
    assert Path(off["cache_dir"]).parent == store_cache
    # No [limits]: nothing forced on the runtime; the window comes from the file's header.
    assert default["enable_speculative_decoding"] is None
    assert default["max_num_tokens"] == 256
    # With vision in the plan, vision_max_tokens is the engine's window and max_images counts.
    vision = vision_view["engine_options"]
    assert (vision["vision_backend"], vision["max_num_tokens"], vision["max_num_images"]) == (
        "cpu",
        128,
        2,
    )
    assert vision["enable_speculative_decoding"] is False
    assert vision_view["max_tokens"] == 128
    # The same entry's text plan: max_tokens, no image slots.
    text = text_view["engine_options"]
    assert (text["vision_backend"], text["max_num_tokens"], text["max_num_images"]) == (
        None,
        200,
        None,
    )
    by_id = {e["id"]: e["engine_options"] for e in ps["engines"]}
    assert by_id["vision:cpu+vision-cpu"] == vision
    assert by_id["spec-off:cpu"] == off


async def test_speculative_true_reaches_the_runtime(limited: InProcessDaemon) -> None:
    """speculative_decoding = true is passed as True: a file without a drafter fails to load."""
    async with limited.client() as c:
        with pytest.raises(EngineError) as info:
            await _load(c, "spec-on")
        # The same file loads without the flag (spec-off above shares its digest).
        assert (await _load(c, "spec-off"))["state"] == "ready"
    message = info.value.message
    assert "speculative decoding" in message and "speculative_decoding" in message
    assert "could not create its engine" in message
