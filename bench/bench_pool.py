"""Engine pool benchmark: the daemon's overhead against direct in-process LiteRT-LM.

One run, same tiny model (tests/models/tiny-text.litertlm), same prompt and token count:
(1) warm generate through a real daemon (Unix socket, NDJSON, runner process) vs a direct
    in-process ``litert_lm`` conversation: p50 overhead;
(2) a cold request (no engine loaded; the spare runner is ready) vs a direct ``Engine()``
    plus the same generation;
(3) PSS per runner, and the daemon's own PSS before any engine exists.

Usage: ``python bench/bench_pool.py [--runs 40] [--cold-runs 8]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.client import Client  # noqa: E402
from modeld.runner import read_memory  # noqa: E402
from tests.conftest import DaemonProcess, daemon_env, install_fixture  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text.litertlm"
PROMPT = "hello there"
TOKENS = 8


def p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


def direct_runs(runs: int, cold_runs: int, cache: Path) -> tuple[list[float], list[float]]:
    import litert_lm

    cache.mkdir(parents=True, exist_ok=True)

    def one(engine: litert_lm.Engine) -> None:
        conv = engine.create_conversation(max_output_tokens=TOKENS)
        for _ in conv.send_message_async(PROMPT):
            pass
        conv.close()

    cold = []
    for _ in range(cold_runs):
        t = time.perf_counter()
        engine = litert_lm.Engine(
            str(MODEL), backend=litert_lm.Backend.CPU(), cache_dir=str(cache), max_num_tokens=256
        )
        one(engine)
        cold.append(time.perf_counter() - t)
    warm = []
    one(engine)
    for _ in range(runs):
        t = time.perf_counter()
        one(engine)
        warm.append(time.perf_counter() - t)
    return warm, cold


async def daemon_runs(d: DaemonProcess, runs: int, cold_runs: int) -> dict[str, object]:
    body = {"model": "tiny-text", "prompt": PROMPT, "max_tokens": TOKENS}
    async with Client(d.socket) as c:
        await asyncio.sleep(2)  # let the spare runner start
        assert d.proc is not None
        daemon_pss = read_memory(d.proc.pid)[0]
        status = await c.request("GET", "/api/engines")
        spare_pss = status["spare"]["pss"]

        async def once() -> float:
            t = time.perf_counter()
            async for _ in c.stream("POST", "/api/generate", body):
                pass
            return time.perf_counter() - t

        cold = []
        for _ in range(cold_runs):
            cold.append(await once())
            await c.request("DELETE", "/api/engines/tiny-text")
            await asyncio.sleep(1.0)  # the spare runner refills in the background
        await once()
        warm = [await once() for _ in range(runs)]
        engines = (await c.request("GET", "/api/engines"))["engines"]
    return {
        "warm": warm,
        "cold": cold,
        "daemon_pss": daemon_pss,
        "spare_pss": spare_pss,
        "runner_pss": engines[0]["pss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--cold-runs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mdb-", dir="/tmp") as tmp:
        root = Path(tmp)
        home, registry = root / "home", root / "registry"
        install_fixture(home, "tiny-text", MODEL, registry=registry)
        d = DaemonProcess(
            home=home,
            env=daemon_env(home, MODELD_REGISTRY=str(registry), MODELD_LOG_LEVEL="warning"),
        )
        d.start()
        try:
            got = asyncio.run(daemon_runs(d, args.runs, args.cold_runs))
        finally:
            d.stop()
        warm_direct, cold_direct = direct_runs(args.runs, args.cold_runs, root / "direct-cache")
    warm_daemon: list[float] = got["warm"]  # type: ignore[assignment]
    cold_daemon: list[float] = got["cold"]  # type: ignore[assignment]
    mib = 1024 * 1024
    print(f"(1) warm generate, {TOKENS} tokens, p50 of {args.runs}:")
    print(f"    direct in-process  {p50(warm_direct):7.2f} ms")
    print(f"    through the daemon {p50(warm_daemon):7.2f} ms")
    print(f"    overhead           {p50(warm_daemon) - p50(warm_direct):+7.2f} ms (target <= 2 ms)")
    print(f"(2) cold request, p50 of {args.cold_runs}:")
    print(f"    direct Engine()+generate {p50(cold_direct):7.2f} ms")
    print(f"    daemon (spare runner)    {p50(cold_daemon):7.2f} ms")
    print(
        f"    overhead                 {p50(cold_daemon) - p50(cold_direct):+7.2f} ms "
        "(target <= 150 ms)"
    )
    print("(3) memory (PSS):")
    print(f"    daemon, no engines  {got['daemon_pss'] / mib:7.1f} MiB")  # type: ignore[operator]
    print(f"    spare runner        {got['spare_pss'] / mib:7.1f} MiB")  # type: ignore[operator]
    print(f"    runner with engine  {got['runner_pss'] / mib:7.1f} MiB")  # type: ignore[operator]


if __name__ == "__main__":
    main()
