"""What the pool shows: ``ps`` rows, the status section, and a request's final record."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from modeld import logs
from modeld.config import format_size
from modeld.engine.types import Engine, PoolConfig, RunnerLike, State
from modeld.metrics import Metrics


def engine_view(e: Engine, now: float, last_eviction: str | None) -> dict[str, Any]:
    """One engine as ``ps`` and ``GET /api/engines`` show it."""
    idle = e.state is State.READY and e.users == 0
    return {
        "id": e.target.engine_id,
        "model": e.target.model_id,
        "digest": e.target.digest,
        "plan": e.target.plan,
        "runtime": e.target.runtime,
        "adapter": e.target.adapter,
        "state": e.state.value,
        "pid": e.runner.pid if e.runner else None,
        "pss_estimate": e.target.expected,
        # What the estimate came from: the file, or the peak measured in an earlier load.
        "pss_file_estimate": e.target.estimate,
        "pss_learned": e.target.learned,
        "pss": e.measured,
        "peak_pss": e.peak or None,
        "reserved": e.reserved,
        "max_tokens": e.target.max_tokens,
        "engine_options": e.options,
        "image_probe": e.target.image_probe,
        "idle_seconds": round(now - e.last_used, 3) if idle else None,
        "expires_in": round(e.expires_at - now, 3) if e.expires_at and idle else None,
        "keep_alive": e.keep_alive,
        "pinned": e.pinned,
        "requests": e.served,
        "queued": max(0, e.users - (1 if e.state is State.BUSY else 0)),
        "load_seconds": e.load_seconds,
        # The runner's own time in litert_lm.Engine() (load_seconds adds admission, the
        # runner's start when no spare was ready, and the round trip).
        "create_seconds": e.create_seconds,
        # The warm-up generation at load (None: this load did not warm up), apart from
        # create_seconds; load_seconds includes both.
        "warm_up_seconds": e.warm_up_timings["seconds"] if e.warm_up_timings else None,
        "warm_up": e.warm_up_timings,
        "cpu_threads": (e.options or {}).get("cpu_threads"),
        "loaded_at": e.created_at,
        "last_eviction": last_eviction,
    }


class Views:
    """The read-only side of ``modeld.pool.Pool`` (a mixin)."""

    config: PoolConfig
    metrics: Metrics | None
    engines: dict[tuple[str, str], Engine]
    spare: RunnerLike | None
    spare_reserved: int
    max_used: int
    held_until: dict[tuple[str, str], float]
    last_eviction: dict[tuple[str, str], str]
    recent_evictions: Any

    used: Callable[[], int]  # provided by Admission, part of the same Pool

    def _phase(self, phase: str) -> Any:
        """The phase histogram's child for ``phase`` (``labels()`` locks and hashes per call)."""
        cache: dict[str, Any] = self.__dict__.setdefault("_phase_children", {})
        child = cache.get(phase)
        if child is None:
            assert self.metrics is not None
            child = cache[phase] = self.metrics.phase_seconds.labels(phase)
        return child

    def _final(
        self,
        e: Engine,
        rec: dict[str, Any],
        *,
        arrived: float,
        loaded_at: float,
        began: float,
        first: float | None,
        image_prepare: float = 0.0,
    ) -> dict[str, Any]:
        now = time.monotonic()
        inner = rec.get("timings") or {}
        waited_load = loaded_at - arrived
        timings = {
            # Decoding, downscaling and re-encoding the request's images (0 without images);
            # done before the request reaches the pool, so not part of "total".
            "image_prepare": image_prepare,
            "load": waited_load,
            "engine_create": e.create_seconds if waited_load > 0.001 else 0.0,
            # The load's warm-up generation, when this request waited for that load.
            "warm_up": (
                float(e.warm_up_timings["seconds"])
                if e.warm_up_timings and waited_load > 0.001
                else 0.0
            ),
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
                    self._phase(phase).observe(float(value))
            if first is not None:
                self._phase("decode").observe(now - first)
            if image_prepare:
                self._phase("image_prepare").observe(image_prepare)
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

    # --- views ---------------------------------------------------------------------------

    def list(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [engine_view(e, now, self.last_eviction.get(k)) for k, e in self.engines.items()]

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
