"""Reading held back: ``pull --limit-rate`` (``TokenBucket``) and a hash that falls behind
(``HashPace``).

``pull --limit-rate``: one token bucket over every connection of a download job.

Bytes are counted as they arrive. Once the bucket is in debt, the connection that took the
last bytes stops reading (``pause_reading`` in the raw range reader, an ``await`` on aiohttp's
path) until the debt is paid back at ``rate``, and TCP holds the sender back. The bucket
starts empty and keeps at most ``burst`` bytes of credit after a quiet spell, and a capped
connection reads at most ``read_size`` bytes at a time. So from the start of a job, after
``t`` seconds it has taken at most ``rate * t`` bytes, plus one read per connection (a
reader pays after its read): a capped pull of ``K`` bytes on ``c`` connections lasts at
least ``(K - c * read_size) / rate`` seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A capped connection reads about 1/20 s of the rate at a time (within these bounds).
MIN_READ = 4096
MAX_READ = 256 * 1024


class TokenBucket:
    """``take(n)``: spend ``n`` bytes; returns the seconds the reader waits before reading
    again. ``wait()``: the seconds left before the debt is paid."""

    def __init__(self, rate: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.tokens = 0.0
        self.stamp = clock()
        self.taken = 0
        self.rate = self.burst = self.read_size = 0
        self.set_rate(rate)

    def set_rate(self, rate: int) -> None:
        """A new cap from now on (a later pull of the same model asked for another)."""
        if rate < 1:
            raise ValueError("a rate is at least 1 byte/s")
        self._refill()
        self.rate = rate
        self.read_size = min(MAX_READ, max(MIN_READ, rate // 20))
        # Credit kept after a quiet spell (a connection that waited for its server): a
        # quarter second's worth, at least one read.
        self.burst = max(self.read_size, rate // 4)
        self.tokens = min(self.tokens, float(self.burst))

    def _refill(self) -> None:
        now = self.clock()
        if self.rate:
            self.tokens = min(float(self.burst), self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, n: int) -> float:
        self._refill()
        self.tokens -= n
        self.taken += n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    def wait(self) -> float:
        self._refill()
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


# The hash pace: reading pauses once this much of the written prefix waits for the hashing
# thread, and goes on once it is down to HASH_RESUME.
HASH_AHEAD = 64 * 1024 * 1024
HASH_RESUME = 32 * 1024 * 1024
# A pause lasts what the hash needs to get down to HASH_RESUME at this rate (then it is
# checked again), at most MAX_HASH_PAUSE.
HASH_RATE = 1_000_000_000
MAX_HASH_PAUSE = 0.05


class HashPace:
    """Holds a job's reading back while its hashing thread is far behind the written prefix.

    Where the link is faster than sha256 on a busy machine (loopback, a LAN mirror, a small
    CPU), the connections and the hashing thread share the cores. The pull then ends with
    what is left to hash: on two cores, 389 MB to 1.2 GB of a 2 GB file at its last byte,
    a different share every pull. Holding the readers back while the hash is far behind
    gives its thread the CPU they would take, and the pull ends with at most
    ``ahead`` bytes to hash. The backlog counts only the contiguous prefix, which the
    hash can take at once: a gap in the file (a piece still on its way) never holds back
    the reader that fills it. ``wait()``: the seconds to wait before reading on.
    """

    def __init__(
        self, backlog: Callable[[], int], *, ahead: int | None = None, resume: int | None = None
    ) -> None:
        self.backlog = backlog
        self.ahead = HASH_AHEAD if ahead is None else ahead
        self.resume = HASH_RESUME if resume is None else resume
        self.holding = False
        self.holds = 0  # times the readers were held back (for the benchmark and tests)

    def wait(self) -> float:
        behind = self.backlog()
        if behind <= (self.resume if self.holding else self.ahead):
            self.holding = False
            return 0.0
        if not self.holding:
            self.holding = True
            self.holds += 1
        return min(MAX_HASH_PAUSE, max(0.001, (behind - self.resume) / HASH_RATE))
