"""The source seam (``modeld.download.source``): a second kind of source is one class.

The shelf (``tests.support.source``) is written outside ``modeld/`` as one ``Source`` and
plugged into the daemon's composition (``Root``) beside the Hub; its files are then pulled,
verified, kept and adopted through the same downloader as the Hub's.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from modeld.daemon.root import Root
from modeld.download.hub import Hub
from modeld.download.source import SourceSet
from tests.support.source import KEY_HEADER, Shelf, ShelfSource, start_shelf
from tests.support.state import MODELS, registry_settings

TINY = (MODELS / "tiny-text.litertlm").read_bytes()


@pytest.fixture
async def shelf() -> AsyncIterator[Shelf]:
    s = await start_shelf()
    yield s
    await s.stop()


async def test_a_source_written_as_one_class_pulls_through_the_downloader(
    clean_env: Path, shelf: Shelf
) -> None:
    """``shelf://tiny`` resolves to a pinned build, its entry is written, and the file is
    installed verified by the shelf's own header; its key goes to the shelf alone, what it
    vouched for is kept under the pinned build, and ``verify`` then checks against that."""
    build = shelf.add("tiny", "tiny.litertlm", TINY)
    home, registry = clean_env / "home", clean_env / "registry"
    registry.mkdir()
    settings = registry_settings(home, registry, piece_size="64KiB")
    sources = SourceSet(ShelfSource(shelf.endpoint, shelf.key), Hub.from_settings(settings))
    async with Root(settings, spare=False, sources=sources) as services:
        pull = await services.sources.pull_source("shelf://tiny", model_id=None, force=False)
        assert pull.job is not None
        await pull.job.wait()
        assert pull.job.verified_by == f"x-shelf-sha256 (127.0.0.1:{shelf.port})"
        assert pull.entry is not None and pull.entry["commit"] == build
        entry = services.catalog.get("tiny")
        assert entry.urls == [f"{shelf.endpoint}/files/tiny/{build}/tiny.litertlm"]
        assert entry.sha256 is None  # the shelf's API names no digest; its redirect does
        kept = await services.store.vouched("tiny", f"tiny@{build}/tiny.litertlm")
        assert kept is not None and kept.source == f"127.0.0.1:{shelf.port}"
        verified = await services.models.verify("tiny")
        assert verified["ok"] and verified["verified_by"] is not None
    files = [r for r in shelf.requests if r["path"].startswith("/files/")]
    assert files and all(r.get(KEY_HEADER) == shelf.key for r in files)
    assert len(shelf.requests) > len(files)  # the bytes came from /blobs/, through ranges


async def test_a_source_s_own_cache_is_adopted_without_a_download(
    clean_env: Path, shelf: Shelf
) -> None:
    """A file in the source's own local cache at the pinned build, whose sha256 a kept vouch
    names, is installed from there (``adopted``): no byte is fetched again."""
    shelf.add("tiny", "tiny.litertlm", TINY)
    home, registry = clean_env / "home", clean_env / "registry"
    registry.mkdir()
    settings = registry_settings(home, registry, piece_size="64KiB")
    cache = clean_env / "shelf-cache"
    cache.mkdir()
    source = ShelfSource(shelf.endpoint, shelf.key, cache=cache)
    async with Root(settings, spare=False, sources=SourceSet(source)) as services:
        first = await services.sources.pull_source("shelf://tiny", model_id=None, force=False)
        assert first.job is not None
        installed = await first.job.wait()
        digest = installed.digest
        shutil.copyfile(installed.path, cache / digest)
        await services.remover.remove_model("tiny", force=True)
        fetched = len(shelf.requests)
        again = await services.models.pull("tiny")
        assert again.job is None and again.adopted == str(cache / digest)
        assert len(shelf.requests) == fetched
