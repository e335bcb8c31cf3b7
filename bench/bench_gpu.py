"""GPU benchmark: a cold load and the first reply through the daemon vs ``litert_lm`` direct.

Run it on a host whose GPU the runtime can use (the Vulkan loader and the driver's ICD
installed). Each run starts a fresh daemon (its own state dir, so a cold GPU program cache)
with the default settings (main=gpu) and imports the model through the CLI; then:

- **first load**: ``modeld load ID`` wall time (CLI subprocess), which includes the one-time
  GPU probe of the file, and the daemon's own ``engine_create`` (the runner's ``Engine()``);
- **load, probe recorded**: unload, then ``POST /api/engines`` over the socket (no CLI start);
- **cold request**: unload, then ``modeld run ID PROMPT`` (load + the first reply), wall time
  and the daemon's ``first_token`` (from the request's arrival).
- **warm-up**: a load with ``warm_up: false`` and one with ``warm_up: true`` (the default
  for gpu plans), each followed by ``--steady`` requests: the first request's ``first_token``
  after each load against the median of the later ones (steady state), and the warm-up's own
  time at load (``warm_up_seconds``, apart from ``create_seconds``).

The peer is a direct ``litert_lm.Engine(path, backend=GPU)`` in a child process of this bench
(same process tree, same ``.litertlm`` file, a fresh cache dir), timed from the process's start
(interpreter and runtime import included, as a runner pays them), ``Engine()`` alone, and the
first streamed chunk of the same prompt. Medians over ``--runs``; ratio = daemon / direct.

Usage: ``python bench/bench_gpu.py [--model PATH] [--runs 3] [--tokens 8]``. Exits 2 with the
runtime's reason where the GPU cannot be used (nothing to compare).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.hostinfo import runtime_version  # noqa: E402
from modeld.store.store import sha256_file  # noqa: E402
from tests.support.daemon import DaemonProcess, default_backend_env  # noqa: E402
from tests.support.state import write_entry  # noqa: E402
from tests.support.unix import unix_request  # noqa: E402

MODEL = REPO / "tests" / "models" / "tiny-text.litertlm"
PROMPT = "hello there"

# The direct peer, run as `python -c DIRECT PATH CACHE TOKENS PROMPT`: one JSON line.
DIRECT = """
import json, sys, time
t0 = time.perf_counter()
import litert_lm
path, cache, tokens, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t1 = time.perf_counter()
try:
    engine = litert_lm.Engine(path, backend=litert_lm.Backend.GPU(), cache_dir=cache)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.exit(1)
t2 = time.perf_counter()
conversation = engine.create_conversation(max_output_tokens=tokens)
first = None
for _ in conversation.send_message_async(prompt, max_output_tokens=tokens):
    first = first or time.perf_counter()
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "engine": t2 - t1, "to_engine": t2 - t0,
                  "first_chunk": (first or t3) - t2, "reply": t3 - t2}), flush=True)
