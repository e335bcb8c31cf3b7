"""``pull --limit-rate``: one token bucket over every connection of a download job.

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
