"""Pull, downloads and import through the real daemon: in-process API, and the CLI."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.config import load_settings
from modeld.daemon import daemon as daemon_mod
from modeld.errors import (
    CorruptModel,
    DownloadNotFound,
    IntegrityError,
    ModeldError,
    ModelNotFound,
)
from tests.support.daemon import DaemonProcess, daemon_env, running_daemon
from tests.support.faults import journaled_blocks, wait_pull_progress
from tests.support.mirror import Faults, Mirror, ThreadMirror
from tests.support.state import MODELS, model_bytes
from tests.support.unix import unix_request
from tests.support.wait import until, wait_sync

SIZE = 2 * 1024 * 1024 + 999
DATA = model_bytes(SIZE, 11)
SHA = hashlib.sha256(DATA).hexdigest()
TINY = MODELS / "tiny-text.litertlm"


def write_entry(reg: Path, model_id: str, urls: list[str], size: int, sha: str | None) -> None:
    reg.mkdir(parents=True, exist_ok=True)
    lines = [
        f'id = "{model_id}"',
        f'display_name = "{model_id}"',
        f'file_name = "{model_id}.litertlm"',
        f"urls = {json.dumps(urls)}",
        f"size = {size}",
    ]
    if sha:
        lines.append(f'sha256 = "{sha}"')
    (reg / f"{model_id}.toml").write_text("\n".join(lines) + "\n")


class Env:
    def __init__(self, home: Path, reg: Path, mirror: Mirror) -> None:
        self.home, self.reg, self.mirror = home, reg, mirror
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def client(self) -> AsyncClient:
        return AsyncClient(self.home / "modeld.sock")


@pytest.fixture
async def env(clean_env: Path) -> AsyncIterator[Env]:
    """An in-process daemon whose registry points at a throttled loopback mirror."""
    mirror = await Mirror(DATA, Faults(throttle=4_000_000)).start()
    reg, home = clean_env / "reg", clean_env / "home"
    write_entry(reg, "m1", [mirror.url], SIZE, SHA)
    write_entry(
        reg,
        "tiny",
        ["http://127.0.0.1:9/none"],
        TINY.stat().st_size,
        hashlib.sha256(TINY.read_bytes()).hexdigest(),
    )
    settings = load_settings(
        home=home,
        socket=home / "modeld.sock",
        main_backend="cpu",
        registry=[reg],
        piece_size="64KiB",
        download_connections=4,
        stall_timeout="2s",
    )
    e = Env(home, reg, mirror)
    ready = asyncio.Event()
    e.task = asyncio.create_task(daemon_mod.run(settings, ready=ready, stop=e.stop))
    await asyncio.wait_for(ready.wait(), 20)
    yield e
    e.stop.set()
    await asyncio.wait_for(e.task, 30)
    await mirror.stop()


async def pull_all(c: AsyncClient, model_id: str) -> list[dict[str, Any]]:
    return [r async for r in c.stream("POST", f"/api/models/{model_id}/pull", {})]


async def test_pull_streams_progress_until_installed(env: Env) -> None:
    """The pull stream reports growing progress with per-mirror detail and ends installed."""
    async with env.client() as c:
        records = await pull_all(c, "m1")
        assert records[-1]["state"] == "installed"
        assert records[-1]["installed"]["digest"] == SHA
        assert records[-1]["verified_by"] == "registry sha256"
        assert any(r["state"] == "downloading" and r["mirrors"] for r in records)
        done = [r["completed"] for r in records]
        assert done == sorted(done)
        blob = env.home / "blobs" / f"sha256-{SHA}"
        assert blob.read_bytes() == DATA
        again = await pull_all(c, "m1")
        assert again == [
            {"id": "m1", "state": "installed", "already": True, "installed": again[0]["installed"]}
        ]


async def test_concurrent_pulls_share_one_download(env: Env) -> None:
    """Two clients pulling at once join one job: the mirror sends the file about once."""
    async with env.client() as a, env.client() as b:
        ra, rb = await asyncio.gather(pull_all(a, "m1"), pull_all(b, "m1"))
    assert ra[-1]["state"] == rb[-1]["state"] == "installed"
    assert env.mirror.sent < SIZE * 1.2


async def test_client_leaving_does_not_stop_the_download(env: Env) -> None:
    """A client that leaves after the first record: the download still completes and installs."""
    async with env.client() as c:
        async for record in c.stream("POST", "/api/models/m1/pull", {}):
            assert record["state"] in ("starting", "probing", "downloading")
            break
    async with env.client() as c:

        async def finished() -> bool:
            return not (await c.request("GET", "/api/downloads"))["downloads"]

        await until(finished)
        records = await pull_all(c, "m1")
    assert records[-1].get("already") is True


async def test_cancel_keeps_partial_and_pull_resumes(env: Env) -> None:
    """DELETE cancels the job, keeps the partial; the next pull resumes from it."""
    env.mirror.faults.throttle = 200_000
    async with env.client() as c:
        first = await c.request("POST", "/api/models/m1/pull", {"detach": True})
        assert first["id"] == "m1"
        listed = (await c.request("GET", "/api/downloads"))["downloads"]
        assert [d["id"] for d in listed] == ["m1"]

        async def started() -> bool:
            listed = (await c.request("GET", "/api/downloads"))["downloads"]
            return bool(listed) and listed[0]["completed"] > 0

        await until(started)  # some bytes are in the partial, for the resume to keep
        cancelled = await c.request("DELETE", "/api/downloads/m1")
        assert cancelled["state"] == "cancelled"
        assert (env.home / "partial" / "m1.partial").exists()
        with pytest.raises(DownloadNotFound):
            await c.request("DELETE", "/api/downloads/m1")
        env.mirror.faults.throttle = None
        records = await pull_all(c, "m1")
    assert records[-1]["state"] == "installed"
    assert records[-1]["resumed"] > 0


async def test_a_pull_after_the_entry_changed_or_went_does_not_join_the_old_download(
    env: Env,
) -> None:
    """An entry edited during its pull (another file: size, sha256, urls): a pull now stops
    the old download, telling its waiter why, and fetches the file the entry names now. An
    entry removed during its pull: a pull now is refused as not in the catalog, and the old
    download stops too."""
    env.mirror.faults.throttle = 50_000
    other = model_bytes(SIZE // 2, 12)
    other_sha = hashlib.sha256(other).hexdigest()
    mirror2 = await Mirror(other).start()
    try:
        async with env.client() as a, env.client() as b:
            waiter = asyncio.create_task(pull_all(a, "m1"))

            async def started() -> bool:
                listed = (await b.request("GET", "/api/downloads"))["downloads"]
                return bool(listed) and listed[0]["received"] > 0

            await until(started)
            write_entry(env.reg, "m1", [mirror2.url], len(other), other_sha)

            async def reloaded() -> bool:
                shown = await b.request("GET", "/api/models/m1")
                return bool(shown.get("sha256") == other_sha)

            await until(reloaded)
            records = await pull_all(b, "m1")
            assert records[-1]["state"] == "installed", records[-1]
            assert records[-1]["installed"]["digest"] == other_sha
            with pytest.raises(ModeldError) as old:
                await waiter
            assert "catalog entry changed" in old.value.message, old.value.message

            # Removed while pulling.
            write_entry(env.reg, "m2", [env.mirror.url], SIZE, SHA)
            await until(lambda: _shown(b, "m2"))
            waiter = asyncio.create_task(pull_all(a, "m2"))

            async def m2_started() -> bool:
                listed = (await b.request("GET", "/api/downloads"))["downloads"]
                return any(d["id"] == "m2" and d["received"] > 0 for d in listed)

            await until(m2_started)
            (env.reg / "m2.toml").unlink()

            async def gone() -> bool:
                return not await _shown(b, "m2")

            await until(gone)
            with pytest.raises(ModelNotFound):
                await pull_all(b, "m2")
            with pytest.raises(ModeldError) as old:
                await waiter
            assert "was removed from the catalog" in old.value.message, old.value.message

            async def none_left() -> bool:
                return not (await b.request("GET", "/api/downloads"))["downloads"]

            # Its job leaves the list when its task has ended, after its waiters were told.
            await until(none_left)
    finally:
        await mirror2.stop()


async def _shown(c: AsyncClient, model_id: str) -> bool:
    try:
        await c.request("GET", f"/api/models/{model_id}")
    except ModelNotFound:
        return False
    return True


async def test_an_entry_pinning_a_file_that_is_not_a_litertlm_is_not_installed(
    clean_env: Path,
) -> None:
    """A catalog entry whose sha256 pins a file that is not a LiteRT-LM model: the pull
    verifies it, then refuses it as ``import`` would, naming the entry; no blob, partial,
    journal or install is left."""
    junk = random.Random(3).randbytes(300_000)
    mirror = await Mirror(junk, Faults()).start()
    reg, home = clean_env / "reg", clean_env / "home"
    write_entry(reg, "junk", [mirror.url], len(junk), hashlib.sha256(junk).hexdigest())
    settings = load_settings(
        home=home, socket=home / "modeld.sock", main_backend="cpu", registry=[reg]
    )
    try:
        async with running_daemon(settings) as d, d.client() as c:
            with pytest.raises(CorruptModel) as exc:
                await pull_all(c, "junk")
            listed = {m["id"]: m for m in (await c.models())["models"]}
            assert listed["junk"]["state"] == "not_installed"
    finally:
        await mirror.stop()
    assert exc.value.message.startswith("junk: the downloaded file: not a LiteRT-LM file (")
    assert exc.value.message.endswith(
        f"it was not installed and nothing was kept: the entry {reg / 'junk.toml'} points at "
        "a file that is not a .litertlm model; correct its `urls` and `sha256`"
    )
    assert not any((home / "blobs").iterdir())
    assert not (home / "partial" / "junk.partial").exists()
    assert journaled_blocks(home, "junk") == 0


async def test_unknown_model_is_404_before_streaming(env: Env) -> None:
    """Pulling an id with no catalog entry fails as a plain error, not a half stream."""
    async with env.client() as c:
        with pytest.raises(ModelNotFound):
            await pull_all(c, "nope")


async def test_import_copies_and_checks_against_the_entry(env: Env, clean_env: Path) -> None:
    """import adopts a real .litertlm matching its entry (size, sha256); id from the name."""
    src = clean_env / "tiny.litertlm"
    shutil.copyfile(TINY, src)
    async with env.client() as c:
        doc = await c.request("POST", "/api/models/import", {"path": str(src)})
        assert doc["id"] == "tiny"
        assert doc["installed"]["verified_by"] == "registry sha256"
        assert src.exists()
        # Never a hard link: the user's file keeps its mode and inode, and editing it later
        # cannot change the verified blob.
        blob = Path(doc["installed"]["path"])
        assert src.stat().st_ino != blob.stat().st_ino
        assert src.stat().st_mode & 0o200
        src.write_bytes(b"edited")
        assert blob.read_bytes() == TINY.read_bytes()


async def test_import_refuses_wrong_bytes_and_unknown_ids(env: Env, clean_env: Path) -> None:
    """A file of the right size but wrong bytes, and a non-.litertlm, are refused; a
    non-.litertlm that no entry names gets no local entry either."""
    bad = clean_env / "tiny.litertlm"
    raw = bytearray(TINY.read_bytes())
    raw[-1] ^= 0xFF
    bad.write_bytes(bytes(raw))
    junk = clean_env / "junk.bin"
    junk.write_bytes(b"\0" * TINY.stat().st_size)
    async with env.client() as c:
        with pytest.raises(IntegrityError, match="sha256"):
            await c.request("POST", "/api/models/import", {"path": str(bad)})
        with pytest.raises(CorruptModel):
            await c.request("POST", "/api/models/import", {"path": str(junk), "id": "tiny"})
        with pytest.raises(CorruptModel):
            await c.request("POST", "/api/models/import", {"path": str(junk)})
    assert not list((env.home / "partial").glob("*.import-*"))
    assert not (env.home / "registry" / "junk.toml").exists()


# --- the real CLI against a real daemon process --------------------------------------


@pytest.fixture
def proc_env(short_tmp: Path) -> Iterator[tuple[DaemonProcess, ThreadMirror]]:
    tm = ThreadMirror(DATA, Faults(throttle=150_000))
    reg = short_tmp / "reg"
    write_entry(reg, "m1", [tm.mirror.url], SIZE, SHA)
    home = short_tmp / "home"
    d = DaemonProcess(
        home=home,
        env=daemon_env(
            home,
            MODELD_REGISTRY=str(reg),
            MODELD_PIECE_SIZE="64KiB",
            MODELD_DOWNLOAD_CONNECTIONS="4",
            MODELD_LOG_LEVEL="info",
        ),
    )
    d.start()
    yield d, tm
    d.stop()
    tm.close()


def test_cli_pull_survives_kill_9_and_resumes(proc_env: tuple[DaemonProcess, ThreadMirror]) -> None:
    """`modeld serve` killed with -9 at random points of a pull resumes to a correct file."""
    d, tm = proc_env
    rnd = random.Random(5)
    for _ in range(3):
        assert d.cli("pull", "m1", "--detach").returncode == 0
        time.sleep(rnd.uniform(0.2, 0.6))  # the point of the kill is what is tested
        d.stop(signal.SIGKILL)
        d.start()
    tm.mirror.faults.throttle = None
    doc = d.cli_json("pull", "m1")
    assert doc["state"] == "installed"
    assert doc["resumed"] > 0
    assert (d.home / "blobs" / f"sha256-{SHA}").read_bytes() == DATA
    # Lost to the kills: at most a block per connection each time (plus probes).
    assert tm.mirror.sent <= SIZE + 3 * 4 * 64 * 1024 + 1024
    assert not (d.home / "partial" / "m1.partial").exists()


def store_problems(d: DaemonProcess) -> list[str]:
    """The ``store`` problems of ``modeld status --json``."""
    problems: list[str] = d.cli_json("status")["store"]["problems"]
    return problems


def test_status_reports_the_state_dir_as_it_is_after_each_pull(
    proc_env: tuple[DaemonProcess, ThreadMirror],
) -> None:
    """`modeld status` reports the store's leftovers as they are now: a partial goes once its
    pull installs, a running download's partial is none, a cancelled one shows at once, and a
    missing model pulled again is no longer missing."""
    d, tm = proc_env
    assert d.cli("pull", "m1", "--detach").returncode == 0
    assert wait_pull_progress(d.socket, 128 * 1024), "the pull made no progress"
    d.stop(signal.SIGKILL)
    d.start()
    human = d.cli("status").stdout
    assert "store: 1 partial download(s)" in human and "`modeld pull ID` resumes" in human
    tm.mirror.faults.throttle = None
    assert d.cli_json("pull", "m1")["state"] == "installed"
    assert not list((d.home / "partial").iterdir())
    assert store_problems(d) == []
    assert "! store:" not in d.cli("status").stdout

    assert d.cli("rm", "m1").returncode == 0
    tm.mirror.faults.throttle = 20_000
    assert d.cli("pull", "m1", "--detach").returncode == 0
    assert wait_pull_progress(d.socket, 1), "the pull made no progress"
    assert store_problems(d) == []  # its partial is a download in progress, no leftover
    assert d.cli_json("pull", "m1", "--cancel")["state"] == "cancelled"
    (problem,) = store_problems(d)
    assert problem.startswith("1 partial download(s)"), problem

    tm.mirror.faults.throttle = None
    assert d.cli_json("pull", "m1")["state"] == "installed"
    assert store_problems(d) == []
    d.stop()
    blob = d.home / "blobs" / f"sha256-{SHA}"
    away = d.home / "away"
    blob.rename(away)
    d.start()
    (problem,) = store_problems(d)
    assert "m1: the file is missing" in problem, problem
    assert d.cli_json("pull", "m1")["state"] == "installed"
    assert blob.read_bytes() == DATA
    assert store_problems(d) == []


def test_a_failed_pull_is_a_status_problem_until_the_model_is_pulled_again(
    proc_env: tuple[DaemonProcess, ThreadMirror],
) -> None:
    """A failed pull shows under `downloads` in `modeld status`; once a later pull of the
    model installs it, the old failure is no longer shown."""
    d, tm = proc_env
    tm.mirror.faults.throttle = None
    tm.mirror.faults.status = 404
    failed = d.cli("pull", "m1")
    assert failed.returncode == 1, failed.stdout

    def problems() -> list[str]:
        found: list[str] = d.cli_json("status")["downloads"]["problems"]
        return found

    # A pull's outcome is recorded when its job's task has ended, after its last record.
    wait_sync(lambda: bool(problems()), what="the failed pull recorded")
    (problem,) = problems()
    assert problem.startswith("m1: "), problem
    tm.mirror.faults.status = None
    assert d.cli_json("pull", "m1")["state"] == "installed"
    wait_sync(lambda: problems() == [], what="the installing pull recorded")
    assert "! downloads:" not in d.cli("status").stdout


def test_a_model_whose_file_is_gone_is_missing_and_pulled_again(short_tmp: Path) -> None:
    """When an installed model's blob disappears, `run` says so and marks it missing, `list`
    shows it missing, and `pull` (with or without --force) fetches the file again."""
    data = TINY.read_bytes()
    tm = ThreadMirror(data, Faults())
    d = started_daemon(short_tmp, "tiny-text", [tm], len(data), hashlib.sha256(data).hexdigest())
    blob = d.home / "blobs" / f"sha256-{hashlib.sha256(data).hexdigest()}"

    def state() -> str:
        (model,) = [m for m in d.cli_json("list")["models"] if m["id"] == "tiny-text"]
        return str(model["state"])

    try:
        assert d.cli_json("pull", "tiny-text")["state"] == "installed"
        assert d.cli("run", "tiny-text", "hi", "--max-tokens", "2").returncode == 0
        blob.rename(short_tmp / "away")
        ran = d.cli("run", "tiny-text", "hi", "--max-tokens", "2")
        assert ran.returncode == 1 and "is missing" in ran.stderr, ran.stderr
        assert "modeld pull tiny-text" in ran.stderr
        d.wait_log("blob_missing model=tiny-text")
        assert state() == "missing"
        pulled = d.cli_json("pull", "tiny-text")
        assert pulled["state"] == "installed" and not pulled.get("already"), pulled
        assert blob.read_bytes() == data
        assert state() == "installed"
        assert d.cli("run", "tiny-text", "hi", "--max-tokens", "2").returncode == 0

        blob.unlink()
        forced = d.cli_json("pull", "tiny-text", "--force")
        assert forced["state"] == "installed" and not forced.get("already"), forced
        assert blob.read_bytes() == data
        assert tm.mirror.sent >= 3 * len(data)
    finally:
        d.stop()
        tm.close()


BIG = 16 * 1024 * 1024 + 777  # 257 blocks of 64 KiB, the last one short
BIG_DATA = model_bytes(BIG, 13)
BIG_SHA = hashlib.sha256(BIG_DATA).hexdigest()


def started_daemon(
    tmp: Path,
    model_id: str,
    mirrors: list[ThreadMirror],
    size: int,
    sha: str,
    connections: int = 4,
    piece_size: str = "64KiB",
) -> DaemonProcess:
    """A started ``modeld serve`` whose one entry is served by ``mirrors`` (64 KiB pieces
    unless told; the log at info: per-piece debug lines slow the loop down enough that the
    endgame takes pieces over)."""
    reg = tmp / "reg"
    write_entry(reg, model_id, [tm.mirror.url for tm in mirrors], size, sha)
    home = tmp / "home"
    env = daemon_env(
        home,
        MODELD_REGISTRY=str(reg),
        MODELD_PIECE_SIZE=piece_size,
        MODELD_DOWNLOAD_CONNECTIONS=str(connections),
        MODELD_LOG_LEVEL="info",
    )
    d = DaemonProcess(home=home, env=env)
    d.start()
    return d


def kill_9_then_pull(
    d: DaemonProcess,
    model_id: str,
    at_least: int,
    mid_block: tuple[int, int] = (0, 0),
    held: Faults | None = None,
) -> dict[str, Any]:
    """Start a pull, kill the daemon with -9 once ``wait_pull_progress`` says so, start it
    again and pull to the end: the final record. The daemon is stopped on the way out.
    ``held``: a mirror's faults whose ``hold_mid_block`` is cleared once the daemon is dead."""
    try:
        assert d.cli("pull", model_id, "--detach").returncode == 0
        reached = wait_pull_progress(d.socket, at_least, mid_block=mid_block)
        assert reached, f"the pull never reached {at_least} bytes (in flight: {mid_block})"
        d.stop(signal.SIGKILL)
        if held is not None:
            held.hold_mid_block = None
        d.start()
        doc: dict[str, Any] = d.cli_json("pull", model_id)
        return doc
    finally:
        d.stop()


