"""Planning and carrying out removals: ``rm ID`` and ``prune``.

``plan_prune`` is pure: it takes a snapshot of the state dir (``Inventory``), what the daemon
is using right now (``Activity``) and what was asked (``Selection``), and returns the items
it would remove and the ones it keeps for safety. ``modeld.services.remover.Remover`` gathers the
snapshot, carries a plan out and removes single models; the API only calls it.

Safety rules, for every kind of item:
- never remove what is loaded (an engine of the model or of its blob), pinned, or being
  downloaded (the job's partial and journal rows);
- a row is deleted before its file (``Store.remove``), so a crash never leaves a row that
  points at a missing file; a file left without a row is an orphan the next prune finds;
- a blob without a row that was renamed into ``blobs/`` moments ago may be an install
  between its rename and its row (``Store.install``): it is kept for ``ORPHAN_GRACE`` s;
- a staging file of this very daemon (``*.import-<pid>-*``, ``*.install-<pid>``) may be an
  import in progress and is kept; one of a dead daemon is a leftover.
Installed models are removed only when asked for (``unused_for``, ``to_budget``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modeld.config import format_duration, format_size
from modeld.layout import BLOB_RE, DIGEST_RE, MODEL_ID_RE, PARTIAL_SUFFIX, staging_pid

# How long a blob without a row is assumed to be an install in progress (its rename into
# blobs/ updates its ctime; Store.install writes the row right after the rename).
ORPHAN_GRACE = 60.0


def valid_model_id(model_id: str) -> bool:
    return bool(MODEL_ID_RE.fullmatch(model_id))


def partial_model_id(name: str) -> str | None:
    """The model a file in ``partial/`` belongs to (``<id>.partial``, the downloader's name)."""
    if name.endswith(PARTIAL_SUFFIX):
        stem = name[: -len(PARTIAL_SUFFIX)]
        if MODEL_ID_RE.fullmatch(stem):
            return stem
    return None


@dataclass(frozen=True)
class Selection:
    """What a prune was asked to remove."""

    partials: bool = False
    partials_age: float = 0.0  # only partials last written at least this long ago (seconds)
    orphans: bool = False
    unused_for: float | None = None  # installed models not used for this long (seconds)
    to_budget: bool = False

    @property
    def empty(self) -> bool:
        return not (self.partials or self.orphans or self.to_budget) and self.unused_for is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "partials": self.partials,
            "partials_age": self.partials_age,
            "orphans": self.orphans,
            "unused_for": self.unused_for,
            "to_budget": self.to_budget,
        }


# With no selection at all, prune removes only what no model can need again.
DEFAULT_SELECTION = Selection(partials=True, orphans=True)


@dataclass(frozen=True)
class Item:
    """One thing to remove (or kept, with the reason why)."""

    kind: str
    size: int
    reason: str
    path: str | None = None
    id: str | None = None
    digest: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "id": self.id,
            "digest": self.digest,
            "path": self.path,
            "size": self.size,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class FileInfo:
    path: Path
    size: int
    mtime: float
    ctime: float


@dataclass(frozen=True)
class Row:
    """A row of ``installed``; ``missing`` when the last scan found no blob for it."""

    id: str
    digest: str
    size: int
    installed_at: float
    last_used: float | None
    missing: bool = False

    @property
    def used_at(self) -> float:
        return self.last_used if self.last_used is not None else self.installed_at


@dataclass(frozen=True)
class Activity:
    """What the daemon uses right now: engines (by model and blob) and downloads."""

    loaded: frozenset[str] = frozenset()  # model ids with an engine (any state)
    loaded_digests: frozenset[str] = frozenset()
    pinned: frozenset[str] = frozenset()  # model ids with a pinned engine
    downloading: frozenset[str] = frozenset()  # model ids (= journal keys)
    download_paths: frozenset[str] = frozenset()  # their partial files

    def model_busy(self, model_id: str, digest: str | None = None) -> str | None:
        """Why the model may not be removed now, or None."""
        if model_id in self.pinned:
            return "pinned"
        if model_id in self.loaded or (digest is not None and digest in self.loaded_digests):
            return "loaded"
        if model_id in self.downloading:
            return "downloading"
        return None


