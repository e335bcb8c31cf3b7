"""What the pool shows: one engine's view (``ps``), and a request's final record with timings."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar

from modeld import logs
from modeld.engine.runner.job import Counted, Done, Embedded, WarmUp, record_to_wire
from modeld.engine.types import Engine, State
from modeld.metrics import Metrics
from modeld.modelfile.plan import Plan


class Turns(TypedDict):
    """How an engine's generations began: how many continued a conversation its runner kept
    after the last reply, how many did not and why (``Restart``), and how many it keeps."""

    kept: int
    continued: int
    restarted: dict[str, int]


@dataclass(frozen=True)
class EngineView:
    """One engine as ``ps`` and ``GET /api/engines`` show it (``to_dict`` is the JSON form)."""

    id: str
    model: str
    digest: str
    plan: Plan
    runtime: str | None
    adapter: str | None
    state: str
    pid: int | None
    pss_estimate: int
    # What the estimate came from: the file, or the peak measured in an earlier load.
    pss_file_estimate: int
    pss_learned: int | None
    pss: int | None
    peak_pss: int | None
    reserved: int
    max_tokens: int
    engine_options: dict[str, Any] | None
    image_probe: dict[str, Any] | None
    idle_seconds: float | None
    expires_in: float | None
    keep_alive: float
    pinned: bool
    requests: int
    queued: int
    load_seconds: float | None
    # The runner's own time in litert_lm.Engine() (load_seconds adds admission, the
    # runner's start when no spare was ready, and the round trip).
    create_seconds: float | None
    # The warm-up generation at load (None: this load did not warm up), apart from
    # create_seconds; load_seconds includes both.
    warm_up_seconds: float | None
    warm_up: WarmUp | None
    cpu_threads: Any
    loaded_at: float
    last_eviction: str | None
    conversations: Turns

    def to_dict(self) -> dict[str, Any]:
        # Fields in declaration order: the API's JSON keeps its key order.
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        doc["plan"] = self.plan.to_dict()
        return doc


def engine_view(e: Engine, now: float, last_eviction: str | None) -> EngineView:
    """The view of ``e`` at monotonic time ``now``."""
    idle = e.state is State.READY and e.users == 0
    return EngineView(
        id=e.target.engine_id,
        model=e.target.model_id,
        digest=e.target.digest,
        plan=e.target.plan,
        runtime=e.target.runtime,
        adapter=e.target.adapter,
        state=e.state.value,
        pid=e.runner.pid if e.runner else None,
        pss_estimate=e.target.expected,
        pss_file_estimate=e.target.estimate,
        pss_learned=e.learned or e.target.learned,
        pss=e.measured,
        peak_pss=e.peak or None,
        reserved=e.reserved,
        max_tokens=e.target.max_tokens,
        engine_options=e.options,
        image_probe=e.target.image_probe,
        idle_seconds=round(now - e.last_used, 3) if idle else None,
        expires_in=round(e.expires_at - now, 3) if e.expires_at and idle else None,
        keep_alive=e.keep_alive,
        pinned=e.pinned,
        requests=e.served,
        queued=max(0, e.users - (1 if e.state is State.BUSY else 0)),
        load_seconds=e.load_seconds,
        create_seconds=e.create_seconds,
        warm_up_seconds=e.warm_up_timings["seconds"] if e.warm_up_timings else None,
        warm_up=e.warm_up_timings,
        cpu_threads=(e.options or {}).get("cpu_threads"),
        loaded_at=e.created_at,
        last_eviction=last_eviction,
        conversations={
            "kept": e.kept,
            "continued": e.turns["continued"],
            "restarted": {k: n for k, n in sorted(e.turns.items()) if k != "continued"},
        },
    )


class Phases:
    """The phase histogram and the token counter, as the request path reports into them."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def observe(self, phase: str, seconds: float) -> None:
        self.metrics.child(self.metrics.phase_seconds, phase).observe(seconds)

    def tokens(self, model_id: str, count: int) -> None:
        self.metrics.child(self.metrics.generated_tokens, model_id).inc(count)

    def turn(self, model_id: str, how: str) -> None:
        self.metrics.child(self.metrics.turns, model_id, how).inc()