def test_kill_9_at_half_then_resume_fetches_at_most_5_percent_more(short_tmp: Path) -> None:
    """A daemon killed with -9 halfway through a pull: the next daemon's pull resumes from
    the journal, and the mirror serves at most 1.05x the file in all (what the kill loses:
    the blocks in flight, and blocks finished but not yet journaled)."""
    # One connection (about 2 s in all): with several, a loaded machine's endgame took over
    # up to 50 blocks from connections held up, which is the endgame's cost, not the kill's.
    tm = ThreadMirror(BIG_DATA, Faults(throttle=8_000_000))
    try:
        d = started_daemon(short_tmp, "big", [tm], BIG, BIG_SHA, connections=1)
        doc = kill_9_then_pull(d, "big", BIG // 2)
    finally:
        tm.close()
    assert doc["state"] == "installed"
    assert doc["resumed"] >= BIG // 3  # about half: less the blocks not yet journaled
    assert (d.home / "blobs" / f"sha256-{BIG_SHA}").read_bytes() == BIG_DATA
    assert tm.mirror.sent <= 1.05 * BIG, (tm.mirror.sent / BIG, doc["resumed"])


MANY = 48 * 1024 * 1024 + 333  # 49 blocks of 1 MiB, the last one short
MANY_DATA = model_bytes(MANY, 17)
MANY_SHA = hashlib.sha256(MANY_DATA).hexdigest()


def test_kill_9_mid_blocks_on_8_connections_then_resume_fetches_at_most_5_percent_more(
    short_tmp: Path,
) -> None:
    """Eight connections, 1 MiB blocks: a daemon killed with -9 past half the file while its
    connections are halfway through their blocks, then a resumed pull. The mirror serves at
    most 1.05x the file in all: the blocks in flight were journaled in part (their first
    bytes and CRC-32), and the resumed pull's end closes no connection to split its piece.
    Before, each connection lost the part of its block in flight (about 4 MiB here), and the
    resumed pull's endgame split healthy pieces with fresh connections."""
    # 3 MB/s per answer (24 MB/s in all, about 2 s): the mirror's socket buffers stay near
    # empty, so what the mirror counts as sent is what the daemon received.
    mib = 1024 * 1024
    # Past 29 MiB the mirror holds each answer halfway through its block, until the kill:
    # on a loaded machine the pull went by the moment it looks for in jerks.
    faults = Faults(throttle=3_000_000, hold_mid_block=(29 * mib, mib))
    tm = ThreadMirror(MANY_DATA, faults)
    try:
        d = started_daemon(short_tmp, "many", [tm], MANY, MANY_SHA, 8, piece_size="4MiB")
        # Past half the file, with 3-6 MiB received past the finished blocks (the eight
        # connections about halfway through their blocks).
        doc = kill_9_then_pull(
            d, "many", MANY // 2, mid_block=(3 * mib, 6 * mib), held=tm.mirror.faults
        )
    finally:
        tm.close()
    assert doc["state"] == "installed"
    assert (d.home / "blobs" / f"sha256-{MANY_SHA}").read_bytes() == MANY_DATA
    assert tm.mirror.sent <= 1.05 * MANY, (tm.mirror.sent / MANY, doc["resumed"])
    # Kept: the finished blocks and the blocks in flight in part.
    assert doc["resumed"] >= MANY // 2 + 2 * mib, doc["resumed"]


def test_cli_pull_repairs_a_flipped_byte_for_half_the_file_at_most(short_tmp: Path) -> None:
    """`modeld pull` from two mirrors, the primary flipping one byte: the daemon repairs the
    file from the other mirror (checking its few blocks, then the liar's from the start)
    and installs it verified; both mirrors serve at most 1.5x the file in all, and
    ``status`` names the liar."""
    liar = ThreadMirror(DATA, Faults(flip_byte=100))
    other = ThreadMirror(DATA, Faults(throttle=300_000))
    d = started_daemon(short_tmp, "m1", [liar, other], SIZE, SHA)
    try:
        doc = d.cli_json("pull", "m1")
        problems = d.cli_json("status")["downloads"]["problems"]
    finally:
        d.stop()
        liar.close()
        other.close()
    assert doc["state"] == "installed"
    assert doc["verified_by"] == "registry sha256"
    assert doc["repaired"] == 1
    # `status` names the mirror that lied, though the pull was saved.
    (problem,) = problems
    assert problem.startswith(f"m1: the mirror 127.0.0.1:{liar.mirror.port} sent 1 blocks"), problem
    assert (d.home / "blobs" / f"sha256-{SHA}").read_bytes() == DATA
    # Besides the blocks, each mirror's probe answers take a few hundred bytes at most.
    assert liar.mirror.sent + other.mirror.sent <= 1.5 * SIZE + 4096


def test_cli_cancel_detach_and_import(
    proc_env: tuple[DaemonProcess, ThreadMirror], short_tmp: Path
) -> None:
    """--detach returns at once, --cancel stops it with the partial kept; errors exit 1; a
    file without an entry is imported under a local one."""
    d, tm = proc_env
    # Slow enough that the pull is still running when the `--cancel` command has started.
    tm.mirror.faults.throttle = 20_000
    out = d.cli("pull", "m1", "--detach")
    assert out.returncode == 0 and "--cancel" in out.stdout

    def under_way() -> bool:
        listed = unix_request(d.socket, "GET", "/api/downloads")[1]["downloads"]
        return any(x["completed"] > 0 for x in listed)

    wait_sync(under_way, what="the detached pull under way")
    cancelled = d.cli_json("pull", "m1", "--cancel")
    assert cancelled["state"] == "cancelled"
    assert (d.home / "partial" / "m1.partial").exists()
    missing = d.cli("pull", "m1", "--cancel")
    assert missing.returncode == 1 and "no pull of 'm1' is running" in missing.stderr
    # A file no entry names: imported under a local entry (its sha256, no URL).
    local = d.cli("import", str(TINY))
    assert local.returncode == 0, local.stderr
    assert "imported tiny-text" in local.stdout and "local entry" in local.stdout
    assert "local = true" in (d.home / "registry" / "tiny-text.toml").read_text()
    # Again: checked against that local entry, and said so (not "registry sha256").
    again = d.cli_json("import", str(TINY))
    assert again["installed"]["verified_by"].startswith("local entry"), again


def test_cli_names_a_mirror_that_ignores_range(
    proc_env: tuple[DaemonProcess, ThreadMirror],
) -> None:
    """The only mirror answers Range requests with 200: the pull streams the file from byte 0,
    and `modeld pull`, its JSON record and the daemon's log all name the mirror as one that
    ignores Range requests."""
    d, tm = proc_env
    tm.mirror.faults.throttle = None
    tm.mirror.faults.ignore_range = True
    host = f"127.0.0.1:{tm.mirror.port}"
    out = d.cli("pull", "m1")
    assert out.returncode == 0, out.stderr
    assert f"mirror ignores Range requests: {host}" in out.stdout, out.stdout
    assert "from byte 0" not in out.stdout  # nothing was on disk: not a resume
    assert (d.home / "blobs" / f"sha256-{SHA}").read_bytes() == DATA
    d.wait_log(f"mirror_ignores_range model=m1 mirror={host}")
    assert d.cli("rm", "m1").returncode == 0
    doc = d.cli_json("pull", "m1")
    assert doc["state"] == "installed", doc
    (mirror,) = doc["mirrors"]
    assert mirror["state"] == "stream_only"
    assert mirror["reason"].startswith("ignores Range requests"), mirror


def test_cli_says_when_a_resume_must_start_from_byte_0(
    proc_env: tuple[DaemonProcess, ThreadMirror],
) -> None:
    """A pull cancelled with blocks journaled, resumed when its only mirror ignores Range: the
    stream starts at byte 0, and the CLI, the record and the log say so and why."""
    d, tm = proc_env
    assert d.cli("pull", "m1", "--detach").returncode == 0
    wait_sync(lambda: journaled_blocks(d.home, "m1") >= 2, what="two blocks journaled")
    assert d.cli_json("pull", "m1", "--cancel")["state"] == "cancelled"
    tm.mirror.faults.throttle = None
    tm.mirror.faults.ignore_range = True
    out = d.cli("pull", "m1")
    assert out.returncode == 0, out.stderr
    host = f"127.0.0.1:{tm.mirror.port}"
    assert f"fetched from byte 0, not resumed: {host} ignores Range requests" in out.stdout, (
        out.stdout
    )
    assert "resumed from" not in out.stdout
    assert (d.home / "blobs" / f"sha256-{SHA}").read_bytes() == DATA
    log = d.wait_log("download_from_zero model=m1")
    assert f'reason="{host} ignores Range requests' in log


def test_the_advice_of_a_failed_pull_can_be_followed_on_the_running_daemon(
    short_tmp: Path,
) -> None:
    """A pull no mirror can serve says how to change the entry, and that works as written on
    the daemon that said it, without a restart: a copy of a bundled entry's file in the
    state dir's registry/ overrides it (here pointed at a loopback mirror), and an entry in
    a MODELD_REGISTRY dir is edited in place."""
    tm = ThreadMirror(DATA, Faults(status=404))
    good = ThreadMirror(DATA, Faults())
    try:
        d = started_daemon(short_tmp, "m1", [tm], SIZE, SHA)
        try:
            failed = d.cli("pull", "m1")
            assert failed.returncode == 1
            said = failed.stderr.strip()
            assert "registry/ in the daemon's state dir (`modeld status` names that dir)" in said
            assert "without a restart" not in said and "set MODELD_REGISTRY" not in said
            # An entry in a MODELD_REGISTRY dir: edit it there.
            source = Path(d.cli_json("show", "m1")["source"])
            source.write_text(source.read_text().replace(tm.mirror.url, good.mirror.url))
            wait_sync(lambda: good.mirror.url in d.cli_json("show", "m1")["entry"]["urls"][0])
            assert d.cli_json("pull", "m1")["state"] == "installed"
            # A bundled entry: its copy in <state dir>/registry, edited, is the one in effect.
            bundled = Path(d.cli_json("show", "gemma-4-E2B-it")["source"])
            state_dir = Path(d.cli_json("status")["settings"]["home"])
            copy = state_dir / "registry" / bundled.name
            text = re.sub(
                r"(?s)urls = \[.*?\]", f'urls = ["{good.mirror.url}"]', bundled.read_text()
            )
            text = re.sub(r"(?m)^size = .*$", f"size = {SIZE}", text)
            copy.write_text(re.sub(r'(?m)^sha256 = ".*"$', f'sha256 = "{SHA}"', text))
            wait_sync(lambda: d.cli_json("show", "gemma-4-E2B-it")["source"] == str(copy))
            assert d.cli_json("pull", "gemma-4-E2B-it")["state"] == "installed"
        finally:
            d.stop()
    finally:
        tm.close()
        good.close()
