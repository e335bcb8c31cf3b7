"""A fleet's pulls through a site cache, at a real model's size: what the origin sends.

Three ``modeld serve`` daemons with ``MODELD_SITE_CACHE`` set to a real nginx
(``proxy_cache`` + ``slice``, the recipe of docs/fleet.md) in front of the stand-in hub
(``tests/support/hub.py``: 302 to expiring signed CDN URLs). Measured, as
tests/fleet/test_site_cache.py checks on a smaller file:

1. the three pull the file at once (cold cache), then each pulls it again after ``rm``:
   bytes the origin sent, wall time of each round;
2. one byte of a cached slice flipped: each daemon pulls again after ``rm`` and repairs;
   bytes the origin sent for each repair.

    nice -n 19 .venv/bin/python bench/bench_fleet.py --size 512MB [--flip-at 0.5]

Needs Debian's nginx (with its slice module), as the fleet tests do.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modeld.config import format_size, parse_size  # noqa: E402
from tests.support.fleet import Site, pull, pull_all, sha256  # noqa: E402
from tests.support.state import model_head  # noqa: E402

SLICE = 1024 * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="512MB", help="file size (default 512MB)")
    parser.add_argument("--daemons", type=int, default=3)
    parser.add_argument(
        "--flip-at", type=float, default=0.5, help="where the flipped byte is, 0 to 1 of the file"
    )
    args = parser.parse_args()
    size = parse_size(args.size)
    head = model_head()
    rng = random.Random(5)
    # randbytes takes at most 2**31 bits at a time.
    chunks = [rng.randbytes(min(SLICE * 64, size - n)) for n in range(0, size, SLICE * 64)]
    data = head + b"".join(chunks)[: size - len(head)]
    root = Path(tempfile.mkdtemp(prefix="md-fleet-", dir="/tmp"))
    site = Site.open(root, data, sign_ttl=3600.0)
    hub, cache = site.hub, site.cache
    try:
        daemons = [site.start(f"d{i}") for i in range(args.daemons)]
        print(f"file {format_size(size)} ({size} B), {args.daemons} daemons, nginx {cache.base}")
        began = time.monotonic()
        records = pull_all(daemons, ["m"] * len(daemons), timeout=3600)
        at_once = time.monotonic() - began
        assert all(r["digest"] == sha256(data) for r in records), records
        sent = hub.sent
        print(f"at once (cold cache): {at_once:.1f} s; origin sent {sent} B = {sent / size:.4f}x")
        for d in daemons:
            assert d.cli("rm", "m").returncode == 0
            began = time.monotonic()
            record = pull(d, "m", timeout=3600)
            assert record["digest"] == sha256(data)
            print(f"  {d.home.name} again (warm cache): {time.monotonic() - began:.1f} s")
        print(f"after {args.daemons} more pulls: origin sent {hub.sent} B = {hub.sent / size:.4f}x")
        bad = int(size * args.flip_at)
        cache.flip(f"/cdn/{sha256(data)}", bad, SLICE)
        print(f"flipped the cached byte at {bad} ({args.flip_at:.0%} of the file)")
        for d in daemons:
            assert d.cli("rm", "m").returncode == 0
            before, began = hub.sent, time.monotonic()
            record = pull(d, "m", timeout=3600)
            assert record["digest"] == sha256(data) and record["repaired"] >= 1, record
            repair = hub.sent - before
            print(
                f"  {d.home.name} repaired {record['repaired']} block(s) in "
                f"{time.monotonic() - began:.1f} s; origin sent {repair} B = {repair / size:.3f}x"
            )
    finally:
        site.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
