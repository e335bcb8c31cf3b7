"""Benchmark: a CPU engine's prefill and decode rates against its thread count.

For each thread count, a fresh child process creates the engine exactly as a runner does
(``modeld.modelfile.runtime.create_engine`` with ``threads``: ``Backend.CPU(thread_count=N)``),
warms it up with one short generation, then runs ``--runs`` replies of ``--tokens`` tokens to
a prompt of about ``--prompt-words`` words. Rates are the runtime's own benchmark figures
(prefill and decode tokens per second of each reply); the table shows their medians. A
process per count, because the runtime's thread pool is set up once per process.

Models: the tiny fixture (tests/models/tiny-text.litertlm) and the larger test model
(``large-text.litertlm`` from ``tests/models/build.py --large``, in
``$MODELD_TEST_MODEL_CACHE``, default ``~/.cache/modeld-test-models``) when it is there.

    python bench/bench_threads.py [--threads 1,2,4,8] [--runs 5] [--model PATH]...

The last column, ``default``, marks the count modeld picks on this machine
(``modeld.config.default_cpu_threads``: one per physical performance core it may use).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.config import default_cpu_threads  # noqa: E402 - after the repo is on sys.path
from tests.support.daemon import checkout_pythonpath  # noqa: E402

TINY = REPO / "tests" / "models" / "tiny-text.litertlm"
LARGE_CACHE = Path(
    os.environ.get("MODELD_TEST_MODEL_CACHE", Path.home() / ".cache" / "modeld-test-models")
)
LARGE = LARGE_CACHE / "large-text.litertlm"

# The child: one engine with N threads, a warm-up reply, then timed replies; one JSON line.
CHILD = """
import json, sys
from modeld.modelfile.runtime import CreateSpec, create_engine
path, cache, threads, runs, tokens, prompt = sys.argv[1:7]
engine = create_engine(CreateSpec(path=path, backend="cpu", threads=int(threads),
                                  cache_dir=cache, max_tokens=1024))
rows = []
for i in range(int(runs) + 1):
    conversation = engine.create_conversation(max_output_tokens=int(tokens))
    conversation.send_message(prompt)
    info = conversation.get_benchmark_info()
    conversation.close()
    if i:  # the first reply is the warm-up
        rows.append({"prefill_tps": info.last_prefill_tokens_per_second,
                     "decode_tps": info.last_decode_tokens_per_second,
                     "prompt_tokens": info.last_prefill_token_count,
                     "tokens": info.last_decode_token_count})
print(json.dumps(rows), flush=True)
import os; os._exit(0)
"""


def measure(path: Path, threads: int, runs: int, tokens: int, prompt: str) -> dict[str, float]:
    """Median prefill and decode tokens/s of ``runs`` replies with ``threads`` threads."""
    with tempfile.TemporaryDirectory(prefix="md-bt-") as cache:
        out = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(path),
                cache,
                str(threads),
                str(runs),
                str(tokens),
                prompt,
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
            env={
                **os.environ,
                "PYTHONPATH": checkout_pythonpath(),
            },
        )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"bench_threads: {path.name} with {threads} threads failed:\n{out.stderr}")
    rows: list[dict[str, Any]] = json.loads(lines[-1])
    return {
        "prefill_tps": statistics.median(r["prefill_tps"] for r in rows),
        "decode_tps": statistics.median(r["decode_tps"] for r in rows),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in rows),
        "tokens": statistics.median(r["tokens"] for r in rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append", help="a .litertlm (repeatable)")
    parser.add_argument("--threads", default="", help="counts, e.g. 1,2,4,8 (default: 1..cpus)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=64)
    args = parser.parse_args()
    models = args.model or [m for m in (TINY, LARGE) if m.is_file()]
    if LARGE not in models and not args.model:
        print(f"(no {LARGE}: build it with `tests/models/build.py --large`)")
    cpus = len(os.sched_getaffinity(0))
    if args.threads:
        counts = [int(c) for c in args.threads.split(",")]
    else:
        counts = sorted({1, 2, 4, 8, 12, 16, 24, 32, cpus} & set(range(1, cpus + 1)))
    default = default_cpu_threads()
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * (args.prompt_words // 9))
    print(
        f"{cpus} CPUs usable, modeld's default {default} threads; median of {args.runs} "
        f"replies of {args.tokens} tokens"
    )
    for path in models:
        print()
        print(f"model {path.name}")
        print()
        print("| threads | prefill tok/s | decode tok/s | |")
        print("|---:|---:|---:|---|")
        for n in counts:
            r = measure(path, n, args.runs, args.tokens, prompt)
            mark = "default" if n == default else ""
            print(f"| {n} | {r['prefill_tps']:.0f} | {r['decode_tps']:.0f} | {mark} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
