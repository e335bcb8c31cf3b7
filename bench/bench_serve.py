"""Serving benchmark: modeld's ``/v1/chat/completions`` vs ``litert-lm serve`` vs direct use.

One command; it prints every goal beside its figure (✓ met, ✗ not). The model is
tests/models/tiny-text-long.litertlm (the tiny decoder with a 1,280-token window); replies
of 8, 256 and 1,024 tokens (``max_completion_tokens``), with a prompt that reaches them:
the first of ``PROMPTS`` whose reply on the direct engine runs to the longest length (the
weights are random, so a reply ends where its end token happens to come). Every figure
line says how many tokens the replies actually had (the median).

Contenders, side by side in one process tree:
(a) modeld over its Unix socket (OpenAI wire format, a runner process), with its default
    CPU thread count;
(b) ``litert-lm serve`` (the installed ``litert-lm`` package's OpenAI server) on
    127.0.0.1, the model imported into its own models dir (``LITERT_LM_DIR``);
(c) direct in-process ``litert_lm``: one engine with modeld's thread count, ``send_message``
    (or iterating ``send_message_async`` when streamed); 16 clients share it under a lock,
    as a plain app would.

Scenarios, each round: one client, (a) and (c), every length, streamed and not; 16
clients, 8 and 256 tokens, (a) streamed and not, (b) and (c) not streamed. ``--rounds``
rounds run every scenario in turn (a shared machine's load changes over a run, and
interleaving spreads it over all of them); with one client, modeld's requests and direct's
alternate (A B B A ...), so a drift within a scenario weighs on both alike; figures are
medians over the rounds, and gaps and ratios are medians of the per-round ones. The HTTP
client is stdlib ``http.client``, one keep-alive connection per client thread.

Goals (issue 13): (1) one client: modeld's p50 within 2 ms of direct, every length,
streamed and not; (2) 16 clients: p99 ≤ 20 times the one-client p50, 8 and 256 tokens;
(3) a streamed request's first token comes within one request's time (the one-client
streamed p50) of its turn (modeld's own ``queue`` phase ends the wait for its turn);
(4) 16 clients: throughput ≥ ``litert-lm serve``'s and ≥ direct calls under a lock.

Usage: ``python bench/bench_serve.py [--rounds 3] [--clients 16] [--scale 1.0]``
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.config import default_cpu_threads  # noqa: E402
from tests.support.daemon import DaemonProcess, daemon_env  # noqa: E402
from tests.support.state import install_fixture  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text-long.litertlm"
MODEL_ID = "tiny-text-long"
WINDOW = 1280
PROMPTS = (
    "Write a long story about the sea.",
    "hello there",
    "Tell me everything about the history of the world.",
    "a",
)
LENGTHS = (8, 256, 1024)
LOADED_LENGTHS = (8, 256)  # the 16-client scenarios
# Requests per scenario at --scale 1: one client, then 16 clients (split over them).
REQUESTS_ONE = {8: 100, 256: 60, 1024: 50}
REQUESTS_MANY = {8: 320, 256: 160}
LITERT_LM = Path(sys.executable).parent / "litert-lm"
OVERHEAD_GOAL_MS = 2.0
TAIL_GOAL = 20.0


@dataclass
class Sample:
    """One request: its time, its first token's (streamed), its token count, modeld's timings."""

    seconds: float
    tokens: int
    first: float | None = None
    timings: dict[str, Any] = field(default_factory=dict)


Once = Callable[[], Sample]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("modeld", timeout=300)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(300)
        sock.connect(self.unix_path)
        self.sock = sock


Connect = Callable[[], http.client.HTTPConnection]


def read_stream(resp: http.client.HTTPResponse, began: float) -> Sample:
    """Read an SSE reply to ``[DONE]``: the first content chunk's time, the usage chunk."""
    first = None
    usage: dict[str, Any] = {}
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: "):
            continue
        if line.startswith(b"data: [DONE]"):
            break
        if first is None and b'"content":"' in line and b'"content":""' not in line:
            first = time.perf_counter() - began
        elif b'"usage"' in line:
            usage = json.loads(line[6:])
    resp.read()
    seconds = time.perf_counter() - began
    tokens = int((usage.get("usage") or {}).get("completion_tokens") or 0)
    timings = (usage.get("modeld") or {}).get("timings") or {}
    return Sample(seconds, tokens, first, timings)


RESETS: dict[str, int] = {}  # server -> connections it reset or closed mid-request