@dataclass
class Inventory:
    """A snapshot of the state dir and its index."""

    now: float
    rows: list[Row] = field(default_factory=list)
    blobs: dict[str, FileInfo] = field(default_factory=dict)  # digest -> blobs/sha256-<hex>
    strays: list[FileInfo] = field(default_factory=list)  # other names in blobs/
    quarantined: list[FileInfo] = field(default_factory=list)  # blobs/*.FAILED*
    partials: list[FileInfo] = field(default_factory=list)
    journal_keys: set[str] = field(default_factory=set)
    caches: dict[str, FileInfo] = field(default_factory=dict)  # name in cache/ -> dir
    disk_budget: int | None = None

    def installed_bytes(self, rows: Iterable[Row]) -> int:
        """Bytes of the blobs these rows use, each blob counted once."""
        return sum({r.digest: r.size for r in rows if not r.missing}.values())


@dataclass
class PrunePlan:
    items: list[Item]
    kept: list[Item]
    installed_bytes: int
    installed_after: int
    budget: int | None

    @property
    def total(self) -> int:
        return sum(i.size for i in self.items)

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": [i.to_dict() for i in self.items],
            "kept": [i.to_dict() for i in self.kept],
            "total": self.total,
            "installed_bytes": self.installed_bytes,
            "installed_after": self.installed_after,
            "disk_budget": self.budget,
        }


# --- planning (pure) -------------------------------------------------------------------


def _plan_partials(
    inv: Inventory, sel: Selection, act: Activity, pid: int
) -> tuple[list[Item], list[Item]]:
    items: list[Item] = []
    kept: list[Item] = []
    with_file: set[str] = set()
    for f in inv.partials:
        model = partial_model_id(f.path.name)
        if model is not None:
            with_file.add(model)
        rows = model is not None and model in inv.journal_keys
        if model in act.downloading or str(f.path) in act.download_paths:
            kept.append(Item("partial", f.size, "downloading", str(f.path), model))
            continue
        if staging_pid(f.path.name) == pid:
            kept.append(Item("partial", f.size, "an import in progress", str(f.path), model))
            continue
        age = inv.now - f.mtime
        if age < sel.partials_age:
            continue
        reason = f"download not in progress, last written {format_duration(age)} ago"
        if rows:
            reason += "; its journal rows go with it"
        items.append(Item("partial", f.size, reason, str(f.path), model))
    for key in sorted(inv.journal_keys - with_file):
        if key in act.downloading:
            continue
        items.append(Item("journal", 0, "journal rows of a download whose file is gone", None, key))
    return items, kept


def _plan_orphans(inv: Inventory, act: Activity, grace: float) -> tuple[list[Item], list[Item]]:
    items: list[Item] = []
    kept: list[Item] = []
    used = {r.digest for r in inv.rows}
    for f in inv.quarantined:
        items.append(Item("quarantined", f.size, "failed verification (*.FAILED)", str(f.path)))
    gone: set[str] = set()
    for digest, f in sorted(inv.blobs.items()):
        if digest in used:
            continue
        if digest in act.loaded_digests:
            kept.append(Item("orphan_blob", f.size, "loaded", str(f.path), digest=digest))
        elif inv.now - f.ctime < grace:
            kept.append(
                Item(
                    "orphan_blob",
                    f.size,
                    "just placed; may be an install in progress",
                    str(f.path),
                    digest=digest,
                )
            )
        else:
            gone.add(digest)
            items.append(
                Item(
                    "orphan_blob", f.size, "no installed model uses it", str(f.path), digest=digest
                )
            )
    for f in inv.strays:
        if inv.now - f.ctime < grace:
            kept.append(
                Item(
                    "orphan_blob", f.size, "just placed; may be an install in progress", str(f.path)
                )
            )
        else:
            items.append(Item("orphan_blob", f.size, "not a blob name modeld writes", str(f.path)))
    for name, f in sorted(inv.caches.items()):
        of = name if DIGEST_RE.fullmatch(name) else None
        # A row's cache stays even while its blob is missing: the blob may come back.
        if of is not None and (
            of in act.loaded_digests or of in used or (of in inv.blobs and of not in gone)
        ):
            continue
        why = "cache of a removed blob" if of is not None else "not a cache dir modeld writes"
        items.append(Item("orphan_cache", f.size, why, str(f.path), digest=of))
    return items, kept


def _model_item(inv: Inventory, r: Row, reason: str) -> Item:
    path = inv.blobs.get(r.digest)
    return Item("model", r.size, reason, str(path.path) if path else None, r.id, r.digest)


