"""CLI latency: each verb's wall time against ``curl --unix-socket`` on the same route.

One real daemon (tiny-text installed, a spare runner up). For ``status``, ``list`` and ``ps``
(and ``show``) it runs the CLI as the console script does (a fresh Python process, stdout to a
pipe) and ``curl`` on the route the verb calls, interleaved run by run so that the load of a
shared machine hits both alike, and prints the median of N, the ratio, and the goal.

``pull``: the time from starting the process until its pull request reaches the daemon's
socket, for the CLI and for curl. A stand-in socket that records when each request arrives
measures it (the real daemon would then download; only the start is measured here).

The CLI runs from this checkout (as the editable install does: its import hook costs
~10 ms at each start), or, with ``--cli PATH``, as that console script, e.g. a regular
``pip install`` into a venv (``--cli VENV/bin/modeld``). Bytecode is written and used, as an
installed package has it. A first row times the interpreter alone (``python -c pass``) on
the same path: the floor under every verb.

Usage: ``python bench/bench_cli.py [--runs 21] [--cli VENV/bin/modeld]``
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.daemon import DaemonProcess, checkout_pythonpath, daemon_env  # noqa: E402
from tests.support.state import MODELS, install_fixture  # noqa: E402

# What the `modeld` console script runs.
CLI = [sys.executable, "-c", "import sys; from modeld.cli import main; sys.exit(main())"]
VERBS = {
    "status": ("/api/status", ["status"]),
    "list": ("/api/models", ["list"]),
    "ps": ("/api/engines", ["ps"]),
    "show": ("/api/models/tiny-text", ["show", "tiny-text"]),
    "list --json": ("/api/models", ["list", "--json"]),
}
GOAL_MS = 100.0


def wall(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall time and CPU time (user + system) of one run of ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed: {done.stderr.decode(errors='replace')}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu


def curl(sock: Path, route: str, method: str = "GET", body: str | None = None) -> list[str]:
    argv = ["curl", "-sS", "-o", "/dev/null", "--unix-socket", str(sock), "-X", method]
    if body is not None:
        argv += ["-H", "Content-Type: application/json", "--data", body]
    return [*argv, f"http://modeld{route}"]


class Arrivals:
    """A stand-in daemon socket: answers health at once, records when a pull arrives."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.arrived: list[float] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(64)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                line = data.split(b"\r\n", 1)[0]
                if b"/pull" in line:
                    self.arrived.append(time.perf_counter())
                    body = b'{"id":"tiny-text","already":true,"installed":{"path":"-"}}\n'
                else:
                    body = b'{"ok":true}'
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )

    def time_to_request(self, argv: list[str], env: dict[str, str]) -> float:
        before = len(self.arrived)
        start = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True, check=False)
        if len(self.arrived) != before + 1:
            raise SystemExit(f"{argv}: the pull request never arrived")
        return self.arrived[-1] - start


def median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def row(
    name: str, cli: list[tuple[float, float]], peer: list[tuple[float, float]], goal: bool = True
) -> str:
    c, p = median_ms([w for w, _ in cli]), median_ms([w for w, _ in peer])
    c_cpu, p_cpu = median_ms([u for _, u in cli]), median_ms([u for _, u in peer])
    verdict = ("ok" if c <= GOAL_MS else "OVER") if goal else "(floor)"
    return (
        f"{name:<14} {c:8.1f} ms {p:8.1f} ms {c / p:6.1f}x   ≤ {GOAL_MS:.0f} ms: {verdict:<7}"
        f" (CPU {c_cpu:.0f} ms vs {p_cpu:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--cli", help="The console script to time (default: this checkout).")
    args = parser.parse_args()
    cli = [args.cli] if args.cli else CLI
    python = [str(Path(args.cli).parent / "python")] if args.cli else [sys.executable]
    root = Path(tempfile.mkdtemp(prefix="md-bench-cli-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
    env = daemon_env(home, MODELD_REGISTRY=str(registry), MODELD_LOG_LEVEL="warning")
    env["PYTHONPATH"] = checkout_pythonpath()
    d = DaemonProcess(home=home, env=env)
    d.start()
    sock = home / "modeld.sock"
    # The CLI as an installed package runs: with its bytecode.
    cli_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if args.cli:
        cli_env.pop("PYTHONPATH")
    print(f"CLI: {' '.join(cli)[-60:]}")
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; median of {args.runs} runs")
    print(f"{'verb':<14} {'modeld':>11} {'curl':>11} {'ratio':>7}   goal")
    try:
        floor = [wall([*python, "-c", "pass"], cli_env) for _ in range(args.runs)]
        curl_floor = [wall(curl(sock, "/api/health"), env) for _ in range(args.runs)]
        print(row("python -c pass", floor, curl_floor, goal=False))
        for name, (route, argv) in VERBS.items():
            wall([*cli, *argv], cli_env)  # warm the page cache and the daemon's answer
            cli_t: list[tuple[float, float]] = []
            curl_t: list[tuple[float, float]] = []
            for _ in range(args.runs):
                cli_t.append(wall([*cli, *argv], cli_env))
                curl_t.append(wall(curl(sock, route), env))
            print(row(name, cli_t, curl_t))
        stand_in = Arrivals(root / "stand-in.sock")
        pull_env = {**cli_env, "MODELD_SOCKET": str(stand_in.path)}
        pull_cli, pull_curl = [], []
        route = "/api/models/tiny-text/pull"
        for _ in range(args.runs):
            pull_cli.append(stand_in.time_to_request([*cli, "pull", "tiny-text"], pull_env))
            pull_curl.append(
                stand_in.time_to_request(curl(stand_in.path, route, "POST", "{}"), pull_env)
            )
        c, p = median_ms(pull_cli), median_ms(pull_curl)
        verdict = "ok" if c - p <= GOAL_MS else "OVER"
        print(
            f"{'pull (start)':<14} {c:8.1f} ms {p:8.1f} ms {c / p:6.1f}x   "
            f"adds {c - p:.0f} ms ≤ {GOAL_MS:.0f} ms: {verdict}"
        )
        print(f"load at the end {os.getloadavg()[0]:.1f}")
    finally:
        d.stop()


if __name__ == "__main__":
    main()