def http_caller(
    server: str, connect: Connect, prompt: str, tokens: int, stream: bool
) -> Callable[[], Once]:
    """A factory of per-client callers, each with its own keep-alive connection."""
    doc: dict[str, Any] = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": tokens,
    }
    if stream:
        doc.update(stream=True, stream_options={"include_usage": True})
    body = json.dumps(doc).encode()
    headers = {"Content-Type": "application/json"}

    def make() -> Once:
        conn = [connect()]

        def once() -> Sample:
            for attempt in range(4):
                try:
                    began = time.perf_counter()
                    conn[0].request("POST", "/v1/chat/completions", body, headers)
                    resp = conn[0].getresponse()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
                    if stream:
                        sample = read_stream(resp, began)
                    else:
                        data = json.loads(resp.read())
                        sample = Sample(
                            time.perf_counter() - began,
                            int(data["usage"]["completion_tokens"]),
                        )
                    if resp.will_close:
                        conn[0].close()
                        conn[0] = connect()
                    return sample
                except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
                    # A server that closes idle connections, or resets one when its accept
                    # backlog overflows: reconnect (counted, and printed with the figures).
                    RESETS[server] = RESETS.get(server, 0) + 1
                    conn[0].close()
                    conn[0] = connect()
                    if attempt == 3:
                        raise
            raise AssertionError("unreachable")

        return once

    return make


class Direct:
    """The in-process peer: one engine with modeld's thread count, shared under a lock."""

    def __init__(self, cache: Path, threads: int) -> None:
        import litert_lm

        cache.mkdir(parents=True, exist_ok=True)
        self.engine = litert_lm.Engine(
            str(MODEL),
            backend=litert_lm.Backend.CPU(thread_count=threads),
            cache_dir=str(cache),
            max_num_tokens=WINDOW,
            enable_benchmark=True,  # as modeld's runner creates it
        )
        self.lock = threading.Lock()

    def reply_tokens(self, prompt: str, tokens: int) -> int:
        conv = self.engine.create_conversation(max_output_tokens=tokens)
        try:
            conv.send_message(prompt)
            return int(conv.get_benchmark_info().last_decode_token_count)
        finally:
            conv.close()

    def caller(self, prompt: str, tokens: int, stream: bool) -> Callable[[], Once]:
        def make() -> Once:
            def once() -> Sample:
                with self.lock:
                    began = time.perf_counter()
                    conv = self.engine.create_conversation(max_output_tokens=tokens)
                    first = None
                    if stream:
                        for _ in conv.send_message_async(prompt):
                            if first is None:
                                first = time.perf_counter() - began
                    else:
                        conv.send_message(prompt)
                    got = int(conv.get_benchmark_info().last_decode_token_count)
                    conv.close()
                    return Sample(time.perf_counter() - began, got, first)

            return once

        return make


@dataclass
class Result:
    p50: float  # ms
    p99: float  # ms
    rps: float
    tokens: float  # median tokens per reply
    first_p50: float | None = None  # ms, streamed
    first_p99: float | None = None
    after_turn_p99: float | None = None  # ms: first token after the request's turn (modeld)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def measure_pair(
    make_a: Callable[[], Once], make_b: Callable[[], Once], requests: int
) -> tuple[Result, Result]:
    """One client each, their requests interleaved A B B A ...: a load that drifts over
    the run (a shared host, a clock that steps) weighs on both alike."""
    a, b = make_a(), make_b()
    a(), b()  # warm-up: connection, engine, caches
    got: tuple[list[Sample], list[Sample]] = ([], [])
    walls = [0.0, 0.0]
    for i in range(requests):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            began = time.perf_counter()
            got[side].append((a, b)[side]())
            walls[side] += time.perf_counter() - began
    return summarize(got[0], walls[0]), summarize(got[1], walls[1])


