"""The engine pool's scheduler with fake runners, plus a hypothesis model of its budget."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from modeld.engine.pool import KeepAlive, Pool, PoolConfig, State, Target
from modeld.engine.runner.job import Done, Token
from modeld.engine.views import Final
from modeld.errors import (
    BadRequest,
    Busy,
    EngineCrashed,
    EngineError,
    HeldBack,
    OverBudget,
    PinnedMemory,
)
from modeld.modelfile.plan import Plan
from modeld.modelfile.runtime import CreateSpec
from tests.support.fake_runner import FakeFactory, number_of, numbered_job
from tests.support.wait import wait_until

PLAN = Plan(main="cpu")


def target(name: str, estimate: int = 100) -> Target:
    digest = (name.encode().hex() * 64)[:64]
    spec = CreateSpec(path=f"/fake/{name}.litertlm")
    return Target(
        model_id=name, digest=digest, plan=PLAN, spec=spec, estimate=estimate, max_tokens=256
    )


def final_of(rec: Token | Final[Done]) -> Final[Done]:
    assert isinstance(rec, Final), rec
    return rec


def done_of(rec: Token | Final[Done]) -> Done:
    return final_of(rec).result


async def consume(pool: Pool, t: Target, **kw: Any) -> list[Token | Final[Done]]:
    return [rec async for rec in pool.generate(t, numbered_job(), **kw)]


def numbered(
    pool: Pool, t: Target, served: list[int]
) -> Callable[[int], Coroutine[Any, Any, None]]:
    """Request number ``n`` (its job carries ``n``), noted in ``served`` when it is done."""

    async def ask(n: int) -> None:
        async for rec in pool.generate(t, numbered_job(n)):
            if isinstance(rec, Final):
                served.append(n)

    return ask


async def make_pool(factory: FakeFactory, budget: int = 1000, **kw: Any) -> Pool:
    pool = Pool(PoolConfig(budget=budget, spare=kw.pop("spare", False), **kw), factory)
    await pool.start()
    return pool


async def test_cold_burst_creates_one_engine() -> None:
    """Fifty concurrent requests for a cold model start exactly one engine, and all succeed."""
    factory = FakeFactory(create_seconds=0.05)
    pool = await make_pool(factory)
    t = target("m")
    results = await asyncio.gather(*(consume(pool, t) for _ in range(50)))
    assert factory.creates == 1
    assert all(done_of(r[-1]).finish == "stop" for r in results)
    assert pool.list()[0]["requests"] == 50
    await pool.stop()


async def test_lru_idle_engine_is_evicted_when_budget_is_full() -> None:
    """With room for two engines, a third evicts the least recently used idle one."""
    factory = FakeFactory(engine_pss=100)
    pool = await make_pool(factory, budget=250)
    a, b, c = target("a"), target("b"), target("c")
    await consume(pool, a)
    await consume(pool, b)
    await consume(pool, a)  # b is now least recently used
    await consume(pool, c)
    assert sorted(e["model"] for e in pool.list()) == ["a", "c"]
    assert pool.last_eviction[b.key].startswith("evicted to load c")
    assert pool.budget.max_used <= 250
    await pool.stop()


async def test_could_never_fit_is_refused_at_once() -> None:
    """An engine larger than the whole budget is refused with its estimate and the budget."""
    pool = await make_pool(FakeFactory(), budget=50)
    with pytest.raises(OverBudget) as info:
        await consume(pool, target("big", estimate=100))
    assert info.value.details == {"estimate": 100, "budget": 50}
    assert pool.engines == {}
    await pool.stop()


async def test_busy_when_memory_is_held_by_busy_engines() -> None:
    """A load that finds only busy engines waits, then fails with Busy after the timeout."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory, budget=150, wait_timeout=0.2)
    running = asyncio.create_task(consume(pool, target("a")))
    await wait_until(lambda: len(factory.gates) == 1)  # a's generation is running
    with pytest.raises(Busy):
        await consume(pool, target("b"))
    factory.release_all()
    await running
    await pool.stop()


