"""``rm`` and ``prune`` end to end: a real daemon on a temp socket, a real store, the CLI as a
subprocess, a real (throttled) download from a loopback mirror and a real engine."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from modeld.config import load_settings
from modeld.errors import BadRequest, ModelInUse, ModelNotInstalled
from modeld.services import prune
from tests.support.daemon import (
    LONG_PROMPT,
    daemon_env,
    queue_chats,
    running_daemon,
    socket_http,
    streamed_chat,
)
from tests.support.mirror import Faults, Mirror
from tests.support.state import MODELS, install_fixture, open_store, registry_settings, write_entry
from tests.support.wait import until, wait_until

TINY = MODELS / "tiny-text.litertlm"


async def _cli(home: Path, *args: str, **env: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "modeld", *args,
        env=daemon_env(home, **env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _cli_json(home: Path, *args: str) -> Any:
    rc, out, err = await _cli(home, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


def _leftovers(home: Path) -> tuple[Path, Path, Path]:
    """A partial without a download, a quarantined file, a cache dir of no blob."""
    partial = home / "partial" / "gone.partial"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"p" * 1234)
    failed = home / "blobs" / f"sha256-{'a' * 64}.FAILED"
    failed.parent.mkdir(parents=True, exist_ok=True)
    failed.write_bytes(b"f" * 100)
    cache = home / "cache" / ("b" * 64)
    cache.mkdir(parents=True)
    (cache / "x.bin").write_bytes(b"c" * 10)
    return partial, failed, cache


async def test_rm_removes_row_blob_and_cache(clean_env: Path) -> None:
    """``modeld rm ID`` deletes the row, the blob and its cache; the model reads not installed."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    (home / "cache" / inst.digest).mkdir(parents=True)
    (home / "cache" / inst.digest / "k").write_bytes(b"k" * 7)
    async with running_daemon(registry_settings(home, reg)) as d:
        doc = await _cli_json(home, "rm", "tiny")
        assert doc["id"] == "tiny"
        assert doc["freed"] == inst.size + 7
        assert [(i["kind"], i["id"], i["digest"]) for i in doc["removed"]] == [
            ("model", "tiny", inst.digest)
        ]
        assert doc["unloaded"] == [] and doc["cancelled_download"] is False
        assert not inst.path.exists()
        assert not (home / "cache" / inst.digest).exists()
        async with d.client() as c:
            assert (await c.model("tiny"))["state"] == "not_installed"
            metrics = await c.request("GET", "/metrics")
            assert f'modeld_removed_bytes_total{{kind="model"}} {float(inst.size + 7)}' in metrics
            with pytest.raises(ModelNotInstalled, match="nothing to remove"):
                await c.remove("tiny")
        rc, out, err = await _cli(home, "rm", "tiny")
        assert rc == 1 and out == ""
        assert len(err.strip().splitlines()) == 1 and "not installed" in err


