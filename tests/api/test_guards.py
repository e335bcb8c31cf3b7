"""Ids in paths and bodies (``modeld.api.guards``, ``requests.ModelId``): Ollama's
``name:latest`` names the id itself, any other tag is refused saying why."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from modeld.errors import BadRequest
from tests.support.daemon import InProcessDaemon, daemon_with_models


@pytest.fixture
async def daemon(clean_env: Path) -> AsyncIterator[InProcessDaemon]:
    async with daemon_with_models(clean_env, ["tiny-text"]) as d:
        yield d


async def test_latest_tag_names_the_id_in_paths_and_bodies(
    daemon: InProcessDaemon, http: httpx.AsyncClient
) -> None:
    """``tiny-text:latest`` shows, loads, generates and unloads ``tiny-text``."""
    async with daemon.client() as c:
        assert (await c.request("GET", "/api/models/tiny-text:latest"))["id"] == "tiny-text"
        loaded = await c.request("POST", "/api/engines", {"model": "tiny-text:latest"})
        assert loaded["model"] == "tiny-text"
        chat = await http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-text:latest",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
        )
        assert chat.status_code == 200, chat.text
        assert (await http.get("/v1/models/tiny-text:latest")).json()["id"] == "tiny-text"
        unloaded = await c.request("DELETE", "/api/engines/tiny-text:latest")
        assert [e["model"] for e in unloaded["unloaded"]] == ["tiny-text"]


async def test_another_tag_is_refused_saying_modeld_has_one_file_per_id(
    daemon: InProcessDaemon, http: httpx.AsyncClient
) -> None:
    """``tiny-text:q4`` is a 400 (path or body) that names the tag and the ids to send."""
    async with daemon.client() as c:
        with pytest.raises(BadRequest, match=r"asks for tag 'q4'.*send 'tiny-text'"):
            await c.request("GET", "/api/models/tiny-text:q4")
    r = await http.post(
        "/v1/chat/completions",
        json={"model": "tiny-text:q4", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400
    assert "asks for tag 'q4'" in r.json()["error"]["message"]
    r = await http.post("/v1/chat/completions", json={"model": "a/b:latest", "messages": []})
    assert r.status_code == 400 and "not a valid model id" in r.json()["error"]["message"]
