"""Digests a source vouched for once, kept per (entry, pinned revision).

A source vouches for a file's sha256 on its answer (huggingface.co: ``X-Linked-Etag`` on its
redirect). A file at a pinned revision never changes, so that answer stays true for the
entry's pinned revision: the store keeps it (the ``vouched`` table), and a later pull from a
mirror alone is checked against it. A later source that contradicts a kept digest fails the
pull.

The revision is the key the entry's source gives its primary URL
(``modeld.download.source.Source.pinned``); an entry whose URL pins no immutable revision has
none, and nothing is kept for it (a branch moves).

``VouchBook`` is a protocol so the downloader does not need the store: tests use
``MemoryVouches``; the daemon uses the store itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Vouch:
    """A sha256 a source vouched for: which host, for how many bytes, and when it was seen."""

    sha256: str
    size: int | None
    source: str  # the host (and port) whose answer vouched (a hub's X-Linked-Etag)
    at: float
    # How it was said (``Claim.via``); the store does not keep it: a kept one reads as the
    # Hub's, the one source that vouches today.
    via: str = "X-Linked-Etag"

    @property
    def day(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.at))

    @property
    def verified_by(self) -> str:
        """How an install checked against this kept digest is marked."""
        return f"{self.now}, kept since {self.day}"

    @property
    def now(self) -> str:
        """How an install checked against this digest as it was just said is marked."""
        return f"{self.via.lower()} ({self.source})"


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
