"""The engine pool: lazy, single-flight engines in runner processes, under a memory budget.

Every engine is keyed by ``(digest, plan key)``. N requests for a cold engine start one
runner; a load whose waiters all left is cancelled. The budget is DESIGN's: the sum of the
runners' PSS, the spare runner included. A new engine reserves its expected size (the
learned peak for that digest/plan/max_tokens, else the estimate from the file); to make room
the pool evicts idle engines, least recently used first, pinned never; if that is not
enough it waits in a bounded queue (then ``Busy``), and if the engine could never fit it
refuses at once (``OverBudget``). A watcher re-reads real PSS and evicts idle engines when
the sum passes the budget.

Each engine's state (``State``) is changed only by ``Pool._set_state``, which checks the
transition. Requests to one engine run one at a time in arrival order (``asyncio.Lock`` is
FIFO); different engines run in parallel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from modeld import logs
from modeld.config import format_size
from modeld.errors import (
    BackendConstraint,
    BadRequest,
    Busy,
    EngineCrashed,
    EngineError,
    EngineNotFound,
    HeldBack,
    ModeldError,
    OverBudget,
    ShuttingDown,
)
from modeld.metrics import Metrics
from modeld.runner_client import RunnerDied, RunnerError


class RunnerLike(Protocol):
    """What the pool needs of a runner; ``runner_client.Runner`` and ``FakeRunner`` have it."""

    pid: int
    closing: bool

    @property
    def alive(self) -> bool: ...
    async def create(self, spec: dict[str, Any]) -> dict[str, Any]: ...
    def generate(self, job: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]: ...
    def memory(self) -> tuple[int, int]: ...
    async def wait_exit(self) -> RunnerDied: ...
    async def close(self, grace: float = 5.0) -> None: ...
    async def kill(self) -> None: ...


RunnerFactory = Callable[[], Awaitable[RunnerLike]]
Learned = Callable[["Target", int], Awaitable[None]]


class State(enum.Enum):
    LOADING = "loading"  # reserving memory, starting the runner, creating the engine
    READY = "ready"  # loaded and idle
    BUSY = "busy"  # one request running (others may queue)
    UNLOADING = "unloading"  # no new requests; in-flight ones finish, then the runner stops
    FAILED = "failed"  # load failed or the runner died; removed right after


_ALLOWED = {
    State.LOADING: {State.READY, State.FAILED, State.UNLOADING},
    State.READY: {State.BUSY, State.UNLOADING, State.FAILED},
    State.BUSY: {State.READY, State.UNLOADING, State.FAILED},
    State.UNLOADING: {State.FAILED},
    State.FAILED: set(),
}


@dataclass(frozen=True)
class Target:
    """One engine to run: the file, the plan and what the runner's ``create`` gets."""

    model_id: str
    digest: str
    plan: dict[str, Any]
    spec: dict[str, Any]
    estimate: int
    max_tokens: int
    learned: int | None = None  # measured peak PSS from earlier runs, if any

    @property
    def key(self) -> tuple[str, str]:
        return (self.digest, str(self.plan["key"]))

    @property
    def expected(self) -> int:
        return self.learned if self.learned else self.estimate

    @property
    def engine_id(self) -> str:
        p = self.plan
        extra = "".join(f"+{m}-{p[m]}" for m in ("vision", "audio") if p.get(m))
        return f"{self.model_id}:{p['main']}{extra}"


@dataclass(eq=False)
class Engine:
    target: Target
    state: State = State.LOADING
    runner: RunnerLike | None = None
    reserved: int = 0
    measured: int | None = None
    peak: int = 0
    users: int = 0  # requests waiting for the load, queued on the lock, or running
    served: int = 0
    pinned: bool = False
    explicit: bool = False
    keep_alive: float = 300.0
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None
    load_seconds: float | None = None
    create_seconds: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ready: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    load_task: asyncio.Task[None] | None = None
    watch_task: asyncio.Task[None] | None = None

    def view(self, now: float, last_eviction: str | None) -> dict[str, Any]:
        idle = self.state is State.READY and self.users == 0
        return {
            "id": self.target.engine_id,
            "model": self.target.model_id,
            "digest": self.target.digest,
            "plan": self.target.plan,
            "state": self.state.value,
            "pid": self.runner.pid if self.runner else None,
            "pss_estimate": self.target.expected,
            "pss": self.measured,
            "peak_pss": self.peak or None,
            "reserved": self.reserved,
            "max_tokens": self.target.max_tokens,
            "idle_seconds": round(now - self.last_used, 3) if idle else None,
            "expires_in": round(self.expires_at - now, 3) if self.expires_at and idle else None,
            "keep_alive": self.keep_alive,
            "pinned": self.pinned,
            "requests": self.served,
            "queued": max(0, self.users - (1 if self.state is State.BUSY else 0)),
            "load_seconds": self.load_seconds,
            "loaded_at": self.created_at,
            "last_eviction": last_eviction,
        }


