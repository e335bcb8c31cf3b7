"""Names on disk: which model ids, file names and revisions are valid, and where the state dir
keeps what.

Every name that reaches an entry modeld writes (``pull hf://``, ``import``) or a path is
checked here, once: ``MODEL_ID_RE`` (always with ``fullmatch``: ``$`` lets a trailing newline
through ``match``), ``file_name_problem``, ``text_problem``, ``revision_problem`` and
``repo_part_problem``. What passes is text TOML can hold and a name no path escapes with.

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
# Ollama's clients name a model ``name:tag``. modeld keeps one file per id, and that file is
# the id's only tag: ``tiny-text:latest`` is ``tiny-text``, any other tag names nothing.
LATEST_TAG = "latest"
DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
BLOB_RE = re.compile(r"^sha256-([0-9a-f]{64})$")
PARTIAL_SUFFIX = ".partial"
# A staging file of an import (``partial/<id>.import-<pid>-<ns>``) or of a blob being placed
# (``blobs/.sha256-<hex>.install-<pid>``): the pid is the daemon's that writes it.
_STAGING_RE = re.compile(r"\.(?:import|install)-(\d+)(?:-|$)")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._-]+")
# Characters no name modeld writes may hold: C0 and C1 controls, and the line separators and
# bidi controls that change how what follows them is shown.
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
# A part of a repository's name (ORG, REPO) or of a file's path in it.
_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A branch, tag or commit of a repository (``refs/pr/1`` included).
_REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
MAX_FILE_NAME_BYTES = 255


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be written into an entry (control characters, or a lone UTF-16
    surrogate that no UTF-8 file holds), or None."""
    found = _CONTROL.search(text)
    if found is not None:
        return f"holds the control character {ascii(found.group())[1:-1]}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"holds {ascii(text[e.start])[1:-1]}, which is no character (not valid UTF-8)"
    return None


def file_name_problem(name: str) -> str | None:
    """Why ``name`` is no file name an entry may hold, or None: a plain name, no separator,
    no ``..``, at most 255 bytes, text an entry can hold."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or ".." in name:
        return "must be a plain file name, without separators or '..'"
    problem = text_problem(name)
    if problem is not None:
        return problem
    if len(name.encode("utf-8")) > MAX_FILE_NAME_BYTES:
        return f"is longer than {MAX_FILE_NAME_BYTES} bytes"
    return None


def revision_problem(revision: str) -> str | None:
    """Why ``revision`` is no branch, tag or commit of a Hub repository, or None."""
    if not _REVISION_RE.fullmatch(revision) or ".." in revision or revision.endswith("/"):
        return (
            "is not a revision: a branch, tag or commit of letters, digits, '.', '_', '-' "
            "and '/' (at most 255)"
        )
    return None


def repo_part_problem(part: str) -> str | None:
    """Why ``part`` is no part of a repository's name or of a file's path in it, or None."""
    if not _PART_RE.fullmatch(part) or ".." in part:
        return "holds other characters than letters, digits, '.', '_' and '-', or '..'"
    return None


def untagged(text: str) -> str:
    """``text`` without a ``:latest`` tag; any other text as it is."""
    name, sep, tag = text.rpartition(":")
    return name if sep and tag == LATEST_TAG else text


def tag_refusal(text: str) -> str | None:
    """What is wrong with ``text`` when it is a valid id with a tag other than ``:latest``
    (``tiny-text:q4``); None for anything else."""
    name, sep, tag = text.rpartition(":")
    if not sep or tag == LATEST_TAG or not MODEL_ID_RE.fullmatch(name):
        return None
    return (
        f"{text[:160]!r} asks for tag {tag[:40]!r}, and modeld has one file per model id, "
        f"tagged only :{LATEST_TAG}; send {name!r} (or '{name}:{LATEST_TAG}'), or a variant's "
        "own id from `modeld list`"
    )


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