async def test_rm_bad_ids_and_bodies_are_400(clean_env: Path) -> None:
    """Bad ids, bad ``force`` values and unknown fields are 400s that say what to send."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        for bad in ("..x", "-rf", "a" * 200, ".hidden", "a b"):
            with pytest.raises(BadRequest, match="not a valid model id"):
                await c.remove(bad)
        with pytest.raises(BadRequest, match="force=1 or force=0"):
            await c.request("DELETE", "/api/models/tiny?force=maybe")
        with pytest.raises(BadRequest, match='"force": must be true or false'):
            await c.request("DELETE", "/api/models/tiny", {"force": "yes"})
        with pytest.raises(BadRequest, match="unknown field"):
            await c.request("DELETE", "/api/models/tiny", {"forc": True})
        assert (await c.model("tiny"))["state"] == "installed"


async def test_prune_body_validation(clean_env: Path) -> None:
    """The prune body is validated field by field; nothing is removed by a bad request."""
    home = clean_env / "home"
    partial, _, _ = _leftovers(home)
    settings = load_settings(home=home, socket=home / "modeld.sock", main_backend="cpu")
    async with running_daemon(settings) as d, d.client() as c:
        cases: list[tuple[dict[str, Any], str]] = [
            ({"dry_run": "yes"}, '"dry_run": must be true or false'),
            ({"partials": [1]}, '"partials": must be true'),
            ({"partials": "soon"}, "partials: 'soon' is not a duration"),
            ({"unused_for": "-5d"}, "unused_for: '-5d' is not a duration"),
            ({"orphans": 1}, '"orphans": must be true or false'),
            ({"bogus": 1}, '"bogus": unknown field'),
            ({"partials": False, "orphans": False}, "nothing selected"),
        ]
        for body, message in cases:
            with pytest.raises(BadRequest) as info:
                await c.prune(body)
            assert message in info.value.message, (body, info.value.message)
        for raw in (b"{", b"[]", b"\xff"):
            async with c.session.post("http://modeld/api/prune", data=raw) as resp:
                assert resp.status == 400
        assert partial.exists()


async def test_prune_dry_run_then_prune(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--dry-run`` lists each leftover with its size and the total and keeps them; prune frees."""
    monkeypatch.setattr(prune, "ORPHAN_GRACE", 0.0)
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    partial, failed, cache = _leftovers(home)
    orphan = home / "blobs" / f"sha256-{'c' * 64}"
    orphan.write_bytes(b"o" * 50)
    async with running_daemon(registry_settings(home, reg)):
        dry = await _cli_json(home, "prune", "--dry-run")
        assert dry["dry_run"] is True and dry["freed"] == 0
        assert dry["selection"]["partials"] and dry["selection"]["orphans"]
        got = {(i["kind"], i["path"], i["size"]) for i in dry["items"]}
        assert got == {
            ("partial", str(partial), 1234),
            ("quarantined", str(failed), 100),
            ("orphan_blob", str(orphan), 50),
            ("orphan_cache", str(cache), 10),
        }
        assert dry["total"] == 1234 + 100 + 50 + 10
        for item in dry["items"]:
            assert set(item) == {"kind", "id", "digest", "path", "size", "reason"}
        assert all(p.exists() for p in (partial, failed, orphan, cache))
        rc, out, _ = await _cli(home, "prune", "--dry-run")
        assert rc == 0 and "would free 1.4 KiB" in out and "quarantined" in out

        done = await _cli_json(home, "prune")
        assert done["freed"] == dry["total"] and done["errors"] == []
        assert not any(p.exists() for p in (partial, failed, orphan, cache))
        assert inst.path.exists()
        again = await _cli_json(home, "prune")
        assert again["items"] == [] and again["freed"] == 0
        status = await _cli_json(home, "status")
        assert status["store"]["problems"] == []


