"""Benchmark: ``modeld verify``'s re-hash, the single SQLite writer, and catalog live reload.

- hash: ``modeld.store.scan.sha256_file`` (1 MiB reads) against ``sha256sum`` on the same file
  (page cache warm), medians of ``-r`` runs; ratio > 1 means modeld is slower.
- writes: small transactions per second through ``Store.write`` (one writer thread,
  ``BEGIN IMMEDIATE``, ``synchronous=FULL``) against plain sqlite3 autocommit inserts on
  the same settings.
- reload: seconds from a registry file's rename into place to the entry being visible
  through the watcher (the promise is "within a second").

    python bench/bench_store.py [--size-mib 512] [-r 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.catalog.catalog import Catalog  # noqa: E402 - after the repo is on sys.path
from modeld.store.scan import sha256_file  # noqa: E402
from modeld.store.store import Store  # noqa: E402


def bench_hash(tmp: Path, size_mib: int, runs: int) -> None:
    path = tmp / "blob"
    with path.open("wb") as f:
        chunk = bytes(range(256)) * 4096  # 1 MiB, not all zeros
        for _ in range(size_mib):
            f.write(chunk)
    sha256_file(path)  # warm the page cache
    ours, peer = [], []
    for _ in range(runs):
        t = time.perf_counter()
        digest, _ = sha256_file(path)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = subprocess.run(["sha256sum", str(path)], capture_output=True, text=True, check=True)
        peer.append(time.perf_counter() - t)
        assert out.stdout.split()[0] == digest
    a, b = statistics.median(ours), statistics.median(peer)
    print(
        f"hash {size_mib} MiB: modeld {a:.3f} s ({size_mib / a:.0f} MiB/s), "
        f"sha256sum {b:.3f} s ({size_mib / b:.0f} MiB/s), ratio {a / b:.2f}"
    )


def insert_event(i: int) -> Callable[[sqlite3.Connection], sqlite3.Cursor]:
    """One write: an ``events`` row at time ``i``."""
    return lambda c: c.execute(
        "INSERT INTO events (at, kind, fields) VALUES (?, 'bench', '{}')", (i,)
    )


async def bench_writes(tmp: Path, n: int) -> None:
    store = Store(tmp / "home")
    await store.open()
    t = time.perf_counter()
    for i in range(n):
        await store.write(insert_event(i))
    ours = time.perf_counter() - t
    t = time.perf_counter()
    await asyncio.gather(*(store.write(insert_event(i)) for i in range(n)))
    concurrent = time.perf_counter() - t
    await store.close()
    conn = sqlite3.connect(tmp / "peer.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("CREATE TABLE e (at REAL, kind TEXT, fields TEXT)")
    t = time.perf_counter()
    for i in range(n):
        conn.execute("INSERT INTO e VALUES (?, 'bench', '{}')", (i,))
    peer = time.perf_counter() - t
    conn.close()
    print(
        f"writes: modeld {n / ours:.0f}/s sequential, {n / concurrent:.0f}/s from "
        f"{n} concurrent callers; plain sqlite3 {n / peer:.0f}/s; ratio {ours / peer:.2f}"
    )


async def bench_reload(tmp: Path, runs: int) -> None:
    reg = tmp / "reg"
    reg.mkdir()
    cat = Catalog([reg])
    await cat.start()
    await asyncio.sleep(1.0)  # let the watcher come up
    out = []
    changed = asyncio.Event()
    cat.listeners.append(lambda _change: changed.set())
    for i in range(runs):
        tmpfile = reg / f".m{i}.tmp"
        tmpfile.write_text(
            f'id = "m{i}"\ndisplay_name = "m"\nfile_name = "m.litertlm"\n'
            'urls = ["http://127.0.0.1:9/m"]\nsize = 1\n'
        )
        changed.clear()
        t = time.perf_counter()
        tmpfile.replace(reg / f"m{i}.toml")
        await asyncio.wait_for(changed.wait(), 10)
        assert f"m{i}" in cat
        out.append(time.perf_counter() - t)
    await cat.stop()
    print(f"reload: median {statistics.median(out):.3f} s, max {max(out):.3f} s over {runs} edits")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("-r", "--runs", type=int, default=3)
    ap.add_argument("--writes", type=int, default=300)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    try:
        bench_hash(tmp, args.size_mib, args.runs)
        asyncio.run(bench_writes(tmp, args.writes))
        asyncio.run(bench_reload(tmp, 10))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
