"""Engine pool benchmark: the daemon's overhead against direct in-process LiteRT-LM.

One run, same tiny model (tests/models/tiny-text.litertlm), same prompt and token count,
direct and daemon runs interleaved (so the load of a shared machine hits both alike):
(1) warm generate through a real daemon (Unix socket, NDJSON, runner process) vs a direct
    in-process ``litert_lm`` conversation: p50/p99 and the p50 overhead; for scale, the
    HTTP floor (``GET /api/health``) and the runner protocol alone (no daemon, no HTTP);
(2) a cold request (no engine loaded; the spare runner is ready) vs a direct ``Engine()``
    plus the same generation;
(3) PSS per runner, and the daemon's own PSS before any engine exists;
(4) the file-based memory estimate against the measured PSS, for the tiny model and the
    ~40 MB one (``tests/models/build.py --large``; skipped when it is not cached).

Usage: ``python bench/bench_pool.py [--runs 100] [--cold-runs 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.client import AsyncClient  # noqa: E402
from modeld.engine.runner.child import read_memory  # noqa: E402
from modeld.engine.runner.client import Runner  # noqa: E402
from modeld.engine.runner.job import GenerateJob, Options  # noqa: E402
from modeld.modelfile.runtime import CreateSpec  # noqa: E402
from tests.support.daemon import DaemonProcess, daemon_env  # noqa: E402
from tests.support.state import install_fixture  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text.litertlm"
LARGE = (
    Path(os.environ.get("MODELD_TEST_MODEL_CACHE", Path.home() / ".cache" / "modeld-test-models"))
    / "large-text.litertlm"
)
PROMPT = "hello there"
TOKENS = 8
MIB = 1024 * 1024


def ms(xs: list[float], q: float = 0.5) -> float:
    if q == 0.5:
        return statistics.median(xs) * 1000
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1] * 1000


class Direct:
    """The peer: LiteRT-LM in this process, same model, prompt and token count."""

    def __init__(self, cache: Path) -> None:
        import litert_lm

        self.lm = litert_lm
        self.cache = cache
        cache.mkdir(parents=True, exist_ok=True)
        self.engine = self.new_engine()
        self.once()

    def new_engine(self) -> Any:
        return self.lm.Engine(
            str(MODEL), backend=self.lm.Backend.CPU(), cache_dir=str(self.cache), max_num_tokens=256
        )

    def once(self, engine: Any = None) -> float:
        t = time.perf_counter()
        conv = (engine or self.engine).create_conversation(max_output_tokens=TOKENS)
        for _ in conv.send_message_async(PROMPT):
            pass
        conv.close()
        return time.perf_counter() - t

    def cold(self) -> float:
        t = time.perf_counter()
        engine = self.new_engine()
        self.once(engine)
        return time.perf_counter() - t


async def runner_alone(runs: int, cache: Path) -> list[float]:
    """The runner protocol without the daemon: a Runner child driven from this process."""
    r = await Runner.start()
    try:
        await r.create(CreateSpec(path=str(MODEL), backend="cpu", cache_dir=str(cache)))
        job = GenerateJob(({"role": "user", "content": PROMPT},), Options(max_tokens=TOKENS))
        out = []
        for i in range(runs + 3):
            t = time.perf_counter()
            async for _ in r.generate(job):
                pass
            if i >= 3:
                out.append(time.perf_counter() - t)
        return out
    finally:
        await r.close()


async def spare_ready(c: AsyncClient) -> None:
    """Wait (up to 5 s) until the spare runner is back, so every cold run starts alike."""
    for _ in range(100):
        if (await c.request("GET", "/api/engines"))["spare"]["pid"]:
            return
        await asyncio.sleep(0.05)


async def daemon_runs(d: DaemonProcess, direct: Direct, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": "tiny-text", "prompt": PROMPT, "max_tokens": TOKENS}
    got: dict[str, Any] = {"warm": [], "direct": [], "health": [], "cold": [], "direct_cold": []}
    async with AsyncClient(d.socket) as c:
        await spare_ready(c)
        await asyncio.sleep(0.5)
        assert d.proc is not None
        got["daemon_pss"] = read_memory(d.proc.pid)[0]
        got["spare_pss"] = (await c.request("GET", "/api/engines"))["spare"]["pss"]

        async def once() -> float:
            t = time.perf_counter()
            async for _ in c.stream("POST", "/api/modeld/generate", body):
                pass
            return time.perf_counter() - t

        for _ in range(args.cold_runs):
            await spare_ready(c)
            got["cold"].append(await once())
            got["direct_cold"].append(direct.cold())
            await c.request("DELETE", "/api/engines/tiny-text")
        for _ in range(5):
            await once()
        for _ in range(args.runs):
            got["direct"].append(direct.once())
            got["warm"].append(await once())
            t = time.perf_counter()
            await c.request("GET", "/api/health")
            got["health"].append(time.perf_counter() - t)
        await asyncio.sleep(1.5)  # the watcher measures every second
        got["tiny"] = (await c.request("GET", "/api/engines"))["engines"][0]
        if LARGE.is_file():
            await c.request("DELETE", "/api/engines/tiny-text")
            await c.request("POST", "/api/engines", {"model": "large-text"})
            async for _ in c.stream(
                "POST", "/api/modeld/generate", {**body, "model": "large-text"}
            ):
                pass
            await asyncio.sleep(1.5)
            got["large"] = (await c.request("GET", "/api/engines"))["engines"][0]
    return got


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--cold-runs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mdb-", dir="/tmp") as tmp:
        root = Path(tmp)
        home, registry = root / "home", root / "registry"
        install_fixture(home, "tiny-text", MODEL, registry=registry)
        if LARGE.is_file():
            install_fixture(home, "large-text", LARGE, registry=registry)
        alone = asyncio.run(runner_alone(args.runs, root / "runner-cache"))
        direct = Direct(root / "direct-cache")
        d = DaemonProcess(
            home=home,
            env=daemon_env(home, MODELD_REGISTRY=str(registry), MODELD_LOG_LEVEL="warning"),
        )
        d.start()
        try:
            got = asyncio.run(daemon_runs(d, direct, args))
        finally:
            d.stop()
    warm, peer = got["warm"], got["direct"]
    paired = [a - b for a, b in zip(warm, peer, strict=True)]
    print(f"(1) warm generate, {TOKENS} tokens, {args.runs} interleaved runs:   p50      p99")
    print(f"    direct in-process          {ms(peer):7.2f}  {ms(peer, 0.99):7.2f} ms")
    print(f"    through the daemon         {ms(warm):7.2f}  {ms(warm, 0.99):7.2f} ms")
    print(f"    overhead (p50 - p50)       {ms(warm) - ms(peer):+7.2f} ms (target <= 2 ms)")
    print(f"    overhead (median of pairs) {ms(paired):+7.2f} ms")
    print(f"    for scale: runner alone    {ms(alone):7.2f}  {ms(alone, 0.99):7.2f} ms (no HTTP)")
    health = got["health"]
    print(f"    for scale: GET /api/health {ms(health):7.2f}  {ms(health, 0.99):7.2f} ms")
    cold, cpeer = got["cold"], got["direct_cold"]
    print(f"(2) cold request, {args.cold_runs} interleaved runs:               p50      max")
    print(f"    direct Engine()+generate   {ms(cpeer):7.2f}  {max(cpeer) * 1000:7.2f} ms")
    print(f"    daemon (spare runner)      {ms(cold):7.2f}  {max(cold) * 1000:7.2f} ms")
    print(f"    overhead                   {ms(cold) - ms(cpeer):+7.2f} ms (target <= 150 ms)")
    print("(3) memory (PSS):")
    print(f"    daemon, no engines  {got['daemon_pss'] / MIB:7.1f} MiB")
    print(f"    spare runner        {got['spare_pss'] / MIB:7.1f} MiB")
    print(f"    runner with engine  {got['tiny']['pss'] / MIB:7.1f} MiB")
    print("(4) memory estimate from the file vs measured PSS (peak):")
    for name in ("tiny", "large"):
        view = got.get(name)
        if view is None:
            print(f"    {name:5} not cached: build it with tests/models/build.py --large")
            continue
        est, peak = view["pss_file_estimate"], view["peak_pss"] or view["pss"]
        print(
            f"    {view['model']:10} file {est / MIB:6.1f} MiB  measured {peak / MIB:6.1f} MiB"
            f"  ratio {est / peak:4.2f}"
        )


if __name__ == "__main__":
    main()