@dataclass
class PoolConfig:
    budget: int
    keep_alive: float = 300.0  # seconds; 0 after each request; -1 never
    queue_limit: int = 128  # requests queued per engine, and loads waiting for memory
    wait_timeout: float = 30.0  # how long a load waits for memory before Busy
    unload_timeout: float = 10.0  # how long unload waits for in-flight requests
    watch_interval: float = 1.0
    spare: bool = True  # keep one runner with the runtime loaded, ready for a cold load
    spare_estimate: int = 64 * 1024 * 1024
    crash_limit: int = 3  # crashes within crash_window hold a model back for hold_seconds
    crash_window: float = 600.0
    hold_seconds: float = 300.0


class Pool:
    """Owns every engine and runner of one daemon; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        runner_factory: RunnerFactory,
        *,
        metrics: Metrics | None = None,
        on_learned: Learned | None = None,
    ) -> None:
        self.config = config
        self.factory = runner_factory
        self.metrics = metrics
        self.on_learned = on_learned
        self.engines: dict[tuple[str, str], Engine] = {}
        self.spare: RunnerLike | None = None
        self.spare_reserved = 0
        self.last_eviction: dict[tuple[str, str], str] = {}
        self.recent_evictions: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self.crashes: dict[tuple[str, str], collections.deque[float]] = {}
        self.held_until: dict[tuple[str, str], float] = {}
        self.max_used = 0
        self.stopping = False
        self._cond = asyncio.Condition()
        self._capacity_waiters = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake_reaper = asyncio.Event()
        self._spare_task: asyncio.Task[None] | None = None

    # --- bookkeeping ---------------------------------------------------------------------

    def used(self) -> int:
        return sum(e.reserved for e in self.engines.values()) + self.spare_reserved

    def _note_used(self) -> None:
        used = self.used()
        self.max_used = max(self.max_used, used)
        if self.metrics:
            self.metrics.budget_used.set(used)

    def _set_state(self, e: Engine, new: State) -> None:
        """The one place an engine's state changes."""
        if new is e.state:
            return
        if new not in _ALLOWED[e.state]:
            raise AssertionError(f"engine {e.target.engine_id}: {e.state.value} -> {new.value}")
        logs.event("engine_state", engine=e.target.engine_id, old=e.state.value, new=new.value)
        e.state = new

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def _wake(self) -> None:
        # Never notify inline: callers may hold the condition's lock already.
        self._spawn(self._notify())
        self._wake_reaper.set()

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self._spawn(self._watch())
        self._spawn(self._reaper())
        if self.config.spare:
            self._refill_spare()

    async def stop(self) -> None:
        """Stop every runner (idempotent); in-flight generations end with an error."""
        self.stopping = True
        for task in list(self._tasks):
            task.cancel()
        engines = list(self.engines.values())
        await asyncio.gather(
            *(self._stop_engine(e, "daemon stopping") for e in engines), return_exceptions=True
        )
        if self._spare_task is not None:
            self._spare_task.cancel()
            with contextlib.suppress(BaseException):
                await self._spare_task
        await self._drop_spare()
        while self._tasks:
            pending = list(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # --- the spare runner --------------------------------------------------------------

    def _refill_spare(self) -> None:
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
        self._note_used()

    async def _take_spare(self) -> RunnerLike | None:
        if self._spare_task is not None and not self._spare_task.done():
            # A spare half started is still faster than a new one.
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._spare_task)
        runner, self.spare = self.spare, None
        if runner is not None and not runner.alive:
            runner = None
        return runner

    async def _drop_spare(self) -> None:
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

    async def _admit(self, e: Engine) -> None:
        """Grow ``e.reserved`` to its expected size, evicting idle engines or waiting."""
        need = e.target.expected
        budget = self.config.budget
        if need > budget:
            raise OverBudget(
                f"model {e.target.model_id}: its engine needs about {format_size(need)} "
                f"({'measured' if e.target.learned else 'estimated from the file'}) but the "
                f"memory budget is {format_size(budget)}; raise MODELD_MEMORY_BUDGET or ask "
                "for fewer max_tokens",
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
                        self._note_used()
                        return
                    if self.spare is not None or self.spare_reserved:
                        await self._drop_spare()
                        continue
                    victim = self._victim(e)
                    if victim is not None:
                        await self._stop_engine(victim, f"evicted to load {e.target.model_id}")
                        continue
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

    # --- loading -------------------------------------------------------------------------

    def _held(self, target: Target) -> None:
        until = self.held_until.get(target.key)
        if until is None:
            return
        left = until - time.monotonic()
        if left <= 0:
            del self.held_until[target.key]
            self.crashes.pop(target.key, None)
            return
        raise HeldBack(
            f"model {target.model_id}: its engine crashed {self.config.crash_limit} times "
            f"within {self.config.crash_window:g} s; held back for another {left:.0f} s. "
            f"Check the file with `modeld verify {target.model_id}` or try another plan",
            retry_after=left,
        )

    async def _engine_for(self, target: Target, keep_alive: float | None) -> Engine:
        """The engine for ``target``, created (once) if needed; counts the caller as a user."""
        if self.stopping:
            raise ShuttingDown("the daemon is stopping; retry when it is back")
        self._held(target)
        e: Engine | None = None
        while True:
            e = self.engines.get(target.key)
            if e is not None and e.state in (State.UNLOADING, State.FAILED):
                await e.gone.wait()
                continue
            break
        if e is None:
            e = Engine(target=target, keep_alive=self.config.keep_alive)
            self.engines[target.key] = e
            e.load_task = self._spawn(self._load(e))
        if e.users >= self.config.queue_limit:
            raise Busy(f"model {target.model_id}: {e.users} requests already queued", 1.0)
        if keep_alive is not None:
            e.keep_alive = keep_alive
        e.users += 1
        e.idle.clear()
        e.expires_at = None
        return e

    async def _load(self, e: Engine) -> None:
        started = time.monotonic()
        t = e.target
        try:
            runner = await self._take_spare()
            if runner is not None:
                # The spare's memory is already counted: it moves into this engine.
                e.reserved, self.spare_reserved = self.spare_reserved, 0
            await self._admit(e)
            if runner is None:
                runner = await self.factory()
            e.runner = runner
            reply = await runner.create(t.spec)
        except BaseException as exc:
            err = self._load_error(t, exc)
            await self._finish_failed_load(e, err)
            if self.metrics:
                self.metrics.engine_loads.labels(t.model_id, "failed").inc()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        e.create_seconds = float(reply.get("seconds", 0.0))
        e.load_seconds = time.monotonic() - started
        e.measured = runner.memory()[0] or int(reply.get("pss", 0))
        e.reserved = max(e.measured, t.expected)
        self._note_used()
        if e.state is not State.LOADING:
            # Unloaded while the engine was being created: the unload stops the runner.
            e.ready.set_exception(EngineError(f"model {t.model_id}: unloaded while loading"))
            e.ready.exception()
            return
        self._set_state(e, State.READY)
        e.last_used = time.monotonic()
        e.watch_task = self._spawn(self._watch_runner(e, runner))
        e.ready.set_result(None)
        if self.metrics:
            self.metrics.engine_loads.labels(t.model_id, "ok").inc()
        logs.event(
            "engine_loaded",
            engine=t.engine_id,
            pid=runner.pid,
            seconds=e.load_seconds,
            create=e.create_seconds,
            pss=e.measured,
            estimate=t.expected,
        )
        # The estimate may have been low: real PSS counts, so make room now if needed.
        await self._enforce_budget(keep=e)
        self._refill_spare()
        self._wake()

    async def _enforce_budget(self, keep: Engine | None = None) -> None:
        while self.used() > self.config.budget:
            if self.spare is not None:
                await self._drop_spare()
                continue
            victim = self._victim(exclude=keep)
            if victim is None:
                logs.event("over_budget", used=self.used(), budget=self.config.budget)
                return
            await self._stop_engine(victim, "budget: measured PSS over the estimate")

    def _load_error(self, t: Target, exc: BaseException) -> ModeldError:
        if isinstance(exc, ModeldError):
            return exc
        if isinstance(exc, asyncio.CancelledError):
            return EngineError(f"model {t.model_id}: the engine load was cancelled")
        if isinstance(exc, RunnerError):
            cls = BackendConstraint if exc.code == "backend_constraint" else EngineError
            return cls(
                f"model {t.model_id}: the runtime could not create its engine "
                f"(plan {t.plan['key']}): {exc.message}",
                model=t.model_id,
            )
        if isinstance(exc, RunnerDied):
            return EngineCrashed(
                f"model {t.model_id}: its runner {exc} while creating the engine; the daemon "
                "is fine. Check the file with `modeld verify`",
                model=t.model_id,
                signal=exc.signal_name,
            )
        return EngineError(f"model {t.model_id}: the engine could not start: {exc}")

    async def _finish_failed_load(self, e: Engine, err: ModeldError) -> None:
        if e.state is State.LOADING:
            self._set_state(e, State.FAILED)
        if e.runner is not None:
            await e.runner.kill()
        if isinstance(err, EngineCrashed):
            self._count_crash(e.target)
        self._remove(e)
        if not e.ready.done():
            e.ready.set_exception(err)
            # Nobody may be waiting any more (all left); do not log "never retrieved".
            e.ready.exception()

    def _remove(self, e: Engine) -> None:
        if self.engines.get(e.target.key) is e:
            del self.engines[e.target.key]
        e.reserved = 0
        e.gone.set()
        if self.metrics:
            with contextlib.suppress(KeyError):
                self.metrics.engine_pss.remove(e.target.engine_id)
        self._note_used()
        self._wake()

    # --- crash and stop ------------------------------------------------------------------

    def _count_crash(self, target: Target) -> None:
        now = time.monotonic()
        times = self.crashes.setdefault(target.key, collections.deque())
        times.append(now)
        while times and times[0] < now - self.config.crash_window:
            times.popleft()
        if len(times) >= self.config.crash_limit:
            self.held_until[target.key] = now + self.config.hold_seconds
            logs.event("model_held_back", model=target.model_id, crashes=len(times))

    async def _watch_runner(self, e: Engine, runner: RunnerLike) -> None:
        died = await runner.wait_exit()
        if runner.closing or e.state in (State.FAILED,):
            return
        logs.event("engine_crashed", engine=e.target.engine_id, how=died.how, reason=died.reason)
        if self.metrics:
            self.metrics.engine_crashes.labels(e.target.model_id, died.signal_name or "exit").inc()
        self._count_crash(e.target)
        self.last_eviction[e.target.key] = f"crashed ({died.how})"
        if e.state is not State.UNLOADING:
            self._set_state(e, State.FAILED)
        self._remove(e)

    async def _stop_engine(self, e: Engine, reason: str) -> None:
        """Stop ``e`` now (idle, or its in-flight work gets an error) and forget it."""
        if e.state in (State.LOADING, State.READY, State.BUSY):
            self._set_state(e, State.UNLOADING)
        if e.load_task is not None and not e.load_task.done():
            e.load_task.cancel()
            with contextlib.suppress(BaseException):
                await e.load_task
        if e.runner is not None:
            await e.runner.close()
        self.last_eviction[e.target.key] = reason
        self.recent_evictions.append(
            {"engine": e.target.engine_id, "reason": reason, "at": time.time()}
        )
        if self.metrics:
            self.metrics.engine_evictions.labels(reason.split(" ", maxsplit=1)[0]).inc()
        logs.event("engine_stopped", engine=e.target.engine_id, reason=reason)
        self._remove(e)

    # --- requests ------------------------------------------------------------------------

    async def _wait_ready(self, e: Engine) -> None:
        try:
            await asyncio.shield(e.ready)
        except asyncio.CancelledError:
            if e.state is State.LOADING and e.users <= 1 and not e.explicit:
                # Every waiter left: a load nobody wants any more only costs memory.
                self._spawn(self._stop_engine(e, "load cancelled: every waiter left"))
            raise

    def _release(self, e: Engine) -> None:
        e.users -= 1
        e.last_used = time.monotonic()
        if e.state is State.BUSY:
            self._set_state(e, State.READY)
        if e.users == 0:
            e.idle.set()
            if e.state is State.READY and not e.pinned:
                if e.keep_alive == 0:
                    self._spawn(self._stop_engine(e, "keep_alive 0"))
                elif e.keep_alive > 0:
                    e.expires_at = e.last_used + e.keep_alive
        self._wake()

    async def load(
        self, target: Target, *, keep_alive: float | None = None, pin: bool = False
    ) -> dict[str, Any]:
        """Load ``target`` now (or find it loaded); return its ``ps`` view."""
        e = await self._engine_for(target, keep_alive)
        e.explicit = True
        e.pinned = e.pinned or pin
        try:
            await self._wait_ready(e)
        finally:
            self._release(e)
        return e.view(time.monotonic(), self.last_eviction.get(e.target.key))

    async def generate(
        self, target: Target, job: dict[str, Any], *, keep_alive: float | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Token records, then a final record with phase timings; see ``runner_generate``."""
        arrived = time.monotonic()
        for attempt in range(2):
            e = await self._engine_for(target, keep_alive)
            started = False
            try:
                await self._wait_ready(e)
                loaded_at = time.monotonic()
                async with e.lock:
                    if e.state not in (State.READY, State.BUSY):
                        if attempt == 0 and e.state is State.FAILED:
                            continue  # crashed while we queued: a fresh engine is fine
                        raise EngineError(f"model {target.model_id}: its engine was unloaded")
                    started = True
                    self._set_state(e, State.BUSY)
                    e.served += 1
                    async for rec in self._run(e, job, arrived, loaded_at):
                        yield rec
                    return
            except RunnerError as err:
                cls = BadRequest if err.code == "bad_request" else EngineError
                raise cls(f"model {target.model_id}: {err.message}") from err
            except RunnerDied as died:
                if not started or e.runner is None or e.runner.closing:
                    raise EngineError(
                        f"model {target.model_id}: its engine was stopped during the request"
                    ) from died
                raise EngineCrashed(
                    f"model {target.model_id}: its engine process was {died.how}"
                    + (f" ({died.reason})" if died.reason else "")
                    + "; the daemon is fine and the next request starts a new engine",
                    model=target.model_id,
                    signal=died.signal_name,
                ) from died
            finally:
                self._release(e)

    async def _run(
        self, e: Engine, job: dict[str, Any], arrived: float, loaded_at: float
    ) -> AsyncIterator[dict[str, Any]]:
        assert e.runner is not None
        began = time.monotonic()
        first: float | None = None
        async with contextlib.aclosing(e.runner.generate(job)) as records:
            async for rec in records:
                if "token" in rec:
                    first = first or time.monotonic()
                    yield {"token": rec["token"]}
                    continue
                yield self._final(
                    e, rec, arrived=arrived, loaded_at=loaded_at, began=began, first=first
                )
        self._spawn(self._measure_after(e))

    async def _measure_after(self, e: Engine) -> None:
        """Measure an engine's PSS after a request (off its path) and learn its peak."""
        if e.runner is None:
            return
        pss = (await asyncio.to_thread(e.runner.memory))[0]
        if pss and e.state in (State.READY, State.BUSY):
            e.measured = pss
            e.peak = max(e.peak, pss)
            e.reserved = max(pss, e.target.expected)
            self._note_used()
        if e.peak > (e.target.learned or 0) and self.on_learned is not None:
            await self.on_learned(e.target, e.peak)

    def _final(
        self,
        e: Engine,
        rec: dict[str, Any],
        *,
        arrived: float,
        loaded_at: float,
        began: float,
        first: float | None,
    ) -> dict[str, Any]:
        now = time.monotonic()
        inner = rec.get("timings") or {}
        waited_load = loaded_at - arrived
        timings = {
            "load": waited_load,
            "engine_create": e.create_seconds if waited_load > 0.001 else 0.0,
            "queue": began - loaded_at,
            "prefill": inner.get("prefill"),
            "first_token": (first - arrived) if first is not None else None,
            "decode_tokens_per_second": inner.get("decode_tokens_per_second"),
            "total": now - arrived,
        }
        if self.metrics:
            for phase in ("load", "queue", "prefill", "first_token", "total"):
                value = timings[phase]
                if value is not None:
                    self.metrics.phase_seconds.labels(phase).observe(float(value))
            self.metrics.generated_tokens.labels(e.target.model_id).inc(rec.get("tokens") or 0)
        fields: dict[str, Any] = {k: v for k, v in timings.items() if v is not None}
        logs.event(
            "generate",
            engine=e.target.engine_id,
            finish=rec.get("finish"),
            tokens=rec.get("tokens"),
            **fields,
        )
        out = {k: v for k, v in rec.items() if k not in ("id", "timings")}
        out.update(done=True, model=e.target.model_id, engine=e.target.engine_id, timings=timings)
        return out

    # --- unload, expiry, watching ----------------------------------------------------------

    def find(self, selector: str) -> list[Engine]:
        """Engines whose id or model id is ``selector``."""
        return [
            e for e in self.engines.values() if selector in (e.target.engine_id, e.target.model_id)
        ]

    async def unload(self, selector: str, *, grace: float | None = None) -> list[dict[str, Any]]:
        """Stop the engines of ``selector``; in-flight requests get ``grace`` s to finish."""
        engines = self.find(selector)
        if not engines:
            raise EngineNotFound(f"no engine loaded for {selector!r}; see `modeld ps`")
        grace = self.config.unload_timeout if grace is None else grace
        views = []
        for e in engines:
            views.append(e.view(time.monotonic(), None))
            was_loading = e.state is State.LOADING
            if e.state in (State.READY, State.BUSY, State.LOADING):
                self._set_state(e, State.UNLOADING)
            # Waiters of a load have nothing in flight yet: stop it now.
            if e.users and not was_loading:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(grace):
                        await e.idle.wait()
            await self._stop_engine(e, "unloaded on request")
        return views

    async def _reaper(self) -> None:
        while True:
            now = time.monotonic()
            due = [
                e
                for e in self.engines.values()
                if e.state is State.READY and e.users == 0 and e.expires_at is not None
            ]
            for e in [e for e in due if e.expires_at is not None and e.expires_at <= now]:
                await self._stop_engine(e, f"keep_alive {e.keep_alive:g}s expired")
            nxt = min(
                (e.expires_at for e in due if e.expires_at and e.expires_at > now), default=None
            )
            self._wake_reaper.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # races with the event (the loop would then never stop).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if nxt is None else max(0.0, nxt - now)):
                    await self._wake_reaper.wait()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.watch_interval)
            # smaps_rollup reads take milliseconds each: keep them off the event loop.
            readings = await asyncio.to_thread(self._read_all)
            self.measure(readings)
            await self._enforce_budget()

    def _read_all(self) -> dict[int, int]:
        runners = [e.runner for e in list(self.engines.values()) if e.runner is not None]
        if self.spare is not None:
            runners.append(self.spare)
        return {r.pid: r.memory()[0] for r in runners}

    def measure(self, readings: dict[int, int] | None = None) -> None:
        """Take every runner's PSS; an engine reserves at least what it really uses."""
        readings = self._read_all() if readings is None else readings
        for e in list(self.engines.values()):
            if e.runner is not None and e.state in (State.READY, State.BUSY):
                pss = readings.get(e.runner.pid, 0)
                if pss:
                    e.measured = pss
                    e.peak = max(e.peak, pss)
                    e.reserved = max(pss, e.target.expected)
                    if self.metrics:
                        self.metrics.engine_pss.labels(e.target.engine_id).set(pss)
        if self.spare is not None and self.spare.pid in readings:
            self.spare_reserved = max(readings[self.spare.pid], 1) if self.spare.alive else 0
        self._note_used()

    # --- views ---------------------------------------------------------------------------

    def list(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [e.view(now, self.last_eviction.get(k)) for k, e in self.engines.items()]

    def status(self) -> dict[str, Any]:
        used, budget = self.used(), self.config.budget
        problems = []
        if used > budget:
            problems.append(
                f"engines use {format_size(used)}, over the budget {format_size(budget)}"
            )
        held = [k[0][:12] for k, until in self.held_until.items() if until > time.monotonic()]
        if held:
            problems.append(f"{len(held)} model file(s) held back after repeated crashes")
        return {
            "summary": f"{len(self.engines)} engine(s), {format_size(used)} of "
            f"{format_size(budget)} budget",
            "problems": problems,
            "loaded": len(self.engines),
            "budget": budget,
            "used": used,
            "max_used": self.max_used,
            "spare": {"pid": self.spare.pid if self.spare else None, "pss": self.spare_reserved},
            "recent_evictions": list(self.recent_evictions),
        }


def validate_keep_alive(value: Any) -> float | None:
    """A request's ``keep_alive``: seconds, a duration string, 0, or -1; None keeps the default."""
    if value is None:
        return None
    from modeld.config import parse_duration

    try:
        seconds = parse_duration(value)
    except (ValueError, ModeldError) as e:
        raise BadRequest(f"keep_alive {value!r}: use e.g. 30s, 5m, 0 or -1") from e
    return -1.0 if seconds < 0 else seconds
