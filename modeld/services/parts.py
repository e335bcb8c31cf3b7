"""The daemon's parts in typed fields: what the adapters (HTTP routes) are handed.

``modeld.daemon.root`` builds one ``Services`` (each part from the parts it needs) and starts
and stops its parts in dependency order. An adapter reaches a part by its field, never by a
name, and goes through the application services (``models``, ``inference``) for anything
that decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modeld import __version__
from modeld.catalog.catalog import Catalog
from modeld.config import Settings
from modeld.download.downloads import Downloads
from modeld.engine.engines import Engines
from modeld.engine.pool import Pool
from modeld.metrics import Metrics
from modeld.services.inference import Inference
from modeld.services.models import Models
from modeld.services.remover import Remover
from modeld.services.sources import Sources
from modeld.store.store import Store


@dataclass
class Services:
    """Every part of one daemon, and the application services over them."""

    settings: Settings
    metrics: Metrics
    catalog: Catalog
    store: Store
    downloads: Downloads
    pool: Pool
    engines: Engines
    remover: Remover
    models: Models
    inference: Inference
    sources: Sources
    version: str = __version__
    started_at: float = field(default_factory=time.time)
    # The ``tcp`` section of ``/api/status`` once TCP listeners serve (``daemon.py``).
    tcp_status: Callable[[], dict[str, Any]] | None = None
    # The ``reload`` section: the last SIGHUP reload's outcome (``daemon/lifecycle.py``).
    reload_status: Callable[[], dict[str, Any]] | None = None
    stopping: bool = False

    async def status(self) -> dict[str, Any]:
        """The ``/api/status`` document: version, settings and each part's section."""
        doc: dict[str, Any] = {
            "version": self.version,
            "uptime": round(time.time() - self.started_at, 3),
            "settings": self.settings.effective(),
            "catalog": self.catalog.status(),
            "store": await self.store.status(in_use=self.downloads.partials()),
            # The GPU (backend) probe results.
            "probes": await self.store.probe_status(),
            "downloads": self.downloads.status(),
            "pool": self.pool.status(),
            "runtime": await self.engines.runtime_status(),
            # Ollama serves ``GET /api/status`` too, with this section alone: its clients read
            # here whether models may run in its cloud, and modeld has none.
            "cloud": {"disabled": True, "source": "modeld"},
        }
        if self.reload_status is not None:
            doc["reload"] = self.reload_status()
        if self.tcp_status is not None:
            doc["tcp"] = self.tcp_status()
        return doc
