"""The engine pool: lazy, single-flight engines in runner processes, under a memory budget.

Every engine is keyed by ``(digest, plan key)``. N requests for a cold engine start one
runner; a load whose waiters all left is cancelled. Memory admission, the spare runner and
eviction are the pool's ``Budget`` (``modeld.engine.budget``); an engine's ``ps`` view and the
final record of a request are in ``modeld.engine.views``; the data types in
``modeld.engine.types`` (all re-exported here).

Each engine's state (``State``) is changed only by ``Pool._set_state``, which checks the
transition against ``ALLOWED``. Requests to one engine run one at a time in arrival order
(``asyncio.Lock`` is FIFO); different engines run in parallel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Self

from modeld import logs
from modeld.catalog.catalog import how_to_edit_entry
from modeld.config import format_size
from modeld.engine.budget import Budget
from modeld.engine.runner.client import RunnerDied, RunnerError
from modeld.engine.runner.job import (
    FINISH_CANCELLED,
    Counted,
    CountJob,
    Created,
    Done,
    Embedded,
    EmbedJob,
    GenerateJob,
    Job,
    Token,
)
from modeld.engine.types import (
    ALLOWED,
    Engine,
    Journal,
    KeepAlive,
    Learned,
    PoolConfig,
    RunnerFactory,
    RunnerLike,
    State,
    Target,
    load_error,
    validate_keep_alive,
)
from modeld.engine.views import EngineView, Final, Moments, Phases, engine_view, final_record
from modeld.errors import (
    BadRequest,
    Busy,
    ContextLengthExceeded,
    EngineCrashed,
    EngineError,
    EngineNotFound,
    EngineUnloaded,
    HeldBack,
    ModeldError,
    ShuttingDown,
    TooLarge,
)
from modeld.metrics import Metrics
from modeld.modelfile.runtime import CreateSpec

__all__ = [
    "ALLOWED",
    "Engine",
    "EngineView",
    "Journal",
    "KeepAlive",
    "Learned",
    "Pool",
    "PoolConfig",
    "RunnerFactory",
    "RunnerLike",
    "State",
    "Target",
    "engine_view",
    "validate_keep_alive",
]


class CrashedWhileQueued(EngineCrashed):
    """An engine crashed while a request waited for its turn; the pool gives the request a
    fresh engine, once."""


class Turn:
    """A request's place in its engine's line, from the engine's lock to the runner's queue.

    The lock (FIFO) decides the order in which jobs are sent to the runner, which runs
    them in that order. A request holds the lock until its job is sent *and* the job
    before it has ended in the runner; so while one job runs, the next one already waits
    in the runner and starts the moment the runner is done, without a round trip through
    the daemon, and no third job is sent. The order stays the order of arrival.
    """

    def __init__(self, e: Engine) -> None:
        self.e = e
        self.ahead = e.last_job  # the end of the job sent before this one
        self.own: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        e.last_job = self.own
        self.held = True

    def sent(self) -> None:
        """The job is in the runner's queue: free the lock once the one ahead has ended."""
        if self.ahead is None or self.ahead.done():
            self.release()
        else:
            self.ahead.add_done_callback(lambda _: self.release())

    def release(self) -> None:
        if self.held:
            self.held = False
            self.e.lock.release()

    def end(self, at: float | None) -> None:
        """The job is over in the runner at ``at`` (None: the runner died before it said so).

        Never before the job ahead: one that left while it waited in the runner is only
        dropped there when its turn comes.
        """
        ahead = self.ahead
        if ahead is not None and not ahead.done():
            ahead.add_done_callback(lambda _: self.end(at))
        elif not self.own.done():
            before = ahead.result() if ahead is not None else None
            died = at is None or (ahead is not None and before is None)
            self.own.set_result(None if died else max(at or 0.0, before or 0.0))

    def began(self, sent: float) -> float:
        """When the runner started this job: when it was sent, or when the one ahead ended."""
        if self.ahead is not None and self.ahead.done():
            return max(sent, self.ahead.result() or sent)
        return sent

    def before_its_turn(self) -> bool:
        """At a crash: the runner died before it ended the job ahead, so never ran this one."""
        return self.ahead is not None and (not self.ahead.done() or self.ahead.result() is None)


