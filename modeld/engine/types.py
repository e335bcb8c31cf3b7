"""The engine pool's data: runner protocol, engine states and transitions, targets, config.

``State`` and its transition table ``ALLOWED`` live here; the one place an engine's state
changes is ``Pool._set_state`` (``modeld.engine.pool``), which checks every change against it.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
import math
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from modeld.config import format_size, parse_duration
from modeld.engine.runner.client import RunnerDied, RunnerError
from modeld.engine.runner.job import Created, Job, Record, WarmUp
from modeld.errors import (
    BackendConstraint,
    BadRequest,
    DiskFull,
    EngineCrashed,
    EngineError,
    ModeldError,
)
from modeld.modelfile.plan import Plan
from modeld.modelfile.runtime import CreateSpec


class RunnerLike(Protocol):
    """What the pool needs of a runner; ``runner_client.Runner`` and ``FakeRunner`` have it."""

    pid: int
    closing: bool
    died: RunnerDied | None

    @property
    def alive(self) -> bool: ...
    def stderr_text(self) -> str: ...
    async def create(self, spec: CreateSpec) -> Created: ...
    def generate(
        self,
        job: Job,
        sent: Callable[[], None] | None = None,
        ended: Callable[[float], None] | None = None,
    ) -> AsyncGenerator[Record, None]: ...
    def memory(self) -> tuple[int, int]: ...
    def rss(self) -> int: ...
    async def wait_exit(self) -> RunnerDied: ...
    async def close(self, grace: float = 5.0) -> None: ...
    async def kill(self) -> None: ...


RunnerFactory = Callable[[], Awaitable[RunnerLike]]
# True when the peak was recorded (one far over the estimate may wait for confirmation).
Learned = Callable[["Target", int], Awaitable[bool]]
# Appends one event (kind, fields) to the store's journal; see ``Store.event``.
Journal = Callable[[str, dict[str, Any]], Awaitable[None]]


class State(enum.Enum):
    LOADING = "loading"  # reserving memory, starting the runner, creating the engine
    READY = "ready"  # loaded and idle
    BUSY = "busy"  # one request running (others may queue)
    UNLOADING = "unloading"  # no new requests; in-flight ones finish, then the runner stops
    FAILED = "failed"  # load failed or the runner died; removed right after


ALLOWED = {
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
    plan: Plan
    spec: CreateSpec
    estimate: int
    max_tokens: int
    learned: int | None = None  # measured peak PSS from earlier runs, if any
    # The file's own window (its LlmMetadata), if it names one: the runtime never goes past
    # it, whatever the entry's [limits] ask.
    file_max_tokens: int | None = None
    # The plan's image probe on this file (``Engines._image_probe``); None without vision.
    image_probe: dict[str, Any] | None = None
    runtime: str | None = None  # the litert-lm version the runner loads
    adapter: str | None = None  # the GPU adapter its GPU probe saw (gpu plans only)
    # Warm up at load (``Engines._warm_up``): True every load, False never, None only for
    # loads that ask (pinned, preloaded).
    warm_up: bool | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.digest, self.plan.key)

    @property
    def expected(self) -> int:
        return self.learned if self.learned else self.estimate

    @functools.cached_property
    def engine_id(self) -> str:
        p = self.plan
        extra = "".join(f"+{m}-{b}" for m, b in (("vision", p.vision), ("audio", p.audio)) if b)
        return f"{self.model_id}:{p.main}{extra}"


@dataclass(eq=False)
class Engine:
    """One engine's bookkeeping; its view is ``modeld.engine.views.EngineView``."""

    target: Target
    state: State = State.LOADING
    runner: RunnerLike | None = None
    reserved: int = 0
    measured: int | None = None
    measured_at: float = 0.0  # monotonic time of the last PSS reading
    peak: int = 0
    recorded: int = 0  # the peak last handed to on_learned
    # The peak on_learned recorded for this engine's file and plan while it runs: what the
    # next admission reserves (``target.learned`` is what this one found at its load).
    learned: int | None = None
    # Set when a request on it failed or was refused: what it holds since proves nothing
    # about the model, so nothing it measures is learned (a huge prompt must not teach).
    tainted: bool = False
    users: int = 0  # requests waiting for the load, queued on the lock, or running
    served: int = 0
    # Its generations by how their conversation began: "continued" (one its runner kept
    # after the last reply) or why not (``Done.restart``); and how many its runner keeps.
    turns: collections.Counter[str] = field(default_factory=collections.Counter)
    kept: int = 0
    pinned: bool = False
    explicit: bool = False
    keep_alive: float = 300.0
    created_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None
    load_seconds: float | None = None
    create_seconds: float | None = None
    # Whether this load warms up, and the warm-up generation's timings (``runner.child``).
    warm_up: bool = False
    warm_up_timings: WarmUp | None = None
    # What the runner created the engine with, read back from the runtime (``runner.py``).
    options: dict[str, Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The end of the last job handed to the runner (``pool.Turn``): when the runner said
    # it was over, or None when the runner died first.
    last_job: asyncio.Future[float | None] | None = None
    ready: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    load_task: asyncio.Task[None] | None = None
    watch_task: asyncio.Task[None] | None = None
    # Set when an unload began (``Pool.unload``): the error of each request it admitted that
    # is not served within the unload's grace. ``final``: the model is gone (``rm --force``),
    # so a request that arrives meanwhile gets that error too, not a fresh engine.
    refusal: Callable[[], ModeldError] | None = None
    final: bool = False


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


@dataclass(frozen=True)
class KeepAlive:
    """A request's ``keep_alive`` for its engine (seconds; 0: stop after the request; -1:
    never), and whether the request may shorten the engine's.

    A caller that may not (the *use* role) only lengthens it: a shorter one, 0 included,
    would let it unload an engine others use, which ``unload`` keeps for admins. Its shorter
    value is then left out for the engine; the request itself is served as usual.
    """

    seconds: float
    may_shorten: bool = True

    def applied_to(self, current: float) -> float:
        """The engine's keep_alive once this request has reached it (``current`` before)."""
        if self.may_shorten or _span(self.seconds) > _span(current):
            return self.seconds
        return current


def _span(keep_alive: float) -> float:
    """How long a keep_alive keeps an idle engine: -1 (never stops) is the longest."""
    return math.inf if keep_alive < 0 else keep_alive


def validate_keep_alive(value: Any) -> float | None:
    """A request's ``keep_alive``: seconds, a duration string, 0, or -1; None keeps the default."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except (ValueError, ModeldError) as e:
        raise BadRequest(f"keep_alive {value!r}: use e.g. 30s, 5m, 0 or -1") from e
    return -1.0 if seconds < 0 else seconds


def _cache_space_short(spec: CreateSpec) -> str | None:
    """How much space the disk of ``spec``'s engine cache has left (e.g. ``12.0 MiB
    free``) when that is less than the model file's size, the room the runtime's weight
    cache takes; None when there is room, or it cannot be told."""
    if not spec.cache_dir or spec.backend != "cpu":
        return None
    try:
        st = os.statvfs(spec.cache_dir)
        size = Path(spec.path).stat().st_size
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    return f"{format_size(free)} free" if free < size else None


def _died_error(t: Target, exc: RunnerDied) -> ModeldError:
    """The error of a runner that died while creating its engine."""
    if exc.reason and "No space left on device" in exc.reason:
        # The runtime writes its weight cache into cache/<digest>/ while creating the
        # engine and aborts when the disk is full: the file is not at fault.
        return DiskFull(
            f"model {t.model_id}: the disk holding MODELD_HOME is full; the runtime "
            f"could not write its engine cache and its runner was {exc.how} "
            f"({exc.reason}). Free space (e.g. `modeld prune`) and load it again",
            model=t.model_id,
            signal=exc.signal_name,
        )
    short = _cache_space_short(t.spec)
    if short is not None:
        # Not every failed cache write says ENOSPC before the abort: the space says it.
        return DiskFull(
            f"model {t.model_id}: its runner was {exc.how} while creating the engine, and "
            f"the disk holding its engine cache ({t.spec.cache_dir}) has {short}, less "
            "than the runtime writes there (about the model file's size). Free space "
            "(e.g. `modeld prune`) and load it again",
            model=t.model_id,
            signal=exc.signal_name,
        )
    return EngineCrashed(
        f"model {t.model_id}: its runner {exc} while creating the engine; the daemon "
        "is fine. Check the file with `modeld verify`",
        model=t.model_id,
        signal=exc.signal_name,
    )


def load_error(t: Target, exc: BaseException) -> ModeldError:
    """The error a failed engine load reports, from what went wrong (runtime, crash, ...)."""
    if isinstance(exc, ModeldError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return EngineError(f"model {t.model_id}: the engine load was cancelled")
    if isinstance(exc, RunnerError):
        cls = BackendConstraint if exc.code == "backend_constraint" else EngineError
        return cls(
            f"model {t.model_id}: the runtime could not create its engine "
            f"(plan {t.plan.key}): {exc.message}",
            model=t.model_id,
        )
    if isinstance(exc, RunnerDied):
        return _died_error(t, exc)
    return EngineError(f"model {t.model_id}: the engine could not start: {exc}")