async def test_low_estimate_is_corrected_by_measured_pss() -> None:
    """An engine measured above its estimate evicts idle ones so the sum stays in budget."""
    factory = FakeFactory(engine_pss=100)
    pool = await make_pool(factory, budget=250)
    await consume(pool, target("a", estimate=50))
    await consume(pool, target("b", estimate=50))
    await consume(pool, target("c", estimate=50))
    assert pool.budget.used() <= 250
    assert sum(r.memory()[0] for r in factory.alive()) <= 250
    assert len(pool.list()) == 2
    await pool.stop()


async def test_pinned_engine_is_never_evicted() -> None:
    """A pinned idle engine stays; a load that cannot fit beside it is refused at once
    (waiting frees nothing), naming the engine and the unload that would make room."""
    pool = await make_pool(FakeFactory(), budget=150)  # a wait would take 30 s
    await pool.load(target("a"), pin=True)
    with pytest.raises(PinnedMemory) as info:
        await consume(pool, target("b"))
    assert "a:cpu" in info.value.message and "`modeld unload a`" in info.value.message
    assert [e["model"] for e in pool.list()] == ["a"]
    await pool.stop()


async def test_a_load_waits_for_a_busy_engine_beside_a_pinned_one() -> None:
    """Pinned and busy engines hold the memory, but the busy one will free enough: the load
    waits for it, and runs once it is evicted."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory, budget=250)
    await pool.load(target("p"), pin=True)
    running = asyncio.create_task(consume(pool, target("a")))
    await wait_until(lambda: len(factory.gates) == 1)  # a's generation is running
    waiting = asyncio.create_task(consume(pool, target("b")))
    await wait_until(lambda: pool.budget._capacity_waiters == 1)
    factory.release_all()
    await running
    factory.hold = False
    assert isinstance((await waiting)[-1], Final)
    assert sorted(e["model"] for e in pool.list()) == ["b", "p"]
    await pool.stop()


async def test_a_keep_alive_that_may_not_shorten_only_lengthens() -> None:
    """A request whose keep_alive may not shorten the engine's (a use-role caller) leaves a
    longer one in place, never (-1) included, and lengthens a shorter one."""
    pool = await make_pool(FakeFactory())
    a = target("a")
    await pool.load(a, keep_alive=KeepAlive(-1))
    for asked in (0, 30, 3600):
        await consume(pool, a, keep_alive=KeepAlive(asked, may_shorten=False))
        assert pool.list()[0]["keep_alive"] == -1
    await pool.load(a, keep_alive=KeepAlive(60))  # may shorten (an admin's)
    await consume(pool, a, keep_alive=KeepAlive(30, may_shorten=False))
    assert pool.list()[0]["keep_alive"] == 60
    await consume(pool, a, keep_alive=KeepAlive(-1, may_shorten=False))
    assert pool.list()[0]["keep_alive"] == -1
    await consume(pool, a, keep_alive=KeepAlive(0))
    await wait_until(lambda: pool.list() == [])
    await pool.stop()


async def test_keep_alive_zero_and_expiry() -> None:
    """keep_alive 0 stops the engine after the request; a short keep-alive expires it."""
    pool = await make_pool(FakeFactory())
    await consume(pool, target("a"), keep_alive=KeepAlive(0))
    await wait_until(lambda: pool.list() == [])
    await consume(pool, target("b"), keep_alive=KeepAlive(0.2))
    assert pool.list()[0]["expires_in"] is not None
    await wait_until(lambda: pool.list() == [])
    assert "expired" in pool.last_eviction[target("b").key]
    await pool.stop()


async def test_crash_mid_request_then_reload_then_held_back() -> None:
    """A crash fails the running request with engine_crashed; the next reloads; 3 crashes hold."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory, crash_limit=3)
    t = target("m")

    def generations(count: int) -> Callable[[], bool]:
        return lambda: len(factory.gates) == count

    for n in range(3):
        task = asyncio.create_task(consume(pool, t))
        await wait_until(generations(n + 1))  # its generation is running
        factory.alive()[-1].crash("SIGSEGV")
        with pytest.raises(EngineCrashed) as info:
            await task
        assert "SIGSEGV" in info.value.message and "m" in info.value.message
        assert factory.creates == n + 1
    with pytest.raises(HeldBack):
        await consume(pool, t)
    await pool.stop()


