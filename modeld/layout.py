"""Names on disk: which model ids are valid, and where the state dir keeps what.

Layout of ``MODELD_HOME``: ``blobs/sha256-<hex>`` (read-only model files), ``partial/<id>.partial``
(downloads in progress), ``cache/<hex>/`` (the runtime's ``cache_dir`` per blob) and
``modeld.db`` (the SQLite index). A model id is checked against ``MODEL_ID_RE`` before it becomes
part of a file name, and a digest against ``DIGEST_RE`` before it becomes a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# A registry entry's id: it names a partial file, so no "/" and no leading dot.
MODEL_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MODEL_ID_RE = re.compile(MODEL_ID_PATTERN)
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
BLOB_RE = re.compile(r"^sha256-([0-9a-f]{64})$")
PARTIAL_SUFFIX = ".partial"
# A staging file of an import (``partial/<id>.import-<pid>-<ns>``) or of a blob being placed
# (``blobs/.sha256-<hex>.install-<pid>``): the pid is the daemon's that writes it.
_STAGING_RE = re.compile(r"\.(?:import|install)-(\d+)(?:-|$)")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._-]+")


def model_id_from(name: str) -> str | None:
    """A model id made from a name (a file's stem, a repository's): runs of other characters
    become ``-``, the ends are trimmed, at most 128 characters; None if nothing is left."""
    made = _NOT_IN_ID.sub("-", name).strip("-._")[:128].rstrip("-._")
    return made if MODEL_ID_RE.fullmatch(made) else None


def staging_pid(name: str) -> int | None:
    """The pid of the daemon whose staging file ``name`` is, or None for any other file."""
    m = _STAGING_RE.search(name)
    return int(m.group(1)) if m else None


def blob_name(digest: str) -> str:
    """The file name of the blob with sha256 ``digest`` in ``blobs/``."""
    return f"sha256-{digest}"


@dataclass(frozen=True)
class StateDir:
    """The paths under one ``MODELD_HOME``."""

    home: Path

    @property
    def db(self) -> Path:
        return self.home / "modeld.db"

    @property
    def blobs(self) -> Path:
        return self.home / "blobs"

    @property
    def partial(self) -> Path:
        return self.home / "partial"

    @property
    def cache(self) -> Path:
        return self.home / "cache"

    def blob(self, digest: str) -> Path:
        return self.blobs / blob_name(digest)

    def cache_for(self, digest: str) -> Path:
        return self.cache / digest

    def partial_for(self, model_id: str) -> Path:
        return self.partial / f"{model_id}{PARTIAL_SUFFIX}"
