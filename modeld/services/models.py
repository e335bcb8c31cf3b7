"""The ``Models`` application service: list, show, verify, install state, pull, bug report.

What the routes (native and OpenAI) and, through the socket, the CLI and the Python client
ask about models is decided here, on the daemon's catalog, store, engines and downloads.
Plans come from ``Engines.plans`` (the one place plans are resolved); nothing is probed
by ``show``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from modeld import logs
from modeld.catalog.catalog import Catalog, Entry, bundled_registry_dir, outdated
from modeld.config import Settings
from modeld.download.downloads import Downloads, result_dict
from modeld.download.job import DownloadJob, OnRefused
from modeld.download.source import SourceSet
from modeld.engine.engines import Engines, entry_max_tokens, error_brief
from modeld.engine.pool import Pool
from modeld.errors import (
    CorruptModel,
    IntegrityError,
    ModeldError,
    ModelNotFound,
    ModelNotInstalled,
)
from modeld.hostinfo import RUNTIME_PACKAGE, host_facts
from modeld.services import verification
from modeld.services.fit import Fits
from modeld.store.store import Installed, Store

# State names shown by ``list`` and ``show``; scripts match on them.
NOT_INSTALLED = "not_installed"
INSTALLED = "installed"
OUTDATED = "outdated"  # installed, but the entry now names another file; still loadable
MISSING = "missing"  # the index has a row, but its file is gone (scan, load, pull, list)

MODEL_EVENTS = 100
RECENT_EVENTS = 30
_SCANNED_EVENTS = 2000


def _concerns(event: dict[str, Any], model_id: str, digest: str | None) -> bool:
    fields = event.get("fields") or {}
    return fields.get("model") == model_id or (
        digest is not None and fields.get("digest") == digest
    )


def _no_plans(e: ModeldError) -> dict[str, Any]:
    return {m: {"plan": None, "error": error_brief(e)} for m in ("text", "vision")}


@dataclass(frozen=True)
class Capabilities:
    """What a model can do, read from its file: the token window an engine of it gets (the
    entry's ``[limits] max_tokens``, else the file's own), and what it takes and returns."""

    context_length: int
    vision: bool
    tools: bool
    embedding: bool
    thinking: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "context_length": self.context_length,
            "vision": self.vision,
            "tools": self.tools,
            "embedding": self.embedding,
            "thinking": self.thinking,
        }


@dataclass
class Pull:
    """A pull as asked: the install that already matches the entry, or the download job."""

    model_id: str
    installed: dict[str, Any] | None = None
    job: DownloadJob | None = None
    # The fit checked before any byte, and the variant taken (``Fits.choose``), if checked.
    choice: dict[str, Any] | None = None
    # The file it was adopted from (the Hugging Face cache), instead of a download.
    adopted: str | None = None
    # The entry ``pull hf://`` wrote for it: path, source, revision.
    entry: dict[str, Any] | None = None

    def _notes(self) -> dict[str, Any]:
        notes = {"adopted": self.adopted, "entry": self.entry}
        return {k: v for k, v in notes.items() if v is not None}

    def _already(self) -> dict[str, Any]:
        doc = {"id": self.model_id, "state": "installed", "already": self.adopted is None}
        doc |= {"installed": self.installed} | self._notes()
        if self.choice is not None:
            doc["choice"] = self.choice
        return doc

    def snapshot(self) -> dict[str, Any]:
        """One document: the install (``already``) or the job's progress now."""
        if self.job is None:
            return self._already()
        return self.job.snapshot() | {"choice": self.choice} | self._notes()

    async def records(self) -> AsyncGenerator[dict[str, Any], None]:
        """Progress records until installed or failed; the last one carries the install.

        Leaving this generator (the client went away) never cancels the job.
        """
        job = self.job
        if job is None:
            yield self._already()
            return
        first = True
        async for record in job.events():
            if record["state"] == "installed":
                record["installed"] = result_dict(job.result)
            if first or record["state"] == "installed":
                record.update(self._notes())
                if self.choice is not None:
                    record["choice"] = self.choice
            first = False
            yield record


