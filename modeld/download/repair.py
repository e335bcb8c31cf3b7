"""Repair, not re-download: find the blocks a lying mirror sent, re-fetch only those.

On a whole-file sha256 mismatch, the blocks each mirror served are re-fetched from another
mirror, one mirror at a time (the one that served most first); blocks whose CRC-32 differs
are rewritten, the mirror that sent them is banned, and the file is hashed again.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from typing import TYPE_CHECKING

import aiohttp

from modeld import logs
from modeld.download.fetch import PrefixHasher
from modeld.download.journal import Block
from modeld.download.mirrors import Mirror, MirrorFailure, open_range
from modeld.errors import DownloadError, IntegrityError

if TYPE_CHECKING:
    from modeld.download.job import DownloadJob


async def repair(
    self: DownloadJob, fd: int, expected: str, digest: str, by: str | None = None
) -> str:
    """Re-fetch elsewhere the blocks each mirror served, fix those that differ, ban liars.

    ``by`` names who vouches for ``expected`` (the failure message says so)."""
    f = self.fetcher
    assert f is not None
    self._set("repairing")
    source = f" ({by})" if by else ""
    by_mirror: dict[str, list[int]] = {}
    for idx, label in f.sources.items():
        by_mirror.setdefault(label, []).append(idx)
    for label, blocks in sorted(by_mirror.items(), key=lambda kv: -len(kv[1])):
        others = [m for m in self.mirrors if m.usable and m.ranges and m.label != label]
        if not others:
            continue
        try:
            fixed = await _refetch(self, fd, sorted(blocks), others)
        except DownloadError as e:
            # The partial stays: a pull once another mirror answers can still repair it.
            raise DownloadError(
                f"{self.id}: the downloaded file's sha256 is {digest}, expected "
                f"{expected}{source}; {e.message}, so the bad bytes could not be found "
                "(partial kept). Pull again once another of the entry's URLs answers, or "
                "add another mirror to the entry"
            ) from e
        if not fixed:
            continue
        self.repaired += len(fixed)
        if self.metrics is not None:
            self.metrics.download_repairs.inc(len(fixed))
        for m in self.mirrors:
            if m.label == label:
                m.state, m.reason = "banned", f"sent {len(fixed)} blocks with wrong bytes"
        logs.event("mirror_banned", model=self.id, mirror=label, blocks=len(fixed))
        hasher = PrefixHasher(fd, self.target.size)
        digest = await hasher.digest()
        if digest == expected:
            return digest
    unreached = [m.label for m in self.mirrors if m.state == "dropped" and not m.answered]
    if unreached:
        # Given up as unreachable for this pull, not proven wrong: one may answer later.
        raise DownloadError(
            f"{self.id}: the downloaded file's sha256 is {digest}, expected {expected}{source}; "
            f"{', '.join(unreached)} could not be reached, so the bad bytes could not be found "
            "(partial kept). Pull again once another of the entry's URLs answers, or add "
            "another mirror to the entry"
        )
    self.partial.unlink(missing_ok=True)
    await self.journal.clear(self.id)
    raise IntegrityError(
        f"{self.id}: the downloaded file's sha256 is {digest}, expected {expected}{source}, "
        "and no mirror could repair it; the entry or every mirror is wrong (partial "
        "discarded). Pull again once another of the entry's URLs answers, or add another "
        "mirror to the entry"
    )


async def _refetch(
    self: DownloadJob, fd: int, blocks: list[int], others: list[Mirror]
) -> list[int]:
    f = self.fetcher
    assert f is not None
    sem = asyncio.Semaphore(self.tuning.connections)
    fixed: list[int] = []

    async def one(idx: int) -> None:
        start, end = f.block_range(idx)
        async with sem:
            for m in others:
                if not m.usable:
                    continue
                try:
                    assert self._session is not None
                    resp = await open_range(
                        self._session, m, start, end, self.target.size, self.tuning.hf_token
                    )
                    try:
                        data = await resp.content.readexactly(end - start)
                    finally:
                        resp.close()
                except (
                    MirrorFailure,
                    aiohttp.ClientError,
                    asyncio.IncompleteReadError,
                    TimeoutError,
                ):
                    continue
                crc = zlib.crc32(data)
                if crc != self._crcs[idx].crc:
                    os.pwrite(fd, data, start)
                    self._crcs[idx] = Block(idx, crc, m.label)
                    self._pending.append(self._crcs[idx])
                    fixed.append(idx)
                return
            raise DownloadError(f"no other mirror could serve block {idx}")

    await asyncio.gather(*(one(i) for i in blocks if i in self._crcs))
    return fixed