async def test_request_queued_behind_a_crash_gets_a_fresh_engine() -> None:
    """The running request fails with engine_crashed; the ones queued behind it (one whose
    job waited in the runner, one on the lock) are served by a fresh engine (the pool's one
    retry), in their order, not failed with it."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory)
    t = target("m")
    served: list[int] = []
    ask = numbered(pool, t, served)
    first = asyncio.create_task(consume(pool, t))
    await wait_until(lambda: len(factory.gates) == 1)  # the first generation runs
    queued = [asyncio.create_task(ask(1))]
    await wait_until(lambda: len(factory.sent) == 2)  # its job waits in the runner
    queued.append(asyncio.create_task(ask(2)))
    await wait_until(lambda: pool.list()[0]["queued"] == 2)  # this one on the lock
    factory.alive()[-1].crash("SIGSEGV")
    with pytest.raises(EngineCrashed):
        await first
    await wait_until(lambda: len(factory.gates) == 2)  # the queued ones run on a new engine
    factory.hold = False
    factory.release_all()
    await asyncio.gather(*queued)
    assert served == [1, 2] and [number_of(job) for job in factory.jobs] == [None, 1, 2]
    assert factory.creates == 2
    await pool.stop()


async def test_load_cancelled_when_every_waiter_leaves() -> None:
    """A load whose only waiter is cancelled stops its runner instead of finishing."""
    factory = FakeFactory(create_seconds=1.0)
    pool = await make_pool(factory)
    task = asyncio.create_task(consume(pool, target("m")))
    await wait_until(lambda: factory.creates == 1)  # the runner is creating the engine
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # A load that finished instead would leave the engine listed and its runner alive.
    await wait_until(lambda: pool.list() == [] and factory.alive() == [])
    assert factory.runners[0].closing
    await pool.stop()


async def test_requests_for_one_engine_are_served_in_arrival_order() -> None:
    """Requests queued on a busy engine run in the order they arrived: one that leaves the
    queue does not disturb the others, and one that arrives just as the engine frees up
    (before the next in line has run) does not go first."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory)
    t = target("m")
    served: list[int] = []
    ask = numbered(pool, t, served)

    async def first_then_barge() -> None:
        await ask(0)
        # The engine was just released and the next in line only woken: a request that
        # reaches the pool now, before the loop runs that one, must queue behind it.
        late = pool.generate(t, numbered_job(99))
        async for rec in late:
            if isinstance(rec, Final):
                served.append(99)

    tasks = [asyncio.create_task(first_then_barge())]
    await wait_until(lambda: len(factory.gates) == 1)  # request 0 runs; the others queue
    engine = next(iter(pool.engines.values()))
    for n in range(1, 9):
        tasks.append(asyncio.create_task(ask(n)))
        await wait_until(functools.partial(lambda k: engine.users == k, n + 1))  # n queued
    tasks[3].cancel()  # request 3 leaves the queue
    await wait_until(lambda: engine.users == 8)
    factory.hold = False
    factory.release_all()
    await asyncio.gather(*tasks, return_exceptions=True)
    expected = [0, 1, 2, 4, 5, 6, 7, 8, 99]
    assert [number_of(job) for job in factory.jobs] == expected  # the order they began
    assert served == expected
    await pool.stop()