sys.stdout.flush()
import os; os._exit(0)
"""


def fail(message: str) -> None:
    """Nothing to compare on this host: say why on stderr and exit 2."""
    print(f"bench_gpu: {message}", file=sys.stderr)
    raise SystemExit(2)


def direct(path: Path, cache: Path, tokens: int) -> dict[str, float]:
    """One direct Engine() on gpu and one reply, in a child process; its timings."""
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", DIRECT, str(path), str(cache), str(tokens), PROMPT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    wall = time.perf_counter() - started
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    doc = json.loads(lines[-1]) if lines else {"error": out.stderr[-2000:]}
    if "error" in doc:
        from modeld.modelfile.probe import extract_reason

        reason = extract_reason(out.stderr, doc["error"])
        fail(f"a direct Engine() on gpu fails here: {reason}")
    doc["process_wall"] = wall
    return {k: float(v) for k, v in doc.items()}


def daemon_run(path: Path, tokens: int, steady: int) -> dict[str, float]:
    """One fresh daemon: first load (CLI), load with the probe recorded (API), cold request."""
    tmp = Path(tempfile.mkdtemp(prefix="md-bg-", dir="/tmp"))
    registry, home = tmp / "registry", tmp / "home"
    digest, size = sha256_file(path)
    write_entry(registry, "bench", size=size, sha256=digest)
    d = DaemonProcess(home=home, env=default_backend_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        assert d.cli("import", str(path), "bench").returncode == 0, "import failed"
        started = time.perf_counter()
        assert d.cli("--version").returncode == 0
        cli_start = time.perf_counter() - started
        started = time.perf_counter()
        first = d.cli("load", "bench", "--json")
        first_wall = time.perf_counter() - started
        if first.returncode != 0:
            fail(f"the daemon could not load the model: {first.stderr.strip()}")
        view = json.loads(first.stdout)
        if view["plan"]["main"] != "gpu":
            gpu = d.cli_json("show", "bench")["probes"].get("gpu") or {}
            fail(f"the daemon's GPU probe failed here, so it loaded on cpu: {gpu.get('reason')}")
        report = d.cli_json("bug-report", "bench", "--output", str(tmp / "report.md"))
        assert report["size"] > 0
        status, doc = unix_request(d.socket, "GET", "/api/models/bench/bug-report")
        probe = next(e for e in doc["events"] if e["kind"] == "gpu_probe")["fields"]
        d.cli_json("unload", "bench")
        started = time.perf_counter()
        status, again = unix_request(d.socket, "POST", "/api/engines", {"model": "bench"})
        again_wall = time.perf_counter() - started
        assert status == 200, again
        d.cli_json("unload", "bench")
        started = time.perf_counter()
        ran = d.cli("run", "bench", PROMPT, "--max-tokens", str(tokens), "--json")
        run_wall = time.perf_counter() - started
        assert ran.returncode == 0, ran.stderr
        final = json.loads(ran.stdout)
        assert final["engine"] == "bench:gpu", final["engine"]
        warm = warm_up_rows(d.socket, tokens, steady)
        return {
            **warm,
            "first_load_wall": first_wall,
            "first_load_create": view["create_seconds"],
            "first_load_daemon": view["load_seconds"],
            "probe": probe["seconds"],
            "cli_start": cli_start,
            "adapter": view["adapter"],
            "load_api_wall": again_wall,
            "load_api_create": again["create_seconds"],
            "run_wall": run_wall,
            "run_first_token": final["timings"]["first_token"],
            "run_create": final["timings"]["engine_create"],
        }
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def warm_up_rows(socket: Path, tokens: int, steady: int) -> dict[str, float]:
    """First request after a load without and with warm-up, against the steady state."""
    out: dict[str, float] = {}
    body = {"model": "bench", "prompt": PROMPT, "max_tokens": tokens}
    for mode in ("cold", "warm"):
        unix_request(socket, "DELETE", "/api/engines/bench")
        status, view = unix_request(
            socket, "POST", "/api/engines", {"model": "bench", "warm_up": mode == "warm"}
        )
        assert status == 200, view
        firsts = []
        for _ in range(steady + 1):
            status, records = unix_request(
                socket, "POST", "/api/modeld/generate", body, timeout=300
            )
            assert status == 200, records
            firsts.append(float(records[-1]["timings"]["first_token"]))
        out[f"{mode}_first"] = firsts[0]
        out[f"{mode}_steady"] = statistics.median(firsts[1:])
        out[f"{mode}_create"] = float(view["create_seconds"])
        out[f"{mode}_warm_up"] = float(view["warm_up_seconds"] or 0.0)
    return out


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(float(r[key]) for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL, help="a .litertlm file")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--steady", type=int, default=5, help="requests after each load")
    args = parser.parse_args()
    path = args.model.resolve()
    if path.suffix != ".litertlm":
        fail("the runtime picks the format by extension; give a .litertlm file")
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, float]] = []
    for _ in range(args.runs):
        # Interleaved, each with a cold cache: a shared machine's load hits both alike.
        with tempfile.TemporaryDirectory(prefix="md-bgd-") as cache:
            theirs.append(direct(path, Path(cache), args.tokens))
        ours.append(daemon_run(path, args.tokens, args.steady))
    for t in theirs:
        t["cold_process"] = t["process_wall"] - t["reply"]
        t["first_reply"] = t["engine"] + t["first_chunk"]
    rows: list[tuple[str, str, str | None]] = [
        (
            "cold load: `modeld load` wall (CLI start, GPU probe, load) vs a process to Engine()",
            "first_load_wall",
            "cold_process",
        ),
        ("the CLI's own start in it (`modeld --version`)", "cli_start", None),
        ("the GPU probe in it (once per file and runtime)", "probe", None),
        (
            "the daemon's load_seconds (probe excluded) vs import + Engine()",
            "first_load_daemon",
            "to_engine",
        ),
        ("Engine() on gpu: the daemon's engine_create vs direct", "first_load_create", "engine"),
        (
            "load again, probe recorded (API wall) vs import + Engine()",
            "load_api_wall",
            "to_engine",
        ),
        ("cold request: `modeld run` wall vs the whole direct process", "run_wall", "process_wall"),
        (
            "first reply: the daemon's first_token (cold request) vs Engine() + first chunk",
            "run_first_token",
            "first_reply",
        ),
    ]
    print(
        f"model {path.name}, litert-lm {runtime_version()}, adapter {ours[0]['adapter']}, "
        f"median of {args.runs} run(s), {args.tokens} tokens"
    )
    print()
    print("| phase | daemon (s) | direct (s) | daemon / direct |")
    print("|---|---:|---:|---:|")
    for label, ours_key, theirs_key in rows:
        a = med(ours, ours_key)
        if theirs_key is None:
            print(f"| {label} | {a:.3f} | - | - |")
            continue
        b = med(theirs, theirs_key)
        print(f"| {label} | {a:.3f} | {b:.3f} | {a / b:.2f} |")
    print()
    print("| load | engine_create (s) | warm_up (s) | first request first_token (s) |", end="")
    print(f" steady first_token, median of {args.steady} (s) | first / steady |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, label in (("cold", "warm_up: false"), ("warm", "warm_up: true (gpu default)")):
        first, steady = med(ours, f"{mode}_first"), med(ours, f"{mode}_steady")
        print(
            f"| {label} | {med(ours, f'{mode}_create'):.3f} | {med(ours, f'{mode}_warm_up'):.3f} "
            f"| {first:.4f} | {steady:.4f} | {first / steady:.1f} |"
        )
    print()
    print(
        f"direct: runtime import {med(theirs, 'import'):.3f} s, first chunk after Engine() "
        f"{med(theirs, 'first_chunk'):.3f} s, whole reply {med(theirs, 'reply'):.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
