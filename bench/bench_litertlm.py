"""Benchmark: reading a .litertlm header from a 2 GB (sparse) file.

Prints median and p99 per read for modeld's reader and, for comparison, for
litert_lm_builder's own header reader (``litertlm_peek.read_litertlm_header``, which
only maps the flatbuffer root), its full ``peek_litertlm_file`` (decodes and prints
every section and the LlmMetadata) and the runtime's ``litert_lm.ModelInfo``.

    python bench/bench_litertlm.py [-n 500] [--model tests/models/x.litertlm]
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from litert_lm_builder import litertlm_peek

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.modelfile.header import read_header  # noqa: E402 - after the repo is on sys.path

SIZE = 2 * 1024**3


def timings(fn: Callable[[], object], n: int) -> list[float]:
    fn()  # warm caches and imports
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return sorted(out)


def p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def runtime_model_info(path: Path) -> Callable[[], object] | None:
    try:
        import litert_lm

        with litert_lm.ModelInfo(str(path)) as mi:
            _ = mi.min_runtime_version
    except Exception as e:
        print(f"(litert_lm.ModelInfo unavailable: {type(e).__name__}: {e})")
        return None

    def run() -> object:
        with litert_lm.ModelInfo(str(path)) as mi:
            return mi.min_runtime_version

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=500)
    parser.add_argument("--model", type=Path, default=REPO / "tests/models/gemma3n-like.litertlm")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "padded.litertlm"
        shutil.copyfile(args.model, path)
        with path.open("r+b") as f:
            f.truncate(SIZE)  # sparse: no 2 GB written
        info = read_header(path)
        print(
            f"file: {args.model.name} padded to {info.file_size:,} bytes, "
            f"{len(info.sections)} sections, header {info.header_end} bytes; n={args.n}"
        )

        candidates: dict[str, Callable[[], object]] = {
            "modeld read_header": lambda: read_header(path),
            "builder read_litertlm_header": lambda: litertlm_peek.read_litertlm_header(
                str(path), io.StringIO()
            ),
            "builder peek_litertlm_file": lambda: litertlm_peek.peek_litertlm_file(
                str(path), None, io.StringIO()
            ),
        }
        if (rt := runtime_model_info(path)) is not None:
            candidates["litert_lm.ModelInfo"] = rt

        results = {name: timings(fn, args.n) for name, fn in candidates.items()}
        ours = statistics.median(results["modeld read_header"])
        print(f"{'reader':32} {'median ms':>10} {'p99 ms':>10} {'median / ours':>14}")
        for name, xs in results.items():
            med = statistics.median(xs)
            print(f"{name:32} {med:10.3f} {p99(xs):10.3f} {med / ours:14.2f}")


if __name__ == "__main__":
    main()