async def test_prune_partials_age_and_unused_for(clean_env: Path) -> None:
    """``--partials 7d`` keeps newer partials; ``--unused-for`` removes only models idle so long."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    install_fixture(home, "tiny-b", MODELS / "tiny-text-b.litertlm", registry=reg)
    old = time.time() - 40 * 86400
    async with open_store(home) as store:
        await store.write(lambda c: c.execute("UPDATE installed SET installed_at = ?", (old,)))
        await store.touch("tiny-b")
    new_partial = home / "partial" / "fresh.partial"
    new_partial.write_bytes(b"n")
    old_partial = home / "partial" / "stale.partial"
    old_partial.write_bytes(b"s" * 3)
    import os

    os.utime(old_partial, (old, old))
    async with running_daemon(registry_settings(home, reg)):
        doc = await _cli_json(home, "prune", "--partials", "7d")
        assert [i["id"] for i in doc["items"]] == ["stale"]
        assert new_partial.exists() and not old_partial.exists()
        rc, _, err = await _cli(home, "prune", "--unused-for", "soon")
        assert rc == 2 and "not a duration" in err
        doc = await _cli_json(home, "prune", "--unused-for", "30d", "--dry-run")
        assert [(i["kind"], i["id"]) for i in doc["items"]] == [("model", "tiny")]
        assert "never used" in doc["items"][0]["reason"]
        doc = await _cli_json(home, "prune", "--unused-for", "30d")
        assert [i["id"] for i in doc["items"]] == ["tiny"]
        listed = await _cli_json(home, "list", "--installed")
        assert [m["id"] for m in listed["models"]] == ["tiny-b"]


async def test_prune_to_budget(clean_env: Path) -> None:
    """``--to-budget`` drops least recently used models until under MODELD_DISK_BUDGET."""
    home, reg = clean_env / "home", clean_env / "reg"
    a = install_fixture(home, "tiny", TINY, registry=reg)
    b = install_fixture(home, "tiny-b", MODELS / "tiny-text-b.litertlm", registry=reg)
    async with running_daemon(registry_settings(home, reg)):
        rc, _, err = await _cli(home, "prune", "--to-budget")
        assert rc == 1 and "MODELD_DISK_BUDGET" in err
    async with open_store(home) as store:
        await store.touch("tiny")  # tiny-b is now the least recently used
    budget = str(max(a.size, b.size) + 1)
    async with running_daemon(registry_settings(home, reg, disk_budget=budget)):
        doc = await _cli_json(home, "prune", "--to-budget")
        assert [i["id"] for i in doc["items"]] == ["tiny-b"]
        assert doc["installed_bytes"] == a.size + b.size
        assert doc["installed_after"] == a.size <= int(budget)
        assert not b.path.exists() and a.path.exists()
        rc, out, _ = await _cli(home, "prune", "--to-budget")
        assert rc == 0 and "nothing to remove" in out and "disk budget" in out


async def test_downloading_model_is_kept_and_rm_force_cancels(clean_env: Path) -> None:
    """A running download's partial survives prune; ``rm`` is 409; ``rm --force`` cancels it."""
    home, reg = clean_env / "home", clean_env / "reg"
    data = TINY.read_bytes()
    mirror = await Mirror(data, Faults(throttle=20_000)).start()
    try:
        write_entry(reg, "slow", size=len(data), sha256=mirror.sha256, urls=[mirror.url])
        async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
            await c.request("POST", "/api/models/slow/pull", {"detach": True})
            partial = home / "partial" / "slow.partial"

            async def started() -> bool:
                return partial.exists() and mirror.sent > 0

            await until(started, 20.0)
            doc = await _cli_json(home, "prune", "--partials")
            assert doc["items"] == []
            assert [(k["id"], k["reason"]) for k in doc["kept"]] == [("slow", "downloading")]
            assert partial.exists()

            with pytest.raises(ModelInUse, match="being downloaded") as info:
                await c.remove("slow")
            assert info.value.code == "model_in_use"
            rc, _, err = await _cli(home, "rm", "slow")
            assert rc == 1 and "--force" in err and len(err.strip().splitlines()) == 1

            doc = await _cli_json(home, "rm", "slow", "--force")
            assert doc["cancelled_download"] is True
            assert [i["kind"] for i in doc["removed"]] == ["partial"]
            assert not partial.exists()
            assert (await c.request("GET", "/api/downloads"))["downloads"] == []
            keys = await _journal_keys(home)
            assert "slow" not in keys
    finally:
        await mirror.stop()


async def test_rm_force_tells_a_waiting_pull_that_nothing_was_kept(clean_env: Path) -> None:
    """``modeld pull slow --json`` follows a slow download; ``modeld rm slow --force`` removes
    it: the puller is told the model was removed and nothing kept, not that the partial is
    kept for a resume."""
    home, reg = clean_env / "home", clean_env / "reg"
    data = TINY.read_bytes()
    mirror = await Mirror(data, Faults(throttle=20_000)).start()
    try:
        write_entry(reg, "slow", size=len(data), sha256=mirror.sha256, urls=[mirror.url])
        async with running_daemon(registry_settings(home, reg)):
            puller = asyncio.create_task(_cli(home, "pull", "slow", "--json"))
            partial = home / "partial" / "slow.partial"

            async def started() -> bool:
                return partial.exists() and mirror.sent > 0

            await until(started, 20.0)
            doc = await _cli_json(home, "rm", "slow", "--force")
            assert doc["cancelled_download"] is True and not partial.exists()
            rc, out, err = await puller
    finally:
        await mirror.stop()
    said = " ".join((out + err).split())
    assert rc == 1, said
    assert "`modeld rm --force` removed the model and its partial; nothing was kept" in said
    assert "partial is kept" not in said


async def _journal_keys(home: Path) -> set[str]:
    from modeld.download.journal import journal_keys

    async with open_store(home) as store:
        return await store.read(journal_keys)


