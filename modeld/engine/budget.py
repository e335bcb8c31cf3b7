"""The memory budget: reservations, admission, the spare runner, eviction, PSS watching.

The budget is the sum of the runners' PSS, the spare runner included. A new engine
reserves its expected size (the learned peak for that digest/plan/max_tokens, else the
estimate from the file); to make room the pool drops the spare runner, then evicts idle
engines, least recently used first, pinned never; if that is not enough it waits in a
bounded queue (then ``Busy``). It refuses at once when the engine could never fit
(``OverBudget``), and when pinned engines leave too little room (``PinnedMemory``: waiting
never frees a pinned engine). A watcher re-reads real PSS and evicts idle engines when the
sum passes the budget; the peak it sees is handed to ``on_learned`` (SQLite) for the next
admission.

``Budget`` is owned by ``modeld.engine.pool.Pool``, which hands it the engines it keeps and
the one way to stop one (``evict``); it never changes an engine's state itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from modeld import logs
from modeld.config import format_size
from modeld.engine.types import Engine, Learned, PoolConfig, RunnerFactory, RunnerLike, State
from modeld.errors import Busy, OverBudget, PinnedMemory
from modeld.metrics import Metrics

# A learned peak is written again only when it grows by more than this fraction: PSS moves
# by a few pages all the time, and every write would cost a SQLite transaction.
LEARN_STEP = 0.02
# The watcher reads a runner's PSS (smaps_rollup: a walk of its page tables, costly kernel
# time each, every second, on the cores its decode needs; docs/benchmarks.md#engine-memory)
# only when its RSS (statm,
# microseconds) moved by more than LEARN_STEP of that PSS (at least PSS_RSS_MIN) since
# the last reading, when a runner came or went (the pages they share move everyone's
# PSS), or when the last reading is PSS_MAX_AGE old.
PSS_RSS_MIN = 1024 * 1024
PSS_MAX_AGE = 30.0


class Budget:
    """The pool's memory accounting and admission; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        engines: dict[tuple[str, str], Engine],
        factory: RunnerFactory,
        *,
        evict: Callable[[Engine, str], Awaitable[None]],
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        metrics: Metrics | None = None,
        on_learned: Learned | None = None,
    ) -> None:
        self.config = config
        self.engines = engines  # the pool's own dict: the budget reads it, never changes it
        self.factory = factory
        self.metrics = metrics
        self.on_learned = on_learned
        self._evict = evict
        self._spawn = spawn
        self.spare: RunnerLike | None = None  # a runner with the runtime loaded, no engine
        self.spare_reserved = 0
        self.max_used = 0
        self.stopping = False
        self._cond = asyncio.Condition()
        # pid -> (its RSS then, its PSS, when): the watcher's last PSS reading of each runner.
        self._readings: dict[int, tuple[int, int, float]] = {}
        self._capacity_waiters = 0
        self._spare_task: asyncio.Task[None] | None = None

    # --- bookkeeping ---------------------------------------------------------------------

    def used(self) -> int:
        return sum(e.reserved for e in self.engines.values()) + self.spare_reserved

    def note_used(self) -> None:
        used = self.used()
        self.max_used = max(self.max_used, used)
        if self.metrics:
            self.metrics.budget_used.set(used)

    def wake(self) -> None:
        """Let loads waiting for memory look again (never inline: the caller may hold the lock).

        A waiter counts itself under the lock before it looks, so none is missed when there
        are 0."""
        if self._capacity_waiters:
            self._spawn(self._notify())

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def stop(self) -> None:
        """No spare runner any more: stop the one there is (or the one starting)."""
        self.stopping = True
        if self._spare_task is not None:
            self._spare_task.cancel()
            with contextlib.suppress(BaseException):
                await self._spare_task
        await self.drop_spare()

    # --- the spare runner --------------------------------------------------------------

    def refill_spare(self) -> None:
        if not self.config.spare or self.stopping or self.spare is not None:
            return
        if self._spare_task is not None and not self._spare_task.done():
            return
        if self.used() + self.config.spare_estimate > self.config.budget:
            return
        self._spare_task = asyncio.ensure_future(self._start_spare())

    async def _start_spare(self) -> None:
        self.spare_reserved = self.config.spare_estimate
        try:
            runner = await self.factory()
        except Exception as e:
            self.spare_reserved = 0
            logs.event("spare_failed", error=str(e))
            return
        self.spare = runner
        self.spare_reserved = max(runner.memory()[0], 1)
        if self.stopping or self.used() > self.config.budget:
            self.spare, self.spare_reserved = None, 0
            await runner.kill()
            return
        self.note_used()

    async def take_spare(self) -> RunnerLike | None:
        if self._spare_task is not None and not self._spare_task.done():
            # A spare half started is still faster than a new one.
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._spare_task)
        runner, self.spare = self.spare, None
        if runner is not None and not runner.alive:
            runner = None
        return runner

    async def drop_spare(self) -> None:
        if self._spare_task is not None and not self._spare_task.done():
            self._spare_task.cancel()
            with contextlib.suppress(BaseException):
                await self._spare_task
        runner, self.spare = self.spare, None
        self.spare_reserved = 0
        if runner is not None:
            await runner.kill()

    # --- admission -----------------------------------------------------------------------

    def _victim(self, exclude: Engine | None) -> Engine | None:
        idle = [
            e
            for e in self.engines.values()
            if e is not exclude and e.state is State.READY and e.users == 0 and not e.pinned
        ]
        return min(idle, key=lambda e: e.last_used, default=None)

    async def admit(self, e: Engine) -> None:
        """Grow ``e.reserved`` to its expected size, evicting idle engines or waiting."""
        need = e.target.expected
        budget = self.config.budget
        if need > budget:
            raise OverBudget(
                f"model {e.target.model_id}: its engine needs about {format_size(need)} "
                f"({'measured' if e.target.learned else 'estimated from the file'}) but the "
                f"memory budget is {format_size(budget)}; raise MODELD_MEMORY_BUDGET or lower "
                "[limits] max_tokens in the model's registry entry",
                estimate=need,
                budget=budget,
            )
        deadline = time.monotonic() + self.config.wait_timeout
        async with self._cond:
            if self._capacity_waiters >= self.config.queue_limit:
                raise Busy("too many engine loads are waiting for memory; retry later", 5.0)
            self._capacity_waiters += 1
            try:
                while True:
                    if self.used() - e.reserved + need <= budget:
                        e.reserved = max(e.reserved, need)
                        self.note_used()
                        return
                    if self.spare is not None or self.spare_reserved:
                        await self.drop_spare()
                        continue
                    victim = self._victim(e)
                    if victim is not None:
                        await self._evict(victim, f"evicted to load {e.target.model_id}")
                        continue
                    self._refuse_if_pinned(e, need)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise Busy(
                            f"model {e.target.model_id}: no memory free for its engine "
                            f"({format_size(need)} needed, {format_size(self.used())} of "
                            f"{format_size(budget)} in use by busy or pinned engines); "
                            "retry later or unload one",
                            min(self.config.wait_timeout, 10.0),
                        )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(remaining):
                            await self._cond.wait()
            finally:
                self._capacity_waiters -= 1

    def _refuse_if_pinned(self, e: Engine, need: int) -> None:
        """Refuse ``e`` at once when pinned engines leave too little room for it: busy
        engines end, idle ones can be evicted, but waiting never frees a pinned one."""
        pinned = [
            x
            for x in self.engines.values()
            if x is not e and x.pinned and x.state in (State.LOADING, State.READY, State.BUSY)
        ]
        held = sum(x.reserved for x in pinned)
        if not pinned or held + need <= self.config.budget:
            return
        models = sorted({x.target.model_id for x in pinned})
        unload = " or ".join(f"`modeld unload {m}`" for m in models)
        raise PinnedMemory(
            f"model {e.target.model_id}: its engine needs about {format_size(need)} but pinned "
            f"engines ({', '.join(sorted(x.target.engine_id for x in pinned))}) hold "
            f"{format_size(held)} of the {format_size(self.config.budget)} memory budget, and "
            f"waiting frees none of it; unload one ({unload}) or raise MODELD_MEMORY_BUDGET",
            needed=need,
            pinned=held,
            budget=self.config.budget,
        )

    async def enforce(self, keep: Engine | None = None) -> None:
        while self.used() > self.config.budget:
            if self.spare is not None:
                await self.drop_spare()
                continue
            victim = self._victim(exclude=keep)
            if victim is None:
                logs.event("over_budget", used=self.used(), budget=self.config.budget)
                return
            await self._evict(victim, "budget: measured PSS over the estimate")

    async def measure_after(self, e: Engine) -> None:
        """Measure an engine's PSS after a request, at most once per watch interval.

        The first request after a load is always measured (its KV cache and arenas are now
        real), so the learned peak reaches SQLite at once; later ones leave it to the
        watcher: reading smaps_rollup costs milliseconds of kernel time, which back-to-back
        requests on a small machine would pay for.
        """
        if e.runner is None:
            return
        if e.measured_at and time.monotonic() - e.measured_at < self.config.watch_interval:
            return
        pid = e.runner.pid
        e.measured_at = time.monotonic()
        pss = (await asyncio.to_thread(e.runner.memory))[0]
        self.measure({pid: pss}, only=e)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.watch_interval)
            # smaps_rollup reads take milliseconds each: keep them off the event loop.
            readings = await asyncio.to_thread(self._read_all)
            self.measure(readings)
            await self.enforce()

    def _read_all(self) -> dict[int, int]:
        """Every runner's PSS: read again where its RSS moved, else the last reading."""
        runners = [e.runner for e in list(self.engines.values()) if e.runner is not None]
        if self.spare is not None:
            runners.append(self.spare)
        if set(self._readings) != {r.pid for r in runners}:
            self._readings = {}  # a runner came or went
        now = time.monotonic()
        out = {}
        for r in runners:
            rss = r.rss()
            last = self._readings.get(r.pid)
            if (
                last is None
                or abs(rss - last[0]) > max(PSS_RSS_MIN, last[1] * LEARN_STEP)
                or now - last[2] >= PSS_MAX_AGE
            ):
                last = (rss, r.memory()[0], now)
                self._readings[r.pid] = last
            out[r.pid] = last[1]
        return out

    def measure(self, readings: dict[int, int] | None = None, only: Engine | None = None) -> None:
        """Take runners' PSS; an engine reserves at least what it really uses."""
        readings = self._read_all() if readings is None else readings
        now = time.monotonic()
        for e in [only] if only is not None else list(self.engines.values()):
            if e.runner is not None and e.state in (State.READY, State.BUSY):
                pss = readings.get(e.runner.pid, 0)
                if pss:
                    e.measured, e.measured_at = pss, now
                    e.peak = max(e.peak, pss)
                    e.reserved = max(pss, e.target.expected)
                    if self.metrics:
                        self.metrics.engine_pss.labels(e.target.engine_id).set(pss)
                    self._learn(e)
        if only is None and self.spare is not None and self.spare.pid in readings:
            self.spare_reserved = max(readings[self.spare.pid], 1) if self.spare.alive else 0
        self.note_used()

    def _learn(self, e: Engine) -> None:
        """Hand a grown peak to ``on_learned`` (SQLite) for the next admission of this file."""
        known = max(e.target.learned or 0, e.recorded)
        if self.on_learned is None or e.peak <= known * (1 + LEARN_STEP):
            return
        # A peak is learned only between requests: one measured during a request that then
        # fails or is refused must never count (``Engine.tainted``).
        if e.tainted or e.state is not State.READY:
            return
        e.recorded = e.peak
        self._spawn(self._record_learned(e, e.peak))

    async def _record_learned(self, e: Engine, peak: int) -> None:
        assert self.on_learned is not None
        if await self.on_learned(e.target, peak):
            e.learned = max(e.learned or 0, peak)
