"""Real-size benchmark: memory, load, threads and generation of a ~1 GB model, modeld vs direct.

The model is a real-size fixture (``tests/models/build.py --real-size``, in
``$MODELD_TEST_MODEL_CACHE``, default ``~/.cache/modeld-test-models``): random weights at
Gemma-3-1B's dimensions, int8. Every figure through the daemon (a ``modeld serve``
subprocess on a temporary socket, its runner a child of it) is printed beside the same work
done directly: a child process of this script that creates ``litert_lm.Engine`` as the
runner does (same file, thread count, window, cache dir kind) and obeys one JSON command a
line on its stdin, so that daemon and direct runs interleave. Sections (``--only``):

- ``memory``: RSS, PSS, anonymous and file-backed PSS (``/proc/PID/smaps_rollup``) of the
  runner and of the direct process after load, after a first reply, after a long prompt; the
  pool's estimate before load against the measured peak (goal: within ±15 %, never under by
  more than 15 %); ``pss_learned`` after the runs; two engines of one file (two processes).
- ``pool``: two real-size models under a budget that holds one: loads alternate, the sum
  of the runners' PSS is sampled; it must stay under the budget, with no OOM kill.
- ``load``: cold (the page cache of the model and its XNNPACK cache dropped) and warm loads,
  the daemon's ``POST /api/engines`` against a direct ``Engine()`` (goal: 1.05 times at most).
- ``threads``: prefill and decode tok/s by thread count (``bench/bench_threads.py``'s
  child), and whether modeld's default is the best row or within 5 % of it.
- ``generate``: prefill and decode tok/s and the first token through the daemon against
  direct and against ``litert_lm.Benchmark`` (the runtime's own benchmark) on the same file
  (goal: 0.98 of direct at least); and the bare-session path against a conversation for each reply.

    python bench/bench_realsize.py [--model PATH] [--model-b PATH] [--only memory,load]
        [--runs 3]

How the page cache is dropped is printed: ``/proc/sys/vm/drop_caches`` where it can be
written, else ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file (the model and the cache
dir's files), which drops their clean pages only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.client import AsyncClient  # noqa: E402
from modeld.config import default_cpu_threads  # noqa: E402
from modeld.engine.engines import DEFAULT_MAX_TOKENS, estimate_from_size  # noqa: E402
from modeld.store.store import sha256_file  # noqa: E402
from tests.support.daemon import DaemonProcess, checkout_pythonpath, daemon_env  # noqa: E402
from tests.support.memory import fadvise_dontneed, pss_sampler, rollup  # noqa: E402
from tests.support.state import install_fixture, write_entry  # noqa: E402

CACHE = Path(
    os.environ.get("MODELD_TEST_MODEL_CACHE", Path.home() / ".cache" / "modeld-test-models")
)
MODEL = CACHE / "gemma3-1b-real.litertlm"
MODEL_B = CACHE / "gemma3-1b-real-pattern.litertlm"
MIB = 1024 * 1024
# The main backend of the daemon's engines and of the direct peer (``--backend``).
BACKEND = {"main": "cpu"}
SHORT = "Tell me a story about a robot who learns to paint."
SENTENCE = "The quick brown fox jumps over the lazy dog, and the sea is calm tonight. "

# The direct peer: one engine made as the runner makes it; one JSON command a line.
DIRECT = r"""
import json, os, sys, time
import litert_lm
from modeld.modelfile.runtime import CreateSpec, create_engine

def rollup():
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out

