"""Benchmark: modeld's downloader vs aria2c (with checksum) vs curl, from nginx on loopback.

Starts its own nginx (one fast server, one with ``limit_rate 20m``) on 127.0.0.1 ephemeral
ports over a random file, warms the page cache the same way before each run, and prints
times and ratios for: (1) one mirror, (2) fast + slow mirror, (3) kill -9 at ~50 % then
resume (bytes fetched / file size, counted by nginx), (4) last byte → installed latency,
(5) end to end: ``modeld pull`` as a user runs it (the CLI process, a real daemon whose state
directory is on the served file's filesystem, the progress stream, the install) vs ``curl``.

    python bench/bench_download.py --size 2GB      # default 512MB; needs nginx, aria2c, curl
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.config import format_size, parse_size  # noqa: E402
from modeld.download import fetch  # noqa: E402
from modeld.download.job import DownloadJob, DownloadTarget, Tuning  # noqa: E402
from modeld.download.journal import Block, SqliteJournal  # noqa: E402
from modeld.store.store import Store  # noqa: E402
from tests.support.daemon import DaemonProcess, checkout_pythonpath, daemon_env  # noqa: E402
from tests.support.state import model_head, write_entry  # noqa: E402

# Goal (2): a fast mirror plus a 20 MB/s-per-connection one takes at most this times the
# fast one alone, in every run.
SLOW_GOAL = 1.1

NGINX_CONF = """
worker_processes 1;
daemon off;
user root;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    log_format bytes '$bytes_sent';
    access_log {prefix}/access.log bytes;
    server {{ listen 127.0.0.1:{fast}; root {root}; }}
    server {{ listen 127.0.0.1:{slow}; root {root}; limit_rate {slow_rate}; }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_file(path: Path, size: int) -> str:
    """A LiteRT-LM header (a pull refuses a file that is not one), then random bytes."""
    marker = path.with_suffix(".sha256")
    head = model_head()
    if path.exists() and path.stat().st_size == size and marker.exists():
        with path.open("rb") as f:
            if f.read(8) == head[:8]:
                return marker.read_text().strip()
    h = hashlib.sha256(head)
    with path.open("wb") as f:
        f.write(head)
        left = size - len(head)
        while left:
            chunk = os.urandom(min(left, 16 << 20))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    marker.write_text(h.hexdigest())
    return h.hexdigest()


def warm(path: Path) -> None:
    """Same state before every run: source file in the page cache, old outputs gone."""
    with path.open("rb") as f:
        while f.read(16 << 20):
            pass


def nginx_bytes(prefix: Path) -> int:
    log = prefix / "access.log"
    return sum(int(x) for x in log.read_text().split()) if log.exists() else 0


def reset_log(prefix: Path, proc: subprocess.Popen[bytes]) -> None:
    (prefix / "access.log").unlink(missing_ok=True)
    proc.send_signal(signal.SIGUSR1)  # reopen logs
    time.sleep(0.2)


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


async def modeld_pull(
    home: Path, urls: list[str], size: int, sha: str, tuning: Tuning, kill_at: float | None = None
) -> dict[str, Any]:
    store = Store(home)
    await store.open()
    try:
        job = DownloadJob(
            target=DownloadTarget("bench", urls, size, sha),
            partial=home / "partial" / "bench.partial",
            journal=SqliteJournal(store),
            installer=store.install,
            tuning=tuning,
        )
        # When each block landed and from where: the tail's last blocks, for the printout.
        landed: list[tuple[float, int, str]] = []
        on_block = job._on_block

        def record(block: Block) -> None:
            landed.append((time.perf_counter(), block.index, block.mirror))
            on_block(block)

        job._on_block = record  # type: ignore[method-assign]
        t, cpu = time.perf_counter(), os.times()
        job.start()
        if kill_at is not None:
            # Polling progress is the point here (a kill at a byte count, not an event).
            while job.fetcher is None or job.fetcher.done_bytes < kill_at * size:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            # What this process got before the kill (bytes handed to the sink), for the
            # breakdown of the excess: the rest of what the server sent was in socket buffers.
            got = job.fetcher
            kill = {"killing_at": got.done_bytes, "received": got.received}
            print(json.dumps(kill), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        await job.wait()
        f = job.fetcher
        assert f is not None
        by_mirror: dict[str, int] = {}
        for label in f.sources.values():
            by_mirror[label] = by_mirror.get(label, 0) + 1
        # Where each mirror's blocks lie (runs of block indices), for all but the main one.
        main_label = max(by_mirror, key=lambda k: by_mirror[k]) if by_mirror else ""
        spans: dict[str, list[list[int]]] = {}
        for idx in sorted(f.sources):
            label = f.sources[idx]
            if label == main_label:
                continue
            runs = spans.setdefault(label, [])
            if runs and runs[-1][1] == idx - 1:
                runs[-1][1] = idx
            else:
                runs.append([idx, idx])
        end = time.perf_counter()
        last_byte = landed[-1][0] if landed else end
        return {
            "seconds": end - t,
            # The last blocks to land: (ms before the last byte, index, mirror's port).
            "last_blocks": [
                (round((last_byte - at) * 1000), idx, label.rsplit(":", 1)[-1])
                for at, idx, label in landed[-4:]
            ],
            # CPU seconds of the whole process (loop + hashing thread): steadier than the
            # wall time on a shared box, and what a busy machine pays.
            "cpu": round(sum(os.times()[:2]) - sum(cpu[:2]), 3),
            "hash_cpu": round(f.hasher.cpu, 3) if f.hasher else 0.0,
            "install_latency": job.install_latency,
            "resumed": job.resumed,
            "timings": job.timings,
            "raw_pieces": f.raw_pieces,
            "connects": f.rangeio.connects,
            "blocks": by_mirror,
            "spans": spans,
            "tail_mb": round((f.hasher.tail_bytes if f.hasher else 0) / 1e6, 1),
            "late_mb": round(f.late_bytes / 1e6, 1),
            "splits": f.splits,
            "takeovers": f.takeovers,
        }
    finally:
        await store.close()


def child(args: argparse.Namespace) -> None:
    """Run one pull in this process (so the parent can kill it with -9)."""
    fetch.RAW_RANGES = not args.aiohttp
    tuning = Tuning(args.connections, parse_size(args.piece_size), 20.0)
    result = asyncio.run(
        modeld_pull(Path(args.home), args.urls, args.bytes, args.sha, tuning, args.kill_at)
    )
    print(json.dumps(result), flush=True)


def run_child(
    home: Path,
    urls: list[str],
    size: int,
    sha: str,
    a: argparse.Namespace,
    kill_at: float | None = None,
    *,
    aiohttp: bool = False,
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--home",
        str(home),
        "--bytes",
        str(size),
        "--sha",
        sha,
        "--connections",
        str(a.connections),
        "--piece-size",
        a.piece_size,
        "--urls",
        *urls,
    ]
    if aiohttp:
        cmd.append("--aiohttp")
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    if kill_at is None and (out.returncode != 0 or not lines):
        raise RuntimeError(out.stderr)
    return lines[-1] if lines else {}


class EndToEnd:
    """``modeld pull ID`` from the shell: the CLI process against a real daemon."""

    MODEL = "bench-e2e"

    def __init__(self, work: Path, size: int, sha: str, url: str, a: argparse.Namespace) -> None:
        self.home, registry = work / "e2e-home", work / "e2e-registry"
        for d in (self.home, registry):
            shutil.rmtree(d, ignore_errors=True)
        registry.mkdir(parents=True)
        write_entry(registry, self.MODEL, size=size, sha256=sha, urls=[url])
        env = daemon_env(
            self.home,
            MODELD_REGISTRY=str(registry),
            MODELD_LOG_LEVEL="warning",
            MODELD_DOWNLOAD_CONNECTIONS=str(a.connections),
            MODELD_PIECE_SIZE=a.piece_size,
        )
        env["PYTHONPATH"] = checkout_pythonpath()
        # The CLI as installed: with its bytecode.
        self.cli_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.daemon = DaemonProcess(home=self.home, env=env)
        self.daemon.start()
        self.parts: list[tuple[float, float]] = []

    def _cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "modeld", *args]
        return subprocess.run(argv, env=self.cli_env, capture_output=True, text=True, check=False)

    def pull(self) -> float:
        self._cli("rm", self.MODEL, "--force")  # not timed: every run downloads it all
        t, wall = time.perf_counter(), time.time()
        done = self._cli("pull", self.MODEL, "--force", "--json")
        took = time.perf_counter() - t
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        record = json.loads(done.stdout)
        # (CLI start → the job exists in the daemon, the job's start → the CLI's exit)
        self.parts.append((record["started_at"] - wall, wall + took - record["started_at"]))
        return took

    def stop(self) -> None:
        self.daemon.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="512MB")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default="/tmp/modeld-bench")
    p.add_argument("--connections", type=int, default=8)
    p.add_argument("--piece-size", default="16MiB")
    p.add_argument("--child", action="store_true")
    p.add_argument("--home")
    p.add_argument("--bytes", type=int)
    p.add_argument("--sha")
    p.add_argument("--urls", nargs="*")
    p.add_argument("--kill-at", type=float)
    p.add_argument("--aiohttp", action="store_true", help="child: piece bodies through aiohttp")
    p.add_argument(
        "--compare-aiohttp",
        action="store_true",
        help="also run modeld with aiohttp's parser for the piece bodies (the old path)",
    )
    p.add_argument("--no-aria", action="store_true", help="skip the aria2c runs (quicker)")
    p.add_argument("--no-slow", action="store_true", help="skip the fast+slow runs")
    p.add_argument("--no-kill", action="store_true", help="skip the kill -9 / resume run")
    p.add_argument("--no-e2e", action="store_true", help="skip the `modeld pull` (CLI) runs")
    p.add_argument(
        "--slow-rate",
        default="20m",
        help="the slow mirror's nginx limit_rate per connection (goal (2) is set for 20m)",
    )
    p.add_argument(
        "--mirror-cpus",
        help="run nginx on these CPUs (taskset list, e.g. 2,3): the mirrors stand in for "
        "remote hosts, so on a bigger host they can be kept off the client's cores",
    )
    a = p.parse_args()
    if a.child:
        child(a)
        return
    size = parse_size(a.size)
    work = Path(a.dir)
    root, prefix = work / "www", work / "nginx"
    for d in (root, prefix):
        d.mkdir(parents=True, exist_ok=True)
    src = root / "model.bin"
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    where = f"nginx on CPUs {a.mirror_cpus}" if a.mirror_cpus else "nginx on the same CPUs"
    print(f"file: {format_size(size)} in {src}; client on CPUs {cpus}, {where}", flush=True)
    sha = make_file(src, size)
    fast, slow = free_port(), free_port()
    (prefix / "nginx.conf").write_text(
        NGINX_CONF.format(prefix=prefix, root=root, fast=fast, slow=slow, slow_rate=a.slow_rate)
    )
    pin = ["taskset", "-c", a.mirror_cpus] if a.mirror_cpus else []
    nginx = subprocess.Popen([*pin, "nginx", "-c", str(prefix / "nginx.conf"), "-p", str(prefix)])
    time.sleep(0.5)
    fast_url, slow_url = f"http://127.0.0.1:{fast}/model.bin", f"http://127.0.0.1:{slow}/model.bin"
    out = work / "out"
    results: dict[str, list[float]] = {}
    latencies: list[float] = []

    def fresh() -> Path:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        warm(src)
        return out

    aria = [
        "aria2c",
        "-x16",
        "-s16",
        "--file-allocation=none",
        "--allow-overwrite=true",
        "--console-log-level=error",
        "--summary-interval=0",
        "-d",
        str(out),
    ]
    # Each round runs every contender once, interleaved, so a noisy neighbour hurts them alike.
    cases: list[tuple[str, Any]] = [
        ("curl", lambda: timed(["curl", "-s", "-o", str(out / "c.bin"), fast_url])),
        ("modeld", lambda: run_child(out / "home1", [fast_url], size, sha, a)),
    ]
    e2e = None if a.no_e2e else EndToEnd(work, size, sha, fast_url, a)
    if e2e is not None:
        cases.append(("modeld pull (CLI)", e2e.pull))
    if a.compare_aiohttp:
        cases.append(
            (
                "modeld aiohttp",
                lambda: run_child(out / "home4", [fast_url], size, sha, a, aiohttp=True),
            )
        )
    if not a.no_aria:
        cases += [
            ("aria2c", lambda: timed([*aria, "-o", "a.bin", fast_url])),
            (
                "aria2c --checksum",
                lambda: timed([*aria, f"--checksum=sha-256={sha}", "-o", "a.bin", fast_url]),
            ),
        ]
    if not a.no_slow:
        cases.append(
            (
                "modeld fast+slow",
                lambda: run_child(out / "home2", [fast_url, slow_url], size, sha, a),
            )
        )
        if a.compare_aiohttp:
            cases.append(
                (
                    "modeld aiohttp f+s",
                    lambda: run_child(
                        out / "home5", [fast_url, slow_url], size, sha, a, aiohttp=True
                    ),
                )
            )
        if not a.no_aria:
            cases.append(
                ("aria2c fast+slow", lambda: timed([*aria, "-o", "a.bin", fast_url, slow_url]))
            )
    resume_ratios: list[float] = []
    resumed: list[int] = []
    excess: list[dict[str, int]] = []
    try:
        for _ in range(a.runs):
            for name, fn in cases:
                fresh()
                r = fn()
                if isinstance(r, dict):
                    print(name, r, flush=True)
                    results.setdefault(name, []).append(r["seconds"])
                    if name == "modeld":
                        latencies.append(r["install_latency"])
                else:
                    results.setdefault(name, []).append(r)
            if not a.no_kill:
                # (3) kill -9 at ~50 %, then resume: bytes nginx sent / file size.
                fresh()
                reset_log(prefix, nginx)
                killed = run_child(out / "home3", [fast_url], size, sha, a, kill_at=0.5)
                time.sleep(0.3)  # nginx logs the requests the kill cut once it sees the reset
                before = nginx_bytes(prefix)
                r = run_child(out / "home3", [fast_url], size, sha, a)
                time.sleep(0.3)
                total = nginx_bytes(prefix)
                resume_ratios.append(total / size)
                resumed.append(r["resumed"])
                # Where the excess went: sent but never received (socket buffers), received
                # but not journaled (blocks in flight), and what the resumed pull fetched
                # beyond what was missing (the endgame's splits and takeovers).
                got = killed.get("received", 0)
                excess.append(
                    {
                        "buffers": before - got,
                        "unjournaled": got - r["resumed"],
                        "resume_extra": total - before - (size - r["resumed"]),
                        "splits": r["splits"],
                        "takeovers": r["takeovers"],
                    }
                )
                print("kill", killed, "excess", excess[-1], flush=True)
    finally:
        if e2e is not None:
            e2e.stop()
        nginx.terminate()
        nginx.wait()
        shutil.rmtree(out, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(
        f"\nmedian of {a.runs} runs, {format_size(size)}, connections={a.connections}, "
        f"piece={a.piece_size}"
    )
    for k, v in med.items():
        runs = " ".join(f"{x:.2f}" for x in results[k])
        print(f"  {k:<20} {v:7.2f} s  ({size / v / 1e6:7.0f} MB/s)  [{runs}]")
    print("goals:")
    print(f"  (1) modeld / curl            {med['modeld'] / med['curl']:.2f}  (goal <= 1.0)")
    if e2e is not None:
        cli = med["modeld pull (CLI)"]
        start = statistics.median(p[0] for p in e2e.parts)
        rest = statistics.median(p[1] for p in e2e.parts)
        print(
            f"  (5) modeld pull (CLI) / curl {cli / med['curl']:.2f}  (goal <= 1.0; CLI start "
            f"→ job {start * 1000:.0f} ms, job → CLI exit {rest:.2f} s)"
        )
    if "modeld aiohttp" in med:
        print(f"      modeld aiohttp / curl    {med['modeld aiohttp'] / med['curl']:.2f}")
    if "aria2c --checksum" in med:
        print(
            f"      modeld / aria2c checksum {med['modeld'] / med['aria2c --checksum']:.2f}"
            "  (goal <= 0.3)"
        )
    if "modeld fast+slow" in med:
        peer = (
            f"; aria2c fast+slow / aria2c {med['aria2c fast+slow'] / med['aria2c']:.2f}"
            if "aria2c fast+slow" in med
            else ""
        )
        # The goal holds run by run: each round's fast+slow against that round's one mirror.
        pairs = zip(results["modeld fast+slow"], results["modeld"], strict=True)
        ratios = [fs / one for fs, one in pairs]
        within = sum(r <= SLOW_GOAL for r in ratios)
        print(
            f"  (2) modeld fast+slow / modeld {med['modeld fast+slow'] / med['modeld']:.2f}"
            f"  (goal <= {SLOW_GOAL} in every run{peer}); runs within goal: {within} of "
            f"{len(ratios)} [{' '.join(f'{r:.2f}' for r in ratios)}]"
        )
    if "modeld aiohttp f+s" in med:
        print(
            "      modeld aiohttp f+s / modeld aiohttp "
            f"{med['modeld aiohttp f+s'] / med['modeld aiohttp']:.2f}"
        )
    if resume_ratios:
        print(
            f"  (3) kill -9 at 50 %: fetched / size {statistics.median(resume_ratios):.3f}"
            f"  (goal <= 1.05; runs {' '.join(f'{x:.3f}' for x in resume_ratios)}; "
            f"resumed {format_size(int(statistics.median(resumed)))})"
        )
        for part in ("buffers", "unjournaled", "resume_extra"):
            mb = " ".join(f"{e[part] / 1e6:.1f}" for e in excess)
            print(f"      {part:<14} MB: {mb}")
    lat = " ".join(f"{x:.3f}" for x in latencies)
    print(
        f"  (4) last byte -> installed  {statistics.median(latencies):.3f} s  (goal <= 0.1; {lat})"
    )


if __name__ == "__main__":
    main()