async def test_the_next_job_waits_in_the_runner_and_a_leaver_there_never_begins() -> None:
    """While a request runs, the next one's job is already in the runner (it starts there
    the moment the first ends) and the one after waits on the lock; a request that leaves
    while its job waits in the runner never begins; the engine stays busy until the last
    job ends, and the others are served in arrival order."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory)
    t = target("m")
    served: list[int] = []
    ask = numbered(pool, t, served)

    tasks = [asyncio.create_task(ask(0))]
    await wait_until(lambda: len(factory.gates) == 1)  # request 0 runs
    engine = next(iter(pool.engines.values()))
    for n in (1, 2, 3):
        tasks.append(asyncio.create_task(ask(n)))
        await wait_until(functools.partial(lambda k: engine.users == k, n + 1))
    assert [number_of(job) for job in factory.sent] == [0, 1]  # 1 waits in the runner, 2 and 3 here
    assert [number_of(job) for job in factory.jobs] == [0]
    tasks[1].cancel()  # request 1 leaves while its job waits in the runner
    await wait_until(lambda: engine.users == 3)
    assert [number_of(job) for job in factory.sent] == [0, 1, 2]  # its place went to the next
    factory.gates[0].set()  # request 0 ends; 2 begins in the runner, 3 is sent
    await wait_until(lambda: len(factory.gates) == 2 and len(factory.sent) == 4)
    assert served == [0] and pool.list()[0]["state"] == "busy"
    factory.gates[1].set()  # request 2 ends; 3 runs: still busy
    await wait_until(lambda: len(factory.gates) == 3)
    assert pool.list()[0]["state"] == "busy"
    factory.gates[2].set()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert [number_of(job) for job in factory.jobs] == [0, 2, 3]  # 1 never began
    assert served == [0, 2, 3]
    assert pool.list()[0]["state"] == "ready"
    await pool.stop()


async def test_unload_waits_for_in_flight_request() -> None:
    """Unload lets a running request finish before stopping the runner."""
    factory = FakeFactory(hold=True)
    pool = await make_pool(factory)
    task = asyncio.create_task(consume(pool, target("m")))
    await wait_until(lambda: len(factory.gates) == 1)  # the request is running
    unload = asyncio.create_task(pool.unload("m"))
    await wait_until(lambda: pool.list()[0]["state"] == "unloading")
    assert not task.done()
    factory.release_all()
    records = await task
    await unload
    assert isinstance(records[-1], Final)
    assert pool.list() == []
    await pool.stop()


async def test_failed_create_reports_runtime_reason() -> None:
    """The runtime's reason for a failed create reaches the caller as engine_error."""
    pool = await make_pool(FakeFactory(fail="NOT_FOUND: tf_lite_prefill_decode not found"))
    with pytest.raises(EngineError) as info:
        await consume(pool, target("m"))
    assert "tf_lite_prefill_decode" in info.value.message
    assert pool.budget.used() == 0
    await pool.stop()


async def test_spare_runner_is_counted_and_used() -> None:
    """The spare runner counts in the budget and becomes the next engine's runner."""
    factory = FakeFactory(spare_pss=10)
    pool = await make_pool(factory, spare=True, spare_estimate=10)
    await wait_until(lambda: pool.budget.spare is not None)
    assert pool.budget.spare is not None and pool.budget.used() == 10
    spare_pid = pool.budget.spare.pid
    await consume(pool, target("m"))
    assert pool.list()[0]["pid"] == spare_pid
    # A new spare is started for the next engine.
    await wait_until(lambda: pool.budget.spare is not None and pool.budget.spare.pid != spare_pid)
    await pool.stop()


