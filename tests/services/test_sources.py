"""Models straight from the Hub: the real daemon, a stand-in hub on loopback, the CLI.

``pull hf://ORG/REPO/FILE[@REV]`` resolves the revision to a commit, writes a pinned entry to
``$MODELD_HOME/registry`` and pulls it verified; Hugging Face's conventions (HF_ENDPOINT,
HF_TOKEN, HF_HUB_OFFLINE, the HF cache) hold; ``rm --entry`` and ``import`` of a bare file
manage the entries modeld writes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import threading
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.config import Settings
from modeld.download import downloads as downloads_mod
from modeld.errors import (
    BadRequest,
    DigestConflict,
    EntryExists,
    EntryNotRemovable,
    HubAccessDenied,
    HubFileNotFound,
    LocalEntry,
    Offline,
)
from tests.support.daemon import daemon_env, running_daemon
from tests.support.hub import Hub, start_hub
from tests.support.state import MODELS, model_bytes, registry_settings, write_entry

TINY = (MODELS / "tiny-text.litertlm").read_bytes()
TINY_B = (MODELS / "tiny-text-b.litertlm").read_bytes()  # same size, other bytes
C1 = "1" * 40
C2 = "2" * 40
BIG = model_bytes(2 * 1024 * 1024 + 77, 5)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
async def the_hub() -> AsyncIterator[Hub]:
    """A stand-in hub on 127.0.0.1: ``org/tiny`` with ``m.litertlm`` at two commits (main is
    C2, tag v1 is C1), and ``big.litertlm`` (2 MiB) at C2."""
    h = await start_hub("127.0.0.1")
    h.add("org/tiny", C1, {"m.litertlm": TINY}, "v1")
    h.add("org/tiny", C2, {"m.litertlm": TINY_B, "big.litertlm": BIG}, "main")
    yield h
    await h.stop()


def _settings(root: Path, hub: Hub | None = None, **extra: Any) -> Settings:
    values: dict[str, Any] = {"piece_size": "64KiB", "download_connections": 4}
    if hub is not None:
        values["hf_endpoint"] = hub.endpoint
    (root / "reg").mkdir(exist_ok=True)
    return registry_settings(root / "home", root / "reg", **(values | extra))


async def _pull(c: AsyncClient, source: str, **body: Any) -> dict[str, Any]:
    records = [r async for r in c.stream("POST", "/api/models/pull", {"source": source, **body})]
    return records[-1] | {"first": records[0]}


def _entry(home: Path, model_id: str) -> dict[str, Any]:
    with (home / "registry" / f"{model_id}.toml").open("rb") as f:
        return tomllib.load(f)


def _resolves(hub: Hub) -> list[dict[str, Any]]:
    return [r for r in hub.requests if "/resolve/" in r["path"]]


def _cdn(hub: Hub) -> list[dict[str, Any]]:
    return [r for r in hub.requests if r["path"].startswith("/cdn/")]


async def test_hf_pull_writes_a_pinned_entry_and_installs_verified(
    clean_env: Path, the_hub: Hub
) -> None:
    """``hf://org/tiny/m.litertlm``: main resolves to C2; the entry pins C2 with the hub's
    size and sha256, lives in MODELD_HOME/registry, and list and show treat it as any."""
    home = clean_env / "home"
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/tiny/m.litertlm")
        assert done["state"] == "installed"
        assert done["verified_by"] == "registry sha256"
        assert done["installed"]["digest"] == sha(TINY_B)
        assert done["entry"]["commit"] == C2 and done["first"]["entry"]["commit"] == C2
        entry = _entry(home, "tiny-m")
        assert entry["urls"] == [f"{the_hub.endpoint}/org/tiny/resolve/{C2}/m.litertlm"]
        assert (entry["size"], entry["sha256"]) == (len(TINY_B), sha(TINY_B))
        listed = {m["id"]: m for m in (await c.models())["models"]}
        assert listed["tiny-m"]["state"] == "installed"
        assert listed["tiny-m"]["source"] == str(home / "registry" / "tiny-m.toml")
        shown = await c.model("tiny-m")
        assert shown["installed"]["verified"] is True and shown["header"] is not None
        # Pulled again: the same commit, nothing to do.
        again = await _pull(c, "hf://org/tiny/m.litertlm")
        assert again["already"] is True
        status = await c.status()
        assert str(home / "registry") in status["catalog"]["dirs"]
        assert status["catalog"]["problems"] == []
    assert "Authorization" not in str(the_hub.requests)  # no token was set


async def test_revisions_pin_different_files(clean_env: Path, the_hub: Hub) -> None:
    """``@v1`` pins C1 (the first file); ``@main`` then moves the entry to C2, and the pull
    replaces the install with the second file. A commit named outright is pinned as is."""
    home = clean_env / "home"
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        first = await _pull(c, "hf://org/tiny/m.litertlm@v1")
        assert first["installed"]["digest"] == sha(TINY)
        assert f"/resolve/{C1}/" in _entry(home, "tiny-m")["urls"][0]
        second = await _pull(c, "hf://org/tiny/m.litertlm@main")
        assert second["installed"]["digest"] == sha(TINY_B)
        assert f"/resolve/{C2}/" in _entry(home, "tiny-m")["urls"][0]
        third = await _pull(c, f"{the_hub.endpoint}/org/tiny/resolve/{C1}/m.litertlm", id="t1")
        assert third["installed"]["digest"] == sha(TINY)
        assert _entry(home, "t1")["sha256"] == sha(TINY)
        with pytest.raises(HubFileNotFound, match=r"no m\.litertlm at revision nope"):
            await _pull(c, "hf://org/tiny/m.litertlm@nope")
        with pytest.raises(BadRequest, match=r"not a \.litertlm file"):
            await _pull(c, "hf://org/tiny/README.md")


async def test_revision_from_the_api_when_no_x_repo_commit(clean_env: Path, the_hub: Hub) -> None:
    """A hub whose resolve answer has no X-Repo-Commit: the commit comes from
    ``/api/models/ORG/REPO/revision/REV``, and size and sha256 from that commit's file."""
    the_hub.repo_commit_header = False
    home = clean_env / "home"
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/tiny/m.litertlm@v1")
        assert done["installed"]["digest"] == sha(TINY)
    assert the_hub.api_requests == 1
    assert f"/resolve/{C1}/" in _entry(home, "tiny-m")["urls"][0]