def _plan_models(
    inv: Inventory, sel: Selection, act: Activity
) -> tuple[list[tuple[Row, str]], list[Item], list[Row]]:
    """Installed models to remove (with why), those kept for safety, and those that stay."""
    remaining = sorted((r for r in inv.rows if not r.missing), key=lambda r: (r.used_at, r.id))
    chosen: list[tuple[Row, str]] = []
    kept: dict[str, Item] = {}
    if sel.unused_for is not None:
        limit = inv.now - sel.unused_for
        for r in [r for r in remaining if r.used_at <= limit]:
            busy = act.model_busy(r.id, r.digest)
            if busy:
                kept.setdefault(r.id, _model_item(inv, r, busy))
                continue
            what = "last used" if r.last_used is not None else "installed, never used,"
            chosen.append((r, f"{what} {format_duration(inv.now - r.used_at)} ago"))
            remaining.remove(r)
    budget = inv.disk_budget
    if sel.to_budget and budget is not None:
        for r in list(remaining):
            now_bytes = inv.installed_bytes(remaining)
            if now_bytes <= budget:
                break
            busy = act.model_busy(r.id, r.digest)
            if busy:
                kept.setdefault(r.id, _model_item(inv, r, busy))
                continue
            remaining.remove(r)
            why = (
                f"least recently used; installed models use {format_size(now_bytes)}, "
                f"over the disk budget {format_size(budget)}"
            )
            chosen.append((r, why))
    return chosen, list(kept.values()), remaining


def plan_prune(
    inv: Inventory,
    sel: Selection,
    act: Activity,
    *,
    orphan_grace: float = ORPHAN_GRACE,
    pid: int | None = None,
) -> PrunePlan:
    """What a prune with ``sel`` removes now, and what it keeps for safety (pure)."""
    pid = os.getpid() if pid is None else pid
    items: list[Item] = []
    kept: list[Item] = []
    if sel.partials:
        got, keep = _plan_partials(inv, sel, act, pid)
        items += got
        kept += keep
    if sel.orphans:
        got, keep = _plan_orphans(inv, act, orphan_grace)
        items += got
        kept += keep
    chosen, keep, remaining = _plan_models(inv, sel, act)
    kept += keep
    left = {r.digest for r in remaining}
    freed: set[str] = set()
    for r, why in chosen:
        # A blob shared with a model that stays is not freed; count each blob once.
        size = 0
        if r.digest not in left and r.digest not in freed:
            freed.add(r.digest)
            cache = inv.caches.get(r.digest)
            size = r.size + (cache.size if cache else 0)
        items.append(replace(_model_item(inv, r, why), size=size))
    before = inv.installed_bytes(r for r in inv.rows if not r.missing)
    return PrunePlan(items, kept, before, inv.installed_bytes(remaining), inv.disk_budget)


# --- the snapshot (file system work, run in a thread) -----------------------------------


def _info(path: Path, *, on_disk: bool = False) -> FileInfo | None:
    """A file's (or a dir's files') size; ``on_disk``: a file's as what removing it frees, the
    blocks it holds (a partial is sparse at the entry's full size until it is filled)."""
    try:
        st = path.lstat()
    except OSError:
        return None
    size = min(st.st_size, st.st_blocks * 512) if on_disk else st.st_size
    if stat.S_ISDIR(st.st_mode):
        size = 0
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                try:
                    size += (Path(dirpath) / name).lstat().st_size
                except OSError:
                    continue
    return FileInfo(path, size, st.st_mtime, st.st_ctime)


def _entries(path: Path) -> list[Path]:
    try:
        return sorted(path.iterdir())
    except FileNotFoundError:
        return []


def scan_files(inv: Inventory, blobs_dir: Path, partial_dir: Path, cache_dir: Path) -> None:
    """Fill ``inv``'s file lists from the three dirs."""
    for p in _entries(blobs_dir):
        info = _info(p)
        if info is None:
            continue
        m = BLOB_RE.fullmatch(p.name)
        if m:
            inv.blobs[m.group(1)] = info
        elif ".FAILED" in p.name:
            inv.quarantined.append(info)
        else:
            inv.strays.append(info)
    for p in _entries(partial_dir):
        info = _info(p, on_disk=True)
        if info is not None:
            inv.partials.append(info)
    for p in _entries(cache_dir):
        info = _info(p)
        if info is not None:
            inv.caches[p.name] = info
