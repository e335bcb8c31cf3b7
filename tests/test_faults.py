"""Faults with real processes: kill -9 of the daemon, a full disk, a runner's SIGSEGV.

Everything is real: ``modeld serve`` subprocesses, the loopback test mirror, the tiny
``.litertlm`` models and their runner processes (found through ``/api/engines`` and
``/proc``), tmpfs mounts for a small disk. The long loop is ``bench/soak_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.errors import DiskFull, EngineCrashed
from tests.support.daemon import DaemonProcess, daemon_env, spawn_daemon
from tests.support.faults import (
    PULL_DATA,
    PULL_SHA,
    PULL_SIZE,
    CycleStats,
    Rig,
    check_state,
    finish_and_check,
    journaled_blocks,
    kill9,
    kill_cycle,
    runner_pids,
    wait_no_runners,
    wait_pull_progress,
)
from tests.support.state import MODELS
from tests.support.unix import unix_http, unix_request
from tests.support.wait import wait_sync


def test_kill9_at_random_points_of_startup_recovers(short_tmp: Path) -> None:
    """After SIGKILL anywhere in start-up, the next start serves with an intact db."""
    home = short_tmp / "home"
    home.mkdir()
    env = daemon_env(home)
    rng = random.Random(7)  # fixed seed: a failure can be replayed
    for _ in range(4):
        proc = spawn_daemon(env, home / "daemon.log")
        time.sleep(rng.uniform(0.0, 1.5))  # the point of the kill is what is tested
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    d = DaemonProcess(home=home, env=env)
    d.start()
    try:
        assert unix_http(d.socket)[0] == 200
        with sqlite3.connect(home / "modeld.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        assert d.stop() == 0
    assert not d.socket.exists()


# --- kill -9 during pulls and loads ---------------------------------------------------------


@pytest.fixture
def rig(short_tmp: Path) -> Iterator[Rig]:
    r = Rig.create(short_tmp)
    yield r
    r.close()


def test_kill9_at_random_points_of_pulls_and_loads(rig: Rig) -> None:
    """20 kills -9 mid-pull/load/rm: blobs, db, rows, runners stay sound; the pull ends right."""
    rng = random.Random(20240)  # fixed seed: a failure can be replayed (bench/soak_faults.py)
    stats = CycleStats()
    for _ in range(20):
        kill_cycle(rig, rng, stats)
    assert stats.kills == 20
    # The random instants did land inside pulls (not only before or after them).
    assert any("pull:downloading" in p for p in stats.phases), stats.phases
    finish_and_check(rig)


def test_startup_after_kill9_recovers_partial_and_leaves_no_runner(rig: Rig) -> None:
    """kill -9 mid-pull with a loaded engine: no runner survives, the next start resumes."""
    d = rig.daemon
    rig.throttle(400_000)
    d.start_quick()
    status, view = unix_request(d.socket, "POST", "/api/engines", {"model": "tiny-text"})
    assert status == 200, view
    engines = unix_request(d.socket, "GET", "/api/engines")[1]
    old = {view["pid"], engines["spare"]["pid"]} - {None}
    assert old <= set(runner_pids(rig.home))
    assert all(ppid == d.proc.pid for ppid in runner_pids(rig.home).values())  # type: ignore[union-attr]
    assert unix_request(d.socket, "POST", "/api/models/m1/pull", {"detach": True})[0] == 200
    assert wait_pull_progress(d.socket, 1024 * 1024), "the pull made no progress"
    wait_sync(lambda: journaled_blocks(rig.home, "m1") >= 8, what="512 KiB journaled")
    kill9(d)
    assert not wait_no_runners(rig.home), "a runner of the killed daemon is still alive"
    state = check_state(rig.home)
    assert state.journals.get("m1", 0) >= 8  # 64 KiB blocks: at least 512 KiB journaled
    assert (rig.home / "partial" / "m1.partial").stat().st_size == PULL_SIZE

    d.start_quick()
    store = unix_request(d.socket, "GET", "/api/status")[1]["store"]
    assert [p for p in store["scan"]["partials"] if "m1" in json.dumps(p)], store["scan"]
    assert not set(runner_pids(rig.home)) & old
    rig.throttle(None)
    records = unix_request(d.socket, "POST", "/api/models/m1/pull", {}, timeout=60)[1]
    assert records[-1]["state"] == "installed", records[-1]
    assert records[-1]["resumed"] >= 512 * 1024
    assert (rig.home / "blobs" / f"sha256-{PULL_SHA}").read_bytes() == PULL_DATA
    out = unix_request(
        d.socket, "POST", "/api/modeld/generate", {"model": "tiny-text", "prompt": "x"}
    )[1]
    assert out[-1].get("done"), out[-1]
    assert d.stop() == 0
    assert check_state(rig.home).journals == {}


# --- ENOSPC during a pull (a real, small tmpfs as the state dir) --------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` on ``path`` (root only); skip the test where mounting is denied."""
    path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.strip()}); needs root/CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def tmpfs_rig(root: Path, size: str) -> Iterator[Rig]:
    """A ``Rig`` whose state dir is a tmpfs of ``size``, closed afterwards."""
    with tmpfs(root / "home", size):
        rig = Rig.create(root)
        rig.daemon.log_path = root / "daemon.log"  # the log must not share the full disk
        try:
            yield rig
        finally:
            rig.close()


