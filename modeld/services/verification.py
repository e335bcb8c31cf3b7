"""What makes an install verified, and what to tell a user whose install is not.

An install is verified when its sha256 is the entry's, or what a source vouched for (a hub's
``X-Linked-Etag``) for the entry's file: now, or earlier for the same pinned revision (kept
in the store, :mod:`modeld.store.vouches`). ``verify`` uses ``vouched_by``; ``verify`` and
the ``unverified`` refusal both say ``how_to_verify``, whose every step works.
"""

from __future__ import annotations

from pathlib import Path

from modeld.catalog.catalog import Catalog, Entry, bundled_registry_dir
from modeld.config import Settings
from modeld.download.job import DownloadTarget, Tuning, vouch_now
from modeld.download.source import SourceSet
from modeld.store.store import Store
from modeld.store.vouches import Vouch


async def vouched_by(
    settings: Settings, sources: SourceSet, store: Store, entry: Entry, digest: str
) -> tuple[str | None, Vouch | None]:
    """Who vouches for an installed file's ``digest`` now, and the source's answer consulted.

    In order: the entry's sha256; else the digest a source vouched for earlier for the
    entry's pinned revision; else the source itself, asked now (one request, no body), whose
    answer is then kept.
    """
    if entry.sha256 is not None:
        return ("registry sha256" if entry.sha256 == digest else None), None
    target = DownloadTarget.from_entry(entry)
    rev = sources.pinned(target.urls)
    kept: Vouch | None = await store.vouched(entry.id, rev) if rev else None
    if kept is not None:
        return (kept.verified_by if kept.sha256 == digest else None), kept
    if settings.hf_hub_offline:
        return None, None  # HF_HUB_OFFLINE: no hub is asked
    fresh = await vouch_now(target, Tuning.from_settings(settings, sources))
    if fresh is None:
        return None, None
    if rev is not None:
        await store.vouch(entry.id, rev, fresh)
    return (fresh.now if fresh.sha256 == digest else None), fresh


def _entry_file(model_id: str, source: Path | None, bundled: Path | None) -> str:
    if source is None:
        return f"the entry of {model_id}"
    if bundled is not None and source.parent == bundled:
        return (
            f"a copy of {source} in registry/ in the daemon's state dir (`modeld status` "
            "names that dir; read at once, it overrides the bundled one)"
        )
    return str(source)


def how_to_verify(
    model_id: str,
    entry: Entry | None,
    digest: str,
    kept: Vouch | None,
    *,
    hub: str | None,
    pinned: bool = False,
    source: Path | None = None,
    bundled: Path | None = None,
) -> str:
    """What can make the install of ``model_id`` (bytes ``digest``) verified; each step works.

    ``kept`` is what a source vouched for (kept for the pinned revision, or asked just now),
    ``hub`` the host that can vouch for the entry's file (``SourceSet.vouching_host``),
    ``source`` the entry's file, ``bundled`` the bundled registry dir.
    """
    verify = f"`modeld verify {model_id}`"
    if entry is None:
        return (
            f"add a registry entry for {model_id} with the file's published sha256 "
            f'(sha256 = "..."), then run {verify}'
        )
    if entry.sha256 is not None:
        if entry.sha256 == digest:
            return f"run {verify}: the entry's sha256 matches this file"
        return (
            f"`modeld pull {model_id}` fetches the file the entry names and checks it "
            "against its sha256"
        )
    if kept is not None:
        return _kept_hint(model_id, entry, digest, kept, pinned)
    edit = (
        f'add sha256 = "<the file\'s published sha256>" to '
        f"{_entry_file(model_id, source, bundled)}, then run {verify}"
    )
    if hub is not None:
        return f"run {verify} while {hub} is reachable (it asks {hub} for the sha256), or {edit}"
    return edit


def _kept_hint(model_id: str, entry: Entry, digest: str, kept: Vouch, pinned: bool) -> str:
    if kept.sha256 == digest:
        return f"run `modeld verify {model_id}`: {kept.source} vouched for this file's sha256"
    # A pinned revision's kept answer makes this install stale for ``pull``; an unpinned
    # URL's answer is not kept, so the install must go first.
    pull = f"`modeld pull {model_id}`"
    fetch = f"{pull} fetches" if pinned else f"`modeld rm {model_id}` then {pull} fetch"
    return (
        f"{fetch} the file {kept.source} vouched for on {kept.day} (sha256 {kept.sha256}); "
        f"this one is {digest}"
    )


async def verification_hint(
    catalog: Catalog, sources: SourceSet, store: Store, model_id: str, digest: str
) -> str:
    """``how_to_verify`` for an install, with its entry, the entry's file and the kept digest."""
    entry: Entry | None = catalog.find(model_id)
    kept = None
    rev = sources.pinned(entry.urls) if entry is not None else None
    if entry is not None and entry.sha256 is None:
        kept = await store.vouched(model_id, rev) if rev else None
    return how_to_verify(
        model_id,
        entry,
        digest,
        kept,
        hub=sources.vouching_host(entry.urls) if entry is not None else None,
        pinned=rev is not None,
        source=catalog.source_of(model_id),
        bundled=bundled_registry_dir(),
    )