def unloaded_by_admin(target: Target) -> EngineUnloaded:
    """The error of a request that an unload's grace did not leave time to serve."""
    return EngineUnloaded(
        f"model {target.model_id}: an admin unloaded its engine (`modeld unload`) before "
        "this request was served; send it again to start a fresh engine",
        1.0,
    )


def stopped_error(e: Engine) -> ModeldError:
    """The error of a request whose engine was stopped while it ran or waited in the runner."""
    if e.refusal is not None:  # an unload's grace ran out, or the daemon stops
        return e.refusal()
    return EngineError(f"model {e.target.model_id}: its engine was stopped during the request")


# Models whose latest runner (and its stderr, up to runner_client.STDERR_LIMIT) is kept.
LAST_RUNNERS = 16
# A runner the GPU probe handed over (``Pool.hand_over``) waits this long for its load; the
# request that probed loads at once, so one still waiting was left by a refused request.
HANDED_TTL = 60.0


# The runtime's refusal of an embedding input, inside a status line that names its C++ source
# file and line: only this sentence of it reaches the client.
_INPUT_OVER_SIGNATURE = re.compile(
    r"Input sequence length \(\d+\) exceeds maximum supported signature length \(\d+\)"
)


def input_too_long(target: Target, why: str) -> str:
    """The 413 for an embedding input over the encoder's longest signature."""
    found = _INPUT_OVER_SIGNATURE.search(why)
    said = f" ({found.group(0)})" if found else ""
    return (
        f"model {target.model_id}: an input is longer than the model takes{said}; "
        "send shorter inputs"
    )


_RUNTIME_PREFIX = re.compile(r"^(?:\w+Error: )?(?:[A-Z][A-Z_]+: )?")


# The runtime's count in its refusal: "... tokens allowed: 1211 >= 256" (prompt >= window).
_PROMPT_COUNT = re.compile(r"(\d+) >= (\d+)")


def prompt_too_long(target: Target, why: str) -> ContextLengthExceeded:
    """The refusal of a prompt over the window of the engine made for ``target``, in OpenAI's
    words (its clients match them), with the runtime's own count where it gave one.

    The window is the entry's ``[limits] max_tokens`` (``vision_max_tokens`` with vision),
    else the file's own, and the runtime never goes past the file's: that entry key is the one
    control. A loaded engine keeps the window it was created with until it is unloaded.
    """
    model = target.model_id
    # The runtime's sentence, without the exception's class and the status code before it.
    why = _RUNTIME_PREFIX.sub("", why)
    ceiling = target.file_max_tokens
    window = min(target.max_tokens, ceiling) if ceiling else target.max_tokens
    counted = _PROMPT_COUNT.search(why)
    tokens = int(counted.group(1)) if counted else None
    if counted:
        window = int(counted.group(2))
        resulted = f"However, your messages resulted in {tokens} tokens"
    else:
        resulted = f"However, your messages do not fit it ({why})"
    said = (
        f"This model's maximum context length is {window} tokens. {resulted}. Please reduce "
        f"the length of the messages (model {model}: the prompt and at least one reply token "
        "must fit the engine's window)"
    )
    details = {"window": window, "prompt_tokens": tokens}
    if ceiling is not None and window >= ceiling:
        return ContextLengthExceeded(
            f"{said}; {window} tokens is the most the model's file allows.", **details
        )
    key = "vision_max_tokens" if target.plan.vision else "max_tokens"
    most = f", up to the file's own {ceiling}" if ceiling else ""
    return ContextLengthExceeded(
        f"{said}, or raise `{key}` under `[limits]` in the model's catalog entry{most} "
        f"(to change it, {how_to_edit_entry(model)}), then `modeld unload {model}` so the "
        "next load takes it.",
        **details,
    )


