"""Serving benchmark: modeld's ``/v1/chat/completions`` vs ``litert-lm serve`` vs direct.

Same tiny model (tests/models/tiny-text.litertlm), same prompt, 8 new tokens:
(a) modeld over its Unix socket (OpenAI wire format, runner process);
(b) ``litert-lm serve`` (the OpenAI server of the installed ``litert-lm`` package) on
    127.0.0.1, the model imported into its own models dir (``LITERT_LM_DIR``);
(c) direct in-process ``litert_lm`` (one engine; 16 clients share it under a lock, since a
    plain app would serialise calls to one engine the same way).
Each with 1 client and with 16 concurrent clients, ``--requests`` requests per scenario
(split over the clients); p50, p99, requests/s, and the ratios the goals are stated in.
All three run side by side and ``--rounds`` rounds measure each in turn (the shared machine's
load changes over a run); each figure is the median over the rounds, and the 1-client gap
is the median of the per-round gaps.
Both servers get the same client: stdlib ``http.client``, one keep-alive connection per
client thread, non-streamed requests.

Usage: ``python bench/bench_serve.py [--requests 200] [--clients 16] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.daemon import DaemonProcess, daemon_env  # noqa: E402
from tests.support.state import install_fixture  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text.litertlm"
PROMPT = "hello there"
TOKENS = 8
LITERT_LM = Path(sys.executable).parent / "litert-lm"


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("modeld", timeout=120)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(120)
        sock.connect(self.unix_path)
        self.sock = sock


Connect = Callable[[], http.client.HTTPConnection]
Once = Callable[[], None]


def http_caller(connect: Connect, model: str) -> Callable[[], Once]:
    """A factory of per-client callers, each with its own keep-alive connection."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_completion_tokens": TOKENS,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}

    def make() -> Once:
        conn = [connect()]

        def once() -> None:
            for attempt in range(2):
                try:
                    conn[0].request("POST", "/v1/chat/completions", body, headers)
                    resp = conn[0].getresponse()
                    data = resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {data[:300]!r}")
                    if resp.will_close:
                        conn[0].close()
                        conn[0] = connect()
                    return
                except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                    # A server that closes idle connections: reconnect once.
                    conn[0].close()
                    conn[0] = connect()
                    if attempt:
                        raise

        return once

    return make


def direct_caller(cache: Path) -> Callable[[], Once]:
    import litert_lm

    cache.mkdir(parents=True, exist_ok=True)
    engine = litert_lm.Engine(
        str(MODEL), backend=litert_lm.Backend.CPU(), cache_dir=str(cache), max_num_tokens=256
    )
    lock = threading.Lock()

    def make() -> Once:
        def once() -> None:
            with lock:
                conv = engine.create_conversation(max_output_tokens=TOKENS)
                conv.send_message(PROMPT)
                conv.close()

        return once

    return make


def measure(make: Callable[[], Once], clients: int, requests: int) -> dict[str, float]:
    """Run ``requests`` calls over ``clients`` threads; latency percentiles and throughput."""
    callers = [make() for _ in range(clients)]
    for c in callers:
        c()  # warm-up: connection, engine, caches
    latencies: list[float] = []
    lock = threading.Lock()
    share = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        barrier.wait()
        mine = []
        for _ in range(share[i]):
            t = time.perf_counter()
            callers[i]()
            mine.append(time.perf_counter() - t)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    latencies.sort()
    return {
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))] * 1000,
        "rps": len(latencies) / wall,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_litert_serve(root: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``litert-lm serve`` on 127.0.0.1 with the model in its own models dir."""
    lit_dir = root / "litert-lm"
    dest = lit_dir / "models" / "tiny-text" / "model.litertlm"
    dest.parent.mkdir(parents=True)
    shutil.copyfile(MODEL, dest)
    port = free_port()
    env = dict(os.environ, LITERT_LM_DIR=str(lit_dir))
    log = (root / "litert-serve.log").open("wb")
    proc = subprocess.Popen(
        [str(LITERT_LM), "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((root / "litert-serve.log").read_text()[-2000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("litert-lm serve did not start in 60 s")


def row(name: str, r: dict[str, float]) -> str:
    return f"    {name:<22} p50 {r['p50']:8.2f} ms   p99 {r['p99']:9.2f} ms   {r['rps']:7.1f} req/s"


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n, k = args.requests, args.clients
    names = ("modeld", "litert-lm serve", "direct in-process")
    # name -> clients -> one result per round
    runs: dict[str, dict[int, list[dict[str, float]]]] = {m: {1: [], k: []} for m in names}
    with tempfile.TemporaryDirectory(prefix="mdb-", dir="/tmp") as tmp:
        root = Path(tmp)
        home, registry = root / "home", root / "registry"
        install_fixture(home, "tiny-text", MODEL, registry=registry)
        d = DaemonProcess(
            home=home,
            env=daemon_env(
                home,
                MODELD_REGISTRY=str(registry),
                MODELD_LOG_LEVEL="warning",
                MODELD_KEEP_ALIVE="-1",
            ),
        )
        d.start()
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc, port = start_litert_serve(root)
            makers = {
                "modeld": http_caller(lambda: UnixHTTPConnection(str(d.socket)), "tiny-text"),
                "litert-lm serve": http_caller(
                    lambda: http.client.HTTPConnection("127.0.0.1", port, timeout=120),
                    "tiny-text",
                ),
                "direct in-process": direct_caller(root / "direct-cache"),
            }
            # All three stay up (idle ones cost nothing) and every round measures each of
            # them in turn: the shared machine's load changes over a run, and interleaving
            # spreads it over all three instead of hitting whichever ran at a bad moment.
            for _ in range(args.rounds):
                for clients in (1, k):
                    for name in names:
                        runs[name][clients].append(measure(makers[name], clients, n))
        finally:
            d.stop()
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)

    results = {name: {c: median_of(by[c]) for c in (1, k)} for name, by in runs.items()}
    print(
        f"{TOKENS} new tokens per request, {n} requests per scenario (non-streamed), "
        f"{args.rounds} interleaved round(s); medians over the rounds"
    )
    for clients in (1, k):
        print(f"{clients} client(s):")
        for name, by in results.items():
            print(row(name, by[clients]))
    md, ls, dr = results["modeld"], results["litert-lm serve"], results["direct in-process"]
    print("goals:")
    gaps = [
        m["p50"] - x["p50"]
        for m, x in zip(runs["modeld"][1], runs["direct in-process"][1], strict=True)
    ]
    listed = " ".join(f"{g:+.2f}" for g in gaps)
    print(
        f"    1-client p50 modeld - direct      {statistics.median(gaps):+7.2f} ms  "
        f"(goal <= +2 ms; per round {listed})"
    )
    tails = [a["p99"] / b["p50"] for a, b in zip(runs["modeld"][k], runs["modeld"][1], strict=True)]
    print(
        f"    {k}-client p99 / 1-client p50     {statistics.median(tails):7.1f} x   "
        f"(goal <= 20 x; per round {' '.join(f'{t:.1f}' for t in tails)})"
    )
    print(f"      litert-lm serve, same ratio      {ls[k]['p99'] / ls[1]['p50']:7.1f} x")
    print(
        f"    {k}-client throughput modeld / litert-lm serve "
        f"{md[k]['rps'] / ls[k]['rps']:5.2f}  (goal >= 1)"
    )
    print(f"    1-client throughput modeld / litert-lm serve  {md[1]['rps'] / ls[1]['rps']:5.2f}")
    print(f"    (direct in-process, for scale: {dr[1]['p50']:.2f} ms p50 with 1 client)")


if __name__ == "__main__":
    main()
