"""The daemon's parts, wired together once and handed to the API.

Each capability registers itself here when the daemon starts: its component, a section of
``/api/status``, and start/stop hooks. Stop hooks run in reverse order of registration.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from modeld import __version__
from modeld.config import Settings
from modeld.metrics import Metrics

StatusSection = Callable[[], Awaitable[dict[str, Any]] | dict[str, Any]]
Hook = Callable[[], Awaitable[None]]


@dataclass
class Services:
    """What the API needs to answer requests; built by ``daemon.py``."""

    settings: Settings
    metrics: Metrics = field(default_factory=Metrics)
    version: str = __version__
    started_at: float = field(default_factory=time.time)
    # Each capability adds its part (catalog, store, downloads, pool, ...) by name.
    parts: dict[str, Any] = field(default_factory=dict)
    status_sections: dict[str, StatusSection] = field(default_factory=dict)
    start_hooks: list[Hook] = field(default_factory=list)
    stop_hooks: list[Hook] = field(default_factory=list)
    stopping: bool = False

    async def status(self) -> dict[str, Any]:
        """The ``/api/status`` document: version, settings and each part's section."""
        doc: dict[str, Any] = {
            "version": self.version,
            "uptime": round(time.time() - self.started_at, 3),
            "settings": self.settings.effective(),
        }
        for name, section in self.status_sections.items():
            value = section()
            doc[name] = await value if isinstance(value, Awaitable) else value
        return doc