async def test_expired_signed_url_is_resolved_again(clean_env: Path, the_hub: Hub) -> None:
    """The CDN's signatures expire while the file downloads: each 403 sends the downloader
    back to the hub for a fresh redirect, and the pull completes verified."""
    the_hub.faults.sign_ttl = 0.3
    # 4 connections x 0.5 MB/s: the 2 MB take about 1 s, so pieces are still being asked
    # for well after the first signature expired (at 2 MB/s each, a quiet machine could
    # fetch every piece within 0.3 s and see no expiry at all).
    the_hub.faults.throttle = 500_000
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/tiny/big.litertlm")
        assert done["installed"]["digest"] == sha(BIG)
        assert done["verified_by"] == "registry sha256"
    # A HEAD to resolve the revision, the probe's GET, then a GET per expired signature.
    gets = [r for r in _resolves(the_hub) if r["method"] == "GET"]
    assert the_hub.expired >= 1 and len(gets) >= 2
    assert _resolves(the_hub)[0]["method"] == "HEAD"


async def test_gated_repo_needs_a_token(
    clean_env: Path, the_hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gated repo: without a token the pull fails at once saying to set HF_TOKEN, and no
    entry is written; with HF_TOKEN (a fallback for MODELD_HF_TOKEN) it installs, the token
    going to the hub only, never to its CDN."""
    the_hub.add("org/gated", C1, {"g.litertlm": TINY}, "main")
    the_hub.repos["org/gated"].gated = True
    the_hub.token = "hf_open_sesame"
    home = clean_env / "home"
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        with pytest.raises(HubAccessDenied) as refused:
            await _pull(c, "hf://org/gated/g.litertlm")
        assert "HF_TOKEN" in refused.value.message and "gated" in refused.value.message
        assert not (home / "registry" / "gated-g.toml").exists()
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        with pytest.raises(HubAccessDenied, match="refused the token"):
            await _pull(c, "hf://org/gated/g.litertlm")
    monkeypatch.setenv("HF_TOKEN", "hf_open_sesame")
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/gated/g.litertlm")
        assert done["installed"]["digest"] == sha(TINY)
    bearer = "Bearer hf_open_sesame"
    assert any(r.get("Authorization") == bearer for r in _resolves(the_hub))
    assert _cdn(the_hub) and all("Authorization" not in r for r in _cdn(the_hub))


async def test_offline_touches_no_network(clean_env: Path, the_hub: Hub) -> None:
    """HF_HUB_OFFLINE: an hf:// pull and the pull of an entry not installed fail at once,
    saying so; the hub gets no request and nothing is left behind."""
    home = clean_env / "home"
    url = f"{the_hub.endpoint}/org/tiny/resolve/{C1}/m.litertlm"
    write_entry(clean_env / "reg", "m1", size=len(TINY), sha256=sha(TINY), urls=[url])
    settings = _settings(clean_env, the_hub, hf_hub_offline=True)
    async with running_daemon(settings) as d, d.client() as c:
        with pytest.raises(Offline, match="HF_HUB_OFFLINE"):
            await _pull(c, "hf://org/tiny/m.litertlm")
        with pytest.raises(Offline, match="HF_HUB_OFFLINE"):
            await c.request("POST", "/api/models/m1/pull", {})
    assert the_hub.requests == [] and the_hub.api_requests == 0
    assert not (home / "partial" / "m1.partial").exists()


def _hf_cache(cache: Path, repo: str, commit: str, name: str, data: bytes) -> Path:
    """A Hugging Face cache as ``huggingface_hub`` lays it out: the blob under its sha256,
    the snapshot a relative link to it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    blob = folder / "blobs" / sha(data)
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = folder / "snapshots" / commit / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return blob


async def test_file_in_the_hf_cache_is_adopted_verified(clean_env: Path, the_hub: Hub) -> None:
    """The file is already in HF_HOME/hub at the resolved commit: it is copied in, checked
    against the hub's sha256, and the CDN sends no byte. Offline, an entry whose file is in
    the cache is adopted too."""
    cache = clean_env / "hf-home" / "hub"
    _hf_cache(cache, "org/tiny", C2, "m.litertlm", TINY_B)
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/tiny/m.litertlm")
        assert done["adopted"].endswith(sha(TINY_B))
        assert done["installed"]["digest"] == sha(TINY_B)
        assert done["installed"]["verified_by"] == "registry sha256"
    assert _cdn(the_hub) == []
    url = f"{the_hub.endpoint}/org/tiny/resolve/{C2}/m.litertlm"
    write_entry(clean_env / "reg", "m2", size=len(TINY_B), sha256=sha(TINY_B), urls=[url])
    async with running_daemon(_settings(clean_env, hf_hub_offline=True)) as d, d.client() as c:
        done = (await c.request("POST", "/api/models/m2/pull", {"stream": False})) or {}
        assert done["adopted"] and done["installed"]["digest"] == sha(TINY_B)


async def test_cached_file_with_other_bytes_is_not_trusted(clean_env: Path, the_hub: Hub) -> None:
    """A cached file whose bytes are not the hub's sha256 is refused and the file is
    downloaded instead."""
    cache = clean_env / "hf-home" / "hub"
    blob = _hf_cache(cache, "org/tiny", C1, "m.litertlm", TINY)
    blob.write_bytes(TINY_B)  # same size, other bytes, under the right name
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        done = await _pull(c, "hf://org/tiny/m.litertlm@v1")
        assert "adopted" not in done
        assert done["installed"]["digest"] == sha(TINY)
    assert _cdn(the_hub)


async def test_rm_entry_and_id_collisions(clean_env: Path, the_hub: Hub) -> None:
    """``rm --entry`` removes the install and the entry modeld wrote; a bundled entry or
    one of a MODELD_REGISTRY dir is refused; an id that is another entry's is refused."""
    home = clean_env / "home"
    write_entry(clean_env / "reg", "mine", size=len(TINY))
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        await _pull(c, "hf://org/tiny/m.litertlm")
        with pytest.raises(EntryExists, match="--id NEW-ID"):
            await _pull(c, "hf://org/tiny/m.litertlm", id="mine")
        with pytest.raises(EntryExists):
            await _pull(c, "hf://org/tiny/big.litertlm", id="tiny-m")  # another file
        doc = await c.remove("tiny-m", entry=True)
        assert doc["entry_removed"] == str(home / "registry" / "tiny-m.toml")
        assert [i["kind"] for i in doc["removed"]] == ["model"]
        assert not (home / "registry" / "tiny-m.toml").exists()
        assert "tiny-m" not in {m["id"] for m in (await c.models())["models"]}
        assert not any((home / "blobs").iterdir())
        with pytest.raises(EntryNotRemovable, match="bundled"):
            await c.remove("gemma-3n-E2B-it", entry=True)
        with pytest.raises(EntryNotRemovable, match=str(clean_env / "reg" / "mine.toml")):
            await c.remove("mine", entry=True)


async def test_import_without_an_entry_makes_a_local_one(clean_env: Path, tmp_path: Path) -> None:
    """``import PATH`` of a file no entry names: a local entry from its header and sha256,
    without URLs; the install is verified against it; a pull of it says it is local."""
    home = clean_env / "home"
    path = tmp_path / "my-model.litertlm"
    path.write_bytes(TINY)
    async with running_daemon(_settings(clean_env)) as d, d.client() as c:
        doc = await c.request("POST", "/api/models/import", {"path": str(path)})
        assert doc["id"] == "my-model"
        assert doc["installed"]["verified_by"] == "local entry (sha256 taken at import)"
        entry = _entry(home, "my-model")
        assert entry["local"] is True and "urls" not in entry
        assert (entry["sha256"], entry["size"]) == (sha(TINY), len(TINY))
        shown = await c.model("my-model")
        assert shown["state"] == "installed" and shown["entry"]["local"] is True
        assert (await c.request("POST", "/api/models/my-model/pull", {"stream": False}))["already"]
        doc = await c.request("POST", "/api/models/import", {"path": str(path), "id": "other"})
        assert doc["id"] == "other" and _entry(home, "other")["local"] is True
        await c.remove("my-model")
        with pytest.raises(LocalEntry, match="modeld import PATH my-model"):
            await c.request("POST", "/api/models/my-model/pull", {"stream": False})
        await c.remove("my-model", entry=True)
        assert not (home / "registry" / "my-model.toml").exists()


async def _cli(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modeld",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_two_imports_of_different_files_to_one_new_id_end_as_one_after_the_other(
    clean_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``modeld import A race & modeld import B race``: both copies are held until both
    imports have decided and copied, so they truly overlap; still one wins, and the other
    is refused as it would be after it, against the entry the winner wrote."""
    both_copying = threading.Barrier(2)
    copy = downloads_mod._link_or_copy

    def held(*args: Any) -> tuple[str, bool]:
        both_copying.wait(60)
        return copy(*args)

    monkeypatch.setattr(downloads_mod, "_link_or_copy", held)
    home = clean_env / "home"
    settings = _settings(clean_env)
    env = daemon_env(home)
    files = {sha(data): data for data in (TINY, TINY_B)}
    async with running_daemon(settings):
        done = await asyncio.gather(
            _cli(env, "import", str(MODELS / "tiny-text.litertlm"), "race"),
            _cli(env, "import", str(MODELS / "tiny-text-b.litertlm"), "race"),
        )
        rc, out, err = await _cli(env, "list", "--json")
        assert rc == 0, err
        race = next(m for m in json.loads(out)["models"] if m["id"] == "race")
    assert sorted(rc for rc, _, _ in done) == [0, 1], done
    said = next(err for rc, _, err in done if rc == 1)
    entry = _entry(home, "race")
    assert entry["sha256"] in files and race["installed"]["digest"] == entry["sha256"]
    loser = next(d for d in files if d != entry["sha256"])
    assert f"has sha256 {loser}, entry race expects {entry['sha256']}; it was not imported" in (
        " ".join(said.split())
    )


async def test_cli_pulls_from_hf_endpoint(
    clean_env: Path, the_hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI as a subprocess, the daemon's HF_ENDPOINT the stand-in hub on 127.0.0.1:
    ``pull hf://``, ``list``, ``show``, ``rm --entry``, then ``pull --detach`` of a file in
    the HF cache (adopted: the CDN never sends it)."""
    monkeypatch.setenv("HF_ENDPOINT", the_hub.endpoint)
    settings = _settings(clean_env)
    assert settings.hf_endpoint == the_hub.endpoint
    env = daemon_env(settings.home, HF_ENDPOINT=the_hub.endpoint)
    async with running_daemon(settings):
        rc, out, err = await _cli(env, "pull", "hf://org/tiny/m.litertlm@v1", "--id", "tm")
        assert rc == 0, err
        assert f"at commit {C1}" in out and "installed tm" in out and sha(TINY) in out
        rc, out, err = await _cli(env, "list")
        assert rc == 0 and "tm" in out and "installed" in out, err
        rc, out, err = await _cli(env, "show", "tm")
        assert rc == 0 and f"/org/tiny/resolve/{C1}/m.litertlm" in out, err
        assert str(settings.home / "registry" / "tm.toml") in out
        rc, out, err = await _cli(env, "rm", "gemma-3n-E2B-it", "--entry")
        assert rc == 1 and "bundled" in err
        rc, out, err = await _cli(env, "rm", "tm", "--entry")
        assert rc == 0 and "removed its entry" in out, err
        assert not (settings.home / "registry" / "tm.toml").exists()
        _hf_cache(settings.hub_cache, "org/tiny", C2, "m.litertlm", TINY_B)
        rc, out, err = await _cli(env, "pull", "hf://org/tiny/m.litertlm", "--detach")
        assert rc == 0, err
        assert f"at commit {C2}" in out and "from the Hugging Face cache" in out
    assert _cdn(the_hub) == [r for r in _cdn(the_hub) if sha(TINY) in r["path"]]


def _damaged_header(data: bytes) -> bytes:
    """``data`` with its header flatbuffer (after the first 32 bytes) overwritten."""
    end = int.from_bytes(data[24:32], "little")
    return data[:32] + b"\xff" * (end - 32) + data[end:]


BAD = {
    "passwd": Path("/etc/passwd").read_bytes(),
    "trunc": TINY[: len(TINY) // 2],
    "damaged": _damaged_header(TINY),
}


async def test_a_hub_file_that_is_not_a_litertlm_model_is_refused_leaving_nothing(
    clean_env: Path, the_hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``modeld pull hf://org/bad/X.litertlm`` of /etc/passwd, a truncated model and one with
    a damaged header: each verified against the hub's sha256, then refused as ``import``
    refuses it; no blob, partial, entry or install is left. A bad new revision of a file
    pulled before puts the entry of the old one back."""
    monkeypatch.setenv("HF_ENDPOINT", the_hub.endpoint)
    the_hub.add("org/bad", C2, {f"{k}.litertlm": v for k, v in BAD.items()}, "main")
    the_hub.add("org/tiny", C2, {"m.litertlm": BAD["passwd"]}, "bad")
    settings = _settings(clean_env)
    home = settings.home
    env = daemon_env(home, HF_ENDPOINT=the_hub.endpoint)
    async with running_daemon(settings):
        said = {}
        for name in BAD:
            rc, out, err = await _cli(env, "pull", f"hf://org/bad/{name}.litertlm")
            assert rc == 1, out
            said[name] = " ".join(err.split())
            assert f"hf://org/bad/{name}.litertlm@main is not a LiteRT-LM model (" in said[name]
            assert "not installed, nothing was kept and its entry was removed" in said[name]
        assert "not a LiteRT-LM file (starts with b'root:x:0'" in said["passwd"]
        assert "the file is truncated" in said["trunc"]
        assert "header flatbuffer cannot be parsed" in said["damaged"]
        rc, out, err = await _cli(env, "list", "--json")
        assert rc == 0, err
        assert not [m for m in json.loads(out)["models"] if m["id"].startswith("bad-")]
        assert not list((home / "registry").glob("bad-*"))
        assert not any((home / "blobs").iterdir())
        assert not [p for p in (home / "partial").iterdir() if p.name.startswith("bad-")]
        # A new revision of a file pulled before: the entry of the old one comes back.
        rc, out, err = await _cli(env, "pull", "hf://org/tiny/m.litertlm@v1")
        assert rc == 0, err
        before = (home / "registry" / "tiny-m.toml").read_text()
        rc, out, err = await _cli(env, "pull", "hf://org/tiny/m.litertlm@bad")
        assert rc == 1 and "the entry it had before is back" in " ".join(err.split()), out
        assert (home / "registry" / "tiny-m.toml").read_text() == before
        rc, out, err = await _cli(env, "list", "--json")
        tiny = next(m for m in json.loads(out)["models"] if m["id"] == "tiny-m")
        assert tiny["state"] == "installed" and tiny["installed"]["digest"] == sha(TINY)


async def test_hub_vouch_contradicting_the_entry_fails_naming_both(
    clean_env: Path, the_hub: Hub
) -> None:
    """The HF_ENDPOINT host is a hub: its X-Linked-Etag on the download is checked against the
    entry it wrote; a hub that later vouches for other bytes fails the pull naming both."""
    async with running_daemon(_settings(clean_env, the_hub)) as d, d.client() as c:
        await _pull(c, "hf://org/tiny/m.litertlm")
        await c.remove("tiny-m")
        the_hub.faults.linked_sha256 = "e" * 64
        with pytest.raises(DigestConflict) as exc:
            _ = [r async for r in c.stream("POST", "/api/models/tiny-m/pull", {})]
    assert sha(TINY_B) in exc.value.message and "e" * 64 in exc.value.message
    assert f"127.0.0.1:{the_hub.port}" in exc.value.message
