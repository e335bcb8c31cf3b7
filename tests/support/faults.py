"""The fault suite's tools: a daemon killed at random points, and what must hold afterwards.

Shared by ``tests/test_faults.py`` (a few dozen kills) and ``bench/soak_faults.py`` (hundreds).
Everything is real: a ``modeld serve`` subprocess, the loopback test mirror, the tiny
``.litertlm`` models, runner processes found by scanning ``/proc``.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import socket
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.mirror import Faults, ThreadMirror
from tests.support.state import MODELS, install_fixture, model_bytes, write_entry
from tests.support.unix import unix_fire, unix_request

_BLOB_RE = re.compile(r"^sha256-([0-9a-f]{64})$")
PULL_SIZE = 3 * 1024 * 1024 + 4321  # not a multiple of a block: a short last block
PULL_DATA = model_bytes(PULL_SIZE, 23)
PULL_SHA = hashlib.sha256(PULL_DATA).hexdigest()


def wait_pull_progress(
    sock_path: Path, at_least: int, timeout: float = 20.0, mid_block: tuple[int, int] = (0, 0)
) -> bool:
    """Wait until the first active download has ``at_least`` bytes in finished blocks, and
    between ``mid_block[0]`` and ``mid_block[1]`` bytes received past them (the blocks in
    flight, in part; ``(0, 0)``: any); False when it never did."""
    low, high = mid_block
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = unix_request(sock_path, "GET", "/api/downloads")[1]["downloads"]
        if active and active[0]["completed"] >= at_least:
            in_flight = active[0]["received"] - active[0]["completed"]
            if not high or low <= in_flight <= high:
                return True
        time.sleep(0.02)
    return False


def kill9(d: DaemonProcess) -> None:
    """SIGKILL the daemon process only (its runners must notice on their own)."""
    assert d.proc is not None
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)


# --- what must hold after a crash -------------------------------------------------------


def _proc_state(pid: int) -> tuple[str, int] | None:
    """``(state letter, ppid)`` of a process, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def runner_pids(home: Path) -> dict[int, int]:
    """Live ``modeld.engine.runner.child`` processes of the state dir ``home``: pid -> ppid.

    A runner inherits the daemon's environment, so ``MODELD_HOME`` marks whose it is.
    """
    mark = f"MODELD_HOME={home}".encode()
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"modeld.engine.runner.child" not in cmdline:
                continue
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        st = _proc_state(pid)
        if mark in environ and st is not None and st[0] not in ("Z", "X"):
            found[pid] = st[1]
    return found


