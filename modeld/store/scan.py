"""Looking at the state dir's files: hashing a blob and finding what the index does not know.

Plain file-system work, run in a thread by :mod:`modeld.store.store`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeld.layout import BLOB_RE, DIGEST_RE, staging_pid

# 1 MiB reads: hashlib releases the GIL for large updates and the syscall count stays low.
HASH_CHUNK = 1024 * 1024


def sha256_file(path: Path, chunk: int = HASH_CHUNK) -> tuple[str, int]:
    """The sha256 (hex) and size of the file at ``path``, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return h.hexdigest(), size


@dataclass
class ScanReport:
    """What a scan of ``blobs/``, ``partial/`` and ``cache/`` found against the index."""

    orphan_blobs: list[dict[str, Any]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    wrong_size: list[dict[str, Any]] = field(default_factory=list)
    quarantined: list[dict[str, Any]] = field(default_factory=list)
    partials: list[dict[str, Any]] = field(default_factory=list)
    orphan_caches: list[str] = field(default_factory=list)
    scanned_at: float = field(default_factory=time.time)

    def problems(self) -> list[str]:
        """One line per kind of leftover, saying what to do."""
        out: list[str] = []
        if self.orphan_blobs:
            n = sum(o["size"] for o in self.orphan_blobs)
            out.append(
                f"{len(self.orphan_blobs)} file(s) in blobs/ ({n} bytes) belong to no installed"
                " model; `modeld prune --orphans` removes them"
            )
        if self.missing:
            out.append(
                f"installed model(s) {', '.join(sorted(self.missing))}: the file is missing;"
                " they count as not installed; `modeld pull ID` fetches it again"
                " (`modeld import PATH ID` for an imported one)"
            )
        for w in self.wrong_size:
            out.append(
                f"model {w['id']}: its file has {w['actual']} bytes, the index says"
                f" {w['size']}; run `modeld verify {w['id']}`"
            )
        if self.quarantined:
            out.append(
                f"{len(self.quarantined)} quarantined file(s) (*.FAILED) in blobs/;"
                " `modeld prune --orphans` removes them"
            )
        if self.partials:
            n = sum(p["size"] for p in self.partials)
            out.append(
                f"{len(self.partials)} partial download(s) ({n} bytes) in partial/;"
                " `modeld pull ID` resumes, `modeld prune --partials` removes them"
            )
        if self.orphan_caches:
            out.append(
                f"{len(self.orphan_caches)} cache dir(s) in cache/ belong to no blob;"
                " `modeld prune --orphans` removes them"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "orphan_blobs": self.orphan_blobs,
            "missing": sorted(self.missing),
            "wrong_size": self.wrong_size,
            "quarantined": self.quarantined,
            "partials": self.partials,
            "orphan_caches": self.orphan_caches,
            "scanned_at": self.scanned_at,
        }


def _size_of(entry: os.DirEntry[str]) -> int:
    if entry.is_dir():
        return sum(p.stat().st_size for p in Path(entry.path).rglob("*") if p.is_file())
    return entry.stat().st_size


def scan_state_dir(
    blobs: Path,
    partial: Path,
    cache: Path,
    rows: dict[str, tuple[str, int, float | None]],
    *,
    in_use: Collection[str] = (),
    pid: int | None = None,
) -> ScanReport:
    """Compare the dirs with the index rows (id -> (digest, size, missing_since)).

    Work in progress is no leftover: the files named in ``in_use`` (the partials of running
    downloads) and the staging files of the daemon ``pid`` (an import, a blob being placed)
    are left out. ``modeld status`` runs this each time: one ``scandir`` per dir and one
    ``stat`` per blob and partial.
    """
    report = ScanReport()

    def busy(entry: os.DirEntry[str]) -> bool:
        return entry.path in in_use or (pid is not None and staging_pid(entry.name) == pid)

    present = _scan_blobs(blobs, {d for d, _, _ in rows.values()}, report, busy)
    for model_id, (digest, size, _) in rows.items():
        if digest not in present:
            report.missing.append(model_id)
        elif present[digest] != size:
            report.wrong_size.append({"id": model_id, "size": size, "actual": present[digest]})
    for entry in _entries(partial):
        if busy(entry):
            continue
        try:
            report.partials.append(
                {"path": entry.path, "size": _size_of(entry), "modified": entry.stat().st_mtime}
            )
        except OSError:
            continue
    for entry in _entries(cache):
        if not (DIGEST_RE.match(entry.name) and entry.name in present):
            report.orphan_caches.append(entry.path)
    return report


def _scan_blobs(
    blobs: Path,
    digests: set[str],
    report: ScanReport,
    busy: Callable[[os.DirEntry[str]], bool],
) -> dict[str, int]:
    """Sort ``blobs/`` into known blobs (returned: digest -> size), orphans, quarantined."""
    present: dict[str, int] = {}
    for entry in _entries(blobs):
        if busy(entry):
            continue
        try:
            size = _size_of(entry)
        except OSError:
            continue
        match = BLOB_RE.match(entry.name)
        if match:
            present[match.group(1)] = size
            if match.group(1) not in digests:
                report.orphan_blobs.append({"path": entry.path, "size": size})
        elif ".FAILED" in entry.name:
            report.quarantined.append({"path": entry.path, "size": size})
        else:
            report.orphan_blobs.append({"path": entry.path, "size": size})
    return present


def _entries(path: Path) -> list[os.DirEntry[str]]:
    """The entries of ``path`` by name (none when it does not exist)."""
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except FileNotFoundError:
        return []