class PhaseTimings(TypedDict):
    """Seconds a request spent in each phase (a rate for the decode); None: not measured."""

    # Decoding, downscaling and re-encoding the request's images (0 without images); done
    # before the request reaches the pool, so not part of "total".
    image_prepare: float
    load: float
    engine_create: float | None
    # The load's warm-up generation, when this request waited for that load.
    warm_up: float
    queue: float
    prefill: float | None
    first_token: float | None
    decode_tokens_per_second: float | None
    total: float


R = TypeVar("R", Done, Embedded, Counted)


@dataclass(frozen=True, slots=True)
class Final(Generic[R]):
    """A request's last record as its caller gets it: the runner's, where it ran, and the
    phases it went through."""

    result: R
    model: str
    engine: str
    timings: PhaseTimings

    def to_json(self) -> dict[str, Any]:
        """The native API's final record: the runner's fields with ``done``, ``model``,
        ``engine`` and the phase timings (unmeasured phases left out)."""
        out = record_to_wire(self.result)
        # How the runner had its conversation is the engine's business (``ps`` counts it).
        for name in ("conversation", "continued_tokens", "restart", "kept"):
            out.pop(name, None)
        out.update(
            done=True,
            model=self.model,
            engine=self.engine,
            timings={k: v for k, v in self.timings.items() if v is not None},
        )
        return out


@dataclass(frozen=True, slots=True)
class Moments:
    """When a request arrived, found its engine ready, began on it and had its first token
    (monotonic seconds), and how long its images took to prepare before all that."""

    arrived: float
    loaded_at: float
    began: float
    first: float | None
    image_prepare: float = 0.0


def final_record(e: Engine, rec: R, phases: Phases | None, at: Moments) -> Final[R]:
    """The last record of a request: the runner's, with the phase timings; logged and counted."""
    now = time.monotonic()
    arrived, loaded_at, began, first = at.arrived, at.loaded_at, at.began, at.first
    image_prepare = at.image_prepare
    inner = rec.timings
    waited_load = loaded_at - arrived
    timings: PhaseTimings = {
        "image_prepare": image_prepare,
        "load": waited_load,
        "engine_create": e.create_seconds if waited_load > 0.001 else 0.0,
        "warm_up": (
            float(e.warm_up_timings["seconds"])
            if e.warm_up_timings and waited_load > 0.001
            else 0.0
        ),
        "queue": began - loaded_at,
        "prefill": inner.prefill,
        "first_token": (first - arrived) if first is not None else None,
        "decode_tokens_per_second": inner.decode_tokens_per_second,
        "total": now - arrived,
    }
    tokens = rec.tokens if isinstance(rec, Done) else 0
    if isinstance(rec, Done):
        _count_turn(e, rec, phases)
    if phases is not None:
        for phase in ("load", "queue", "prefill", "first_token", "total"):
            value = timings[phase]  # type: ignore[literal-required]
            if value is not None:
                phases.observe(phase, float(value))
        if first is not None:
            phases.observe("decode", now - first)
        if image_prepare:
            phases.observe("image_prepare", image_prepare)
        phases.tokens(e.target.model_id, tokens)
    fields: dict[str, Any] = {k: v for k, v in timings.items() if v is not None}
    logs.event(
        "generate",
        engine=e.target.engine_id,
        finish=rec.finish if isinstance(rec, Done) else "stop",
        tokens=tokens,
        **fields,
    )
    return Final(rec, e.target.model_id, e.target.engine_id, timings)


def _count_turn(e: Engine, rec: Done, phases: Phases | None) -> None:
    """Count how ``rec``'s conversation began on ``e`` (``Turns``)."""
    e.kept = rec.kept
    how = "continued" if rec.conversation == "continued" else rec.restart
    if how is None:
        return
    e.turns[how] += 1
    if phases is not None:
        phases.turn(e.target.model_id, how)
