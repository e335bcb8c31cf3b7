"""``GET /api/models``, ``GET /api/models/{id}`` and ``POST /api/models/{id}/verify``."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from modeld.catalog.catalog import Catalog, Entry, bundled_registry_dir, outdated
from modeld.engine.engines import check_runtime
from modeld.errors import ModeldError, ModelNotFound, ModelNotInstalled
from modeld.hostinfo import RUNTIME_PACKAGE, runtime_version
from modeld.modelfile import header as litertlm
from modeld.modelfile import plan
from modeld.services import verification
from modeld.services.fit import Fits
from modeld.services.parts import Services
from modeld.store.store import Installed, Store

# State names shown by ``list`` and ``show``; scripts match on them.
NOT_INSTALLED = "not_installed"
INSTALLED = "installed"
OUTDATED = "outdated"  # installed, but the entry now names another file; still loadable
MISSING = "missing"  # the index has a row, but start-up found no file


def _parts(services: Services) -> tuple[Catalog, Store]:
    return services.parts["catalog"], services.parts["store"]


def _summary(
    model_id: str,
    entry: Entry | None,
    inst: Installed | None,
    missing: bool,
    catalog: Catalog,
) -> dict[str, Any]:
    is_outdated = inst is not None and outdated(entry, inst.digest, inst.size)
    if inst is not None:
        state = OUTDATED if is_outdated else INSTALLED
    else:
        state = MISSING if missing else NOT_INSTALLED
    installed = None
    if inst is not None:
        installed = inst.to_dict() | {"outdated": is_outdated}
    source = catalog.source_of(model_id)
    return {
        "id": model_id,
        "display_name": entry.display_name if entry else model_id,
        "file_name": entry.file_name if entry else None,
        "size": entry.size if entry else (inst.size if inst else None),
        "sha256": entry.sha256 if entry else None,
        "in_catalog": entry is not None,
        "source": str(source) if source else None,
        "state": state,
        "installed": installed,
    }


async def list_models(services: Services, installed_only: bool = False) -> dict[str, Any]:
    """The catalog with each entry's install state, plus installed models it lacks."""
    catalog, store = _parts(services)
    installs = {i.model_id: i for i in await store.list_installed()}
    missing = await store.missing()
    ids = sorted({e.id for e in catalog.entries()} | installs.keys() | missing.keys())
    fits = Fits.of_services(services)
    models = []
    for m in ids:
        if installed_only and m not in installs:
            continue
        doc = _summary(m, catalog.find(m), installs.get(m), m in missing, catalog)
        entry = catalog.find(m)
        # Whether its smallest (text-only) engine fits MODELD_MEMORY_BUDGET at all.
        doc["fit"] = (await fits.of(entry, installs.get(m))).to_dict() if entry else None
        models.append(doc)
    return {"models": models, "problems": [str(p) for p in catalog.problems]}


def _engine_settings(services: Services, entry: Entry | None, model_id: str) -> dict[str, Any]:
    """The CPU threads and warm-up rule an engine of this model gets, and loaded engines'."""
    settings = services.settings
    runtime = entry.runtime if entry else None
    threads_from = "entry" if runtime and runtime.threads else "MODELD_CPU_THREADS"
    warm_up = runtime.warm_up if runtime and runtime.warm_up is not None else None
    if warm_up is None:
        warm_up_rule = "gpu plans and pinned loads" if settings.warm_up else "never"
    else:
        warm_up_rule = "every load (entry)" if warm_up else "never (entry)"
    pool = services.parts.get("pool")
    loaded = (
        {e["id"]: e["cpu_threads"] for e in pool.list() if e["model"] == model_id}
        if pool is not None
        else {}
    )
    return {
        "cpu_threads": (runtime.threads if runtime else None) or settings.cpu_threads,
        "cpu_threads_from": threads_from,
        "warm_up": warm_up_rule,
        "loaded_cpu_threads": loaded,
    }


def _error(e: ModeldError) -> dict[str, Any]:
    return {"code": e.code, "message": e.message}


