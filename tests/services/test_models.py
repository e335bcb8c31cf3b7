"""``modeld.services.models``: the ``Models`` service on the real parts of a ``Root`` (no socket).

Each test builds the daemon's own composition (``Root``) on a temporary state dir with the
tiny fixture models, starts it without a spare runner, and asks the service directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from modeld.daemon.root import Root
from modeld.errors import ModelNotFound, ModelNotInstalled
from modeld.modelfile.header import read_header
from modeld.services.parts import Services
from modeld.store.store import sha256_file
from tests.support.state import MODELS, install_fixture, registry_settings, write_entry

TINY = MODELS / "tiny-text.litertlm"
GEMMA3N = MODELS / "gemma3n-like.litertlm"


@pytest.fixture
async def started(clean_env: Path) -> AsyncIterator[Services]:
    """A started ``Root`` whose registry has tiny-text (installed), gemma3n-like (installed),
    ``absent`` (not installed); ``orphan`` is installed without an entry."""
    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    install_fixture(home, "gemma3n-like", GEMMA3N, registry=registry)
    install_fixture(home, "orphan", TINY)
    write_entry(registry, "absent", size=123, sha256="a" * 64)
    async with Root(registry_settings(home, registry), spare=False) as services:
        yield services


def _by_id(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["id"]: m for m in doc["models"]}


async def test_listing_gives_each_models_install_state(started: Services) -> None:
    """Entries with and without an install, and an install without an entry, each in its state."""
    doc = _by_id(await started.models.listing())
    assert doc["tiny-text"]["state"] == "installed" and doc["tiny-text"]["in_catalog"]
    assert doc["absent"]["state"] == "not_installed" and doc["absent"]["installed"] is None
    assert doc["orphan"]["state"] == "installed" and not doc["orphan"]["in_catalog"]
    installed = _by_id(await started.models.listing(installed_only=True))
    assert set(installed) == {"tiny-text", "gemma3n-like", "orphan"}


async def test_an_install_whose_entry_names_another_file_is_outdated(
    started: Services, clean_env: Path
) -> None:
    """A changed entry makes its install outdated; a pull then starts a download."""
    registry = clean_env / "registry"
    write_entry(registry, "tiny-text", size=999, sha256="b" * 64)
    started.catalog.reload()
    assert _by_id(await started.models.listing())["tiny-text"]["state"] == "outdated"
    assert await started.models.current("tiny-text") is None
    pull = await started.models.pull("tiny-text")
    assert pull.job is not None and pull.installed is None
    assert "tiny-text" in started.downloads.jobs
    await started.downloads.cancel("tiny-text")


async def test_pull_of_a_current_install_starts_nothing(started: Services) -> None:
    """The "already installed?" decision: a current install answers, no job starts."""
    pull = await started.models.pull("tiny-text")
    digest, _ = sha256_file(TINY)
    assert pull.job is None and pull.installed is not None
    assert pull.installed["digest"] == digest
    assert pull.snapshot() == {
        "id": "tiny-text",
        "state": "installed",
        "already": True,
        "installed": pull.installed,
    }
    assert [r async for r in pull.records()] == [pull.snapshot()]
    assert started.downloads.jobs == {}


async def test_show_resolves_plans_through_the_engines(started: Services) -> None:
    """``show``'s plans are the engines' (one resolver): cpu text plan; vision needs gpu."""
    doc = await started.models.show("gemma3n-like")
    assert doc["header"] is not None and doc["header_error"] is None
    text = doc["plans"]["text"]
    assert text["error"] is None and text["plan"]["main"] == "cpu"
    info = read_header(GEMMA3N, model_id="gemma3n-like")
    entry = started.catalog.find("gemma3n-like")
    assert doc["plans"] == started.engines.plans(
        "gemma3n-like", entry, info, probes={}, image_probes={}
    )
    # The vision encoder requires gpu and the settings ask vision=cpu: no plan, and why.
    assert doc["plans"]["vision"]["plan"] is None
    assert doc["plans"]["vision"]["error"]["code"] == "backend_constraint"


async def test_show_of_a_model_not_installed_says_how_to_install(started: Services) -> None:
    """No install: no header, and each plan's error says to pull; an unknown id is refused."""
    doc = await started.models.show("absent")
    assert doc["state"] == "not_installed" and doc["header"] is None
    for name in ("text", "vision"):
        assert doc["plans"][name]["error"]["code"] == "model_not_installed"
        assert "modeld pull absent" in doc["plans"][name]["error"]["message"]
    with pytest.raises(ModelNotFound):
        await started.models.show("nope")


