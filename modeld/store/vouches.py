"""Digests a hub vouched for once, kept per (entry, pinned revision).

huggingface.co vouches for a file's sha256 on its redirect (``X-Linked-Etag``). An LFS
object at a pinned commit never changes, so that answer stays true for the entry's pinned
revision: the store keeps it (the ``vouched`` table), and a later pull from a mirror alone is
checked against it. A later source that contradicts a kept digest fails the pull.

The revision is the pinned ``resolve`` path of the entry's primary URL
(``ORG/REPO@COMMIT/FILE``); an entry whose URL does not pin a commit has none, and nothing
is kept for it (``resolve/main`` moves).

``VouchBook`` is a protocol so the downloader does not need the store: tests use
``MemoryVouches``; the daemon uses the store itself.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlsplit

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Vouch:
    """A sha256 a hub vouched for: which host, for how many bytes, and when it was seen."""

    sha256: str
    size: int | None
    source: str  # the host (and port) whose redirect carried X-Linked-Etag
    at: float

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.at))

    @property
    def verified_by(self) -> str:
        """How an install checked against this kept digest is marked."""
        return f"x-linked-etag ({self.source}), kept since {self.day}"


class VouchBook(Protocol):
    async def vouched(self, model_id: str, revision: str) -> Vouch | None: ...
    async def vouch(self, model_id: str, revision: str, vouch: Vouch) -> None: ...


class MemoryVouches:
    """Kept digests in memory (tests, and downloads outside a daemon)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, str], Vouch] = {}

    async def vouched(self, model_id: str, revision: str) -> Vouch | None:
        return self.kept.get((model_id, revision))

    async def vouch(self, model_id: str, revision: str, vouch: Vouch) -> None:
        # The first answer is kept: a different one later is a conflict, never an update.
        self.kept.setdefault((model_id, revision), vouch)


def pinned_revision(url: str) -> str | None:
    """``ORG/REPO@COMMIT/FILE`` for a ``.../ORG/REPO/resolve/COMMIT/FILE`` URL, else None."""
    parts = [unquote(p) for p in urlsplit(url).path.split("/") if p]
    if "resolve" not in parts:
        return None
    i = parts.index("resolve")
    if i == 0 or len(parts) < i + 3 or not _COMMIT_RE.fullmatch(parts[i + 1]):
        return None
    return f"{'/'.join(parts[:i])}@{parts[i + 1]}/{'/'.join(parts[i + 2 :])}"
