"""A fleet behind a site cache: real nginx (``proxy_cache`` + ``slice``) in front of a
stand-in hub, and three ``modeld serve`` daemons with ``MODELD_SITE_CACHE`` set.

The hub answers as huggingface.co does: a 302 to an expiring signed CDN URL carrying
``X-Linked-Etag``/``X-Linked-Size``. Every daemon pulls the same file; what the origin
sends (``Hub.sent``, body bytes of its CDN) is what the cache saves. docs/fleet.md has the
recipe, the figures at 512 MB (``bench/bench_fleet.py``) and the prerequisites.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fleet import Site, free_port, need, pull, pull_all, sha256
from tests.support.mirror import Faults, Mirror, pinned_path
from tests.support.state import model_bytes, write_entry
from tests.support.unix import unix_request
from tests.support.wait import wait_sync

pytestmark = pytest.mark.fleet

SIZE = 24 * 1024 * 1024 + 4321  # not a whole number of slices
DATA = model_bytes(SIZE, 33)
SLICE = 1024 * 1024


@pytest.fixture
def site(short_tmp: Path) -> Iterator[Site]:
    need("nginx", "Debian's nginx (with its slice module)")
    opened = Site.open(short_tmp, DATA, sign_ttl=30.0)
    try:
        yield opened
    finally:
        opened.close()


def _origin_bytes(site: Site) -> int:
    return site.hub.sent


def _mirror(record: dict[str, Any], role: str) -> dict[str, Any]:
    mirrors = record["mirrors"]
    assert isinstance(mirrors, list)
    (found,) = [m for m in mirrors if m["role"] == role]
    assert isinstance(found, dict)
    return found


def test_three_daemons_at_once_then_one_after_another_cost_the_origin_one_file(
    site: Site,
) -> None:
    """Three daemons pull the same file at once through the cache (two by its catalog entry,
    one as ``hf://``), then each pulls it again after an ``rm``: every install is verified
    by the origin's X-Linked-Etag, and the origin sends at most 1.05 times the file in all."""
    daemons = [site.start(f"d{i}") for i in range(3)]
    models = ["m", "m", "hf://org/repo/m.litertlm"]
    records = pull_all(daemons, models)
    for record in records:
        assert record["state"] == "installed", record
        assert record["digest"] == sha256(DATA)
        assert record["verified_by"] in (
            f"x-linked-etag (127.0.0.1:{site.hub.port})",
            "registry sha256",  # hf:// writes the sha256 the origin vouched for in its entry
        )
        assert _mirror(record, "site_cache")["host"] == site.cache.label
    at_once = _origin_bytes(site)
    for d, record in zip(daemons, records, strict=True):
        assert d.cli("rm", record["id"]).returncode == 0
        again = pull(d, record["id"])
        assert again["state"] == "installed" and again["digest"] == sha256(DATA)
    after = _origin_bytes(site)
    print(f"origin bytes: {at_once} at once, {after} after three more pulls; file {SIZE}")
    assert after <= 1.05 * SIZE


def test_a_flipped_byte_in_the_cache_is_repaired_from_the_origin(site: Site) -> None:
    """A cached slice with one byte flipped: each daemon still installs the verified file,
    the cache is banned for that pull and named (its record, the log), and the repair
    fetches from the origin only blocks up to the bad one."""
    first = site.start("warm")
    pull(first, "m")  # the cache now holds every slice
    bad = 5 * SLICE + 777
    site.cache.flip(f"/cdn/{sha256(DATA)}", bad, SLICE)
    before = _origin_bytes(site)
    daemons = [site.start(f"d{i}") for i in range(3)]
    for d in daemons:
        record = pull(d, "m")
        assert record["state"] == "installed" and record["digest"] == sha256(DATA), record
        assert record["verified_by"] is not None and record["repaired"] >= 1
        cache = _mirror(record, "site_cache")
        assert cache["state"] == "banned", cache
        assert f"mirror_banned model=m mirror={site.cache.label}" in d.log()
        problems = d.cli_json("status")["downloads"]["problems"]
        assert any(f"the site cache {site.cache.label} sent 1 blocks" in p for p in problems)
    repair = _origin_bytes(site) - before
    print(f"origin bytes for three repairs: {repair} (bad byte at {bad})")
    # Each repair re-fetches the cache's blocks in file order up to the bad one, a few
    # connections' worth past it at most: never the whole file.
    assert repair < 3 * (bad + 16 * SLICE)


def test_the_cache_down_falls_back_to_the_origin_saying_so_once(site: Site) -> None:
    """With nothing listening at the cache's address the pull installs from the origin, and
    the daemon's log says so in one line."""
    dead = f"http://127.0.0.1:{free_port()}"
    d = site.start("d0", cache=dead)
    record = pull(d, "m")
    assert record["state"] == "installed" and record["digest"] == sha256(DATA)
    assert _mirror(record, "site_cache")["state"] == "dropped"
    assert _mirror(record, "origin")["received"] > 0
    lines = [line for line in d.log().splitlines() if "site_cache_fallback" in line]
    assert len(lines) == 1, lines
    assert "to=origin" in lines[0] and dead.removeprefix("http://") in lines[0]


def test_a_pull_killed_at_half_resumes_through_the_cache(site: Site) -> None:
    """A daemon killed with SIGKILL half-way through a pull (a slow origin, a cold cache)
    resumes after its restart through the cache: blocks journaled are kept, the rest comes
    through the cache, the origin serves no piece itself, and the file is verified."""
    site.hub.faults.throttle = 256 * 1024  # per answer: about 12 s for the file
    d = site.start("d0")
    pulling = d.cli("pull", "m", "--detach", "--json")
    assert pulling.returncode == 0, pulling.stderr

    def half() -> bool:
        downloads = unix_request(d.socket, "GET", "/api/downloads")[1]["downloads"]
        return bool(downloads) and downloads[0]["completed"] >= SIZE // 2

    wait_sync(half, 120.0, what="half of the pull")
    d.stop(signal.SIGKILL)
    site.hub.faults.throttle = None
    d.start_quick()
    record = pull(d, "m")
    assert record["state"] == "installed" and record["digest"] == sha256(DATA)
    assert record["verified_by"] is not None
    print(f"resumed {record['resumed']} of {SIZE}; origin bytes {site.hub.sent}")
    assert record["resumed"] >= SIZE // 2 - 8 * 1024 * 1024, record["resumed"]
    assert _mirror(record, "site_cache")["received"] > 0
    assert _mirror(record, "origin")["received"] <= 1  # its probe's byte only


def test_with_the_origin_down_a_warm_cache_serves_checked_against_the_entry(
    site: Site, short_tmp: Path
) -> None:
    """A plain mirror's file (no redirect) cached by one daemon's pull, then the mirror
    stopped: another daemon installs it from the cache alone, verified against the entry's
    sha256 (the origin that could vouch is down), the origin found unreachable."""
    origin = site.loop.run(Mirror(DATA, Faults(), path=pinned_path(repo="org/plain")).start())
    registry = short_tmp / "registry"
    write_entry(registry, "plain", size=SIZE, sha256=sha256(DATA), urls=[origin.url])
    first = site.start("warm")
    assert pull(first, "plain")["state"] == "installed"
    site.loop.run(origin.stop())
    d = site.start("d0")
    record = pull(d, "plain")
    assert record["state"] == "installed" and record["digest"] == sha256(DATA)
    assert record["verified_by"] == "registry sha256"
    assert _mirror(record, "site_cache")["received"] == SIZE
    gone = _mirror(record, "origin")
    assert gone["received"] == 0 and "cannot connect" in gone["reason"], gone
