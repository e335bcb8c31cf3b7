"""A fake runner for the pool's scheduler tests (test support, not shipped with modeld).

It speaks the pool's ``RunnerLike`` protocol without a process: a fixed PSS, tokens on
demand, generations that can be held open and released, and crashes on request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, Callable

from modeld.engine.runner.client import RunnerDied, RunnerError
from modeld.engine.runner.job import Created, Done, GenerateJob, Job, Record, Token
from modeld.modelfile.runtime import CreateSpec

_PIDS = itertools.count(100_000)


def numbered_job(n: int | None = None) -> GenerateJob:
    """A job that carries ``n`` (``number_of``), so that a test can tell jobs apart."""
    return GenerateJob(({"role": "user", "content": "" if n is None else str(n)},))


def number_of(job: Job) -> int | None:
    """The ``n`` of a ``numbered_job``; None for a job without one."""
    if not isinstance(job, GenerateJob) or not job.messages:
        return None
    content = job.messages[0]["content"]
    return int(content) if isinstance(content, str) and content else None


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

    async def create(self, spec: CreateSpec) -> Created:
        self.factory.creates += 1
        # The time a real create takes, simulated (what the tests around it wait through).
        await asyncio.sleep(self.factory.create_seconds)
        if self.died is not None:
            raise self.died
        if self.factory.fail:
            raise RunnerError("engine_error", self.factory.fail)
        self.spec = spec
        self.pss = self.factory.engine_pss
        return Created(0.0, None, self.pss, self.pss, {})

    async def generate(
        self,
        job: Job,
        sent: Callable[[], None] | None = None,
        ended: Callable[[float], None] | None = None,
    ) -> AsyncGenerator[Record, None]:
        self.factory.sent.append(job)
        if sent is not None:
            sent()
        # As the real child: one job at a time, in the order they were sent; a job whose
        # caller leaves while it waits never begins.
        async with self._one_at_a_time:
            async for rec in self._generate(job):
                if isinstance(rec, Done) and ended is not None:
                    ended(time.monotonic())
                yield rec

    async def _generate(self, job: Job) -> AsyncGenerator[Record, None]:
        if self.died is not None:
            raise self.died
        self.factory.jobs.append(job)
        gate = asyncio.Event()
        if not self.factory.hold:
            gate.set()
        self.factory.gates.append(gate)
        refuse, self.factory.refuse = self.factory.refuse, None
        if refuse is not None:  # a request the runtime refuses after growing to a PSS
            reason, self.pss = refuse
            raise RunnerError("bad_request", reason)
        for token in ("a", "b"):
            if self.died is not None:
                raise self.died
            yield Token(token)
        waiter = asyncio.ensure_future(gate.wait())
        exited = asyncio.ensure_future(self._exited.wait())
        try:
            await asyncio.wait([waiter, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            exited.cancel()
        if self.died is not None:
            raise self.died
        yield Done("stop", tokens=2)

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
        self.jobs: list[Job] = []  # every generation's job, in the order they began
        self.sent: list[Job] = []  # every job sent to a runner, begun or not
        # The next job is refused by the runtime with this reason, after growing to this PSS.
        self.refuse: tuple[str, int] | None = None
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