def _plans(
    services: Services,
    model_id: str,
    entry: Entry | None,
    info: litertlm.ModelInfo,
    *,
    probes: dict[str, dict[str, Any]],
    image_probes: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    # Only current results decide (a stale one is probed again at the next load).
    results: dict[str, bool | None] = {b: p["ok"] for b, p in probes.items() if p["current"]}
    try:
        check_runtime(model_id, entry, info, runtime_version())
    except ModeldError as e:
        return {name: {"plan": None, "error": _error(e)} for name in ("text", "vision")}
    entry_prefs = plan.Prefs.from_mapping(entry.backends.model_dump() if entry else None)
    out: dict[str, Any] = {}
    for name, modalities in (("text", ("text",)), ("vision", ("text", "image"))):
        try:
            p = plan.resolve(
                info,
                model=model_id,
                settings=plan.Prefs.from_settings(services.settings),
                entry=entry_prefs,
                modalities=modalities,
                probes=results,
            )
        except ModeldError as e:
            out[name] = {"plan": None, "error": _error(e)}
        else:
            unprobed = sorted(plan.needs_probe(p, results))
            out[name] = {"plan": p.to_dict(), "error": None, "needs_probe": unprobed}
            if p.vision is not None:
                # None: not probed with an image yet (the first image request or load does).
                out[name]["image_probe"] = image_probes.get(p.key)
    return out


async def show_model(services: Services, model_id: str) -> dict[str, Any]:
    """One model: entry, install state, header sections and constraints, plans, probes."""
    catalog, store = _parts(services)
    entry = catalog.find(model_id)
    inst = await store.installed(model_id)
    missing = model_id in await store.missing()
    if entry is None and inst is None and not missing:
        raise ModelNotFound(
            f"no model {model_id!r} in the catalog or installed; `modeld list` shows the known ids"
        )
    doc = _summary(model_id, entry, inst, missing, catalog)
    doc["entry"] = entry.to_dict() if entry else None
    doc["fit"] = (await Fits.of_services(services).of(entry, inst)).to_dict() if entry else None
    doc["engine_settings"] = _engine_settings(services, entry, model_id)
    doc["header"] = doc["header_error"] = None
    doc["probes"] = {}
    doc["image_probes"] = {}
    doc["runtime"] = {"package": RUNTIME_PACKAGE, "version": runtime_version(), "adapter": None}
    if inst is None:
        why = ModelNotInstalled(
            f"model {model_id} is not installed, so its file's sections are unknown; "
            f"run `modeld pull {model_id}`"
        )
        doc["plans"] = {m: {"plan": None, "error": _error(why)} for m in ("text", "vision")}
        return doc
    doc["probes"] = await store.probes(inst.digest)
    # plan key -> one small image run through that plan on this host (``modeld.modelfile.probe``).
    doc["image_probes"] = await store.image_probes(inst.digest)
    gpu = doc["probes"].get("gpu")
    if gpu is not None and gpu["ok"] and gpu["current"]:
        doc["runtime"]["adapter"] = gpu["adapter"]
    try:
        info = await asyncio.to_thread(litertlm.read_header, inst.path, model_id=model_id)
    except ModeldError as e:
        doc["header_error"] = _error(e)
        doc["plans"] = {m: {"plan": None, "error": _error(e)} for m in ("text", "vision")}
        return doc
    except OSError as e:
        err = ModelNotInstalled(
            f"model {model_id}: its file cannot be read ({e.strerror or e}); "
            f"run `modeld verify {model_id}` or `modeld pull {model_id}`"
        )
        doc["header_error"] = _error(err)
        doc["plans"] = {m: {"plan": None, "error": _error(err)} for m in ("text", "vision")}
        return doc
    doc["header"] = info.to_dict()
    doc["plans"] = _plans(
        services, model_id, entry, info, probes=doc["probes"], image_probes=doc["image_probes"]
    )
    return doc


async def verify_model(services: Services, model_id: str) -> dict[str, Any]:
    """Re-hash the blob; an unverified install becomes verified when a source vouches for it.

    Sources, in order: the entry's sha256; else the digest a hub vouched for earlier for the
    entry's pinned revision; else the hub itself, asked now (one request, no body), whose
    answer is then kept. ``hint`` says what can still make an unverified install verified.
    """
    catalog, store = _parts(services)
    before = await store.installed(model_id)
    entry = catalog.find(model_id)
    if before is None and entry is None:
        catalog.get(model_id)  # raises ModelNotFound with its hint
    report = await store.verify(model_id)
    doc = report.to_dict()
    verified_by = before.verified_by if before else None
    vouch = None
    if report.ok and verified_by is None and entry is not None:
        verified_by, vouch = await verification.vouched_by(
            services.settings, store, entry, report.digest
        )
        if verified_by is not None:
            await store.set_verified(model_id, verified_by)
    doc["verified_by"] = verified_by if report.ok else None
    doc["outdated"] = report.ok and outdated(entry, report.digest, report.size)
    doc["hint"] = None
    if report.ok and verified_by is None:
        doc["hint"] = verification.how_to_verify(
            model_id,
            entry,
            report.digest,
            vouch,
            hub=verification.hub_of(entry.urls) if entry is not None else None,
            source=catalog.source_of(model_id),
            bundled=bundled_registry_dir(),
        )
    return doc


def add_routes(app: web.Application, services: Services) -> None:
    async def index(request: web.Request) -> web.Response:
        flag = request.query.get("installed", "").lower() in ("1", "true", "yes")
        return web.json_response(await list_models(services, installed_only=flag))

    async def show(request: web.Request) -> web.Response:
        return web.json_response(await show_model(services, request.match_info["id"]))

    async def verify(request: web.Request) -> web.Response:
        return web.json_response(await verify_model(services, request.match_info["id"]))

    app.router.add_get("/api/models", index)
    app.router.add_get("/api/models/{id}", show)
    app.router.add_post("/api/models/{id}/verify", verify)