class PoolMachine(RuleBasedStateMachine):
    """Random loads, requests, releases, unloads and crashes never push use over the budget."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.factory = FakeFactory(engine_pss=100, spare_pss=10, hold=True)
        self.budget = 320
        self.pool = self.loop.run_until_complete(
            make_pool(
                self.factory, budget=self.budget, wait_timeout=0.05, spare=True, spare_estimate=10
            )
        )
        self.tasks: list[asyncio.Task[Any]] = []
        # Honest estimates (>= the fake's 100): then reservations alone keep the invariant.
        self.targets = [target(f"m{i}", estimate=100 + 10 * i) for i in range(4)]

    def settle(self) -> None:
        """Let every task that can run do so (a few loop turns, not a length of time)."""

        async def turns() -> None:
            for _ in range(50):
                await asyncio.sleep(0)

        self.loop.run_until_complete(turns())

    @rule(
        i=st.integers(0, 3),
        keep=st.sampled_from([None, 0, -1, 30]),
        may_shorten=st.booleans(),
    )
    def request(self, i: int, keep: float | None, may_shorten: bool) -> None:
        alive = None if keep is None else KeepAlive(keep, may_shorten)
        self.tasks.append(
            self.loop.create_task(consume(self.pool, self.targets[i], keep_alive=alive))
        )
        self.settle()

    @rule()
    def release(self) -> None:
        self.factory.release_all()
        self.settle()

    @rule(i=st.integers(0, 3), pin=st.booleans())
    def load(self, i: int, pin: bool) -> None:
        self.tasks.append(self.loop.create_task(self.pool.load(self.targets[i], pin=pin)))
        self.settle()

    # Draws never depend on the pool's state (which depends on timing): hypothesis needs
    # the same draws when it replays an example.
    @rule(i=st.integers(0, 3))
    def unload(self, i: int) -> None:
        model = self.targets[i].model_id
        if self.pool.find(model):
            self.tasks.append(self.loop.create_task(self.pool.unload(model, grace=0.02)))
        self.settle()

    @rule(i=st.integers(0, 7))
    def crash(self, i: int) -> None:
        alive = self.factory.alive()
        if alive:
            alive[i % len(alive)].crash("SIGKILL")
        self.settle()

    @invariant()
    def within_budget(self) -> None:
        assert self.pool.budget.used() <= self.budget
        assert sum(r.memory()[0] for r in self.factory.alive()) <= self.budget
        for key, e in self.pool.engines.items():
            assert key == e.target.key
            if e.state in (State.READY, State.BUSY):
                # A loaded engine has its runner and reserves at least its expected size.
                assert e.runner is not None
                assert e.reserved >= e.target.expected

    def teardown(self) -> None:
        self.factory.release_all()
        self.loop.run_until_complete(self.pool.stop())
        for t in self.tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            self.loop.run_until_complete(asyncio.gather(*self.tasks, return_exceptions=True))
        assert self.pool.budget.max_used <= self.budget
        self.loop.close()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


async def test_image_prepare_is_its_own_phase_in_the_final_record() -> None:
    """The caller's image preparation time is reported as ``image_prepare`` and observed."""
    from modeld.metrics import Metrics

    metrics = Metrics()
    pool = Pool(PoolConfig(budget=1000, spare=False), FakeFactory(), metrics=metrics)
    await pool.start()
    try:
        with_images = (await consume(pool, target("m"), image_prepare=0.125))[-1]
        without = (await consume(pool, target("m")))[-1]
    finally:
        await pool.stop()
    assert final_of(with_images).timings["image_prepare"] == 0.125
    assert final_of(without).timings["image_prepare"] == 0.0
    observed = metrics.registry.get_sample_value(
        "modeld_generate_phase_seconds_sum", {"phase": "image_prepare"}
    )
    assert observed == 0.125  # once: a request without images adds nothing


