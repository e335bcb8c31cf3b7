"""The source seam (``modeld.download.source``): a second kind of source is one class, and a
site cache stands in front of any source's URLs.

The shelf (``tests.support.source``) is written outside ``modeld/`` as one ``Source`` and
plugged into the daemon's composition (``Root``) beside the Hub; its files are then pulled,
verified, kept and adopted through the same downloader as the Hub's.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from yarl import URL

from modeld.daemon.root import Root
from modeld.download.hub import Hub
from modeld.download.job import DownloadJob, DownloadTarget, Tuning, memory_job
from modeld.download.source import SiteCache, SourceSet
from tests.support.cache import PassCache
from tests.support.mirror import Faults, Mirror, SlowHeadMirror, pinned_path
from tests.support.source import KEY_HEADER, Shelf, ShelfSource, start_shelf
from tests.support.state import MODELS, model_bytes, registry_settings
from tests.support.wait import wait_until

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


def test_a_site_cache_serves_an_url_under_its_host_and_path() -> None:
    """``scheme://HOST[:PORT]/PATH?Q`` maps to ``BASE/HOST[:PORT]/PATH?Q``; the cache's own
    URLs are kept."""
    cache = SiteCache(URL("http://cache.lan:8080/models/"))
    hub = URL("https://huggingface.co/o/r/resolve/" + "a" * 40 + "/m.litertlm")
    assert cache.map(hub) == URL(
        "http://cache.lan:8080/models/huggingface.co/o/r/resolve/" + "a" * 40 + "/m.litertlm"
    )
    cdn = URL("http://127.0.0.1:9000/cdn/abc?sig=1%2F2&x=y", encoded=True)
    assert (
        str(cache.map(cdn)) == "http://cache.lan:8080/models/127.0.0.1:9000/cdn/abc?sig=1%2F2&x=y"
    )
    assert cache.map(cache.map(cdn)) == cache.map(cdn)


def _cached_job(short_tmp: Path, cache: str, data: bytes, hub: Mirror, **kw: float) -> DownloadJob:
    target = DownloadTarget("m1", [hub.url], len(data), None)
    sources = SourceSet(Hub(hosts=("localhost",)), caches=lambda: [SiteCache(URL(cache))])
    tuning = Tuning(4, 256 * 1024, stall_timeout=5.0, sources=sources, **kw)
    return memory_job(target, short_tmp, tuning)


async def _cached_pull(short_tmp: Path, cache: str, data: bytes, hub: Mirror) -> DownloadJob:
    job = _cached_job(short_tmp, cache, data, hub)
    job.start()
    with contextlib.suppress(Exception):
        await job.wait()
    return job


async def test_a_pull_goes_through_the_site_cache_and_the_origin_still_vouches(
    short_tmp: Path,
) -> None:
    """Behind a site cache the hub's redirect is followed through the cache too: every
    piece comes through it, the origin is only probed (its X-Linked-Etag verifies the file),
    and no token or claim is taken from the cache."""
    data = model_bytes(3 * 1024 * 1024 + 5, 8)
    hub = await Mirror(data, Faults(hf=True), host="localhost", path=pinned_path()).start()
    cache = await PassCache().start()
    try:
        job = await _cached_pull(short_tmp, cache.base, data, hub)
    finally:
        await cache.stop()
        await hub.stop()
    assert job.state == "installed", job.error
    assert job.verified_by == f"x-linked-etag (localhost:{hub.port})"
    front, origin = job.mirrors
    assert (front.via, origin.fallback) == (SiteCache(URL(cache.base)), True)
    assert front.received == len(data) and origin.received <= 1
    assert any(r.startswith(f"/127.0.0.1:{hub.port}/cdn/f?sig=") for r in cache.requests)
    assert front.claim is None and origin.claim is not None


async def test_a_site_cache_that_lies_is_banned_and_one_down_falls_back_once(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache that flips a byte is banned and the file repaired from the origin; a cache
    that cannot be reached leaves the pull to the origin, with one line saying so."""
    data = model_bytes(3 * 1024 * 1024 + 5, 9)
    hub = await Mirror(data, Faults(hf=True), host="localhost", path=pinned_path()).start()
    cache = await PassCache(flip=2 * 1024 * 1024 + 3).start()
    try:
        lied = await _cached_pull(short_tmp / "a", cache.base, data, hub)
        with caplog.at_level(logging.INFO, logger="modeld"):
            down = await _cached_pull(short_tmp / "b", "http://127.0.0.1:9", data, hub)
    finally:
        await cache.stop()
        await hub.stop()
    assert lied.state == "installed" and lied.repaired >= 1, lied.error
    assert lied.mirrors[0].state == "banned"
    assert down.state == "installed", down.error
    assert down.mirrors[1].received > 0
    lines = [r.getMessage() for r in caplog.records if "site_cache_fallback" in r.getMessage()]
    assert len(lines) == 1 and "127.0.0.1:9" in lines[0], lines


async def test_a_site_cache_slow_to_answer_its_probe_is_waited_for(short_tmp: Path) -> None:
    """A cache that took the connection but sends its probe's answer late (it is filling
    the slice from the origin) is not dropped: once it answers, it serves the whole pull,
    and the origin is only probed."""
    data = model_bytes(1024 * 1024 + 5, 10)
    hub = await Mirror(data, Faults(hf=True), host="localhost", path=pinned_path()).start()
    slow = await SlowHeadMirror(data, interval=0.2).start()
    job = _cached_job(
        short_tmp, f"http://127.0.0.1:{slow.port}", data, hub, probe_header_timeout=0.5
    )
    try:
        job.start()
        await wait_until(lambda: bool(job.mirrors) and "probe" in (job.mirrors[0].reason or ""))
        slow.release.set()
        await job.wait()
    finally:
        slow.release.set()
        await slow.stop()
        await hub.stop()
    front, origin = job.mirrors
    assert front.state != "dropped" and front.received == len(data), front.snapshot()
    assert origin.received <= 1
