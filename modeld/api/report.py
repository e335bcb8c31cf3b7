"""``GET /api/models/{id}/bug-report``: the facts an upstream issue about a model needs.

Host, OS, Python, the runtime's version and the GPU adapter, the entry and its revision,
the installed file (size, digest, what verified it), the header and plans, every probe with
its child's stderr, the latest runner's whole stderr, and the journal's recent events. The
CLI (``modeld bug-report ID``) writes it to one file.
"""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from aiohttp import web

from modeld.api.models import show_model
from modeld.engine.engines import Engines
from modeld.engine.pool import Pool
from modeld.hostinfo import host_facts
from modeld.services.parts import Services
from modeld.store.store import Store

# ".../resolve/<revision>/<file>": Hugging Face, its mirrors, and entries from hf:// pulls.
_RESOLVE = re.compile(r"/resolve/(?P<rev>[^/]+)/")
MODEL_EVENTS = 100
RECENT_EVENTS = 30
_SCANNED_EVENTS = 2000


def revision_of(urls: list[str]) -> str | None:
    """The revision pinned in the entry's URLs (the primary's first), or None."""
    for url in urls:
        path = unquote(urlsplit(url).path)
        m = _RESOLVE.search(path)
        if m is not None:
            return m.group("rev")
    return None


def _concerns(event: dict[str, Any], model_id: str, digest: str | None) -> bool:
    fields = event.get("fields") or {}
    return fields.get("model") == model_id or (
        digest is not None and fields.get("digest") == digest
    )


async def bug_report(services: Services, model_id: str) -> dict[str, Any]:
    """Everything about ``model_id`` an upstream bug report asks for (see the module doc)."""
    store: Store = services.parts["store"]
    engines: Engines = services.parts["engines"]
    pool: Pool = services.parts["pool"]
    shown = await show_model(services, model_id)
    inst = shown["installed"]
    entry = shown["entry"]
    digest = inst["digest"] if inst else None
    events = await store.events(limit=_SCANNED_EVENTS)
    return {
        "generated_at": time.time(),
        "modeld_version": services.version,
        "host": host_facts(),
        "runtime": await engines.runtime_info(),
        "settings": services.settings.effective(),
        "model": {
            "id": model_id,
            "state": shown["state"],
            "registry": shown["source"],
            "entry": entry,
            "revision": revision_of(entry["urls"]) if entry else None,
            "file_name": shown["file_name"],
            "size": inst["size"] if inst else shown["size"],
            "digest": digest,
            "verified_by": inst["verified_by"] if inst else None,
            "installed": inst,
        },
        "header": shown["header"],
        "header_error": shown["header_error"],
        "plans": shown["plans"],
        "probes": await store.probes(digest, with_log=True) if digest else {},
        "engines": [v for v in pool.list() if v["model"] == model_id],
        "runner": pool.runner_log(model_id),
        "events": [e for e in events if _concerns(e, model_id, digest)][:MODEL_EVENTS],
        "recent_events": events[:RECENT_EVENTS],
    }


def add_routes(app: web.Application, services: Services) -> None:
    async def report(request: web.Request) -> web.Response:
        return web.json_response(await bug_report(services, request.match_info["id"]))

    app.router.add_get("/api/models/{id}/bug-report", report)