def fill_disk(path: Path) -> int:
    """Write ``path`` until the file system is full; return the bytes written."""
    chunk = b"\0" * (256 * 1024)
    n = 0
    with path.open("wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return n


def test_enospc_mid_pull_is_one_disk_full_error_and_daemon_serves_on(short_tmp: Path) -> None:
    """The disk fills mid-pull: one disk_full record, partial kept, daemon serves, pull resumes."""
    with tmpfs_rig(short_tmp, "80m") as rig:
        d = rig.daemon
        rig.throttle(600_000)
        d.start_quick()
        # An engine loaded before the disk fills (its runtime cache is written by then).
        assert unix_request(d.socket, "POST", "/api/engines", {"model": "tiny-text"})[0] == 200
        result: list[Any] = []
        puller = threading.Thread(
            target=lambda: result.append(
                unix_request(d.socket, "POST", "/api/models/m1/pull", {}, timeout=60)
            )
        )
        puller.start()
        wait_pull_progress(d.socket, 512 * 1024)
        wait_sync(lambda: journaled_blocks(d.home, "m1") >= 1, what="a block journaled")
        fill_disk(d.home / "filler")
        puller.join(60)
        status, records = result[0]
        assert status == 200
        errors = [r for r in records if "error" in r]
        assert errors == [records[-1]], records[-3:]
        assert errors[0]["error"]["code"] == "disk_full", errors
        assert "pull again" in errors[0]["error"]["message"]
        # Healthy while the disk is still full: liveness, reads, generation on a warm engine.
        assert unix_request(d.socket, "GET", "/api/health")[0] == 200
        assert unix_request(d.socket, "GET", "/api/models")[0] == 200
        # The job leaves the list when its task has ended, a moment after its last record.
        wait_sync(
            lambda: unix_request(d.socket, "GET", "/api/downloads")[1]["downloads"] == [],
            what="the failed pull gone from the list",
        )
        status_doc = unix_request(d.socket, "GET", "/api/status")[1]
        assert any("disk full" in p for p in status_doc["downloads"]["problems"]), status_doc
        out = unix_request(
            d.socket, "POST", "/api/modeld/generate", {"model": "tiny-text", "prompt": "x"}
        )
        assert out[0] == 200 and out[1][-1].get("done"), out
        assert (d.home / "partial" / "m1.partial").is_file()
        # Space again: the pull resumes from the kept partial and installs the right bytes.
        (d.home / "filler").unlink()
        rig.throttle(None)
        records = unix_request(d.socket, "POST", "/api/models/m1/pull", {}, timeout=60)[1]
        assert records[-1]["state"] == "installed", records[-1]
        assert records[-1]["resumed"] > 0
        assert (d.home / "blobs" / f"sha256-{PULL_SHA}").read_bytes() == PULL_DATA
        assert d.stop() == 0
        check_state(d.home)


def test_pull_larger_than_free_space_is_refused_before_writing(short_tmp: Path) -> None:
    """On an 8 MiB disk a pull is refused at once with disk_full saying what to do; no write."""
    with tmpfs_rig(short_tmp, "8m") as rig:
        d = rig.daemon
        d.start_quick()
        status, body = unix_request(d.socket, "POST", "/api/models/m1/pull", {})
        # The check runs in the job: a plain 507, or a stream that ends with one error.
        if status == 200:
            assert [r for r in body if "error" in r] == [body[-1]], body
            body = body[-1]
        else:
            assert status == 507, body
        assert body["error"]["code"] == "disk_full"
        assert "free space" in body["error"]["message"], body
        assert not (d.home / "partial" / "m1.partial").exists()
        assert unix_request(d.socket, "GET", "/api/health")[0] == 200
        assert d.stop() == 0


def test_engine_load_on_full_disk_names_the_full_disk(short_tmp: Path) -> None:
    """A cold load on a full disk fails with a message that says the disk is full, not "verify".

    The runtime writes its XNNPack weight cache into ``cache/<digest>/`` while creating the
    engine; on ENOSPC it aborts (SIGABRT) after printing ``ERROR: ...: No space left on
    device``. The daemon must survive (it does) and say what to do: free space.
    """
    with tmpfs_rig(short_tmp, "8m") as rig:
        d = rig.daemon
        d.start_quick()
        fill_disk(d.home / "filler")
        status, body = unix_request(d.socket, "POST", "/api/engines", {"model": "tiny-text"})
        assert unix_request(d.socket, "GET", "/api/health")[0] == 200
        assert status >= 400, body
        message = body["error"]["message"]
        assert body["error"]["code"] == "disk_full", body
        assert "verify" not in message, message
        assert "No space left on device" in message or "disk full" in message, message


def test_a_runner_dead_at_create_with_no_room_for_its_cache_is_disk_full(short_tmp: Path) -> None:
    """A runner that dies creating its engine without saying ENOSPC (an abort whose last
    words are not the write's) is still reported as a full disk when the disk of its engine
    cache has less room than the model file (the runtime's weight cache takes about that);
    with room, it is a crash, and `modeld verify` is the advice."""
    from modeld.engine.runner.client import RunnerDied
    from modeld.engine.types import Target, load_error
    from modeld.modelfile.plan import Plan
    from modeld.modelfile.runtime import CreateSpec

    died = RunnerDied("SIGABRT", -6, "terminate called without an active exception")

    def target(cache: Path) -> Target:
        spec = CreateSpec(path=str(MODELS / "tiny-text.litertlm"), cache_dir=str(cache))
        return Target("tiny-text", "ab" * 32, Plan(main="cpu"), spec, 100, 256)

    with tmpfs(short_tmp / "small", "256k") as small:
        fill_disk(small / "filler")
        err = load_error(target(small), died)
        assert isinstance(err, DiskFull), err
        assert "modeld prune" in err.message and str(small) in err.message
    roomy = load_error(target(short_tmp), died)
    assert isinstance(roomy, EngineCrashed) and "modeld verify" in roomy.message


# --- a runner's SIGSEGV mid-generation ------------------------------------------------------


async def _segv_mid_stream(c: AsyncClient, pid: int) -> tuple[int, EngineCrashed | None]:
    """Stream a long generation; freeze the runner after the first token, then SIGSEGV it.

    Returns (tokens received, the error) — error None when the whole answer had already
    been sent before the freeze (then the caller tries again).
    """
    body = {"model": "tiny-text", "prompt": "tell a long story", "max_tokens": 4000}
    records: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

    async def read() -> None:
        # A reader task, so waiting with a timeout never cancels the stream itself.
        try:
            async for rec in c.stream("POST", "/api/modeld/generate", body):
                records.put_nowait(rec)
            records.put_nowait(None)
        except Exception as e:
            records.put_nowait(e)

    reader = asyncio.create_task(read())
    tokens = 0
    try:
        first = await asyncio.wait_for(records.get(), 30)
        assert isinstance(first, dict) and "token" in first, first
        tokens = 1
        os.kill(pid, signal.SIGSTOP)  # frozen mid-generation: no more tokens come
        while True:
            try:
                rec = await asyncio.wait_for(records.get(), 0.5)
            except TimeoutError:
                break  # nothing more in flight: the runner is stopped inside the request
            if rec is None or isinstance(rec, BaseException) or rec.get("done"):
                os.kill(pid, signal.SIGCONT)
                return tokens, None  # the answer was complete before the freeze
            tokens += 1
        os.kill(pid, signal.SIGSEGV)
        os.kill(pid, signal.SIGCONT)
        while (rec := await asyncio.wait_for(records.get(), 30)) is not None:
            if isinstance(rec, EngineCrashed):
                return tokens, rec
            assert isinstance(rec, dict) and "token" in rec, rec
            tokens += 1
        raise AssertionError("the stream ended without an error after the runner's SIGSEGV")
    finally:
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader


async def test_runner_sigsegv_mid_generation(short_tmp: Path) -> None:
    """SIGSEGV of the runner mid-stream: engine_crashed naming the signal; the daemon serves on."""
    rig = Rig.create(short_tmp)
    d = rig.daemon
    try:
        d.start_quick()
        async with AsyncClient(d.socket) as c:
            view = await c.request("POST", "/api/engines", {"model": "tiny-text"})
            pid = view["pid"]
            assert pid in runner_pids(rig.home)  # the pid the API names is a runner of ours
            assert runner_pids(rig.home)[pid] == d.proc.pid  # type: ignore[union-attr]
            for _ in range(5):
                tokens, err = await _segv_mid_stream(c, pid)
                if err is not None:
                    break
                pid = (await c.request("GET", "/api/engines"))["engines"][0]["pid"]
            else:
                raise AssertionError("every answer was complete before the runner froze")
            assert tokens >= 1  # the crash came mid-stream, after tokens were sent
            assert err.code == "engine_crashed"
            assert "SIGSEGV" in err.message and "tiny-text" in err.message, err.message
            assert pid not in runner_pids(rig.home)
            assert (await c.health())["status"] == "ok"
            # The next request loads a new engine and completes.
            final = [
                r
                async for r in c.stream(
                    "POST",
                    "/api/modeld/generate",
                    {"model": "tiny-text", "prompt": "again", "max_tokens": 5},
                )
            ][-1]
            assert final["done"] and final["tokens"] == 5
            engines = (await c.request("GET", "/api/engines"))["engines"]
            assert engines[0]["pid"] != pid and "crashed" in (engines[0]["last_eviction"] or "")
        assert d.stop() == 0
        assert not wait_no_runners(rig.home)
        assert "engine_crashed" in d.log() and "SIGSEGV" in d.log()
    finally:
        rig.close()


def test_pull_installs_when_partial_dir_is_another_file_system(short_tmp: Path) -> None:
    """partial/ on its own disk (a tmpfs): the install copies across and the blob is right."""
    rig = Rig.create(short_tmp)
    d = rig.daemon
    try:
        with tmpfs(d.home / "partial", "80m"):
            rig.throttle(None)
            d.start_quick()
            status, records = unix_request(d.socket, "POST", "/api/models/m1/pull", {}, timeout=60)
            assert status == 200 and records[-1].get("state") == "installed", records[-1]
            assert (d.home / "blobs" / f"sha256-{PULL_SHA}").read_bytes() == PULL_DATA
            assert not list((d.home / "partial").iterdir())
            assert not [p for p in (d.home / "blobs").iterdir() if ".install" in p.name]
            assert d.stop() == 0
            check_state(d.home)
    finally:
        rig.close()