spec = CreateSpec.from_json(json.loads(sys.argv[1]))
say = lambda doc: (sys.stdout.write(json.dumps(doc) + "\n"), sys.stdout.flush())
engines = []
for line in sys.stdin:
    cmd = json.loads(line)
    op = cmd["op"]
    if op == "create":
        t = time.perf_counter()
        engines.append(create_engine(spec))
        say({"seconds": time.perf_counter() - t, "mem": rollup()})
    elif op == "mem":
        say({"mem": rollup()})
    elif op == "gen":
        engine = engines[-1]
        t = time.perf_counter()
        conv = engine.create_conversation(max_output_tokens=cmd["tokens"])
        first, chunks = None, 0
        for _ in conv.send_message_async(cmd["prompt"]):
            chunks += 1
            if first is None:
                first = time.perf_counter() - t
        total = time.perf_counter() - t
        info = conv.get_benchmark_info()
        conv.close()
        say({"first": first, "total": total,
             "prompt_tokens": info.last_prefill_token_count,
             "tokens": info.last_decode_token_count,
             "prefill_tps": info.last_prefill_tokens_per_second,
             "decode_tps": info.last_decode_tokens_per_second})
    elif op == "quit":
        break
os._exit(0)
"""


def mem_row(m: dict[str, int]) -> str:
    """RSS, PSS, its anonymous and file-backed parts, and the private dirty pages, in MiB."""
    keys = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Private_Dirty")
    return " ".join(f"{m.get(k, 0) / MIB:8.0f}" for k in keys)


MEM_HEAD = "     RSS      PSS anon PSS file PSS priv.dirty (MiB)"


class Direct:
    """The direct peer process (``DIRECT``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - read back on a failure
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DIRECT, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, "PYTHONPATH": checkout_pythonpath()},
        )

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            tail = self.log.read()[-2000:].decode(errors="replace")
            raise SystemExit(f"the direct peer died (exit {self.proc.wait()}):\n{tail}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def close(self) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=30)


def direct_spec(path: Path, cache_dir: Path, threads: int, max_tokens: int) -> dict[str, Any]:
    return {
        "path": str(path),
        "backend": BACKEND["main"],
        "threads": threads,
        "max_tokens": max_tokens,
        "cache_dir": str(cache_dir),
    }


def drop_page_cache(paths: list[Path]) -> str:
    """Drop the page cache of ``paths`` (files, or every file under a folder); say how."""
    with contextlib.suppress(OSError):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    fadvise_dontneed(paths)
    return "posix_fadvise(DONTNEED)"


def long_prompt(words: int) -> str:
    return (SENTENCE * (words // len(SENTENCE.split()) + 1)).strip()


@contextlib.contextmanager
def daemon(
    models: dict[str, Path], entries: dict[str, Path] | None = None, **env: str
) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon with ``models`` installed and ``entries`` in its registry only."""
    with tempfile.TemporaryDirectory(prefix="mdr-", dir="/tmp") as tmp:
        root = Path(tmp)
        home, registry = root / "home", root / "registry"
        for name, path in models.items():
            install_fixture(home, name, path, registry=registry)
        for name, path in (entries or {}).items():
            write_entry(registry, name, size=path.stat().st_size, sha256=sha256_file(path)[0])
        d = DaemonProcess(
            home=home,
            env=daemon_env(
                home,
                MODELD_REGISTRY=str(registry),
                MODELD_LOG_LEVEL="warning",
                MODELD_MAIN_BACKEND=BACKEND["main"],
                **env,
            ),
        )
        d.start()
        try:
            yield d, root
        finally:
            d.stop(timeout=60)


async def generate(c: AsyncClient, model: str, prompt: str, tokens: int, **extra: Any) -> Any:
    """One streamed reply; the final record, with the client's own first-token time."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, **extra}
    t = time.perf_counter()
    first = None
    final: dict[str, Any] = {}
    async for rec in c.stream("POST", "/api/modeld/generate", body):
        if first is None and "token" in rec:
            first = time.perf_counter() - t
        if rec.get("done"):
            final = rec
    final["client_first"] = first
    final["client_total"] = time.perf_counter() - t
    return final


def learned_rows(home: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(home / "modeld.db")) as db:
        return db.execute("SELECT plan_key, max_tokens, pss FROM memory").fetchall()


def rates(rec: dict[str, Any]) -> tuple[float | None, float | None]:
    """(prefill tok/s, decode tok/s) of a daemon reply's final record."""
    t = rec.get("timings") or {}
    prefill = rec["prompt_tokens"] / t["prefill"] if t.get("prefill") else None
    return prefill, t.get("decode_tokens_per_second")


# --- memory --------------------------------------------------------------------------------


async def memory_daemon(d: DaemonProcess, words: int) -> dict[str, Any]:
    got: dict[str, Any] = {}
    async with AsyncClient(d.socket) as c:
        view = await c.request("POST", "/api/engines", {"model": "real"})
        pid = view["pid"]
        got["estimate"], got["max_tokens"] = view["pss_file_estimate"], view["max_tokens"]
        got["load"] = rollup(pid)
        got["reply"] = await generate(c, "real", SHORT, 16)
        got["after_reply"] = rollup(pid)
        got["long"] = await generate(c, "real", long_prompt(words), 16)
        got["after_long"] = rollup(pid)
        await asyncio.sleep(2.5)  # the watcher reads PSS every second
        got["view"] = (await c.request("GET", "/api/engines"))["engines"][0]
        got["rows"] = learned_rows(d.home)
    return got


def section_memory(args: argparse.Namespace) -> None:
    threads = default_cpu_threads()
    words = args.long_words
    with daemon({"real": args.model}) as (d, root):
        got = asyncio.run(memory_daemon(d, words))
        direct = Direct(direct_spec(args.model, root / "direct", threads, got["max_tokens"]))
        try:
            dl = direct.ask(op="create")["mem"]
            direct.ask(op="gen", prompt=SHORT, tokens=16)
            dr = direct.ask(op="mem")["mem"]
            direct.ask(op="gen", prompt=long_prompt(words), tokens=16)
            dlong = direct.ask(op="mem")["mem"]
            # Two engines of one file: a second process, same file.
            second = Direct(direct_spec(args.model, root / "direct", threads, got["max_tokens"]))
            try:
                second.ask(op="create")
                second.ask(op="gen", prompt=SHORT, tokens=16)
                pair = (direct.ask(op="mem")["mem"], second.ask(op="mem")["mem"])
            finally:
                second.close()
        finally:
            direct.close()
    print(f"model {args.model.name} ({args.model.stat().st_size / 1e6:.0f} MB), {threads} threads")
    short, long = got["reply"]["prompt_tokens"], got["long"]["prompt_tokens"]
    print(f"  prompt tokens: short {short}, long {long}")
    print(f"  {'':28}{MEM_HEAD}")
    for label, dm, pm in (
        ("after load", got["load"], dl),
        ("after first reply", got["after_reply"], dr),
        ("after long prompt", got["after_long"], dlong),
    ):
        print(f"  {label:18} daemon  {mem_row(dm)}")
        ratio = dm["Pss"] / pm["Pss"] if pm["Pss"] else 0
        print(f"  {'':18} direct  {mem_row(pm)}   PSS ratio {ratio:.2f}")
    peak = max(got["view"]["peak_pss"] or 0, got["after_long"]["Pss"])
    est = got["estimate"]
    verdict = "met" if 0.85 <= est / peak <= 1.15 else "NOT met"
    print(
        f"  estimate before load {est / MIB:.0f} MiB, measured peak {peak / MIB:.0f} MiB:"
        f" x{est / peak:.2f} (goal 0.85-1.15: {verdict})"
    )
    view = got["view"]
    learned = view.get("pss_learned")
    print(
        f"  after the runs: pss_learned {learned and learned / MIB:.0f} MiB in the view,"
        f" memory rows {[(k, t, round(p / MIB)) for k, t, p in got['rows']]}"
    )
    a, b = pair
    print(
        f"  two engines of one file (two processes): PSS {a['Pss'] / MIB:.0f} + "
        f"{b['Pss'] / MIB:.0f} = {(a['Pss'] + b['Pss']) / MIB:.0f} MiB, RSS {a['Rss'] / MIB:.0f}"
        f" + {b['Rss'] / MIB:.0f} MiB; alone it was {dr['Pss'] / MIB:.0f} MiB PSS"
    )


# --- fit ---------------------------------------------------------------------------------


def section_fit(args: argparse.Namespace) -> None:
    """A pull of the real-size model, not installed, under a budget between the old estimate
    and the measured peak: refused before any byte is asked for."""
    size = args.model.stat().st_size
    needs = estimate_from_size(size, DEFAULT_MAX_TOKENS)
    budget = int(needs * 0.9)
    with daemon({}, {"real-entry": args.model}, MODELD_MEMORY_BUDGET=str(budget)) as (d, _):
        listed = d.cli_json("list")
        pulled = d.cli("pull", "real-entry")
    fit = next(m for m in listed["models"] if m["id"] == "real-entry")["fit"]
    print(
        f"entry of {size / 1e6:.0f} MB, not installed, budget {budget / MIB:.0f} MiB: fit needs"
        f" {fit['needs'] / MIB:.0f} MiB (from the {fit['source']}), fits {fit['fits']}"
    )
    print(f"  modeld pull: exit {pulled.returncode}: {pulled.stderr.strip()[:300]}")


# --- pool ------------------------------------------------------------------------------------


async def pool_runs(d: DaemonProcess, rounds: int) -> dict[str, Any]:
    async with AsyncClient(d.socket) as c, AsyncClient(d.socket) as s:
        async with pss_sampler(s) as seen:
            replies = [
                await generate(c, model, SHORT, 16)
                for _ in range(rounds)
                for model in ("real", "real-b")
            ]
        doc = await c.request("GET", "/api/engines")
    return {"max_sum": seen[0], "doc": doc, "replies": replies}


def section_pool(args: argparse.Namespace) -> None:
    if not args.model_b.is_file():
        print(f"pool: {args.model_b} is not cached; build it with build.py --real-size")
        return
    budget = int(args.model.stat().st_size * 2.1)
    with daemon({"real": args.model, "real-b": args.model_b}, MODELD_MEMORY_BUDGET=str(budget)) as (
        d,
        _,
    ):
        got = asyncio.run(pool_runs(d, args.runs))
        log = d.log()
    ev = got["doc"]["recent_evictions"]
    print(f"budget {budget / MIB:.0f} MiB (holds one engine); {2 * args.runs} replies alternating")
    print(
        f"  max sampled PSS sum {got['max_sum'] / MIB:.0f} MiB ({got['max_sum'] / budget:.2f}"
        f" of the budget), pool's max_used {got['doc']['max_used'] / MIB:.0f} MiB"
    )
    print(f"  evictions {len(ev)}: {sorted({e['reason'] for e in ev})}")
    killed = [ln for ln in log.splitlines() if "oom" in ln.lower() or "crash" in ln.lower()]
    print(f"  OOM or crash lines in the daemon log: {len(killed)}")


# --- load ------------------------------------------------------------------------------------


async def load_once(c: AsyncClient) -> tuple[float, dict[str, Any]]:
    with contextlib.suppress(Exception):
        await c.request("DELETE", "/api/engines/real")
    for _ in range(200):  # the spare runner back, so every load starts alike
        if (await c.request("GET", "/api/engines"))["spare"]["pid"]:
            break
        await asyncio.sleep(0.05)
    t = time.perf_counter()
    view = await c.request("POST", "/api/engines", {"model": "real"})
    return time.perf_counter() - t, view


def section_load(args: argparse.Namespace) -> None:
    threads = default_cpu_threads()
    res: dict[str, list[float]] = {k: [] for k in ("d_cold", "x_cold", "d_warm", "x_warm")}
    create: dict[str, list[float]] = {"cold": [], "warm": []}
    how = ""
    with daemon({"real": args.model}) as (d, root):

        async def run() -> None:
            nonlocal how
            async with AsyncClient(d.socket) as c:
                await load_once(c)  # builds the XNNPACK cache
                view = None
                spec = None
                for i in range(args.runs * 2):
                    kind = "cold" if i % 2 == 0 else "warm"
                    caches = [args.model, d.home / "cache", root / "direct"]
                    if kind == "cold":
                        how = await asyncio.to_thread(drop_page_cache, caches)
                    seconds, view = await load_once(c)
                    res[f"d_{kind}"].append(seconds)
                    create[kind].append(view["create_seconds"])
                    await c.request("DELETE", "/api/engines/real")
                    spec = spec or direct_spec(
                        args.model, root / "direct", threads, view["max_tokens"]
                    )
                    if i == 0:
                        x = Direct(spec)
                        x.ask(op="create")
                        x.close()
                    if kind == "cold":
                        await asyncio.to_thread(drop_page_cache, caches)
                    x = Direct(spec)
                    # The interpreter and runtime imported, as in a spare runner.
                    await asyncio.sleep(1.0)
                    res[f"x_{kind}"].append(x.ask(op="create")["seconds"])
                    x.close()

        asyncio.run(run())
    print(f"model {args.model.name}, {args.runs} cold and {args.runs} warm loads each")
    print(f"  page cache dropped by {how}")
    for kind in ("cold", "warm"):
        dm, xm = statistics.median(res[f"d_{kind}"]), statistics.median(res[f"x_{kind}"])
        cm = statistics.median(create[kind])
        print(
            f"  {kind}: daemon POST /api/engines {dm:.2f} s (runner's Engine() {cm:.2f} s),"
            f" direct Engine() {xm:.2f} s: x{dm / xm:.2f} (goal <= 1.05)"
        )


# --- threads ---------------------------------------------------------------------------------


def thread_rates(path: Path, threads: int, runs: int, tokens: int, prompt: str) -> Any:
    """``bench/bench_threads.py``'s ``measure``: one child per thread count."""
    spec = importlib.util.spec_from_file_location(
        "bench_threads", REPO / "bench" / "bench_threads.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.measure(path, threads, runs, tokens, prompt)


def section_threads(args: argparse.Namespace) -> None:
    cpus = len(os.sched_getaffinity(0))
    counts = sorted({1, 2, 4, 8, 16, cpus} & set(range(1, cpus + 1)))
    default = default_cpu_threads()
    prompt = long_prompt(128)
    print(f"model {args.model.name}: {cpus} CPUs, default {default} threads; median of {args.runs}")
    print("| threads | prefill tok/s | decode tok/s | |")
    print("|---:|---:|---:|---|")
    rows = {}
    for n in counts:
        rows[n] = thread_rates(args.model, n, args.runs, 32, prompt)
        r = rows[n]
        mark = "default" if n == default else ""
        print(f"| {n} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | {mark} |", flush=True)
    for key in ("prefill_tps", "decode_tps"):
        best = max(rows.values(), key=lambda r: r[key])[key]
        mine = rows[default][key] if default in rows else 0.0
        print(f"  {key}: default {mine / best:.3f} of the best row (goal >= 0.95)")


# --- generate --------------------------------------------------------------------------------

BENCH = r"""
import json, sys, time, litert_lm
path, cache, threads, prefill, decode, backend = sys.argv[1:7]
import os; os.makedirs(cache, exist_ok=True)  # the runtime refuses a missing cache dir
b = litert_lm.Benchmark(path, litert_lm.Backend.GPU() if backend == "gpu"
                        else litert_lm.Backend.CPU(thread_count=int(threads)),
                        prefill_tokens=int(prefill), decode_tokens=int(decode), cache_dir=cache)
info = b.run()
doc = {k: getattr(info, k) for k in dir(info) if not k.startswith("_")
       and isinstance(getattr(info, k), (int, float, list))}
print(json.dumps(doc, default=str), flush=True)
import os; os._exit(0)
"""


async def gen_daemon(c: AsyncClient, prompt: str, tokens: int, **extra: Any) -> dict[str, Any]:
    rec = await generate(c, "real", prompt, tokens, **extra)
    prefill, decode = rates(rec)
    return {
        "first": rec["client_first"],
        "prefill_tps": prefill,
        "decode_tps": decode,
        "prompt_tokens": rec["prompt_tokens"],
        "tokens": rec["tokens"],
    }


def section_generate(args: argparse.Namespace) -> None:
    threads = default_cpu_threads()
    prompt = long_prompt(args.prompt_words)
    tokens = 64
    got: dict[str, list[dict[str, Any]]] = {"daemon": [], "direct": [], "conversation": []}
    with daemon({"real": args.model}) as (d, root):

        async def run() -> None:
            async with AsyncClient(d.socket) as c:
                view = await c.request("POST", "/api/engines", {"model": "real"})
                x = Direct(direct_spec(args.model, root / "direct", threads, view["max_tokens"]))
                try:
                    x.ask(op="create")
                    x.ask(op="gen", prompt=SHORT, tokens=4)
                    await gen_daemon(c, SHORT, 4)
                    for _ in range(args.runs):
                        got["direct"].append(x.ask(op="gen", prompt=prompt, tokens=tokens))
                        got["daemon"].append(await gen_daemon(c, prompt, tokens))
                        # The same job with a one-character system turn: two messages are
                        # answered on a conversation, not a bare session (``session_plain``).
                        got["conversation"].append(await gen_daemon(c, prompt, tokens, system="."))
                finally:
                    x.close()

        asyncio.run(run())
        n_prompt = got["direct"][0]["prompt_tokens"]
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                BENCH,
                str(args.model),
                str(root / "bench"),
                str(threads),
                str(n_prompt),
                str(tokens),
                BACKEND["main"],
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(
            f"litert_lm.Benchmark failed (exit {out.returncode}):\n{out.stderr[-2000:]}"
        )
    bench = json.loads(lines[-1])

    def med(side: str, key: str) -> float:
        return float(statistics.median(r[key] for r in got[side] if r[key] is not None))

    print(
        f"model {args.model.name}, {threads} threads, prompt {n_prompt} tokens, {tokens}"
        f" decoded; median of {args.runs}"
    )
    print("| | first token s | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|")
    for side in ("direct", "daemon", "conversation"):
        first, pre, dec = (med(side, k) for k in ("first", "prefill_tps", "decode_tps"))
        print(f"| {side} | {first:.3f} | {pre:.1f} | {dec:.2f} |")
    print(f"| litert_lm.Benchmark | {bench} |")
    for key in ("prefill_tps", "decode_tps"):
        print(
            f"  daemon/direct {key}: x{med('daemon', key) / med('direct', key):.3f} (goal >= 0.98)"
        )
    print(f"  first token daemon/direct: x{med('daemon', 'first') / med('direct', 'first'):.3f}")
    print(
        f"  bare session vs conversation (daemon): first token x"
        f"{med('daemon', 'first') / med('conversation', 'first'):.3f}, decode x"
        f"{med('daemon', 'decode_tps') / med('conversation', 'decode_tps'):.3f}"
    )


SECTIONS = {
    "memory": section_memory,
    "fit": section_fit,
    "pool": section_pool,
    "load": section_load,
    "threads": section_threads,
    "generate": section_generate,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--model-b", type=Path, default=MODEL_B)
    parser.add_argument("--only", default=",".join(SECTIONS))
    parser.add_argument("--backend", choices=["cpu", "gpu"], default="cpu", help="main backend")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-words", type=int, default=1100, help="the long prompt's words")
    parser.add_argument("--prompt-words", type=int, default=100, help="generate's prompt")
    args = parser.parse_args()
    BACKEND["main"] = args.backend
    if not args.model.is_file():
        print(f"{args.model} is not cached: build it with tests/models/build.py --real-size")
        return 1
    print(f"host: {os.uname().nodename}, {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}")
    for name in args.only.split(","):
        print(f"\n== {name}")
        SECTIONS[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
