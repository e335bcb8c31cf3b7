"""SIGHUP: re-read the settings and the registry without dropping engines or connections.

Only what can change while serving is applied: ``LIVE_FIELDS``. They are assigned on the one
``Settings`` object the daemon was built with, so every part that holds it (the pool reading
``keep_alive``, the API reading the allow-lists, admin lists and CORS origins) sees the new
values on its next use. Fields that need a restart (the socket, the TCP listeners, the state
dir, the memory budget, ...) are reported in the log line and left as they were. A config
that does not load is logged and changes nothing; ``modeld status`` shows it as a problem
(section ``reload``) until a reload succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from modeld import logs
from modeld.catalog.catalog import Catalog, bundled_registry_dir
from modeld.config import Settings, config_file_path, load_settings
from modeld.daemon.notify import Notifier
from modeld.errors import ModeldError
from modeld.services.parts import Services

LIVE_FIELDS = (
    "log_level",
    "keep_alive",
    "allow_uids",
    "allow_gids",
    "admin_uids",
    "admin_gids",
    "cors_origins",
    "registry",
    "disk_budget",
    "hf_token",
    "site_cache",
)


async def reload_settings(
    services: Services, load: Callable[[], Settings] = load_settings
) -> dict[str, Any]:
    """Apply a fresh ``load()`` to ``services.settings``; return what changed and what did not."""
    try:
        new = load()
    except ModeldError as e:
        logs.event("reload_failed", logging.ERROR, code=e.code, message=e.message)
        return {
            "ok": False,
            "code": e.code,
            "error": e.message,
            "changed": [],
            "restart_needed": [],
        }
    current = services.settings
    changed = [f for f in LIVE_FIELDS if getattr(new, f) != getattr(current, f)]
    restart_needed = [
        f
        for f in Settings.model_fields
        if f not in LIVE_FIELDS and getattr(new, f) != getattr(current, f)
    ]
    for field in changed:
        setattr(current, field, getattr(new, field))
    if "log_level" in changed:
        logging.getLogger("modeld").setLevel(current.log_level.upper())
    if "keep_alive" in changed:
        # The pool copies its default at start; engines loaded from now on get the new one.
        services.pool.config.keep_alive = current.keep_alive
    catalog_ok = True
    catalog = services.catalog
    if "registry" in changed:
        await _point_catalog_at(catalog, current.registry_dirs)
    # Always re-read: registry files may have changed even where the dirs did not.
    try:
        catalog.reload()
    except Exception as e:  # one bad registry must not take the daemon down
        catalog_ok = False
        logs.event("reload_catalog_failed", logging.ERROR, error=str(e))
    logs.event(
        "reloaded",
        changed=",".join(changed) or "-",
        restart_needed=",".join(restart_needed) or None,
        catalog="reloaded" if catalog_ok else None,
    )
    return {"ok": True, "changed": changed, "restart_needed": restart_needed}


async def _point_catalog_at(catalog: Catalog, registry: list[Path]) -> None:
    """Swap the catalog's dirs (bundled first, as ``Root`` does) and re-aim its watcher."""
    catalog.dirs = [bundled_registry_dir(), *registry]
    await catalog.stop()
    await catalog.start()


class Reloader:
    """Runs one reload at a time in response to SIGHUP, telling the service manager."""

    def __init__(
        self,
        services: Services,
        notifier: Notifier,
        load: Callable[[], Settings] = load_settings,
    ) -> None:
        self.services = services
        self.notifier = notifier
        self.load = load
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        # The last reload's outcome (``reload_settings``) and when it ran; None before any.
        self.last: dict[str, Any] | None = None

    def request(self) -> None:
        """Signal-handler entry point: schedule a reload on the running loop."""
        if self.services.stopping:
            return
        task = asyncio.get_running_loop().create_task(self._reload())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload(self) -> None:
        async with self._lock:
            logs.event("reloading", reason="SIGHUP")
            self.notifier.reloading("reloading settings and registry")
            outcome = await reload_settings(self.services, self.load)
            path = config_file_path()
            self.last = outcome | {"at": time.time(), "config_file": str(path) if path else None}
            status = (
                f"serving on {self.services.settings.socket_path}"
                if outcome["ok"]
                else f"serving; reload failed (old settings kept): {outcome['error']}"
            )
            self.notifier.ready(status)

    def status(self) -> dict[str, Any]:
        """The ``reload`` section of ``/api/status``: the last reload (SIGHUP), and while it
        failed, a problem saying that the old settings stay and how to fix it."""
        last = self.last
        if last is None:
            return {"summary": None, "problems": [], "last": None}
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["at"]))
        if last["ok"]:
            summary = f"settings reloaded at {when}"
            waiting = last["restart_needed"]
            if not waiting:
                return {"summary": summary, "problems": [], "last": last}
            names = ", ".join(waiting)
            summary += f"; {names} wait(s) for a restart"
            # The daemon runs on values its config no longer holds: say so until a restart
            # (or a reload that puts the old values back).
            problem = (
                f"the settings now give {names} new values that only a restart applies; "
                "the daemon still runs on the old ones. Restart it (`systemctl restart "
                "modeld`, or stop and start `modeld serve`) to apply them"
            )
            return {"summary": summary, "problems": [problem], "last": last}
        where = f" ({last['config_file']})" if last["config_file"] else ""
        problem = (
            f"the settings reload at {when} failed, so the daemon keeps the settings it had: "
            f"{last['error']}. Fix the config file{where}, then reload again "
            f"(`systemctl reload modeld` or `kill -HUP {os.getpid()}`)"
        )
        return {
            "summary": f"settings reload at {when} failed; the old settings stay",
            "problems": [problem],
            "last": last,
        }

    async def close(self) -> None:
        """Cancel reloads still running (shutdown)."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