class Models:
    """Models as users see them: the catalog's entries with what is installed of each."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        store: Store,
        *,
        engines: Engines,
        pool: Pool,
        downloads: Downloads,
        fits: Fits,
        sources: SourceSet,
    ) -> None:
        self.settings = settings
        self.sources = sources
        self.catalog = catalog
        self.store = store
        self.engines = engines
        self.pool = pool
        self.downloads = downloads
        self.fits = fits
        # The choice each running download was started with: a pull that joins one says it too.
        self._choices: dict[str, dict[str, Any] | None] = {}

    # --- install state ---------------------------------------------------------------

    def _summary(
        self, model_id: str, entry: Entry | None, inst: Installed | None, missing: bool
    ) -> dict[str, Any]:
        is_outdated = inst is not None and outdated(entry, inst.digest, inst.size)
        if inst is not None:
            state = OUTDATED if is_outdated else INSTALLED
        else:
            state = MISSING if missing else NOT_INSTALLED
        installed = None
        if inst is not None:
            installed = inst.to_dict() | {"outdated": is_outdated}
            # A use not yet written to SQLite (``Engines.touch`` batches them) counts too.
            used = self.engines.used_at(model_id)
            if used is not None and used > (installed["last_used"] or 0):
                installed["last_used"] = used
        source = self.catalog.source_of(model_id)
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

    async def listing(self, installed_only: bool = False) -> dict[str, Any]:
        """The catalog with each entry's install state, plus installed models it lacks."""
        installs = {i.model_id: i for i in await self.store.list_installed()}
        missing = await self.store.missing()
        ids = sorted({e.id for e in self.catalog.entries()} | installs.keys() | missing.keys())
        models = []
        for m in ids:
            if installed_only and m not in installs:
                continue
            entry = self.catalog.find(m)
            doc = self._summary(m, entry, installs.get(m), m in missing)
            # Whether its smallest (text-only) engine fits MODELD_MEMORY_BUDGET at all.
            doc["fit"] = (await self.fits.of(entry, installs.get(m))).to_dict() if entry else None
            models.append(doc)
        return {"models": models, "problems": [str(p) for p in self.catalog.problems]}

    async def servable(self) -> list[Installed]:
        """Installed models that can answer: an install without an entry has no limits to load."""
        return [
            inst
            for inst in await self.store.list_installed()
            if self.catalog.find(inst.model_id) is not None
        ]

    async def servable_one(self, model_id: str) -> Installed:
        """One servable model (``GET /v1/models/{id}``), refused as a generation would be: an
        id the catalog does not know is ``model_not_found``, a known one not installed is
        ``model_not_installed``."""
        self.catalog.get(model_id)  # raises ModelNotFound with its hint
        inst = await self.store.installed(model_id)
        if inst is None:
            raise self.catalog.not_installed(model_id)
        return inst

    async def capabilities(self, model_id: str) -> Capabilities:
        """What an installed model can do, from its file's header and its entry's limits;
        refused as ``servable_one`` refuses."""
        inst = await self.servable_one(model_id)
        info = await self.engines.header(model_id, inst.digest, inst.path)
        llm = info.llm_metadata
        return Capabilities(
            context_length=entry_max_tokens(self.catalog.find(model_id), info),
            vision=info.section_for("tf_lite_vision_encoder") is not None,
            tools=bool(llm and llm.supports_function_calling),
            embedding=info.kind == "embedding",
            thinking=bool(llm and llm.supports_thinking),
        )

    async def current(self, model_id: str) -> dict[str, Any] | None:
        """The model's install when it still matches its entry (so a pull has nothing to do).

        An unverified install whose bytes differ from what a hub vouched for for the entry's
        pinned revision is not current either: a pull fetches the vouched file.
        """
        inst = await self.store.installed(model_id)
        if inst is None:
            return None
        entry = self.catalog.find(model_id)
        with contextlib.suppress(ModelNotFound):
            if outdated(entry, inst.digest, inst.size):
                return None
        if entry is not None and not inst.verified and entry.sha256 is None:
            rev = self.sources.pinned(entry.urls)
            kept = await self.store.vouched(model_id, rev) if rev else None
            if kept is not None and kept.sha256 != inst.digest:
                return None
        return inst.to_dict()

    async def pull(
        self,
        model_id: str,
        *,
        force: bool = False,
        limit_rate: int | None = None,
        on_refused: OnRefused | None = None,
    ) -> Pull:
        """Start or join the model's download, unless its install is current already.

        Before any byte, a model that can never load is refused, or a variant that fits is
        taken (``Fits.choose``; ``force`` skips the refusal). ``limit_rate`` caps the
        download's total rate in bytes/s (``pull --limit-rate``); ``on_refused`` runs when
        the downloaded file is not a LiteRT-LM model (``Downloads.pull``).
        """
        # A pull never joins a download of a file its entry no longer names.
        await self.downloads.drop_stale(model_id)
        current = await self.current(model_id)
        choice: dict[str, Any] | None = None
        if current is None and model_id not in self.downloads.jobs:
            found = await self.fits.choose(model_id, force=force)
            choice = {**found, "fit": found["fit"].to_dict()}
            if found["chosen"] != model_id:
                model_id = found["chosen"]
                current = await self.current(model_id)
        if current is not None:
            return Pull(model_id, installed=current, choice=choice)
        adopted = await self._adopt(model_id)
        if adopted is not None:
            doc, source = adopted
            return Pull(model_id, installed=doc, choice=choice, adopted=source)
        joins = model_id in self.downloads.jobs
        job = self.downloads.pull(model_id, limit_rate=limit_rate, on_refused=on_refused)
        if joins:
            choice = choice or self._choices.get(model_id)
        else:
            self._choices = {m: c for m, c in self._choices.items() if m in self.downloads.jobs}
            self._choices[model_id] = choice
        return Pull(model_id, job=job, choice=choice)

    async def _adopt(self, model_id: str) -> tuple[dict[str, Any], str] | None:
        """Install the entry's file from a source's own cache (the Hub's ``HF_HUB_CACHE``),
        when it is there at the entry's pinned revision and its sha256 is what the entry or a
        source vouched for; never unverified. None when there is nothing to adopt (then it is
        downloaded)."""
        entry = self.catalog.find(model_id)
        if entry is None or entry.local or model_id in self.downloads.jobs:
            return None
        expected = entry.sha256
        if expected is None:
            rev = self.sources.pinned(entry.urls)
            kept = await self.store.vouched(model_id, rev) if rev else None
            expected = kept.sha256 if kept is not None else None
        if expected is None:
            return None  # nothing to check a cached file against
        for url in entry.urls:
            found = self.sources.cached_copy(url, expected)
            if found is None or found.stat().st_size != entry.size:
                continue
            try:
                doc = await self.downloads.import_file(found, model_id)
            except (IntegrityError, CorruptModel) as e:
                logs.event("hf_cache_refused", model=model_id, path=str(found), reason=e.message)
                continue
            logs.event("hf_cache_adopted", model=model_id, path=str(found))
            return doc["installed"], str(found)
        return None

    def _engine_settings(self, entry: Entry | None, model_id: str) -> dict[str, Any]:
        """The CPU threads and warm-up rule an engine of this model gets, and loaded engines'."""
        settings = self.settings
        runtime = entry.runtime if entry else None
        threads_from = "default"  # one per physical core usable (``default_cpu_threads``)
        if runtime and runtime.threads:
            threads_from = "entry"
        elif "cpu_threads" in settings.model_fields_set:
            threads_from = "MODELD_CPU_THREADS"
        warm_up = runtime.warm_up if runtime and runtime.warm_up is not None else None
        if warm_up is None:
            warm_up_rule = "gpu plans and pinned loads" if settings.warm_up else "never"
        else:
            warm_up_rule = "every load (entry)" if warm_up else "never (entry)"
        views = [e for e in self.pool.list() if e["model"] == model_id]
        return {
            "cpu_threads": (runtime.threads if runtime else None) or settings.cpu_threads,
            "cpu_threads_from": threads_from,
            "warm_up": warm_up_rule,
            "loaded_cpu_threads": {e["id"]: e["cpu_threads"] for e in views},
            "kept_conversations": settings.kept_conversations,
            "loaded_conversations": {e["id"]: e["conversations"] for e in views},
        }

    # --- show ------------------------------------------------------------------------

    async def show(self, model_id: str) -> dict[str, Any]:
        """One model: entry, install state, header sections and constraints, plans, probes."""
        entry = self.catalog.find(model_id)
        inst = await self.store.installed(model_id)
        missing = model_id in await self.store.missing()
        if entry is None and inst is None and not missing:
            raise self.catalog.unknown(model_id, "in the catalog or installed")
        doc = self._summary(model_id, entry, inst, missing)
        doc["entry"] = entry.to_dict() if entry else None
        if doc["entry"] is not None:
            # Every peer may show a model: a URL's credentials or signature stay in its file.
            doc["entry"]["urls"] = [logs.redact_url(u) for u in doc["entry"]["urls"]]
        doc["fit"] = (await self.fits.of(entry, inst)).to_dict() if entry else None
        doc["engine_settings"] = self._engine_settings(entry, model_id)
        doc["header"] = doc["header_error"] = None
        doc["probes"] = {}
        doc["image_probes"] = {}
        doc["runtime"] = {
            "package": RUNTIME_PACKAGE,
            "version": self.engines.runtime,
            "adapter": None,
        }
        if inst is None:
            doc["plans"] = _no_plans(
                ModelNotInstalled(
                    f"model {model_id} is not installed, so its file's sections are unknown; "
                    f"run {self.catalog.how_to_install(model_id)}"
                )
            )
            return doc
        doc["probes"] = await self.store.probes(inst.digest)
        # plan key -> one small image run through that plan on this host (modelfile.probe).
        doc["image_probes"] = await self.store.image_probes(inst.digest)
        gpu = doc["probes"].get("gpu")
        if gpu is not None and gpu["ok"] and gpu["current"]:
            doc["runtime"]["adapter"] = gpu["adapter"]
        try:
            info = await self.engines.header(model_id, inst.digest, inst.path)
        except ModeldError as e:
            doc["header_error"] = error_brief(e)
            doc["plans"] = _no_plans(e)
            return doc
        except OSError as e:
            err = ModelNotInstalled(
                f"model {model_id}: its file cannot be read ({e.strerror or e}); "
                f"run `modeld verify {model_id}` or `modeld pull {model_id}`"
            )
            doc["header_error"] = error_brief(err)
            doc["plans"] = _no_plans(err)
            return doc
        doc["header"] = info.to_dict()
        doc["plans"] = self.engines.plans(
            model_id, entry, info, probes=doc["probes"], image_probes=doc["image_probes"]
        )
        return doc

    # --- verify ----------------------------------------------------------------------

    async def verify(self, model_id: str) -> dict[str, Any]:
        """Re-hash the blob; an unverified install becomes verified when a source vouches.

        Sources, in order: the entry's sha256; else the digest a hub vouched for earlier for
        the entry's pinned revision; else the hub itself, asked now (one request, no body),
        whose answer is then kept. ``hint`` says what can still make an unverified install
        verified.
        """
        before = await self.store.installed(model_id)
        entry = self.catalog.find(model_id)
        if before is None:
            raise self.catalog.not_installed(model_id)
        report = await self.store.verify(model_id)
        doc = report.to_dict()
        verified_by = before.verified_by if before else None
        vouch = None
        if report.ok and verified_by is None and entry is not None:
            verified_by, vouch = await verification.vouched_by(
                self.settings, self.sources, self.store, entry, report.digest
            )
            if verified_by is not None:
                await self.store.set_verified(model_id, verified_by)
        doc["verified_by"] = verified_by if report.ok else None
        doc["outdated"] = report.ok and outdated(entry, report.digest, report.size)
        doc["hint"] = None
        if report.ok and verified_by is None:
            doc["hint"] = verification.how_to_verify(
                model_id,
                entry,
                report.digest,
                vouch,
                hub=self.sources.vouching_host(entry.urls) if entry is not None else None,
                pinned=entry is not None and self.sources.pinned(entry.urls) is not None,
                source=self.catalog.source_of(model_id),
                bundled=bundled_registry_dir(),
            )
        return doc

    # --- bug report ------------------------------------------------------------------

    async def bug_report(self, model_id: str, version: str) -> dict[str, Any]:
        """What an upstream issue about ``model_id`` needs.

        Host, OS, Python, the runtime's version and the GPU adapter, the entry and its
        revision, the installed file (size, digest, what verified it), the header and plans,
        every probe with its child's stderr, the latest runner's whole stderr, and the
        journal's recent events.
        """
        shown = await self.show(model_id)
        inst = shown["installed"]
        entry = shown["entry"]
        digest = inst["digest"] if inst else None
        events = await self.store.events(limit=_SCANNED_EVENTS)
        return {
            "generated_at": time.time(),
            "modeld_version": version,
            "host": host_facts(),
            "runtime": await self.engines.runtime_info(),
            "settings": self.settings.effective(),
            "model": {
                "id": model_id,
                "state": shown["state"],
                "registry": shown["source"],
                "entry": entry,
                "revision": self.sources.revision(entry["urls"]) if entry else None,
                "file_name": shown["file_name"],
                "size": inst["size"] if inst else shown["size"],
                "digest": digest,
                "verified_by": inst["verified_by"] if inst else None,
                "installed": inst,
            },
            "header": shown["header"],
            "header_error": shown["header_error"],
            "plans": shown["plans"],
            "probes": await self.store.probes(digest, with_log=True) if digest else {},
            "engines": [v for v in self.pool.list() if v["model"] == model_id],
            "runner": self.pool.runner_log(model_id),
            "events": [e for e in events if _concerns(e, model_id, digest)][:MODEL_EVENTS],
            "recent_events": events[:RECENT_EVENTS],
        }
