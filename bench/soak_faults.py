"""Fault soak: kill -9 of a real daemon at random points of pulls, loads and removals, many times.

Each cycle starts ``modeld serve``, removes/pulls ``m1`` from a throttled loopback mirror and
loads or generates on a tiny real model, kills the daemon with SIGKILL at a random instant,
then checks: no runner of it is alive, every blob's sha256 matches its name, the db passes
``integrity_check``, no row points at a missing file. At the end the pull completes to the
right bytes. Prints the kills, what was running at each (sampled), and the cycle times.

Usage: ``python bench/soak_faults.py [--cycles 300] [--seed 1]``
"""

from __future__ import annotations

import argparse
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support.faults import CycleStats, Rig, finish_and_check, kill_cycle  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    # The mirror's server logs every connection the kills cut; that is expected noise here.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    root = Path(tempfile.mkdtemp(prefix="md-soak-", dir="/tmp"))
    rig = Rig.create(root)
    rng = random.Random(args.seed)
    stats = CycleStats()
    began = time.monotonic()
    failed: str | None = None
    try:
        for i in range(args.cycles):
            try:
                kill_cycle(rig, rng, stats)
            except (AssertionError, RuntimeError) as e:
                failed = f"cycle {i} (seed {args.seed}): {e}"
                break
            if (i + 1) % 25 == 0:
                print(f"{i + 1} kills, {time.monotonic() - began:.0f} s", flush=True)
        if failed is None:
            records = finish_and_check(rig)
            print(f"final pull: installed, resumed {records[-1].get('resumed', 0)} bytes")
    finally:
        rig.close()
        if failed is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"kills: {stats.kills}  wall: {time.monotonic() - began:.1f} s")
    if stats.seconds:
        print(
            f"cycle: p50 {statistics.median(stats.seconds):.2f} s, max {max(stats.seconds):.2f} s"
        )
    for phase, n in sorted(stats.phases.items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {phase}")
    if failed is not None:
        print(f"FAILED {failed}\nstate dir kept: {root}", file=sys.stderr)
        return 1
    print("all invariants held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
