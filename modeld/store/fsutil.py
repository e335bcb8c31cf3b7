"""Durable file moves: fsync a file or dir, and commit a finished file as a read-only blob.

Plain file-system work (no db), shared by :mod:`modeld.store.store` (installs, quarantine) and
:mod:`modeld.download.job` (which imports ``place_blob`` through ``modeld.store.store``).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from modeld.errors import IntegrityError

__all__ = ["fsync_dir", "fsync_path", "place_blob"]


def fsync_path(path: Path, flags: int = 0) -> None:
    """fsync a file (or, with ``os.O_DIRECTORY``, a dir, so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a dir, so a rename or unlink in it survives power loss."""
    fsync_path(path, os.O_DIRECTORY)


def place_blob(src: Path, dest: Path, size: int) -> None:
    """Commit ``src`` as the read-only blob ``dest``: fsync it, rename it, fsync the dir.

    Raises ``IntegrityError`` (nothing moved) when ``src`` is not ``size`` bytes. ``src`` on
    another file system is copied into ``dest``'s dir first, so the rename stays atomic.
    """
    actual = src.stat().st_size
    if actual != size:
        raise IntegrityError(f"{src} has {actual} bytes, expected {size}; it was not installed")
    fsync_path(src)
    src.chmod(0o444)
    try:
        src.replace(dest)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        # Another file system: copy into blobs/ under a name no blob has, so the final
        # rename stays on one file system and is atomic (a leftover is a stray for prune).
        tmp = dest.parent / f".{dest.name}.install-{os.getpid()}"
        shutil.copyfile(src, tmp)
        fsync_path(tmp)
        tmp.chmod(0o444)
        tmp.replace(dest)
        src.unlink()
    fsync_dir(dest.parent)