class Pool:
    """Owns every engine and runner of one daemon; see the module docstring."""

    def __init__(
        self,
        config: PoolConfig,
        runner_factory: RunnerFactory,
        *,
        metrics: Metrics | None = None,
        on_learned: Learned | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.config = config
        self.journal = journal
        self.factory = runner_factory
        self.metrics = metrics
        self.phases = Phases(metrics) if metrics is not None else None
        self.engines: dict[tuple[str, str], Engine] = {}
        self.budget = Budget(
            config,
            self.engines,
            runner_factory,
            evict=self._stop_engine,
            spawn=self._spawn,
            metrics=metrics,
            on_learned=on_learned,
        )
        self.last_eviction: dict[tuple[str, str], str] = {}
        self.recent_evictions: collections.deque[dict[str, Any]] = collections.deque(maxlen=20)
        self.crashes: dict[tuple[str, str], collections.deque[float]] = {}
        # model id -> (engine id, its latest runner, when it was given the engine): the
        # runner object keeps its stderr after it exits, for `modeld bug-report`.
        self.last_runners: collections.OrderedDict[str, tuple[str, RunnerLike, float]] = (
            collections.OrderedDict()
        )
        self.held_until: dict[tuple[str, str], float] = {}
        # key -> a runner whose engine the GPU probe created for that target, its spec and
        # its create reply (``hand_over``): the load that follows takes it as it is.
        self.handed: dict[tuple[str, str], tuple[RunnerLike, CreateSpec, Created]] = {}
        self.stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake_reaper = asyncio.Event()
        self._reaper_due: float | None = None  # when the reaper wakes up by itself

    def _set_state(self, e: Engine, new: State) -> None:
        """The one place an engine's state changes."""
        if new is e.state:
            return
        if new not in ALLOWED[e.state]:
            raise AssertionError(f"engine {e.target.engine_id}: {e.state.value} -> {new.value}")
        # READY <-> BUSY happens twice a request: a debug line, not one in every request's log.
        routine = {e.state, new} == {State.READY, State.BUSY}
        logs.event(
            "engine_state",
            logging.DEBUG if routine else logging.INFO,
            engine=e.target.engine_id,
            old=e.state.value,
            new=new.value,
        )
        e.state = new

    def _note_queue(self, model_id: str) -> None:
        """Requests for ``model_id`` not yet running (waiting for a load or the engine lock)."""
        if self.metrics:
            waiting = sum(
                max(0, x.users - (1 if x.state is State.BUSY else 0))
                for x in self.engines.values()
                if x.target.model_id == model_id
            )
            self.metrics.child(self.metrics.queue_depth, model_id).set(waiting)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wake(self, reaper: bool = True) -> None:
        self.budget.wake()
        if reaper:
            self._wake_reaper.set()

    # --- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        self._spawn(self.budget.watch())
        self._spawn(self._reaper())
        if self.config.spare:
            self.budget.refill_spare()

    async def stop(self) -> None:
        """Stop every runner (idempotent); in-flight generations end with an error."""
        self.stopping = self.budget.stopping = True
        for task in list(self._tasks):
            task.cancel()
        engines = list(self.engines.values())
        for e in engines:
            e.refusal = e.refusal or functools.partial(
                ShuttingDown, "the daemon is stopping; retry when it is back"
            )
        await asyncio.gather(
            *(self._stop_engine(e, "daemon stopping") for e in engines), return_exceptions=True
        )
        await self.budget.stop()
        for runner, _, _ in self.handed.values():
            await runner.kill()
        self.handed.clear()
        while self._tasks:
            pending = list(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

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

    async def _engine_for(
        self, target: Target, keep_alive: KeepAlive | None, *, warm_up: bool | None = None
    ) -> Engine:
        """The engine for ``target``, created (once) if needed; counts the caller as a user.

        ``warm_up``: whether this caller's load warms up (None: the target's rule,
        ``Target.warm_up``); it only counts when this caller starts the load.
        """
        if self.stopping:
            raise ShuttingDown("the daemon is stopping; retry when it is back")
        self._held(target)
        e: Engine | None = None
        while True:
            e = self.engines.get(target.key)
            if e is not None and e.state in (State.UNLOADING, State.FAILED):
                if e.final and e.refusal is not None:
                    raise e.refusal()  # the model is being removed: no fresh engine
                # An unload's requests finish first; then this one starts a fresh engine.
                await e.gone.wait()
                continue
            break
        if e is None:
            e = Engine(
                target=target,
                keep_alive=self.config.keep_alive,
                warm_up=bool(target.warm_up) if warm_up is None else warm_up,
            )
            self.engines[target.key] = e
            e.load_task = self._spawn(self._load(e))
        if e.users >= self.config.queue_limit:
            raise Busy(f"model {target.model_id}: {e.users} requests already queued", 1.0)
        if keep_alive is not None:
            e.keep_alive = keep_alive.applied_to(e.keep_alive)
        e.users += 1
        self._note_queue(target.model_id)
        e.idle.clear()
        e.expires_at = None
        return e

    def hand_over(
        self, key: tuple[str, str], runner: RunnerLike, spec: CreateSpec, reply: Created
    ) -> None:
        """Keep ``runner``, whose engine for ``spec`` is created (the GPU probe's), for the
        load of ``key``; one not taken within ``HANDED_TTL`` is stopped."""
        old = self.handed.pop(key, None)
        if old is not None:
            self._spawn(old[0].kill())
        self.handed[key] = (runner, spec, reply)
        self._spawn(self._expire_handed(key, runner))

    async def _expire_handed(self, key: tuple[str, str], runner: RunnerLike) -> None:
        await asyncio.sleep(HANDED_TTL)
        found = self.handed.get(key)
        if found is not None and found[0] is runner:
            del self.handed[key]
            await runner.kill()

    async def _take_handed(self, t: Target) -> tuple[RunnerLike, Created] | None:
        """The runner handed over for ``t`` with its engine created, if it fits ``t``."""
        found = self.handed.pop(t.key, None)
        if found is None:
            return None
        runner, spec, reply = found
        if runner.alive and spec == dataclasses.replace(t.spec, warm_up=spec.warm_up):
            return runner, reply
        await runner.kill()
        return None

    async def _start_engine(self, e: Engine) -> Created:
        """Admit ``e``, give it a runner (one handed over with its engine, the spare or a new
        one) and create its engine; the runner's ``create`` reply."""
        t = e.target
        handed = await self._take_handed(t)
        if handed is not None:
            e.runner = handed[0]  # stopped with the engine if the admission fails
            self._note_runner(t, handed[0])
            await self.budget.admit(e)
            return handed[1]
        runner = await self.budget.take_spare()
        if runner is not None:
            # The spare's memory is already counted: it moves into this engine.
            e.reserved, self.budget.spare_reserved = self.budget.spare_reserved, 0
        await self.budget.admit(e)
        if runner is None:
            runner = await self.factory()
        e.runner = runner
        self._note_runner(t, runner)
        return await runner.create(
            dataclasses.replace(t.spec, warm_up=True) if e.warm_up else t.spec
        )

    async def _load(self, e: Engine) -> None:
        started = time.monotonic()
        t = e.target
        try:
            reply = await self._start_engine(e)
            runner = e.runner
            assert runner is not None
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError)
            # Cancelled by an unload: its waiters get the unload's error.
            err = e.refusal() if cancelled and e.refusal is not None else load_error(t, exc)
            if not cancelled:
                self._record(
                    "engine_load_failed",
                    model=t.model_id,
                    engine=t.engine_id,
                    code=err.code,
                    message=err.message,
                )
            await self._finish_failed_load(e, err)
            if self.metrics:
                self.metrics.engine_loads.labels(t.model_id, "failed").inc()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        e.create_seconds = reply.seconds
        e.warm_up_timings = reply.warm_up
        e.options = reply.options
        if self.metrics:
            self.metrics.phase_seconds.labels("engine_create").observe(e.create_seconds)
            if e.warm_up_timings is not None:
                self.metrics.phase_seconds.labels("warm_up").observe(
                    float(e.warm_up_timings["seconds"])
                )
        e.load_seconds = time.monotonic() - started
        e.measured = runner.memory()[0] or reply.pss
        e.reserved = max(e.measured, t.expected)
        self.budget.note_used()
        if e.state is not State.LOADING:
            # Unloaded while the engine was being created: the unload stops the runner.
            e.ready.set_exception(
                e.refusal()
                if e.refusal is not None
                else EngineError(f"model {t.model_id}: unloaded while loading")
            )
            e.ready.exception()
            return
        self._set_state(e, State.READY)
        e.last_used = time.monotonic()
        e.watch_task = self._spawn(self._watch_runner(e, runner))
        e.ready.set_result(None)
        if self.metrics:
            self.metrics.engine_loads.labels(t.model_id, "ok").inc()
        self._record(
            "engine_loaded",
            model=t.model_id,
            engine=t.engine_id,
            pid=runner.pid,
            seconds=e.load_seconds,
            create=e.create_seconds,
            warm_up=e.warm_up_timings["seconds"] if e.warm_up_timings else None,
            pss=e.measured,
            estimate=t.expected,
            adapter=t.adapter,
        )
        # The estimate may have been low: real PSS counts, so make room now if needed.
        await self.budget.enforce(keep=e)
        self.budget.refill_spare()
        self._wake()

    def _record(self, kind: str, **fields: Any) -> None:
        """An event for the store's journal (which logs it too), or only the log."""
        if self.journal is None:
            logs.event(kind, **fields)
        else:
            self._spawn(self.journal(kind, fields))

    def _note_runner(self, t: Target, runner: RunnerLike) -> None:
        self.last_runners.pop(t.model_id, None)
        self.last_runners[t.model_id] = (t.engine_id, runner, time.time())
        while len(self.last_runners) > LAST_RUNNERS:
            self.last_runners.popitem(last=False)

    def runner_log(self, model_id: str) -> dict[str, Any] | None:
        """The latest runner of ``model_id`` (alive or not) and its whole stderr, or None."""
        found = self.last_runners.get(model_id)
        if found is None:
            return None
        engine_id, runner, since = found
        died = runner.died if not runner.alive else None
        return {
            "engine": engine_id,
            "pid": runner.pid,
            "alive": runner.alive,
            "since": since,
            "exit": str(died) if died is not None else None,
            "signal": died.signal_name if died is not None else None,
            "stderr": runner.stderr_text(),
        }

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
        self._note_queue(e.target.model_id)
        if self.metrics:
            with contextlib.suppress(KeyError):
                self.metrics.engine_pss.remove(e.target.engine_id)
        self.budget.note_used()
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
        self._record(
            "engine_crashed",
            model=e.target.model_id,
            engine=e.target.engine_id,
            how=died.how,
            reason=died.reason,
        )
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
        # Busy while a job sent after this one is still in the runner.
        if e.state is State.BUSY and (e.last_job is None or e.last_job.done()):
            self._set_state(e, State.READY)
        if e.users == 0:
            e.idle.set()
            if e.state is State.READY and not e.pinned:
                if e.keep_alive == 0:
                    self._spawn(self._stop_engine(e, "keep_alive 0"))
                elif e.keep_alive > 0:
                    e.expires_at = e.last_used + e.keep_alive
        self._note_queue(e.target.model_id)
        # The reaper needs waking only for an expiry earlier than the one it sleeps until.
        due = self._reaper_due
        self._wake(reaper=e.expires_at is not None and (due is None or e.expires_at < due))

    async def load(
        self,
        target: Target,
        *,
        keep_alive: KeepAlive | None = None,
        pin: bool = False,
        warm_up: bool | None = None,
    ) -> dict[str, Any]:
        """Load ``target`` now (or find it loaded); return its ``ps`` view.

        ``warm_up`` (the caller's explicit choice) wins; else the target's rule, and where
        that leaves it open, a pinned load warms up (it is kept for a quick first reply).
        """
        if warm_up is None:
            warm_up = pin if target.warm_up is None else target.warm_up
        e = await self._engine_for(target, keep_alive, warm_up=warm_up)
        e.explicit = True
        e.pinned = e.pinned or pin
        try:
            await self._wait_ready(e)
        finally:
            self._release(e)
        return engine_view(e, time.monotonic(), self.last_eviction.get(e.target.key)).to_dict()

    async def generate(
        self,
        target: Target,
        job: GenerateJob,
        *,
        keep_alive: KeepAlive | None = None,
        image_prepare: float = 0.0,
    ) -> AsyncGenerator[Token | Final[Done], None]:
        """``Token`` records, then the ``Final`` record with phase timings.

        ``image_prepare`` is the time the caller spent preparing the job's images (it comes
        before the request reaches the pool); it is reported as its own phase. The job goes
        to the runner while the one before it still runs (``Turn``). A request whose engine
        crashed before its turn came (queued on the lock, or its job waiting in the runner)
        is given a fresh engine, once: it never ran, and a fresh engine serves it as well.
        """
        async with contextlib.aclosing(
            self._serve(target, job, keep_alive=keep_alive, image_prepare=image_prepare)
        ) as records:
            async for rec in records:
                if isinstance(rec, Token):
                    yield rec
                    continue
                result = rec.result
                if not isinstance(result, Done):
                    raise EngineError(f"model {target.model_id}: its runner answered no reply")
                yield Final(result, rec.model, rec.engine, rec.timings)

    async def embed(
        self, target: Target, job: EmbedJob, *, keep_alive: KeepAlive | None = None
    ) -> Final[Embedded]:
        """The vectors of an embedding job, with phase timings."""
        async with contextlib.aclosing(self._serve(target, job, keep_alive=keep_alive)) as recs:
            async for rec in recs:
                result = None if isinstance(rec, Token) else rec.result
                if isinstance(result, Embedded) and not isinstance(rec, Token):
                    return Final(result, rec.model, rec.engine, rec.timings)
        raise EngineError(f"model {target.model_id}: its runner answered no vectors")

    async def count(
        self, target: Target, job: CountJob, *, keep_alive: KeepAlive | None = None
    ) -> Final[Counted]:
        """The tokens a generation job's prompt takes, counted by its engine's runner."""
        async with contextlib.aclosing(self._serve(target, job, keep_alive=keep_alive)) as recs:
            async for rec in recs:
                result = None if isinstance(rec, Token) else rec.result
                if isinstance(result, Counted) and not isinstance(rec, Token):
                    return Final(result, rec.model, rec.engine, rec.timings)
        raise EngineError(f"model {target.model_id}: its runner answered no count")

    async def _serve(
        self,
        target: Target,
        job: Job,
        *,
        keep_alive: KeepAlive | None = None,
        image_prepare: float = 0.0,
    ) -> AsyncGenerator[Token | Final[Done] | Final[Embedded] | Final[Counted], None]:
        arrived = time.monotonic()
        fresh_engine_once = True
        while True:
            try:
                e, loaded_at = await self._admit(target, keep_alive)
            except CrashedWhileQueued:
                if not fresh_engine_once:
                    raise
                fresh_engine_once = False
                continue  # a fresh engine serves it as well
            turn = Turn(e)
            given = False  # whether a record went to the caller
            try:
                self._note_queue(target.model_id)
                e.served += 1
                records = self._run(
                    e, job, turn, arrived=arrived, loaded_at=loaded_at, prepare=image_prepare
                )
                async for rec in records:
                    given = True
                    yield rec
                return
            except RunnerError as err:
                turn.end(time.monotonic())  # the runner reported it: it went on
                e.tainted = True
                if err.code == "too_large" and target.spec.kind == "embedding":
                    raise TooLarge(input_too_long(target, err.message)) from err
                if err.code == "too_large":
                    raise prompt_too_long(e.target, err.message) from err
                cls = BadRequest if err.code == "bad_request" else EngineError
                raise cls(f"model {target.model_id}: {err.message}") from err
            except RunnerDied as died:
                turn.end(None)
                if e.runner is None or e.runner.closing:
                    raise stopped_error(e) from died
                if fresh_engine_once and not given and turn.before_its_turn():
                    fresh_engine_once = False
                    continue  # it never ran: as a request queued on the lock, a fresh engine
                raise EngineCrashed(
                    f"model {target.model_id}: its engine process was {died.how}"
                    + (f" ({died.reason})" if died.reason else "")
                    + "; the daemon is fine and the next request starts a new engine",
                    model=target.model_id,
                    signal=died.signal_name,
                ) from died
            finally:
                # Left early (cancelled in the runner, which then went on) or any other end.
                alive = e.runner is not None and e.runner.alive
                turn.end(time.monotonic() if alive else None)
                turn.release()
                self._release(e)

    async def _admit(self, target: Target, keep_alive: KeepAlive | None) -> tuple[Engine, float]:
        """The target's engine, ready (now busy), with its lock held (FIFO) and the caller
        counted as a user: the caller releases both. Returns the engine and when it was
        ready; an engine that crashed while the request waited raises ``CrashedWhileQueued``.
        While an unload drains it, the engine stays ``unloading`` and serves what it admitted.
        """
        e = await self._engine_for(target, keep_alive)
        try:
            await self._wait_ready(e)
            loaded_at = time.monotonic()
            await e.lock.acquire()
        except BaseException:
            self._release(e)
            raise
        if e.state in (State.READY, State.BUSY):
            self._set_state(e, State.BUSY)
            return e, loaded_at
        runner = e.runner
        if e.state is State.UNLOADING and runner is not None and not runner.closing:
            # Admitted before the unload began: it is served within the unload's grace.
            return e, loaded_at
        e.lock.release()
        self._release(e)
        if e.state is State.FAILED:
            raise CrashedWhileQueued(
                f"model {target.model_id}: its engine crashed while this request waited; "
                "send it again"
            )
        if e.refusal is not None:
            raise e.refusal()
        raise EngineError(f"model {target.model_id}: its engine was unloaded")

    async def _run(
        self,
        e: Engine,
        job: Job,
        turn: Turn,
        *,
        arrived: float,
        loaded_at: float,
        prepare: float,
    ) -> AsyncIterator[Token | Final[Done] | Final[Embedded] | Final[Counted]]:
        assert e.runner is not None
        sent = time.monotonic()
        first: float | None = None
        # The turn ends when the runner's last record arrives, read or not: a client that
        # stops reading holds its own request, not the jobs behind it.
        async with contextlib.aclosing(e.runner.generate(job, turn.sent, turn.end)) as records:
            async for rec in records:
                if isinstance(rec, Token):
                    first = first or time.monotonic()
                    yield rec
                    continue
                if isinstance(rec, Done) and rec.finish == FINISH_CANCELLED and e.runner.closing:
                    # Cut short by the runner's close (an unload, the daemon stopping): no
                    # reply, not a short one.
                    raise stopped_error(e)
                # The runner went on to the next job: let the one after that be sent.
                turn.end(time.monotonic())
                ttft = rec.timings.first_token
                began = turn.began(sent)
                if first is None and ttft is not None:
                    # A non-streamed reply sends no token frames: the runner's own figure.
                    first = began + ttft
                moments = Moments(arrived, loaded_at, began, first, prepare)
                # One branch per record type: ``final_record``'s type variable takes no union.
                if isinstance(rec, Done):  # noqa: SIM114
                    yield final_record(e, rec, self.phases, moments)
                elif isinstance(rec, Embedded):
                    yield final_record(e, rec, self.phases, moments)
                else:
                    yield final_record(e, rec, self.phases, moments)
        if not e.measured_at or time.monotonic() - e.measured_at >= self.config.watch_interval:
            self._spawn(self.budget.measure_after(e))

    # --- unload, expiry, watching ----------------------------------------------------------

    def find(self, selector: str) -> list[Engine]:
        """Engines whose id or model id is ``selector``."""
        return [
            e for e in self.engines.values() if selector in (e.target.engine_id, e.target.model_id)
        ]

    async def unload(
        self,
        selector: str,
        *,
        grace: float | None = None,
        refusal: Callable[[Target], ModeldError] | None = None,
        final: bool = False,
    ) -> list[dict[str, Any]]:
        """Stop the engines of ``selector``; in-flight requests get ``grace`` s to finish.

        In flight are the requests the engine admitted before the unload began: the one in
        the runner and those queued on its lock. They are served in order; the engine stops
        after the last one, or when ``grace`` runs out. Each one not served by then (and each
        waiter of a load that the unload stops) gets ``refusal(target)``, by default a 503
        ``engine_unloaded``. A request that arrives meanwhile waits and starts a fresh engine,
        unless ``final`` (the model is being removed): then it gets the refusal at once.
        """
        engines = self.find(selector)
        if not engines:
            raise EngineNotFound(f"no engine loaded for {selector!r}; see `modeld ps`")
        grace = self.config.unload_timeout if grace is None else grace
        refuse = refusal or unloaded_by_admin
        views = []
        for e in engines:
            views.append(engine_view(e, time.monotonic(), None).to_dict())
            e.refusal = functools.partial(refuse, e.target)
            e.final = e.final or final
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
            # Cleared before the scan, and "no due time" while it runs: an expiry set while
            # an engine is being stopped below wakes the next round instead of being lost.
            self._wake_reaper.clear()
            self._reaper_due = None
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
            self._reaper_due = nxt
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation that
            # races with the event (the loop would then never stop).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if nxt is None else max(0.0, nxt - now)):
                    await self._wake_reaper.wait()

    # --- views ---------------------------------------------------------------------------

    def views(self) -> list[EngineView]:
        """Every engine as ``ps`` shows it."""
        now = time.monotonic()
        return [engine_view(e, now, self.last_eviction.get(k)) for k, e in self.engines.items()]

    def list(self) -> list[dict[str, Any]]:
        """``views()`` in their JSON form."""
        return [v.to_dict() for v in self.views()]

    def status(self) -> dict[str, Any]:
        """The ``engines`` section of ``/api/status``: the budget, the spare, evictions."""
        used, budget = self.budget.used(), self.config.budget
        problems = []
        if used > budget:
            problems.append(
                f"engines use {format_size(used)}, over the budget {format_size(budget)}"
            )
        held = [k[0][:12] for k, until in self.held_until.items() if until > time.monotonic()]
        if held:
            problems.append(f"{len(held)} model file(s) held back after repeated crashes")
        spare = self.budget.spare
        return {
            "summary": f"{len(self.engines)} engine(s), {format_size(used)} of "
            f"{format_size(budget)} budget",
            "problems": problems,
            "loaded": len(self.engines),
            "budget": budget,
            "used": used,
            "max_used": self.budget.max_used,
            "spare": {"pid": spare.pid if spare else None, "pss": self.budget.spare_reserved},
            "recent_evictions": list(self.recent_evictions),
        }