async def test_watcher_reads_pss_again_only_when_rss_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a runner's PSS walks its page tables (milliseconds of kernel time): the
    watcher reads it again only once the runner's RSS (cheap to read) moved past the step,
    or the last reading is old, and then it sees the growth."""
    from modeld.engine import budget as budget_module

    mib = 1024 * 1024
    factory = FakeFactory(engine_pss=100 * mib)
    pool = await make_pool(factory, budget=10_000 * mib, watch_interval=0.01)
    await consume(pool, target("m"))
    (engine,) = pool.engines.values()
    (runner,) = factory.alive()

    async def ticks(n: int) -> None:
        for _ in range(n):
            await wait_until(
                functools.partial(lambda s: engine.measured_at > s, engine.measured_at)
            )

    await ticks(3)
    reads = factory.pss_reads
    await ticks(10)
    assert factory.pss_reads == reads  # the RSS did not move: the last reading holds
    runner.pss += mib // 2  # under the step
    await ticks(5)
    assert factory.pss_reads == reads and engine.measured == 100 * mib
    runner.pss += 10 * mib
    await wait_until(lambda: engine.measured == runner.pss)
    assert factory.pss_reads == reads + 1
    monkeypatch.setattr(budget_module, "PSS_MAX_AGE", 0.0)  # every reading is old at once
    await ticks(3)
    assert factory.pss_reads >= reads + 3
    await pool.stop()


async def test_peak_of_a_failed_request_is_never_learned() -> None:
    """A request the runtime refuses after its runner grew: the watcher sees the growth, but
    nothing from that runner is learned; a runner whose requests succeed is learned."""
    learned: list[tuple[str, int]] = []

    async def on_learned(t: Target, pss: int) -> bool:
        learned.append((t.model_id, pss))
        return True

    factory = FakeFactory(engine_pss=100)
    pool = Pool(
        PoolConfig(budget=100_000, spare=False, watch_interval=0.01), factory, on_learned=on_learned
    )
    await pool.start()
    bad, good = target("bad"), target("good")
    with pytest.raises(BadRequest):
        factory.refuse = ("too long", 9000)
        await anext(pool.generate(bad, numbered_job()))
    (engine,) = pool.engines.values()
    await wait_until(lambda: engine.measured == 9000)
    await consume(pool, good)
    await wait_until(lambda: ("good", 100) in learned)
    await consume(pool, bad)  # later requests succeed: the runner still proves nothing
    seen = engine.measured_at
    await wait_until(lambda: engine.measured_at > seen)
    assert all(model != "bad" for model, _ in learned), learned
    await pool.stop()


async def test_a_runner_handed_over_with_its_engine_is_loaded_without_a_second_create() -> None:
    """A runner whose engine the GPU probe created for a target is that target's engine at
    its load (no second create); one handed over for another spec is stopped, not used."""
    factory = FakeFactory()
    pool = await make_pool(factory)
    t = target("m")
    probe_runner = await factory()
    reply = await probe_runner.create(t.spec)
    pool.hand_over(t.key, probe_runner, t.spec, reply)
    await consume(pool, t)
    assert factory.creates == 1
    assert pool.engines[t.key].runner is probe_runner
    other = target("o")
    stale = await factory()
    await stale.create(CreateSpec(path="/fake/elsewhere.litertlm"))
    pool.hand_over(other.key, stale, CreateSpec(path="/fake/elsewhere.litertlm"), reply)
    await consume(pool, other)
    assert not stale.alive
    assert pool.engines[other.key].runner is not stale
    assert factory.creates == 3
    await pool.stop()


async def test_handed_over_runners_stop_with_the_pool() -> None:
    """A runner handed over and never loaded is stopped when the pool stops."""
    factory = FakeFactory()
    pool = await make_pool(factory)
    t = target("m")
    runner = await factory()
    pool.hand_over(t.key, runner, t.spec, await runner.create(t.spec))
    await pool.stop()
    assert not runner.alive


@pytest.mark.parametrize("recorded", [True, False])
async def test_the_view_shows_a_peak_learned_while_its_engine_runs(recorded: bool) -> None:
    """Once a running engine's peak is recorded, its view shows it as ``pss_learned`` (not
    only the next load's); a peak that was not recorded (awaiting confirmation) is not shown."""

    async def on_learned(t: Target, pss: int) -> bool:
        return recorded

    factory = FakeFactory(engine_pss=100)
    pool = Pool(
        PoolConfig(budget=100_000, spare=False, watch_interval=0.01), factory, on_learned=on_learned
    )
    await pool.start()
    t = target("m")
    await consume(pool, t)
    (engine,) = pool.engines.values()
    await wait_until(lambda: engine.recorded == 100)
    # The peak is handed over before it is recorded: a second request lets that finish.
    await consume(pool, t)
    await wait_until(lambda: not recorded or engine.learned == 100)
    (view,) = pool.list()
    assert view["pss_learned"] == (100 if recorded else None)
    await pool.stop()
