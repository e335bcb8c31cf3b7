"""``modeld.daemon.root``: the parts start in dependency order and stop the other way round.

The real parts on a temporary state dir (no spare runner, no socket); the stop methods are
wrapped only to record the order in which they are called, then run as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from modeld.catalog.catalog import Catalog
from modeld.daemon.root import Root
from modeld.download.downloads import Downloads
from modeld.engine.engines import Engines
from modeld.engine.pool import Pool
from modeld.services.remover import Remover
from modeld.store.store import Store
from tests.support.state import registry_settings

STOPS: list[tuple[type[Any], str]] = [
    (Remover, "drain"),
    (Engines, "stop"),
    (Pool, "stop"),
    (Downloads, "stop"),
    (Catalog, "stop"),
    (Store, "close"),
]


def _record(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    for cls, name in STOPS:
        real: Callable[..., Awaitable[None]] = getattr(cls, name)

        def wrapped(
            self: Any, *a: Any, _real: Any = real, _cls: type[Any] = cls, **k: Any
        ) -> Awaitable[None]:
            calls.append(_cls.__name__)
            result: Awaitable[None] = _real(self, *a, **k)
            return result

        monkeypatch.setattr(cls, name, wrapped)


async def test_parts_stop_in_the_reverse_of_their_dependencies(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Remover, engines, pool, downloads, catalog, then the store last; all running before."""
    calls: list[str] = []
    _record(monkeypatch, calls)
    home = clean_env / "home"
    root = Root(registry_settings(home, clean_env / "registry"), spare=False)
    async with root as services:
        assert calls == []
        assert (await services.store.status())["summary"]
        assert services.catalog.status()["watching"] is True
        assert not services.stopping
    assert calls == ["Remover", "Engines", "Pool", "Downloads", "Catalog", "Store"]
    assert services.stopping and services.pool.stopping
    assert services.catalog.status()["watching"] is False


async def test_a_failed_stop_is_logged_and_the_others_still_stop(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool's stop raising neither skips the downloads, catalog and store, nor escapes."""
    calls: list[str] = []
    _record(monkeypatch, calls)
    real_stop = Pool.stop

    async def failing(self: Pool) -> None:
        await real_stop(self)
        raise OSError("runner would not die")

    monkeypatch.setattr(Pool, "stop", failing)
    root = Root(registry_settings(clean_env / "home", clean_env / "registry"), spare=False)
    with caplog.at_level(logging.ERROR, logger="modeld"):
        async with root:
            pass
    assert calls == ["Remover", "Engines", "Pool", "Downloads", "Catalog", "Store"]
    assert any("stopping Pool failed" in r.getMessage() for r in caplog.records)


async def test_a_part_that_fails_to_start_stops_those_started(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pool failing to start: downloads, catalog and store stop; the caller gets the error."""
    calls: list[str] = []
    _record(monkeypatch, calls)

    async def refuse(self: Pool) -> None:
        raise OSError("no runner")

    monkeypatch.setattr(Pool, "start", refuse)
    root = Root(registry_settings(clean_env / "home", clean_env / "registry"), spare=False)
    with pytest.raises(OSError, match="no runner"):
        async with root:
            pytest.fail("the body must not run")
    assert calls == ["Downloads", "Catalog", "Store"]
