"""Installs from a mirror alone are verified: the real daemon, a stand-in hub and a mirror.

The stand-in hub (``tests.support.mirror.hub``) answers like huggingface.co: a 302 with
``X-Linked-Etag``/``X-Linked-Size`` to a signed CDN URL. Entries pin a revision
(``.../resolve/COMMIT/FILE``), so what the hub vouched for is kept per (entry, revision).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.download import hub as hub_mod
from modeld.download.hub import Hub
from modeld.errors import (
    DigestConflict,
    DownloadError,
    IntegrityError,
    ModelNotInstalled,
    Unverified,
)
from modeld.store.vouches import Vouch
from tests.support.daemon import daemon_env, running_daemon
from tests.support.hub import hub
from tests.support.mirror import COMMIT, Faults, Mirror, pinned_path
from tests.support.state import (
    MODELS,
    install_fixture,
    model_bytes,
    open_store,
    registry_settings,
    write_entry,
)
from tests.support.wait import until

SIZE = 2 * 1024 * 1024 + 4321
DATA = model_bytes(SIZE, 23)
SHA = hashlib.sha256(DATA).hexdigest()
OTHER = model_bytes(SIZE, 24)  # same size, other bytes
TINY = MODELS / "tiny-text.litertlm"
REVISION = f"org/repo@{COMMIT}/m.litertlm"
DEAD_HUB = f"http://localhost:9{pinned_path()}"  # nothing listens on port 9


@pytest.fixture(autouse=True)
def localhost_is_a_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in hub runs on ``localhost``: modeld reads its X-Linked-Etag."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))


@pytest.fixture
async def stop_later() -> AsyncIterator[list[Mirror]]:
    started: list[Mirror] = []
    yield started
    for m in started:
        await m.stop()


async def _mirror(stop_later: list[Mirror], data: bytes = DATA, **faults: Any) -> Mirror:
    m = await Mirror(data, Faults(**faults), path=pinned_path()).start()
    stop_later.append(m)
    return m


async def _hub(stop_later: list[Mirror], **faults: Any) -> Mirror:
    h = await hub(DATA, Faults(**faults))
    stop_later.append(h)
    return h


def _settings(root: Path) -> Any:
    return registry_settings(
        root / "home",
        root / "reg",
        piece_size="64KiB",
        download_connections=4,
        stall_timeout="2s",
    )


async def _pull(c: AsyncClient, model_id: str = "m1") -> dict[str, Any]:
    records = [r async for r in c.stream("POST", f"/api/models/{model_id}/pull", {})]
    return records[-1]


def _no_blob(home: Path) -> bool:
    blobs = home / "blobs"
    return not blobs.exists() or not any(blobs.iterdir())


async def test_bundled_style_entry_installs_verified_from_the_mirror_alone(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """Hub unreachable, mirror only: an entry with the sha256 of its pinned revision installs
    verified."""
    mirror = await _mirror(stop_later)
    write_entry(clean_env / "reg", "m1", size=SIZE, sha256=SHA, urls=[DEAD_HUB, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        done = await _pull(c)
        assert done["state"] == "installed"
        assert done["verified_by"] == "registry sha256"
        assert done["installed"]["digest"] == SHA
        shown = await c.model("m1")
        assert shown["installed"]["verified"] is True
    assert (clean_env / "home" / "blobs" / f"sha256-{SHA}").read_bytes() == DATA
    assert mirror.sent >= SIZE


async def test_hub_answer_is_kept_for_a_later_pull_from_the_mirror_alone(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """An entry without sha256: the first pull keeps what the hub vouched for; after `rm`,
    a restart and with the hub down, a pull from the mirror alone is verified by it."""
    the_hub = await _hub(stop_later)
    mirror = await _mirror(stop_later)
    write_entry(clean_env / "reg", "m1", size=SIZE, urls=[the_hub.url, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        first = await _pull(c)
        assert first["verified_by"] == f"x-linked-etag (localhost:{the_hub.port})"
        await c.remove("m1")
    async with open_store(clean_env / "home") as store:
        kept = await store.vouched("m1", REVISION)
    assert kept is not None
    assert (kept.sha256, kept.source) == (SHA, f"localhost:{the_hub.port}")
    await the_hub.stop()
    stop_later.remove(the_hub)
    sent = mirror.sent
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        second = await _pull(c)
        assert second["verified_by"] == kept.verified_by
        assert "kept since" in second["verified_by"]
        assert (await c.model("m1"))["installed"]["verified"] is True
    assert mirror.sent - sent >= SIZE  # the file came from the mirror


async def test_mirror_serving_other_bytes_than_the_pinned_sha256_fails(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """Hub unreachable, and the mirror serves other bytes than the entry's sha256: the pull
    fails naming the expected digest and who vouches for it; nothing is installed."""
    mirror = await _mirror(stop_later, OTHER)
    write_entry(clean_env / "reg", "m1", size=SIZE, sha256=SHA, urls=[DEAD_HUB, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        # IntegrityError when the dead hub was already given up, DownloadError (partial kept
        # for a later repair) while it is still being retried: both refuse the bytes.
        with pytest.raises((IntegrityError, DownloadError)) as exc:
            await _pull(c)
        assert SHA in exc.value.message
        assert hashlib.sha256(OTHER).hexdigest() in exc.value.message
        assert "registry sha256" in exc.value.message
        with pytest.raises(ModelNotInstalled):
            await c.verify("m1")
    assert _no_blob(clean_env / "home")


async def test_hub_answer_contradicting_the_entry_fails_naming_both(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """The hub's X-Linked-Etag is not the entry's sha256: ``digest_conflict`` names both,
    and nothing is installed (the mirror's probe may have started the fetch already)."""
    bogus = "b" * 64
    the_hub = await _hub(stop_later, linked_sha256=bogus)
    mirror = await _mirror(stop_later)
    write_entry(clean_env / "reg", "m1", size=SIZE, sha256=SHA, urls=[the_hub.url, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        with pytest.raises(DigestConflict) as exc:
            await _pull(c)
        assert exc.value.code == "digest_conflict"
        assert SHA in exc.value.message
        assert bogus in exc.value.message
        assert "the entry's sha256" in exc.value.message
        assert f"localhost:{the_hub.port}" in exc.value.message
    assert the_hub.sent <= 1  # its probe's one byte: no piece from a source that conflicts
    assert _no_blob(clean_env / "home")


async def test_hub_answer_contradicting_the_kept_one_fails_naming_both(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """An entry without sha256: a hub that later vouches for another digest for the same
    pinned revision fails the pull, naming the kept answer and the new one."""
    the_hub = await _hub(stop_later)
    mirror = await _mirror(stop_later)
    write_entry(clean_env / "reg", "m1", size=SIZE, urls=[the_hub.url, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        assert (await _pull(c))["verified_by"].startswith("x-linked-etag")
        await c.remove("m1")
        the_hub.faults.linked_sha256 = "c" * 64
        with pytest.raises(DigestConflict) as exc:
            await _pull(c)
        assert SHA in exc.value.message and "c" * 64 in exc.value.message
        assert "(kept)" in exc.value.message
        assert REVISION in exc.value.message


async def test_unverified_refusal_and_verify_say_what_works(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """Installed unverified while the hub was down: the refusal and ``verify`` both say to
    run ``verify`` with the hub reachable or to add the sha256; with the hub back, ``verify``
    makes it verified."""
    the_hub = await _hub(stop_later, status=503)  # down: no redirect, no X-Linked-Etag
    mirror = await _mirror(stop_later)
    write_entry(clean_env / "reg", "m1", size=SIZE, urls=[the_hub.url, mirror.url])
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        done = await _pull(c)
        assert done["verified_by"] is None
        with pytest.raises(Unverified) as refused:
            await c.request("POST", "/api/engines", {"model": "m1"})
        message = refused.value.message
        assert "`modeld verify m1` while localhost is reachable" in message
        assert 'sha256 = "' in message and str(clean_env / "reg" / "m1.toml") in message
        assert "--allow-unverified" in message
        report = await c.verify("m1")
        assert report["ok"] is True and report["verified_by"] is None
        assert "`modeld verify m1` while localhost is reachable" in report["hint"]
        the_hub.faults.status = None  # the hub is back
        report = await c.verify("m1")
        assert report["verified_by"] == f"x-linked-etag (localhost:{the_hub.port})"
        assert report["hint"] is None
        assert (await c.model("m1"))["installed"]["verified"] is True


async def test_verify_hint_to_add_the_sha256_works_and_the_cli_prints_it(
    clean_env: Path, stop_later: list[Mirror]
) -> None:
    """No hub among the URLs: the hint names the entry's file and the sha256 key (no hub to
    ask); after adding it, ``verify`` makes the install verified."""
    mirror = await _mirror(stop_later)
    reg = clean_env / "reg"
    write_entry(reg, "m1", size=SIZE, urls=[mirror.url])
    settings = _settings(clean_env)
    async with running_daemon(settings) as d, d.client() as c:
        assert (await _pull(c))["verified_by"] is None
        report = await c.verify("m1")
        assert report["hint"] == (
            f'add sha256 = "<the file\'s published sha256>" to {reg / "m1.toml"}, '
            "then run `modeld verify m1`"
        )
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "modeld",
            "verify",
            "m1",
            env=daemon_env(settings.home),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(cli.communicate(), 60)
        assert cli.returncode == 0, err
        assert "to make it verified" in out.decode() and "sha256 =" in out.decode()
        write_entry(reg, "m1", size=SIZE, sha256=SHA, urls=[mirror.url])

        async def reloaded() -> bool:
            return bool((await c.model("m1"))["entry"]["sha256"] == SHA)

        await until(reloaded)
        report = await c.verify("m1")
        assert report["verified_by"] == "registry sha256"


async def test_install_other_than_the_kept_answer_is_replaced_by_pull(
    clean_env: Path, stop_later: list[Mirror], tmp_path: Path
) -> None:
    """An unverified install whose bytes are not what the hub vouched for: the hint says
    ``pull`` fetches the vouched file, and it does, from the mirror alone, verified."""
    mirror = await _mirror(stop_later)
    home = clean_env / "home"
    write_entry(clean_env / "reg", "m1", size=SIZE, urls=[DEAD_HUB, mirror.url])
    other = tmp_path / "other.litertlm"
    other.write_bytes(OTHER)
    install_fixture(home, "m1", other, verified_by=None)
    async with open_store(home) as store:
        await store.vouch("m1", REVISION, Vouch(SHA, SIZE, "huggingface.co", 1.7e9))
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        report = await c.verify("m1")
        assert report["verified_by"] is None
        assert report["hint"].startswith("`modeld pull m1` fetches the file huggingface.co")
        with pytest.raises(Unverified, match="`modeld pull m1` fetches"):
            await c.request("POST", "/api/engines", {"model": "m1"})
        done = await _pull(c)
        assert done["installed"]["digest"] == SHA
        assert done["verified_by"] == "x-linked-etag (huggingface.co), kept since 2023-11-14"


def test_pinned_revision_reads_the_resolve_path() -> None:
    """Only a ``resolve/<40-hex commit>/<file>`` URL pins a revision; ``main`` does not."""
    pinned = Hub().pinned
    url = "https://huggingface.co/litert-community/g/resolve/" + "a" * 40 + "/d/g.litertlm"
    assert pinned(url) == f"litert-community/g@{'a' * 40}/d/g.litertlm"
    assert pinned("https://huggingface.co/o/r/resolve/main/g.litertlm") is None
    assert pinned("https://example.com/files/g.litertlm") is None


async def test_import_is_checked_against_the_kept_answer(clean_env: Path, tmp_path: Path) -> None:
    """An entry without sha256 whose hub vouched once: an imported file with those bytes is
    verified by the kept answer; other bytes are refused naming both digests."""
    home = clean_env / "home"
    good = tmp_path / "m1.litertlm"
    good.write_bytes(TINY.read_bytes())
    bad = tmp_path / "bad.litertlm"
    raw = bytearray(good.read_bytes())
    raw[-10] ^= 0xFF  # past the header: still a readable .litertlm, other bytes
    bad.write_bytes(bytes(raw))
    size, truth = len(raw), hashlib.sha256(good.read_bytes()).hexdigest()
    write_entry(clean_env / "reg", "m1", size=size, urls=[DEAD_HUB])
    async with open_store(home) as store:
        await store.vouch("m1", REVISION, Vouch(truth, size, "huggingface.co", 1.7e9))
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        with pytest.raises(DigestConflict) as exc:
            await c.request("POST", "/api/models/import", {"path": str(bad), "id": "m1"})
        assert truth in exc.value.message
        assert hashlib.sha256(bytes(raw)).hexdigest() in exc.value.message
        doc = await c.request("POST", "/api/models/import", {"path": str(good), "id": "m1"})
        assert (
            doc["installed"]["verified_by"]
            == "x-linked-etag (huggingface.co), kept since 2023-11-14"
        )
