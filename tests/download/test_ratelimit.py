"""The ``--limit-rate`` token bucket's accounting, on a fake clock."""

from __future__ import annotations

import heapq

import pytest

from modeld.download.ratelimit import MIN_READ, TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_debt_is_paid_at_the_rate() -> None:
    """The bucket starts empty: each take's wait is the debt over the rate."""
    clock = Clock()
    bucket = TokenBucket(1000, clock=clock)
    assert bucket.take(500) == pytest.approx(0.5)
    assert bucket.take(500) == pytest.approx(1.0)  # debts add up
    clock.now += 0.25
    assert bucket.wait() == pytest.approx(0.75)
    clock.now += 0.75
    assert bucket.wait() == 0.0
    assert bucket.taken == 1000


def test_credit_after_a_quiet_spell_is_capped_at_the_burst() -> None:
    """A long pause does not bank more than ``burst`` bytes of credit."""
    clock = Clock()
    bucket = TokenBucket(100_000, clock=clock)
    assert bucket.burst == 25_000 and bucket.read_size == 5_000
    clock.now += 3600
    assert bucket.take(bucket.burst) == 0.0
    assert bucket.take(10_000) == pytest.approx(0.1)


def test_a_new_rate_applies_from_now_on() -> None:
    """set_rate keeps the debt in bytes and pays it at the new rate; 0 is refused."""
    clock = Clock()
    bucket = TokenBucket(1000, clock=clock)
    bucket.take(2000)
    bucket.set_rate(4000)
    assert bucket.wait() == pytest.approx(0.5)
    assert TokenBucket(10, clock=clock).read_size == MIN_READ
    with pytest.raises(ValueError, match="at least 1"):
        bucket.set_rate(0)


@pytest.mark.parametrize(("rate", "connections", "read"), [(50_000, 1, 8192), (1 << 20, 8, 65536)])
def test_connections_that_obey_their_waits_stay_under_the_cap(
    rate: int, connections: int, read: int
) -> None:
    """Readers that each read, take, and wait out what ``take`` says (then ``wait`` again, as
    the range reader's resume does): by any time t, the job has taken at most
    ``rate * t + connections * read_size`` bytes, and it keeps close to the rate."""
    clock = Clock()
    start = clock.now
    bucket = TokenBucket(rate, clock=clock)
    read = min(read, bucket.read_size)
    ready = [(start, i) for i in range(connections)]  # (when it may read, connection)
    heapq.heapify(ready)
    total = 0
    while clock.now - start < 10:
        when, conn = heapq.heappop(ready)
        clock.now = when
        wait = bucket.wait()
        if wait > 0:  # resumed while others took bytes meanwhile: wait again
            heapq.heappush(ready, (when + wait, conn))
            continue
        total += read
        assert total <= rate * (clock.now - start) + connections * bucket.read_size
        heapq.heappush(ready, (when + bucket.take(read) + 1e-4, conn))
    assert total >= rate * 10 * 0.9