def measure(make: Callable[[], Once], clients: int, requests: int) -> Result:
    """Run ``requests`` calls over ``clients`` threads; latency percentiles and throughput."""
    callers = [make() for _ in range(clients)]
    for c in callers:
        c()  # warm-up: connection, engine, caches
    samples: list[Sample] = []
    lock = threading.Lock()
    share = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    barrier = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        barrier.wait()
        mine = [callers[i]() for _ in range(share[i])]
        with lock:
            samples.extend(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return summarize(samples, time.perf_counter() - began)


def summarize(samples: list[Sample], wall: float) -> Result:
    """Latency percentiles, throughput over ``wall`` seconds, first tokens."""
    lat = [s.seconds * 1000 for s in samples]
    firsts = [s.first * 1000 for s in samples if s.first is not None]
    # modeld's timings: from arrival to the first token, less the wait for its turn.
    after = [
        (s.timings["first_token"] - s.timings.get("queue", 0) - s.timings.get("load", 0)) * 1000
        for s in samples
        if s.timings.get("first_token") is not None
    ]
    return Result(
        p50=statistics.median(lat),
        p99=pct(lat, 0.99),
        rps=len(samples) / wall,
        tokens=statistics.median(s.tokens for s in samples),
        first_p50=statistics.median(firsts) if firsts else None,
        first_p99=pct(firsts, 0.99) if firsts else None,
        after_turn_p99=pct(after, 0.99) if after else None,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_litert_serve(root: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``litert-lm serve`` on 127.0.0.1 with the model in its own models dir."""
    lit_dir = root / "litert-lm"
    dest = lit_dir / "models" / MODEL_ID / "model.litertlm"
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


def pick_prompt(direct: Direct) -> str:
    """The first prompt whose reply runs to the longest length (else the longest reply)."""
    longest = max(LENGTHS)
    got = {p: direct.reply_tokens(p, longest) for p in PROMPTS}
    return next((p for p in PROMPTS if got[p] >= longest), max(got, key=lambda p: got[p]))


def mark(ok: bool) -> str:
    return "✓" if ok else "✗"


def listed(xs: list[float], fmt: str = "{:.1f}") -> str:
    return " ".join(fmt.format(x) for x in xs)


Key = tuple[str, int, int, bool]  # (contender, clients, tokens, streamed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="times the default requests")
    args = parser.parse_args()
    k = args.clients
    threads = default_cpu_threads()
    load_before = os.getloadavg()
    scenarios: list[tuple[Key, int]] = []
    for n in LENGTHS:
        for stream in (False, True):
            for name in ("modeld", "direct"):  # one client: measured as a pair
                scenarios.append(((name, 1, n, stream), REQUESTS_ONE[n]))
    for n in LOADED_LENGTHS:
        scenarios.append((("modeld", k, n, False), REQUESTS_MANY[n]))
        scenarios.append((("modeld", k, n, True), REQUESTS_MANY[n]))
        scenarios.append((("litert-lm serve", k, n, False), REQUESTS_MANY[n]))
        scenarios.append((("direct", k, n, False), REQUESTS_MANY[n]))
    runs: dict[Key, list[Result]] = {key: [] for key, _ in scenarios}
    with tempfile.TemporaryDirectory(prefix="mdb-", dir="/tmp") as tmp:
        root = Path(tmp)
        home, registry = root / "home", root / "registry"
        install_fixture(home, MODEL_ID, MODEL, registry=registry)
        direct = Direct(root / "direct-cache", threads)
        prompt = pick_prompt(direct)
        d = DaemonProcess(
            home=home,
            env=daemon_env(
                home,
                MODELD_REGISTRY=str(registry),
                MODELD_LOG_LEVEL="warning",
                MODELD_KEEP_ALIVE="-1",
                MODELD_CPU_THREADS=str(threads),
            ),
        )
        d.start_quick()
        proc: subprocess.Popen[bytes] | None = None
        try:
            proc, port = start_litert_serve(root)

            def modeld(n: int, stream: bool) -> Callable[[], Once]:
                return http_caller(
                    "modeld", lambda: UnixHTTPConnection(str(d.socket)), prompt, n, stream
                )

            def litert(n: int, stream: bool) -> Callable[[], Once]:
                def connect() -> http.client.HTTPConnection:
                    return http.client.HTTPConnection("127.0.0.1", port, timeout=300)

                return http_caller("litert-lm serve", connect, prompt, n, stream)

            def in_process(n: int, stream: bool) -> Callable[[], Once]:
                return direct.caller(prompt, n, stream)

            makers = {"modeld": modeld, "litert-lm serve": litert, "direct": in_process}
            for r in range(args.rounds):
                for (name, clients, n, stream), requests in scenarios:
                    count = max(clients, round(requests * args.scale))
                    if clients == 1 and name == "direct":
                        continue  # measured with modeld's, request by request
                    if clients == 1:
                        mine, theirs = measure_pair(modeld(n, stream), in_process(n, stream), count)
                        runs[(name, 1, n, stream)].append(mine)
                        runs[("direct", 1, n, stream)].append(theirs)
                        continue
                    make = makers[name](n, stream)
                    runs[(name, clients, n, stream)].append(measure(make, clients, count))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            d.stop()
            if proc is not None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(10)
    load_after = os.getloadavg()

    def med(key: Key, attr: str) -> float:
        return statistics.median(float(getattr(x, attr)) for x in runs[key])

    cpu = platform.processor() or platform.machine()
    print(
        f"bench_serve: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} "
        f"CPUs ({cpu}), load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"model {MODEL_ID}, {threads} CPU thread(s); prompt {prompt!r}; {args.rounds} "
        "interleaved round(s), medians over the rounds"
    )
    print(
        f"{'scenario':<46} {'tokens':>6} {'p50 ms':>9} {'p99 ms':>9} {'req/s':>7} {'first p50':>10}"
    )
    for key in runs:
        name, clients, n, stream = key
        label = f"{name}, {clients} client(s), {n} tokens, {'streamed' if stream else 'whole'}"
        first = "" if runs[key][0].first_p50 is None else f"{med(key, 'first_p50'):10.2f}"
        print(
            f"{label:<46} {med(key, 'tokens'):6.0f} {med(key, 'p50'):9.2f} "
            f"{med(key, 'p99'):9.2f} {med(key, 'rps'):7.1f} {first}"
        )
    if RESETS:
        print(f"connections reset or closed mid-request (then retried): {RESETS}")
    print("goals:")
    for n in LENGTHS:
        for stream in (False, True):
            m, x = ("modeld", 1, n, stream), ("direct", 1, n, stream)
            gaps = [a.p50 - b.p50 for a, b in zip(runs[m], runs[x], strict=True)]
            gap = statistics.median(gaps)
            how = "streamed" if stream else "whole"
            print(
                f"  {mark(gap <= OVERHEAD_GOAL_MS)} 1 client, {n:4} tokens {how:8}: p50 modeld - "
                f"direct {gap:+7.2f} ms (goal <= +{OVERHEAD_GOAL_MS:g}; rounds "
                f"{listed(gaps, '{:+.2f}')})"
            )
    for n in LOADED_LENGTHS:
        for stream in (False, True):
            many, one = ("modeld", k, n, stream), ("modeld", 1, n, stream)
            tails = [a.p99 / b.p50 for a, b in zip(runs[many], runs[one], strict=True)]
            tail = statistics.median(tails)
            how = "streamed" if stream else "whole"
            print(
                f"  {mark(tail <= TAIL_GOAL)} {k} clients, {n:4} tokens {how:8}: p99 / 1-client "
                f"p50 {tail:6.1f} x (goal <= {TAIL_GOAL:g}; rounds {listed(tails)})"
            )
    for n in LOADED_LENGTHS:
        many, one = ("modeld", k, n, True), ("modeld", 1, n, True)
        after = [
            (a.after_turn_p99 or float("inf")) / b.p50
            for a, b in zip(runs[many], runs[one], strict=True)
        ]
        ratio = statistics.median(after)
        print(
            f"  {mark(ratio <= 1)} {k} clients, {n:4} tokens streamed: first token after its turn,"
            f" p99 {med(many, 'after_turn_p99'):.2f} ms = {ratio:.2f} x one request "
            f"(goal <= 1; rounds {listed(after, '{:.2f}')})"
        )
    for n in LOADED_LENGTHS:
        for peer in ("litert-lm serve", "direct"):
            m, x = ("modeld", k, n, False), (peer, k, n, False)
            ratios = [a.rps / b.rps for a, b in zip(runs[m], runs[x], strict=True)]
            ratio = statistics.median(ratios)
            what = "direct under a lock" if peer == "direct" else peer
            print(
                f"  {mark(ratio >= 1)} {k} clients, {n:4} tokens whole: throughput modeld / {what}"
                f" {ratio:5.2f} (goal >= 1; rounds {listed(ratios, '{:.2f}')})"
            )
    ls = ("litert-lm serve", k, 8, False)
    tail_ls = med(ls, "p99") / med(("modeld", 1, 8, False), "p50")
    print(f"  (for scale: litert-lm serve's {k}-client p99 at 8 tokens is {tail_ls:.0f} x modeld's")
    print("   1-client p50; it answers one request at a time from the kernel's accept backlog)")


if __name__ == "__main__":
    main()
