"""The ``Sources`` application service: models from a source by name, and modeld's own entries.

``pull hf://ORG/REPO/FILE[@REV]`` (an address of one of the daemon's sources,
``modeld.download.source``; the Hub is the first) resolves the revision to a pinned one at the
source, writes the entry it makes (pinned URL, size and sha256 as the source vouches for
them) to ``$MODELD_HOME/registry/<id>.toml``, then pulls it as any entry: adopted from the
source's own cache when there, else through the verified downloader. ``rm --entry`` removes
such an entry (and the model's install).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from modeld import logs
from modeld.catalog.catalog import Catalog, Entry, bundled_registry_dir
from modeld.config import Settings
from modeld.download.job import Tuning
from modeld.download.source import Address, Resolved, Source, SourceSet
from modeld.errors import (
    BadRequest,
    CorruptModel,
    EntryExists,
    EntryNotRemovable,
    ModeldError,
    ModelNotInstalled,
    Offline,
)
from modeld.layout import MODEL_ID_RE
from modeld.services.models import Models, Pull
from modeld.services.remover import Remover


def _same_file(entry: Entry, source: Source, address: Address) -> bool:
    """Whether ``entry`` (one modeld wrote) is ``address``'s file at any revision."""
    if entry.local or not entry.urls:
        return False
    return source.same_file(entry.urls[0], address)


def source_entry(model_id: str, found: Resolved) -> Entry:
    """The registry entry of a resolved file: pinned URL, size and sha256 as its source said."""
    return Entry(
        id=model_id,
        display_name=found.display_name[:200],
        file_name=found.file_name,
        urls=[found.url],
        size=found.size,
        sha256=found.sha256,
    )


class Sources:
    """Where models come from beyond the bundled catalog: the daemon's sources (the Hub), and
    entries modeld wrote."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        models: Models,
        remover: Remover,
        known: SourceSet,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.models = models
        self.remover = remover
        self.known = known
        self._lock = asyncio.Lock()  # one entry written at a time

    def _check_id(self, model_id: str, source: Source, ref: Address) -> None:
        """Refuse an id that is another entry's: a bundled one, one of a MODELD_REGISTRY dir,
        or one modeld wrote for another file (the same file at a new revision is updated)."""
        existing = self.catalog.find(model_id)
        if existing is None or (
            self.catalog.is_own(model_id) and _same_file(existing, source, ref)
        ):
            return
        raise EntryExists(
            f"model id {model_id} is already the entry of {self.catalog.source_of(model_id)}; "
            f"pull {ref.shown} under another id (`modeld pull {ref.shown} --id NEW-ID`)",
            source=str(self.catalog.source_of(model_id)),
        )

    async def pull_source(
        self, source: str, *, model_id: str | None, force: bool, limit_rate: int | None = None
    ) -> Pull:
        """Resolve ``source`` (hf:// or a resolve URL) at its source, write its entry, pull
        it (``limit_rate``: as ``Models.pull``)."""
        kind = self.known.for_address(source)
        if kind is None:
            if not self.known.all:
                raise BadRequest(f"{source!r} is not a model id, and this daemon has no source")
            kind = self.known.all[0]  # its refusal says the forms it takes
        ref = kind.address(source)
        if self.settings.hf_hub_offline:
            raise Offline(
                f"HF_HUB_OFFLINE is set: resolving {ref.shown} needs the Hub, and modeld does not "
                "touch the network. Pull an entry made before by its id (`modeld list`), or "
                "unset HF_HUB_OFFLINE"
            )
        model_id = model_id or ref.model_id
        if model_id is None:
            raise BadRequest(f"no model id can be made from {ref.shown}; pass one with --id")
        if not MODEL_ID_RE.fullmatch(model_id):
            raise BadRequest(f"{model_id!r} is not a model id (letters, digits, '.', '_', '-')")
        self._check_id(model_id, kind, ref)  # before any request: a refusal costs nothing
        found = await kind.resolve(ref, Tuning.from_settings(self.settings).connect_timeout)
        entry = source_entry(model_id, found)
        async with self._lock:
            self._check_id(model_id, kind, ref)
            path = self.catalog.source_of(model_id)
            replaced: str | None = None  # the entry this one replaces (another revision)
            if self.catalog.find(model_id) != entry:
                replaced = path.read_text() if path is not None else None
                comment = (
                    f"Written by `modeld pull {ref.shown}` on "
                    f"{time.strftime('%Y-%m-%d', time.gmtime())}: revision {ref.revision} is "
                    f"commit {found.pinned};\nsize and sha256 are what {ref.home} vouched "
                    f"for ({found.said}). `modeld rm --entry {model_id}` removes it."
                )
                path = self.catalog.write_entry(entry, comment)  # small: on the loop, as reload is
                logs.event(
                    "hub_entry_written",
                    model=model_id,
                    source=ref.shown,
                    commit=found.pinned,
                    path=str(path),
                )

        async def refused(e: CorruptModel) -> ModeldError:
            return await self._refused(model_id, entry, replaced, ref, e)

        pull = await self.models.pull(
            model_id, force=force, limit_rate=limit_rate, on_refused=refused
        )
        pull.entry = {
            "path": str(path),
            "source": ref.shown,
            "revision": ref.revision,
            "commit": found.pinned,
        }
        return pull

    async def _refused(
        self, model_id: str, entry: Entry, replaced: str | None, ref: Address, e: CorruptModel
    ) -> ModeldError:
        """The source's file is not a LiteRT-LM model: the entry written for it goes (the one it
        replaced comes back), so nothing of the pull is left; the error says so."""
        async with self._lock:
            if self.catalog.find(model_id) == entry and self.catalog.is_own(model_id):
                if replaced is None:
                    self.catalog.remove_entry(model_id)
                else:
                    self.catalog.put_back(model_id, replaced)
                logs.event("hub_entry_refused", model=model_id, source=ref.shown)
        after = "the entry it had before is back" if replaced else "its entry was removed"
        return CorruptModel(
            f"{ref.shown} is not a LiteRT-LM model ({e.problem or e.message}); it was not "
            f"installed, nothing was kept and {after}: choose a LiteRT-LM model (a .litertlm "
            "file)",
            problem=e.problem,
        )

    async def remove_entry(self, model_id: str, *, force: bool) -> dict[str, Any]:
        """Remove the model's install (if any) and the entry modeld wrote for it.

        A bundled entry, or one in a MODELD_REGISTRY dir, is not modeld's to remove: refused
        before anything is removed.
        """
        source = self.catalog.source_of(model_id)
        if source is None:
            raise self.catalog.unknown(model_id)
        if not self.catalog.is_own(model_id):
            if source.parent == bundled_registry_dir():
                raise EntryNotRemovable(
                    f"the entry of {model_id} is bundled with modeld and cannot be removed; "
                    f"`modeld rm {model_id}` removes its installed file"
                )
            raise EntryNotRemovable(
                f"the entry of {model_id} is {source}, in a MODELD_REGISTRY dir that you "
                f"manage: delete that file yourself (`modeld rm {model_id}` removes the "
                "installed file)"
            )
        doc: dict[str, Any] = {
            "id": model_id,
            "removed": [],
            "freed": 0,
            "unloaded": [],
            "cancelled_download": False,
        }
        with contextlib.suppress(ModelNotInstalled):  # nothing installed: the entry alone goes
            doc = await self.remover.remove_model(model_id, force=force)
        path = self.catalog.remove_entry(model_id)
        logs.event("entry_removed", model=model_id, path=str(path))
        return doc | {"entry_removed": str(path)}