def wait_no_runners(home: Path, timeout: float = 10.0) -> dict[int, int]:
    """Wait until no runner of ``home`` is alive; return the ones still alive at the end."""
    deadline = time.monotonic() + timeout
    while (left := runner_pids(home)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@dataclass
class StateReport:
    blobs: int = 0
    rows: int = 0
    journals: dict[str, int] = field(default_factory=dict)  # model -> journaled blocks


def check_state(home: Path) -> StateReport:
    """Assert the state dir is sound with no daemon running; report what it holds.

    Every blob's sha256 matches its name; the db passes ``integrity_check`` and
    ``foreign_key_check``; no installed row points at a missing or wrong-sized blob; no
    journaled download is without its partial file.
    """
    report = StateReport()
    blobs = home / "blobs"
    for path in sorted(blobs.iterdir()) if blobs.is_dir() else []:
        m = _BLOB_RE.match(path.name)
        if m is None:
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == m.group(1), f"{path.name} holds bytes with sha256 {digest}"
        report.blobs += 1
    db_path = home / "modeld.db"
    if not db_path.exists():
        return report
    db = sqlite3.connect(db_path)
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if "installed" in tables:
            rows = db.execute(
                "SELECT id, digest, size FROM installed WHERE missing_since IS NULL"
            ).fetchall()
            for model_id, digest, size in rows:
                blob = blobs / f"sha256-{digest}"
                assert blob.is_file(), f"row {model_id} points at missing {blob.name}"
                assert blob.stat().st_size == size, f"row {model_id}: {blob.name} has wrong size"
            report.rows = len(rows)
        if "download_journal" in tables:
            journal = db.execute("SELECT key, expected FROM download_journal").fetchall()
            for key, expected in journal:
                partial = home / "partial" / f"{key}.partial"
                if not partial.is_file():
                    # Only legitimate window: killed after the install, before the clear.
                    row = db.execute(
                        "SELECT digest FROM installed WHERE id = ? AND missing_since IS NULL",
                        (key,),
                    ).fetchone()
                    assert row is not None and row[0] == expected, (
                        f"journal row {key} without its partial file and not installed"
                    )
                n = db.execute(
                    "SELECT count(*) FROM download_blocks WHERE key = ?", (key,)
                ).fetchone()[0]
                report.journals[key] = int(n)
    finally:
        db.close()
    return report


# --- the kill loop -----------------------------------------------------------------------


@dataclass
class Rig:
    """A state dir with two tiny models installed and ``m1`` pullable from a loopback mirror."""

    root: Path
    mirror: ThreadMirror
    daemon: DaemonProcess

    @classmethod
    def create(cls, root: Path, **extra_env: str) -> Rig:
        home, reg = root / "home", root / "reg"
        for name in ("tiny-text", "tiny-text-b"):
            install_fixture(home, name, MODELS / f"{name}.litertlm", registry=reg)
        mirror = ThreadMirror(PULL_DATA, Faults(throttle=1_000_000))
        write_entry(reg, "m1", size=PULL_SIZE, sha256=PULL_SHA, urls=[mirror.mirror.url])
        env = daemon_env(
            home,
            MODELD_REGISTRY=str(reg),
            MODELD_PIECE_SIZE="64KiB",
            MODELD_DOWNLOAD_CONNECTIONS="4",
            MODELD_STALL_TIMEOUT="2s",
            MODELD_LOG_LEVEL="info",
            MODELD_SHUTDOWN_TIMEOUT="5s",
        )
        env.update(extra_env)
        return cls(root, mirror, DaemonProcess(home=home, env=env))

    @property
    def home(self) -> Path:
        return self.daemon.home

    def close(self) -> None:
        d = self.daemon
        if d.proc is not None and d.proc.poll() is None:
            d.stop(signal.SIGKILL)
        self.mirror.close()

    def throttle(self, rate: float | None) -> None:
        self.mirror.mirror.faults.throttle = rate


@dataclass
class CycleStats:
    kills: int = 0
    phases: dict[str, int] = field(default_factory=dict)  # what was running at the kill
    seconds: list[float] = field(default_factory=list)


def _phase(d: DaemonProcess) -> str:
    """A label for what the daemon is doing right now (downloading, loading, …)."""
    try:
        downloads = unix_request(d.socket, "GET", "/api/downloads", timeout=1.0)[1]["downloads"]
        engines = unix_request(d.socket, "GET", "/api/engines", timeout=1.0)[1]["engines"]
    except (OSError, ValueError, KeyError, TypeError):
        return "busy"
    parts = [f"pull:{x['state']}" for x in downloads]
    parts += [f"engine:{e['state']}" for e in engines]
    return "+".join(sorted(parts)) or "idle"


def kill_cycle(rig: Rig, rng: random.Random, stats: CycleStats) -> None:
    """Start the daemon, start a pull and loads, kill -9 at a random instant, check the state."""
    began = time.monotonic()
    d = rig.daemon
    rig.throttle(rng.choice([None, 3_000_000, 1_000_000, 400_000]))
    d.start_quick()
    opened: list[socket.socket] = []
    try:
        if rng.random() < 0.35:
            # Remove the model so the pull has work again (and rm itself can be cut short).
            opened.append(unix_fire(d.socket, "DELETE", "/api/models/m1?force=1"))
            time.sleep(rng.uniform(0.0, 0.05))
        opened.append(unix_fire(d.socket, "POST", "/api/models/m1/pull", {"detach": True}))
        model = rng.choice(["tiny-text", "tiny-text-b"])
        if rng.random() < 0.5:
            opened.append(unix_fire(d.socket, "POST", "/api/engines", {"model": model}))
        else:
            opened.append(
                unix_fire(
                    d.socket, "POST", "/api/modeld/generate", {"model": model, "prompt": "hi"}
                )
            )
        time.sleep(rng.uniform(0.0, 1.0))
        phase = _phase(d) if rng.random() < 0.5 else "unobserved"
        kill9(d)
    finally:
        for s in opened:
            s.close()
    stats.kills += 1
    stats.phases[phase] = stats.phases.get(phase, 0) + 1
    left = wait_no_runners(rig.home)
    assert not left, f"runners of the killed daemon still alive: {left}"
    check_state(rig.home)
    stats.seconds.append(time.monotonic() - began)


def finish_and_check(rig: Rig) -> list[dict[str, Any]]:
    """After the kills: a clean start, the pull completes correctly, a generation works."""
    d = rig.daemon
    rig.throttle(None)
    d.start_quick()
    status, records = unix_request(d.socket, "POST", "/api/models/m1/pull", {}, timeout=60)
    assert status == 200, records
    assert records[-1]["state"] == "installed", records[-1]
    assert (rig.home / "blobs" / f"sha256-{PULL_SHA}").read_bytes() == PULL_DATA
    status, out = unix_request(
        d.socket,
        "POST",
        "/api/modeld/generate",
        {"model": "tiny-text", "prompt": "x", "max_tokens": 4},
    )
    assert status == 200 and out[-1].get("done"), out[-1]
    assert d.stop() == 0
    assert not wait_no_runners(rig.home)
    check_state(rig.home)
    return records  # type: ignore[no-any-return]


def journaled_blocks(home: Path, model_id: str) -> int:
    """Whole blocks of ``model_id``'s download journaled so far (read while the daemon runs)."""
    db_path = home / "modeld.db"
    if not db_path.exists():
        return 0
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
    try:
        row = db.execute(
            "SELECT count(*) FROM download_blocks WHERE key = ? AND length IS NULL", (model_id,)
        ).fetchone()
    except sqlite3.OperationalError:  # the downloader has not created its tables yet
        return 0
    finally:
        db.close()
    return int(row[0])