async def test_capabilities_are_read_from_the_file(clean_env: Path) -> None:
    """A text model's window is its file's unless its entry sets one; vision, embedding, tools
    and thinking come from the header; an id not installed or unknown is refused."""
    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    install_fixture(home, "gemma3n-like", GEMMA3N, registry=registry)
    install_fixture(home, "tiny-embed", MODELS / "tiny-embed.litertlm", registry=registry)
    install_fixture(home, "short", TINY)
    digest, size = sha256_file(TINY)
    write_entry(registry, "short", size=size, sha256=digest, extra="[limits]\nmax_tokens = 128\n")
    write_entry(registry, "absent", size=123, sha256="a" * 64)
    async with Root(registry_settings(home, registry), spare=False) as services:
        models = services.models
        text = await models.capabilities("tiny-text")
        assert text.to_dict() == {
            "context_length": 256,
            "vision": False,
            "tools": False,
            "embedding": False,
            "thinking": False,
        }
        assert (await models.capabilities("short")).context_length == 128
        vision = await models.capabilities("gemma3n-like")
        assert vision.vision and not vision.embedding
        embed = await models.capabilities("tiny-embed")
        assert embed.embedding and not embed.vision
        with pytest.raises(ModelNotInstalled):
            await models.capabilities("absent")
        with pytest.raises(ModelNotFound):
            await models.capabilities("nope")


async def test_verify_rehashes_and_keeps_the_registry_verdict(started: Services) -> None:
    """A good blob verifies against the entry's sha256; no hint is needed."""
    doc = await started.models.verify("tiny-text")
    assert doc["ok"] is True and doc["verified_by"] == "registry sha256"
    assert doc["outdated"] is False and doc["hint"] is None
    with pytest.raises(ModelNotFound):
        await started.models.verify("nope")


async def test_servable_leaves_out_installs_without_an_entry(started: Services) -> None:
    """What the OpenAI routes list: installed models with an entry, never ``orphan``."""
    ids = sorted(i.model_id for i in await started.models.servable())
    assert ids == ["gemma3n-like", "tiny-text"]


async def test_bug_report_gathers_the_model_and_its_file(started: Services) -> None:
    """The report names the version asked, the install and its plans, with the journal."""
    doc = await started.models.bug_report("tiny-text", "9.9.9")
    digest, size = sha256_file(TINY)
    assert doc["modeld_version"] == "9.9.9"
    assert doc["model"]["digest"] == digest and doc["model"]["size"] == size
    assert doc["plans"]["text"]["plan"]["main"] == "cpu"
    assert doc["engines"] == [] and isinstance(doc["recent_events"], list)


async def test_show_names_where_the_cpu_thread_count_comes_from(started: Services) -> None:
    """Unset, the count is the default (one per physical core), never "MODELD_CPU_THREADS";
    set, the setting; an entry's own [runtime] threads win over both."""
    shown = await started.models.show("tiny-text")
    assert shown["engine_settings"]["cpu_threads_from"] == "default"
    started.settings.cpu_threads = 3  # as a SIGHUP reload of a config that sets it
    shown = await started.models.show("tiny-text")
    assert shown["engine_settings"]["cpu_threads"] == 3
    assert shown["engine_settings"]["cpu_threads_from"] == "MODELD_CPU_THREADS"
