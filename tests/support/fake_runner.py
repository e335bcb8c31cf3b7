"""A fake runner for the pool's scheduler tests (test support, not shipped with modeld).

It speaks the pool's ``RunnerLike`` protocol without a process: a fixed PSS, tokens on
demand, generations that can be held open and released, and crashes on request.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Callable
from typing import Any

from modeld.engine.runner.client import RunnerDied, RunnerError
from modeld.modelfile.runtime import CreateSpec

_PIDS = itertools.count(100_000)


class FakeRunner:
    """One fake engine process."""

    def __init__(self, factory: FakeFactory) -> None:
        self.factory = factory
        self.pid = next(_PIDS)
        self.closing = False
        self.pss = factory.spare_pss
        self.spec: CreateSpec | None = None
        self.died: RunnerDied | None = None
        self._exited = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    async def create(self, spec: CreateSpec) -> dict[str, Any]:
        self.factory.creates += 1
        # The time a real create takes, simulated (what the tests around it wait through).
        await asyncio.sleep(self.factory.create_seconds)
        if self.died is not None:
            raise self.died
        if self.factory.fail:
            raise RunnerError("engine_error", self.factory.fail)
        self.spec = spec
        self.pss = self.factory.engine_pss
        return {"ok": True, "seconds": 0.0, "pss": self.pss, "rss": self.pss}

    async def generate(
        self, job: dict[str, Any], sent: Callable[[], None] | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        self.factory.sent.append(job)
        if sent is not None:
            sent()
        # As the real child: one job at a time, in the order they were sent; a job whose
        # caller leaves while it waits never begins.
        async with self._one_at_a_time:
            async for rec in self._generate(job):
                yield rec

    async def _generate(self, job: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        if self.died is not None:
            raise self.died
        self.factory.jobs.append(job)
        gate = asyncio.Event()
        if not self.factory.hold:
            gate.set()
        self.factory.gates.append(gate)
        if job.get("fake_fail"):  # a request the runtime refuses after growing to fake_pss
            self.pss = int(job.get("fake_pss", self.pss))
            raise RunnerError("bad_request", str(job["fake_fail"]))
        for token in ("a", "b"):
            if self.died is not None:
                raise self.died
            yield {"token": token}
        waiter = asyncio.ensure_future(gate.wait())
        exited = asyncio.ensure_future(self._exited.wait())
        try:
            await asyncio.wait([waiter, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            exited.cancel()
        if self.died is not None:
            raise self.died
        yield {"done": True, "finish": "stop", "tokens": 2, "timings": {}, "pss": self.pss}

    def memory(self) -> tuple[int, int]:
        self.factory.pss_reads += 1
        return (self.pss, self.pss) if self.alive else (0, 0)

    def rss(self) -> int:
        return self.pss if self.alive else 0

    def stderr_text(self) -> str:
        return f"fake runner {self.pid}: created with {self.spec}" if self.spec else ""

    async def wait_exit(self) -> RunnerDied:
        await self._exited.wait()
        assert self.died is not None
        return self.died

    def crash(self, signal_name: str = "SIGSEGV") -> None:
        self.died = RunnerDied(signal_name, -11, None)
        self._exited.set()

    async def close(self, grace: float = 5.0) -> None:
        self.closing = True
        await self.kill()

    async def kill(self) -> None:
        self.closing = True
        if self.died is None:
            self.died = RunnerDied(None, 0, None)
        self._exited.set()


class FakeFactory:
    """Makes FakeRunners and remembers them; ``hold=True`` keeps generations open.

    ``create_seconds`` is how long each engine creation takes; with ``fail`` every creation
    fails with that runtime reason."""

    def __init__(
        self,
        *,
        engine_pss: int = 100,
        spare_pss: int = 10,
        hold: bool = False,
        create_seconds: float = 0.0,
        fail: str | None = None,
    ) -> None:
        self.create_seconds = create_seconds
        self.fail = fail
        self.engine_pss = engine_pss
        self.spare_pss = spare_pss
        self.hold = hold
        self.runners: list[FakeRunner] = []
        self.gates: list[asyncio.Event] = []
        self.jobs: list[dict[str, Any]] = []  # every generation's job, in the order they began
        self.sent: list[dict[str, Any]] = []  # every job sent to a runner, begun or not
        self.creates = 0
        self.pss_reads = 0  # PSS readings of any of its runners (the costly kind)

    async def __call__(self) -> FakeRunner:
        runner = FakeRunner(self)
        self.runners.append(runner)
        return runner

    def alive(self) -> list[FakeRunner]:
        return [r for r in self.runners if r.alive]

    def release_all(self) -> None:
        for gate in self.gates:
            gate.set()
