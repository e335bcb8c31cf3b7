"""The composition root: every part of the daemon built once, started and stopped in order.

Each part is built from the parts it needs (typed constructor arguments, callbacks
included), so a part can only be built after what it depends on. Each part is an async
context manager, and ``Root`` enters them on one ``AsyncExitStack`` in the order they were
built: start-up follows the dependencies, and shutdown runs the other way round without a
list of hooks to keep in order. Stopping goes:

- the remover, so a removal in flight finishes while the pool and store still run;
- the engines, which write the pending ``last_used`` times;
- the pool, every runner;
- the downloads, each job's journal written;
- the catalog's watcher;
- the store, last, its queued writes finished.
"""

from __future__ import annotations

import functools
import logging
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from types import TracebackType
from typing import TypeVar

from modeld.catalog.catalog import Catalog, bundled_registry_dir
from modeld.config import Settings, runner_data_limit
from modeld.daemon.apikeys import KeyRing
from modeld.download.downloads import daemon_downloads
from modeld.download.hub import Hub
from modeld.download.source import SourceSet, site_caches
from modeld.engine.engines import Engines, LearnedMemory, journal_to
from modeld.engine.pool import Pool, PoolConfig
from modeld.engine.runner.client import Runner
from modeld.metrics import Metrics
from modeld.services.fit import Fits
from modeld.services.inference import Inference
from modeld.services.models import Models
from modeld.services.parts import Services
from modeld.services.remover import Remover
from modeld.services.sources import Sources
from modeld.services.verification import verification_hint
from modeld.store.store import Store

P = TypeVar("P", bound=AbstractAsyncContextManager[object])


class Root:
    """Builds the daemon's parts (nothing runs yet); ``async with`` starts and stops them.

    ``services`` holds every part in a typed field for the adapters; ``keys`` checks TCP
    clients' API keys. ``spare`` keeps a started runner ready for the next load; ``sources``
    are where files come from (default: the Hub as the settings name it).
    """

    def __init__(
        self, settings: Settings, *, spare: bool = True, sources: SourceSet | None = None
    ) -> None:
        self._parts: list[AbstractAsyncContextManager[object]] = []
        self._stack: AsyncExitStack | None = None
        metrics = Metrics()
        store = self._part(Store(settings.home))
        catalog = self._part(
            Catalog([bundled_registry_dir(), *settings.registry_dirs], own=settings.own_registry)
        )
        # Where files come from (the Hub), and the site caches in front of every pull: the
        # one place a kind of source is named.
        if sources is None:
            sources = SourceSet(Hub.from_settings(settings), caches=site_caches(settings))
        downloads = self._part(daemon_downloads(settings, catalog, store, metrics, sources))
        memory = LearnedMemory(store)
        pool = self._part(
            Pool(
                PoolConfig(
                    budget=settings.memory_budget, keep_alive=settings.keep_alive, spare=spare
                ),
                functools.partial(
                    Runner.start, data_limit=runner_data_limit(settings.memory_budget)
                ),
                metrics=metrics,
                on_learned=memory.learned,
                journal=journal_to(store),
            )
        )
        engines = self._part(
            Engines(
                settings,
                catalog,
                store,
                pool,
                memory,
                # The `unverified` refusal says what can make an install verified (catalog,
                # kept digests, the entry's hub), which the engine layer does not reach.
                explain_unverified=functools.partial(verification_hint, catalog, sources, store),
            )
        )
        remover = self._part(
            Remover(settings, metrics, store, pool, downloads, flush_uses=engines.flush_uses)
        )
        models = Models(
            settings,
            catalog,
            store,
            engines=engines,
            pool=pool,
            downloads=downloads,
            fits=Fits(settings, catalog, store, engines),
            sources=sources,
        )
        self.services = Services(
            settings=settings,
            metrics=metrics,
            catalog=catalog,
            store=store,
            downloads=downloads,
            pool=pool,
            engines=engines,
            remover=remover,
            models=models,
            inference=Inference(settings, engines, pool),
            sources=Sources(settings, catalog, models, remover, sources),
        )
        self.keys = KeyRing(settings.api_keys_path)
        metrics.up_since.set(self.services.started_at)
        metrics.budget_total.set(settings.memory_budget)
        metrics.registry_errors.set_function(lambda: len({p.path for p in catalog.problems}))

    def _part(self, part: P) -> P:
        """Keep ``part`` to be entered after every part built before it (its dependencies)."""
        self._parts.append(part)
        return part

    async def __aenter__(self) -> Services:
        """Start every part in dependency order; one that fails stops those started."""
        async with AsyncExitStack() as stack:
            for part in self._parts:
                await _enter(stack, part)
            self._stack = stack.pop_all()
        return self.services

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop every part started, the last one first; each stops even if another failed."""
        self.services.stopping = True
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


async def _enter(stack: AsyncExitStack, part: AbstractAsyncContextManager[object]) -> None:
    """Start ``part`` and push its stop, which logs a failure instead of raising it.

    A failed stop must not keep the parts below it from stopping, nor hide why the daemon
    stopped: the other parts still stop (runners, the db), and the log says which failed.
    """
    await part.__aenter__()

    async def stop(
        et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            await part.__aexit__(et, e, tb)
        except Exception:
            logging.getLogger("modeld").exception("stopping %s failed", type(part).__name__)
        return False

    stack.push_async_exit(stop)