async def test_loaded_model_is_kept_and_rm_force_unloads(clean_env: Path) -> None:
    """A loaded, pinned model: prune keeps it, ``rm`` is 409, ``rm --force`` unloads, removes."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        await c.request("POST", "/api/engines", {"model": "tiny", "pin": True})
        doc = await _cli_json(home, "prune", "--unused-for", "0")
        assert doc["items"] == []
        assert [(k["id"], k["reason"]) for k in doc["kept"]] == [("tiny", "pinned")]
        rc, _, err = await _cli(home, "rm", "tiny")
        assert rc == 1 and "loaded" in err and "--force" in err
        assert inst.path.exists()
        doc = await _cli_json(home, "rm", "tiny", "--force")
        assert doc["unloaded"] and doc["removed"][0]["kind"] == "model"
        assert (await c.request("GET", "/api/engines"))["engines"] == []
        assert not inst.path.exists()


async def test_rm_force_serves_what_the_engine_admitted_and_refuses_the_rest(
    clean_env: Path,
) -> None:
    """``rm --force`` while clients stream from the model: each request the engine had
    admitted is served in full, or (past the unload's grace) refused with 404
    ``model_not_installed``; one sent while the engine drains is refused at once, not given a
    fresh engine of a model being removed. Never a 500; the removal completes."""
    home, reg = clean_env / "home", clean_env / "reg"
    model = "tiny-text-long"
    inst = install_fixture(home, model, MODELS / f"{model}.litertlm", registry=reg)
    async with (
        running_daemon(registry_settings(home, reg)) as d,
        d.client() as c,
        socket_http(d) as http,
    ):
        await c.request("POST", "/api/engines", {"model": model})
        tasks = await queue_chats(c, http, model, [1200] * 8)
        rm = asyncio.create_task(c.request("DELETE", f"/api/models/{model}?force=true"))

        async def draining() -> bool:
            engines = (await c.request("GET", "/api/engines"))["engines"]
            assert engines, "the engine stopped before a request could reach it draining"
            return bool(engines[0]["state"] == "unloading")

        await until(draining, 30.0)
        late = await streamed_chat(http, model, LONG_PROMPT, 8)
        assert (late["status"], late["code"]) == (404, "model_not_installed"), late
        doc = await rm
        assert doc["unloaded"] == [f"{model}:cpu"] and not inst.path.exists()
        seen = await asyncio.gather(*tasks)
        for s in seen:
            assert s["tokens"] == 1200 or s["code"] == "model_not_installed", s
            if s["code"] is not None:
                assert f"was removed (`modeld rm {model} --force`)" in s["message"], s
        assert (await c.request("GET", "/api/engines"))["engines"] == []


async def test_ctrl_c_exits_130_and_the_daemon_finishes(clean_env: Path) -> None:
    """SIGINT while the CLI waits exits 130; the removal it asked for still completes whole."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d:
        import sqlite3

        # A second connection holds the database's write lock (the daemon waits up to 10 s).
        hold = sqlite3.connect(home / "modeld.db", isolation_level=None, check_same_thread=False)
        hold.execute("BEGIN IMMEDIATE")  # the daemon's row delete now waits on this lock
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "modeld", "rm", "tiny",
                env=daemon_env(home),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            # The daemon runs in this process: its removal task is there, blocked on the lock.
            await wait_until(
                lambda: any(
                    getattr(t.get_coro(), "__name__", "") == "_remove_model"
                    for t in asyncio.all_tasks()
                ),
                30.0,
            )
            assert proc.returncode is None
            proc.send_signal(signal.SIGINT)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 130, err
            assert inst.path.exists()  # nothing happened yet: the row delete is still waiting
        finally:
            hold.execute("ROLLBACK")
            hold.close()
        async with d.client() as c:

            async def gone() -> bool:
                state: str = (await c.model("tiny"))["state"]
                return state == "not_installed"

            await until(gone, 20.0)

            async def file_gone() -> bool:
                return not inst.path.exists()

            await until(file_gone, 20.0)


async def test_rm_of_an_id_sharing_a_loaded_blob(clean_env: Path) -> None:
    """Two ids on one file, one loaded: ``rm`` of the other removes its row and keeps the blob."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    twin = install_fixture(home, "twin", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        await c.request("POST", "/api/engines", {"model": "tiny"})
        doc = await c.request("DELETE", "/api/models/twin")
        assert [i["kind"] for i in doc["removed"]] == ["model"]
        assert twin.path.exists()  # still tiny's blob
        engines = (await c.request("GET", "/api/engines"))["engines"]
        assert [e["model"] for e in engines] == ["tiny"]
        ids = {m["id"] for m in (await c.request("GET", "/api/models?installed=1"))["models"]}
        assert "twin" not in ids and "tiny" in ids
