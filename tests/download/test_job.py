"""The downloader against real loopback mirrors with faults: many pieces, several mirrors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import random
import shutil
import threading
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from yarl import URL

from modeld.download import hub as hub_mod
from modeld.download import mirrors as mirrors_mod
from modeld.download import prefixhash
from modeld.download.fetch import Fetcher
from modeld.download.hub import Hub
from modeld.download.job import DownloadJob, DownloadState, DownloadTarget, Tuning, memory_job
from modeld.download.journal import Block, JournalState, MemoryJournal
from modeld.download.mirrors import MirrorFailure, check_url
from modeld.download.schedule import Piece, Schedule
from modeld.download.source import SourceSet
from modeld.errors import DigestConflict, DiskFull, DownloadError, IntegrityError
from modeld.store.vouches import MemoryVouches, Vouch
from tests.support.hub import hub
from tests.support.mirror import COMMIT, Faults, Mirror, pinned_path, start_mirrors
from tests.support.wait import wait_until

SIZE = 3 * 1024 * 1024 + 12345  # not a multiple of the block size: a short last block
PIECE = 64 * 1024


@pytest.fixture(scope="module")
def data() -> bytes:
    return random.Random(7).randbytes(SIZE)


@pytest.fixture
async def stop_later() -> AsyncIterator[list[Mirror]]:
    started: list[Mirror] = []
    yield started
    for m in started:
        await m.stop()


def tuning(**kw: Any) -> Tuning:
    # The Hub as a source: its hosts (``hub.HF_HOSTS``, which tests patch) vouch.
    base: dict[str, Any] = {"connections": 6, "piece_size": PIECE, "stall_timeout": 1.0}
    base.update(kw)
    base.setdefault("sources", SourceSet(Hub()))
    return Tuning(**base)


async def run_pull(
    home: Path,
    mirrors: list[Mirror],
    stop_later: list[Mirror],
    *,
    sha: str | None,
    size: int = SIZE,
    **kw: Any,
) -> DownloadJob:
    stop_later.extend(mirrors)
    target = DownloadTarget("m1", [m.url for m in mirrors], size, sha)
    job = memory_job(target, home, kw.pop("tuning", None) or tuning(), **kw)
    job.start()
    await job.wait()
    return job


def installed_bytes(job: DownloadJob) -> bytes:
    return Path(job.result["path"]).read_bytes()


async def test_single_mirror_many_pieces(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """One plain mirror: each of ~50 pieces is fetched, verified by sha256, installed."""
    ms = await start_mirrors(data)
    sha = hashlib.sha256(data).hexdigest()
    job = await run_pull(short_tmp, ms, stop_later, sha=sha)
    assert job.state == "installed"
    assert installed_bytes(job) == data
    assert job.verified_by == "registry sha256"
    assert not (short_tmp / "partial" / "m1.partial").exists()
    ranges = [r["Range"] for r in ms[0].requests if "Range" in r]
    assert len(ranges) > SIZE // PIECE  # the probe plus one request per piece
    assert all(r["Accept-Encoding"] == "identity" for r in ms[0].requests)


async def test_three_mirrors_share_the_work(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """Pieces are spread over every healthy mirror at once."""
    ms = await start_mirrors(data, Faults(), Faults(), Faults())
    job = await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert installed_bytes(job) == data
    assert all(m.sent > 0 for m in ms)


@pytest.mark.parametrize(
    ("fault", "dropped"),
    [
        (Faults(status=404), True),
        (Faults(ignore_range=True), False),
        (Faults(wrong_content_range=True), True),
        (Faults(wrong_size=True), True),
        (Faults(redirect_loop=True), True),
        (Faults(redirect_to="ftp://127.0.0.1/f"), True),
        (Faults(short=True), False),
        (Faults(fail_first=3), False),
        (Faults(drop_after=100_000, drop_times=5), False),
        (Faults(throttle=200_000), False),
        (Faults(stall_after=200_000), False),
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, Faults) else str(v),
)
async def test_each_fault_beside_a_good_mirror(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], fault: Faults, dropped: bool
) -> None:
    """Each fault on one mirror beside a good one: the file still arrives whole and verified."""
    ms = await start_mirrors(data, fault, Faults())
    job = await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert job.state == "installed"
    assert installed_bytes(job) == data
    bad = job.mirrors[0]
    if dropped:
        assert bad.state == "dropped", bad.snapshot()


@pytest.mark.parametrize(
    "fault",
    [
        Faults(short=True),
        Faults(fail_first=4, retry_after="0"),
        Faults(drop_after=150_000, drop_times=8),
        Faults(ignore_range=True),
    ],
    ids=["short206", "500-then-ok", "drops", "no-ranges-stream"],
)
async def test_fault_alone_still_completes(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], fault: Faults
) -> None:
    """Recoverable faults on the only mirror: retried, re-queued or streamed to a correct file."""
    ms = await start_mirrors(data, fault)
    job = await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert installed_bytes(job) == data


async def test_mixed_faults_over_three_mirrors(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """Drops, a short 206 and throttling at once on three mirrors, plus a fourth that is gone."""
    ms = await start_mirrors(
        data,
        Faults(drop_after=90_000, drop_times=6, fail_first=2),
        Faults(short=True, throttle=2_000_000),
        Faults(throttle=5_000_000),
        Faults(status=410),
    )
    job = await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert installed_bytes(job) == data
    assert job.mirrors[3].state == "dropped"


async def test_all_mirrors_gone_fails_and_keeps_nothing_broken(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """When no mirror can serve, the pull fails with a message naming each mirror's reason and
    what to fix for each cause."""
    ms = await start_mirrors(data, Faults(status=404), Faults(wrong_size=True))
    with pytest.raises(DownloadError, match="no mirror could serve") as exc:
        await run_pull(short_tmp, ms, stop_later, sha=None)
    assert "404" in str(exc.value) and "the entry says" in str(exc.value)
    assert "fix the entry's `urls`" in str(exc.value) and "or the mirror" in str(exc.value)
    assert not (short_tmp / "blobs").exists() or not any((short_tmp / "blobs").iterdir())


@pytest.mark.parametrize(
    ("fault", "advice"),
    [
        (Faults(status=404), "the entry's URL is wrong or the file is not on that mirror"),
        (Faults(wrong_size=True), f"another file than the entry's size ({SIZE} bytes) says"),
    ],
    ids=["404", "wrong-size"],
)
async def test_a_first_pull_no_mirror_serves_keeps_nothing(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], fault: Faults, advice: str
) -> None:
    """A first pull whose only mirror answers 404, or has a file of another size, wrote not a
    byte: no partial and no journal stay, and the error says so and what to fix."""
    ms = await start_mirrors(data, fault)
    journal = MemoryJournal()
    with pytest.raises(DownloadError) as exc:
        await run_pull(short_tmp, ms, stop_later, sha=None, journal=journal)
    message = exc.value.message
    assert "nothing was kept" in message and "pull again to resume" not in message
    assert advice in message and "MODELD_REGISTRY" in message
    assert exc.value.code == "download_failed"
    assert not (short_tmp / "partial" / "m1.partial").exists()
    assert "m1" not in journal.states


async def test_only_a_pull_that_wrote_bytes_keeps_its_partial_when_no_mirror_serves(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A pull whose mirror answers 404 from the start leaves no partial; once it served some
    bytes and then answers 404, the partial and its journal stay, to be resumed."""
    ms = await start_mirrors(data, Faults(status=404, throttle=1_000_000))
    stop_later.extend(ms)
    journal = MemoryJournal()
    target = DownloadTarget("m1", [ms[0].url], SIZE, hashlib.sha256(data).hexdigest())
    job = memory_job(target, short_tmp, tuning(connections=2), journal=journal)
    job.start()
    with pytest.raises(DownloadError, match="nothing was kept"):
        await job.wait()
    assert not (short_tmp / "partial" / "m1.partial").exists()
    ms[0].faults.status = None
    job = memory_job(target, short_tmp, tuning(connections=2), journal=journal)
    job.start()
    await wait_until(lambda: job.fetcher is not None and job.fetcher.done_bytes >= 3 * PIECE)
    ms[0].faults.status = 404
    with pytest.raises(DownloadError, match="no mirror can serve") as exc:
        await job.wait()
    assert "the partial is kept, pull again to resume" in exc.value.message
    assert (short_tmp / "partial" / "m1.partial").stat().st_blocks > 0
    assert journal.states["m1"].blocks


async def test_lying_mirror_is_repaired_not_redownloaded(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A mirror that flips a byte: only its blocks are re-fetched elsewhere, and it is banned."""
    ms = await start_mirrors(data, Faults(flip_byte=100), Faults(throttle=300_000))
    job = await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert installed_bytes(job) == data
    liar = job.mirrors[0]
    assert job.repaired == 1
    assert liar.state == "banned"
    assert job.mirrors[1].state != "banned"
    # The other mirror's few blocks are checked first, then the liar's from the start of the
    # file: the bad block is its first, and the repair stops there.
    assert ms[0].sent + ms[1].sent <= 1.5 * SIZE


async def test_repair_checks_the_smaller_mirrors_blocks_first_and_stops_at_the_match(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A partial whose blocks came from two mirrors (from the journal), one of which flipped a
    byte in the middle of its share: its blocks are the fewer, so they are checked first,
    in file order, against the other mirror; once the bad block is rewritten, the file is
    re-hashed from that block on and the repair stops. It costs about a quarter of the file
    (and the blocks in flight), not every block of both mirrors again."""
    honest, liar = await start_mirrors(data, Faults(), Faults())
    stop_later += [honest, liar]
    nblocks = -(-SIZE // PIECE)
    split = nblocks // 2 + 1  # the liar sent blocks [split, nblocks): the fewer
    bad = (split + nblocks) // 2 * PIECE + 123
    got = bytearray(data)
    got[bad] ^= 0xFF
    partial = short_tmp / "partial" / "m1.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(got)
    label = {i: (liar if i >= split else honest) for i in range(nblocks)}
    blocks = {
        i: Block(i, zlib.crc32(got[i * PIECE : (i + 1) * PIECE]), f"127.0.0.1:{label[i].port}")
        for i in range(nblocks)
    }
    journal = MemoryJournal()
    await journal.begin("m1", JournalState(SIZE, PIECE, None, {}, blocks))
    job = await run_pull(
        short_tmp, [honest, liar], stop_later, sha=hashlib.sha256(data).hexdigest(), journal=journal
    )
    assert installed_bytes(job) == data
    assert job.resumed == SIZE and job.repaired == 1
    assert [m.state == "banned" for m in job.mirrors] == [False, True]
    assert liar.sent <= 1  # its probe: its blocks were checked against the other mirror
    # The liar's blocks up to the bad one, and those in flight beside it (6 connections).
    checked = bad // PIECE - split + 1
    assert honest.sent <= 1 + (checked + 5) * PIECE
    assert liar.sent + honest.sent <= 0.4 * SIZE


async def test_single_lying_mirror_is_an_integrity_error(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """With no other mirror to repair from, a wrong sha256 fails clearly and installs nothing."""
    ms = await start_mirrors(data, Faults(flip_byte=10))
    with pytest.raises(IntegrityError, match="sha256"):
        await run_pull(short_tmp, ms, stop_later, sha=hashlib.sha256(data).hexdigest())
    assert not (short_tmp / "partial" / "m1.partial").exists()


async def test_no_sha_in_entry_uses_linked_etag(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without an entry sha256, the primary's X-Linked-Etag (read on its redirect) verifies."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    primary = Mirror(data, Faults(hf=True), host="localhost")
    await primary.start()
    (other,) = await start_mirrors(data)
    job = await run_pull(short_tmp, [primary, other], stop_later, sha=None)
    assert job.verified_by == f"x-linked-etag (localhost:{primary.port})"
    assert installed_bytes(job) == data


async def test_two_hubs_that_disagree_fail_the_pull(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two hub-like sources vouching for different hashes: the pull fails naming both, and
    never installs the file as unverified."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost", "127.0.0.1"))
    a = Mirror(data, Faults(hf=True), host="localhost")
    b = Mirror(data, Faults(hf=True, linked_sha256="0" * 64))
    await a.start()
    await b.start()
    with pytest.raises(DigestConflict) as exc:
        await run_pull(short_tmp, [a, b], stop_later, sha=None)
    assert hashlib.sha256(data).hexdigest() in exc.value.message
    assert "0" * 64 in exc.value.message
    assert not (short_tmp / "blobs").exists() or not any((short_tmp / "blobs").iterdir())


async def test_hub_contradicting_the_entry_fails_the_pull(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An X-Linked-Etag other than the entry's sha256 fails the pull with ``digest_conflict``,
    naming both digests, and installs nothing (the other mirror's probe may have started the
    fetch: test_mirrors has the hub that answers late)."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    bogus = "e" * 64
    the_hub = await hub(data, Faults(linked_sha256=bogus))
    (mirror,) = await start_mirrors(data)
    truth = hashlib.sha256(data).hexdigest()
    with pytest.raises(DigestConflict) as exc:
        await run_pull(short_tmp, [the_hub, mirror], stop_later, sha=truth)
    assert exc.value.code == "digest_conflict"
    assert hashlib.sha256(data).hexdigest() in exc.value.message
    assert bogus in exc.value.message
    assert f"localhost:{the_hub.port}" in exc.value.message
    assert the_hub.sent == 1  # its probe's one byte: no piece went to a mirror that conflicts
    assert not (short_tmp / "blobs").exists() or not any((short_tmp / "blobs").iterdir())


async def test_kept_answer_verifies_a_pull_from_the_mirror_alone(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry without sha256: the hub's X-Linked-Etag is kept for (entry, revision); a
    later pull with the hub down is verified against it."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    the_hub = await hub(data)
    (mirror,) = await start_mirrors(data)
    book = MemoryVouches()
    first = await run_pull(short_tmp / "a", [the_hub, mirror], stop_later, sha=None, vouches=book)
    assert first.verified_by == f"x-linked-etag (localhost:{the_hub.port})"
    kept = book.kept[("m1", f"org/repo@{COMMIT}/m.litertlm")]
    assert kept.sha256 == hashlib.sha256(data).hexdigest()
    await the_hub.stop()
    before = mirror.sent
    second = memory_job(
        DownloadTarget("m1", [the_hub.url, mirror.url], SIZE, None),
        short_tmp / "b",
        tuning(),
        vouches=book,
    )
    second.start()
    await second.wait()
    assert mirror.sent - before >= SIZE  # the whole file came from the mirror
    assert second.verified_by == kept.verified_by
    assert second.verified_by.startswith(f"x-linked-etag (localhost:{the_hub.port}), kept")
    assert installed_bytes(second) == data


async def test_mirror_bytes_other_than_the_kept_answer_fail(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """With the hub down, a mirror serving other bytes than the kept digest fails the pull
    (nothing installed), naming who vouched for the expected digest."""
    book = MemoryVouches()
    truth = hashlib.sha256(data).hexdigest()
    rev = f"org/repo@{COMMIT}/m.litertlm"
    await book.vouch("m1", rev, Vouch(truth, SIZE, "huggingface.co", time.time()))
    liar = await Mirror(data, Faults(flip_byte=5), path=pinned_path()).start()
    dead = f"http://localhost:9{pinned_path()}"
    stop_later.append(liar)
    target = DownloadTarget("m1", [dead, liar.url], SIZE, None)
    job = memory_job(target, short_tmp, tuning(), vouches=book)
    job.start()
    # No other mirror can show which bytes are wrong: the partial stays for a later pull.
    with pytest.raises(DownloadError, match="kept since") as exc:
        await job.wait()
    assert truth in exc.value.message
    assert job.state == "failed"
    assert not (short_tmp / "blobs").exists() or not any((short_tmp / "blobs").iterdir())


async def test_no_source_vouches_installs_unverified(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """No sha256 anywhere: the file is installed with verified_by None."""
    ms = await start_mirrors(data)
    job = await run_pull(short_tmp, ms, stop_later, sha=None)
    assert job.verified_by is None
    assert job.result["digest"] == hashlib.sha256(data).hexdigest()


async def test_token_goes_only_to_huggingface(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MODELD_HF_TOKEN is sent to the hub host only, never to a mirror or the CDN target."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    hub = Mirror(data, Faults(hf=True), host="localhost")
    await hub.start()
    (mirror,) = await start_mirrors(data)
    with_token = tuning(sources=SourceSet(Hub(token="secret")))
    await run_pull(short_tmp, [hub, mirror], stop_later, sha=None, tuning=with_token)
    origin = [r for r in hub.requests if r["path"].startswith("/f")]
    cdn = [r for r in hub.requests if r["path"].startswith("/cdn")]
    assert origin and all(r.get("Authorization") == "Bearer secret" for r in origin)
    assert cdn and not any("Authorization" in r for r in cdn)
    assert not any("Authorization" in r for r in mirror.requests)


async def test_expired_signed_url_goes_back_to_origin(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 403 from an expired signed CDN URL sends the next request to the original URL."""
    monkeypatch.setattr(hub_mod, "HF_HOSTS", ("localhost",))
    hub = Mirror(data, Faults(hf=True, sign_ttl=0.3, throttle=3_000_000), host="localhost")
    await hub.start()
    job = await run_pull(
        short_tmp,
        [hub],
        stop_later,
        sha=hashlib.sha256(data).hexdigest(),
        tuning=tuning(connections=2),
    )
    assert installed_bytes(job) == data
    origin_hits = [r for r in hub.requests if r["path"].startswith("/f")]
    assert len(origin_hits) > 2  # re-signed after expiry, not only at the start


def test_url_rules() -> None:
    """Only http(s) URLs, and never a redirect from https down to http."""
    check_url(URL("https://a.example/f"))
    check_url(URL("http://a.example/f"), came_from=URL("http://b.example/f"))
    with pytest.raises(MirrorFailure, match="only http"):
        check_url(URL("ftp://a.example/f"))
    with pytest.raises(MirrorFailure, match="https to http"):
        check_url(URL("http://a.example/f"), came_from=URL("https://b.example/f"))


async def cancelled_pull(
    home: Path, data: bytes, stop_later: list[Mirror], after: int
) -> tuple[list[Mirror], DownloadTarget, MemoryJournal]:
    """A throttled pull into a fresh journal, cancelled once ``after`` bytes arrived."""
    ms = await start_mirrors(data, Faults(throttle=1_000_000))
    stop_later.extend(ms)
    journal = MemoryJournal()
    target = DownloadTarget("m1", [ms[0].url], SIZE, hashlib.sha256(data).hexdigest())
    job = memory_job(target, home, tuning(connections=2), journal=journal)
    job.start()
    await wait_until(lambda: job.fetcher is not None and job.fetcher.done_bytes >= after)
    job.cancel()
    with pytest.raises(DownloadError, match="cancelled"):
        await job.wait()
    return ms, target, journal


async def test_a_cancel_mid_block_resumes_from_the_marks(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """Blocks in flight are journaled in part as they go: a pull cancelled mid-block resumes
    each one from its mark (its first bytes CRC-checked on disk), asking the mirror only for
    the rest; a mark whose bytes on disk differ is not trusted."""
    mib = 1024 * 1024
    ms = await start_mirrors(data, Faults(throttle=1_000_000))
    stop_later.extend(ms)
    journal = MemoryJournal()
    target = DownloadTarget("m1", [ms[0].url], SIZE, hashlib.sha256(data).hexdigest())
    slow = tuning(connections=2, piece_size=mib)  # 1 MiB blocks, one per piece
    job = memory_job(target, short_tmp, slow, journal=journal)
    job.start()

    def marked() -> list[Block]:
        state = journal.states.get("m1")
        return [b for b in state.blocks.values() if b.length] if state else []

    await wait_until(
        lambda: len(marked()) == 2 and all((b.length or 0) >= 100_000 for b in marked())
    )
    job.cancel()
    with pytest.raises(DownloadError, match="cancelled"):
        await job.wait()
    marks = {b.index: b for b in marked()}
    kept, spoilt = sorted(marks)
    with (short_tmp / "partial" / "m1.partial").open("r+b") as f:
        f.seek(spoilt * mib + 10)
        f.write(b"\xff\xfe")  # not what the mark's CRC-32 covers
    ms[0].faults.throttle = None
    first = len(ms[0].requests)
    job2 = memory_job(target, short_tmp, tuning(piece_size=mib), journal=journal)
    job2.start()
    await job2.wait()
    assert installed_bytes(job2) == data
    assert "m1" not in journal.states  # cleared after the install
    ranges = [r["Range"] for r in ms[0].requests[first:] if r.get("Range") != "bytes=0-0"]
    starts = {int(r.removeprefix("bytes=").partition("-")[0]) for r in ranges}
    assert kept * mib + (marks[kept].length or 0) in starts  # the rest of the kept mark only
    assert spoilt * mib in starts  # the spoilt one again from its start
    assert job2.resumed >= (marks[kept].length or 0)


async def test_a_cancel_while_verifying_waits_for_the_hasher_before_the_file_closes(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled (twice) while the digest waits on a writeback call that blocks (a full
    disk queue), the pull ends only after the hasher's threads did: they never use the
    file's descriptor once it is closed (its number may be another file's by then)."""
    release = threading.Event()

    def blocking_writeback(fd: int, offset: int, length: int) -> None:
        release.wait(30)

    monkeypatch.setattr(prefixhash, "start_writeback", blocking_writeback)
    ms = await start_mirrors(data)
    stop_later.extend(ms)
    target = DownloadTarget("m1", [ms[0].url], SIZE, hashlib.sha256(data).hexdigest())
    job = memory_job(target, short_tmp, tuning())
    job.start()
    try:
        await wait_until(lambda: job.state is DownloadState.VERIFYING)
        assert job.fetcher is not None and job.fetcher.hasher is not None
        hasher = job.fetcher.hasher
        job.cancel()
        await asyncio.sleep(0.05)
        job.cancel()
        ended = asyncio.ensure_future(job.wait())
        with contextlib.suppress(AssertionError):
            await wait_until(ended.done, limit=0.5)
        ended_before_the_threads = ended.done()
    finally:
        release.set()
    with pytest.raises(DownloadError, match="cancelled"):
        await ended
    assert not ended_before_the_threads
    assert not hasher.thread.is_alive() and not hasher.writeback.thread.is_alive()


async def test_resume_uses_journal_and_rechecks_blocks(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A cancelled pull resumes from its journal; a journaled block with bad bytes is re-fetched."""
    ms, target, journal = await cancelled_pull(short_tmp, data, stop_later, SIZE // 3)
    state = journal.states["m1"]
    whole = sorted(i for i, b in state.blocks.items() if b.length is None)
    marked = sum(b.length or 0 for b in state.blocks.values())  # blocks in flight, in part
    assert len(whole) >= (SIZE // 3) // PIECE - 1
    # Corrupt one journaled block on disk: the resume must not trust it.
    bad = whole[0]
    partial = short_tmp / "partial" / "m1.partial"
    with partial.open("r+b") as f:
        f.seek(bad * PIECE + 5)
        f.write(b"\x00\x01\x02")
    ms[0].faults.throttle = None
    before = ms[0].sent
    job2 = memory_job(target, short_tmp, tuning(), journal=journal)
    job2.start()
    await job2.wait()
    assert installed_bytes(job2) == data
    assert job2.resumed == (len(whole) - 1) * PIECE + marked
    assert job2.from_zero is None and "from_zero" not in job2.snapshot()  # a plain resume
    assert ms[0].sent - before <= SIZE - job2.resumed + PIECE  # only the missing part again
    assert "m1" not in journal.states


async def test_a_resume_from_a_mirror_that_ignores_range_counts_nothing_as_resumed(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A resume whose only mirror ignores Range streams the file from byte 0: nothing of the
    partial spared a byte of it, so ``resumed`` is 0 and ``received`` is the file's size."""
    ms, target, journal = await cancelled_pull(short_tmp, data, stop_later, SIZE // 3)
    assert journal.states["m1"].blocks
    ms[0].faults.throttle = None
    ms[0].faults.ignore_range = True
    job = memory_job(target, short_tmp, tuning(), journal=journal)
    job.start()
    await job.wait()
    assert installed_bytes(job) == data
    assert job.from_zero is not None and "ignores Range" in job.from_zero
    record = job.snapshot()
    assert (record["resumed"], record["received"]) == (0, SIZE)


async def test_marks_fetched_again_on_another_mirror_are_not_counted_as_resumed(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A resume whose marks' mirror is gone: another mirror fetches those blocks from their
    start, so only the whole journaled blocks count as resumed."""
    mib = 1024 * 1024
    ms = await start_mirrors(data, Faults(throttle=1_000_000), Faults())
    stop_later.extend(ms)
    journal = MemoryJournal()
    target = DownloadTarget("m1", [ms[0].url], SIZE, hashlib.sha256(data).hexdigest())
    job = memory_job(target, short_tmp, tuning(connections=2, piece_size=mib), journal=journal)
    job.start()

    def marks() -> list[Block]:
        state = journal.states.get("m1")
        return [b for b in state.blocks.values() if b.length] if state else []

    await wait_until(lambda: len(marks()) == 2 and all((b.length or 0) >= 100_000 for b in marks()))
    job.cancel()
    with pytest.raises(DownloadError, match="cancelled"):
        await job.wait()
    blocks = journal.states["m1"].blocks
    whole = sum(min(SIZE, (i + 1) * mib) - i * mib for i, b in blocks.items() if not b.length)
    marked = [i for i, b in blocks.items() if b.length]
    assert marked
    ms[0].faults.status = 404
    moved = DownloadTarget("m1", [ms[0].url, ms[1].url], SIZE, target.sha256)
    job = memory_job(moved, short_tmp, tuning(piece_size=mib), journal=journal)
    job.start()
    await job.wait()
    assert installed_bytes(job) == data
    assert job.resumed == whole
    starts = {r["Range"].removeprefix("bytes=").partition("-")[0] for r in ms[1].requests}
    assert {str(i * mib) for i in marked} <= starts


async def test_changed_file_on_mirror_discards_its_blocks(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A mirror whose strong ETag changed since the journal: its journaled blocks are re-fetched."""
    ms, target, journal = await cancelled_pull(short_tmp, data, stop_later, SIZE // 4)
    ms[0].faults = Faults(etag='"changed"')
    job2 = memory_job(target, short_tmp, tuning(), journal=journal)
    job2.start()
    await job2.wait()
    assert job2.resumed == 0
    assert installed_bytes(job2) == data
    assert job2.from_zero is not None and "journaled blocks still holds" in job2.from_zero
    assert job2.snapshot()["from_zero"] == job2.from_zero


async def test_a_partial_without_its_journal_says_it_starts_from_byte_0(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """A partial whose journal is gone cannot be checked: the pull starts from byte 0 and its
    progress says why."""
    ms, target, journal = await cancelled_pull(short_tmp, data, stop_later, SIZE // 4)
    ms[0].faults.throttle = None
    await journal.clear("m1")
    job = memory_job(target, short_tmp, tuning(), journal=journal)
    job.start()
    await job.wait()
    assert job.from_zero == "the partial on disk has no journal: its blocks cannot be checked"
    assert job.snapshot()["from_zero"] == job.from_zero and job.resumed == 0
    assert installed_bytes(job) == data


async def test_disk_full_stops_at_once(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """ENOSPC from the writer stops the pull at once with DiskFull; the partial is kept."""
    ms = await start_mirrors(data)
    calls = 0

    def full_after_some(fd: int, buf: memoryview, offset: int) -> int:
        nonlocal calls
        calls += 1
        if calls > 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.pwrite(fd, buf, offset)

    with pytest.raises(DiskFull, match="disk full"):
        await run_pull(short_tmp, ms, stop_later, sha=None, writer=full_after_some)
    assert (short_tmp / "partial" / "m1.partial").exists()
    assert ms[0].sent < SIZE


async def test_free_space_within_the_reserve_says_the_reserve(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free space over the file's size but under it plus the 64 MiB modeld keeps free: the
    refusal names the reserve (it said "needs N bytes but only M are free", with M > N)."""
    ms = await start_mirrors(data)
    free = SIZE + (1 << 20)
    usage = shutil._ntuple_diskusage(1 << 40, (1 << 40) - free, free)
    monkeypatch.setattr("modeld.download.job.shutil.disk_usage", lambda _path: usage)
    with pytest.raises(DiskFull) as got:
        await run_pull(short_tmp, ms, stop_later, sha=None)
    message = got.value.message
    assert "3.0 MiB more" in message and "keeps 64.0 MiB free" in message, message
    assert "only 4.0 MiB is free" in message and "modeld prune" in message
    assert ms[0].requests == []


async def test_not_enough_free_space_is_refused_before_the_first_byte(
    short_tmp: Path, data: bytes, stop_later: list[Mirror]
) -> None:
    """An entry larger than the free space fails before any request for data."""
    ms = await start_mirrors(data)
    with pytest.raises(DiskFull, match="free"):
        await run_pull(short_tmp, ms, stop_later, sha=None, size=1 << 60)
    assert ms[0].requests == []


BIG = 16 * 1024 * 1024 + 4321  # 17 blocks of 1 MiB, the last one short


@pytest.fixture(scope="module")
def big() -> bytes:
    return random.Random(11).randbytes(BIG)


async def endgame_pull(
    home: Path, big: bytes, stop_later: list[Mirror], primary: Faults
) -> tuple[list[Mirror], DownloadJob, Fetcher]:
    """Pull ``big`` from a primary with ``primary`` faults and a fast second mirror.

    4 MiB pieces and a 60 s stall timeout, so only the endgame can rescue a slow piece.
    """
    ms = await start_mirrors(big, primary, Faults())
    job = await run_pull(
        home,
        ms,
        stop_later,
        sha=hashlib.sha256(big).hexdigest(),
        size=BIG,
        tuning=tuning(connections=4, piece_size=4 * 1024 * 1024, stall_timeout=60.0),
    )
    assert installed_bytes(job) == big
    assert job.fetcher is not None
    return ms, job, job.fetcher


async def test_endgame_takes_over_a_throttled_mirrors_piece(
    short_tmp: Path, big: bytes, stop_later: list[Mirror]
) -> None:
    """A hard-throttled primary's in-flight block is taken over by the fast mirror at the end."""
    # 64 KB/s: the primary's first block alone would take 16 s; the fast mirror does the rest.
    ms, job, f = await endgame_pull(short_tmp, big, stop_later, Faults(throttle=64_000))
    slow, fast = job.mirrors
    # The slow mirror was given work (its probe block), not just left out ...
    assert [r["Range"] for r in ms[0].requests if r.get("Range") != "bytes=0-0"]
    # ... and that work was taken over: every block came from the fast mirror, the slow one
    # sent less than one block, and its connection was closed without a strike against it.
    assert f.takeovers >= 1
    assert set(f.sources.values()) == {fast.label}
    assert ms[0].sent < 1024 * 1024
    assert slow.strikes == 0 and slow.reason is None


async def test_endgame_splits_pieces_of_a_mirror_that_stalls(
    short_tmp: Path, big: bytes, stop_later: list[Mirror]
) -> None:
    """Pieces in flight on a mirror that goes silent are split/taken over, not waited for."""
    # Both mirrors are fast until the primary stops sending after 5 MiB (mid-piece); the
    # stall timeout (60 s) is far away, so only the endgame can finish those pieces.
    faults = Faults(stall_after=5 * 1024 * 1024 + 100_000)
    _, job, f = await endgame_pull(short_tmp, big, stop_later, faults)
    stalled, fast = job.mirrors
    served = list(f.sources.values())
    # The stalled mirror served at most what it sent before going silent, the rest came
    # from the other one, and no request of the stalled mirror ran into the stall timeout.
    assert served.count(stalled.label) <= 5
    assert served.count(fast.label) >= len(served) - 5
    assert f.splits + f.takeovers >= 1
    assert stalled.reason is None and stalled.strikes == 0


async def fast_and_slow_pull(
    home: Path, big: bytes, stop_later: list[Mirror], slow: Faults, piece_size: int
) -> tuple[list[Mirror], Fetcher, mirrors_mod.Mirror, list[int]]:
    """Pull ``big`` from a fast primary and a mirror with ``slow`` faults: the mirrors, the
    fetcher, the slow mirror's state and the blocks it served."""
    ms = await start_mirrors(big, Faults(), slow)
    job = await run_pull(
        home,
        ms,
        stop_later,
        sha=hashlib.sha256(big).hexdigest(),
        size=BIG,
        tuning=tuning(connections=4, piece_size=piece_size, stall_timeout=60.0),
    )
    assert installed_bytes(job) == big
    f = job.fetcher
    assert f is not None
    second = job.mirrors[1]
    return ms, f, second, [i for i, label in f.sources.items() if label == second.label]


async def test_a_throttled_mirror_never_holds_the_hash_front(
    short_tmp: Path, big: bytes, stop_later: list[Mirror]
) -> None:
    """A fast primary and a throttled mirror: the throttled one's blocks lie at the file's end,
    and the last block releases little to the hasher (the hash tail is bounded)."""
    throttled = Faults(throttle=2_000_000)
    ms, f, _, slow_blocks = await fast_and_slow_pull(
        short_tmp, big, stop_later, throttled, 2 * 1024 * 1024
    )
    assert f.hasher is not None
    # The throttled mirror was asked for work (its probe), but only ever got the back.
    assert [r["Range"] for r in ms[1].requests if r.get("Range") != "bytes=0-0"]
    assert all(i >= f.nblocks * 3 // 4 for i in slow_blocks), slow_blocks
    # At most a quarter of the file was left for the hasher when the last block landed.
    assert f.late_bytes <= BIG // 4
    assert f.hasher.tail_bytes <= BIG
    assert f.prefix_blocks == f.nblocks


async def test_a_mirror_that_bursts_then_crawls_is_measured_on_its_probe_piece(
    short_tmp: Path, big: bytes, stop_later: list[Mirror]
) -> None:
    """A mirror that sends each answer's first block at once (as socket buffers do) and then
    2 MB/s: its probe piece of several blocks measures it as slow, so it never gets the file's
    front; on one block it had looked as fast as the fast mirror."""
    bursty = Faults(throttle=2_000_000, burst=1024 * 1024)
    _, f, slow, slow_blocks = await fast_and_slow_pull(
        short_tmp, big, stop_later, bursty, 4 * 1024 * 1024
    )
    # Measured as slow, or never measured (its probe piece cut short by the endgame).
    assert slow.conn_rate is None or slow.conn_rate < 10e6, slow.conn_rate
    assert all(i >= f.nblocks // 2 for i in slow_blocks), slow_blocks


@pytest.mark.parametrize("capped", [False, True], ids=["throttled-mirror", "limit-rate"])
async def test_each_mirrors_progress_counts_bytes_as_they_arrive(
    short_tmp: Path, data: bytes, stop_later: list[Mirror], capped: bool
) -> None:
    """A slow pull of a file under one probe piece: each progress record's mirror, and the
    job's own speed, show the bytes received so far and a speed above 0 while they flow, not
    only once its piece (or block) ends."""
    small = data[: 300 * 1024]
    ms = await start_mirrors(small, Faults() if capped else Faults(throttle=150_000))
    stop_later.extend(ms)
    target = DownloadTarget("m1", [ms[0].url], len(small), hashlib.sha256(small).hexdigest())
    job = memory_job(target, short_tmp, tuning(piece_size=4 * 1024 * 1024))
    if capped:
        job.limit_rate(150_000)
    job.start()
    seen: list[dict[str, Any]] = []

    def flowing() -> bool:
        record = job.snapshot()
        seen.append(record)
        mirror = record["mirrors"][0] if record["mirrors"] else {"received": 0, "speed": 0}
        flows = 0 < mirror["received"] < len(small) and mirror["speed"] > 0
        # What a progress bar shows moves too, while no block is complete.
        shown = 0 < record["arrived"] < len(small) and record["completed"] == 0
        return flows and shown and record["speed"] > 0 and record["eta"] is not None

    await wait_until(flowing)
    assert seen[-1]["mirrors"][0]["received"] <= seen[-1]["received"]
    await job.wait()
    assert job.snapshot()["arrived"] == len(small)
    assert job.snapshot()["mirrors"][0]["received"] == job.snapshot()["received"]


def test_a_near_best_slower_mirror_takes_the_queues_back() -> None:
    """Scheduler unit: the best mirror takes the queue's front, a near-best slower one its back,
    and a piece at the hash front on a far slower mirror is moved to the best one."""
    from modeld.download.mirrors import Mirror as MirrorState
    from modeld.download.schedule import Piece, Schedule

    mb = 1024 * 1024
    fast = MirrorState(
        URL("http://127.0.0.1:1/f"), primary=True, state=mirrors_mod.MirrorState.OK, conn_rate=100e6
    )
    slower = MirrorState(
        URL("http://127.0.0.1:2/s"), state=mirrors_mod.MirrorState.OK, conn_rate=60e6
    )
    fast.speed = slower.speed = 1e6
    s = Schedule(
        size=64 * mb, block_size=mb, piece_size=4 * mb, mirrors=[fast, slower], done=bytearray(64)
    )
    s._plan()
    fast.active = 2  # the fast mirror already has connections: the slower one is due one
    m, p = s._next_piece() or (None, None)
    assert m is slower and p is not None and p.end == 64 * mb and p.start >= 60 * mb
    slower.active = 2  # (a worker counts its connection when it starts the piece)
    m, p = s._next_piece() or (None, None)
    assert m is fast and p is not None and p.start == 0
    # The hash front's piece at 20 MB/s: it keeps its current block, the rest moves.
    now = time.monotonic()
    held = Piece(4 * mb, 8 * mb, 4 * mb + 1000, mirror=slower, began=now - 1.0, got=20_000_000)
    s.prefix_blocks = 4
    s.inflight.add(held)
    moved = s._free_front(fast, 100e6)
    assert moved is not None and moved[0] is fast and moved[1].start == 5 * mb
    assert held.end == 5 * mb and not held.abandoned and s.front_moves == 1
    # At 64 KB/s even its current block would keep the hasher waiting: the piece moves whole.
    held.got = 64_000
    moved = s._free_front(fast, 100e6)
    assert (
        moved is not None
        and moved[0] is fast
        and (moved[1].start, moved[1].end) == (4 * mb, 5 * mb)
    )
    assert held.abandoned and s.takeovers == 1 and s.front_moves == 2


def test_the_queue_tapers_and_a_healthy_piece_is_not_split_with_its_own_mirror() -> None:
    """Scheduler unit, one mirror: once the queue holds less than two pieces per connection,
    the front piece is half an even share of it per connection; in the endgame a piece whose
    connection runs at its mirror's rate is left alone (a split would close a connection
    with full socket buffers), and one held up for seconds at a tenth of it is split."""
    from modeld.download.schedule import Piece, Schedule

    mb = 1024 * 1024
    one = mirrors_mod.Mirror(
        URL("http://127.0.0.1:1/f"), primary=True, state=mirrors_mod.MirrorState.OK, conn_rate=50e6
    )
    s = Schedule(
        size=64 * mb,
        block_size=mb,
        piece_size=16 * mb,
        mirrors=[one],
        done=bytearray(64),
        connections=8,
    )
    s._plan()
    sizes = []
    while s.queue:
        share = -(-sum(p.end - p.pos for p in s.queue) // (2 * 8 * mb))
        picked = s._next_piece()
        assert picked is not None and picked[0] is one
        sizes.append((picked[1].end - picked[1].pos) // mb)
        # Half an even share per connection of what is left (or up to half that more,
        # rather than leave a sliver of a block or two behind).
        assert sizes[-1] <= 1.5 * share, (sizes, share)
    # The first piece is one stagger step (16 / 8 blocks), below the taper's share of 4.
    assert sizes[0] == 2 and sizes[-1] <= 2 and sum(sizes) == 64, sizes
    now = time.monotonic()
    healthy = Piece(0, 8 * mb, 2 * mb, mirror=one, began=now - 2.0, got=2 * mb)
    healthy.last = now
    s.inflight = {healthy}
    one.conn_rate = 1.5e6  # what its pieces measured (``_rate`` takes the lower)
    assert s._steal() is None and healthy.end == 8 * mb and s.splits == 0
    # Beside a piece at 1 MB/s, one at 100 KB/s for two seconds: a fresh connection takes
    # the second half of the slow one.
    fast = Piece(8 * mb, 16 * mb, 10 * mb, mirror=one, began=now - 2.0, got=2 * mb)
    held = Piece(0, 8 * mb, 2 * mb, mirror=one, began=now - 2.0, got=200_000)
    fast.last = held.last = now
    s.inflight = {fast, held}
    one.conn_rate = 50e6
    stolen = s._steal()
    assert stolen is not None and stolen[0] is one and s.splits == 1
    assert held.end == stolen[1].pos < 8 * mb and fast.end == 16 * mb


def test_front_pieces_are_staggered_and_a_lagging_front_hands_on_its_rest() -> None:
    """Scheduler unit, one mirror, 8 connections: pieces taken off the front at once are cut
    to end one after another in file order (2, 4, ... 16 blocks at one rate), and from then
    on a piece taken a step after the last one is whole. The piece at the hash front whose
    connection has run at a tenth of the mirror's rate hands its rest (past its current
    block) to a fresh connection; a healthy one, or one judged too soon, keeps it."""
    from modeld.download.schedule import LAG, Piece, Schedule

    mb = 1024 * 1024
    one = mirrors_mod.Mirror(
        URL("http://127.0.0.1:1/f"), primary=True, state=mirrors_mod.MirrorState.OK, conn_rate=50e6
    )
    s = Schedule(
        size=512 * mb,
        block_size=mb,
        piece_size=16 * mb,
        mirrors=[one],
        done=bytearray(512),
        connections=8,
    )
    s._plan()
    burst = []
    for _ in range(8):
        picked = s._next_piece()
        assert picked is not None and picked[0] is one
        burst.append(picked[1])
    assert [(p.end - p.pos) // mb for p in burst] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [p.start for p in burst] == sorted(p.start for p in burst)
    # A step later the first one is done and the last one has two blocks behind it.
    burst[0].pos = burst[0].end
    burst[-1].pos += 2 * mb
    picked = s._next_piece()
    assert picked is not None and picked[1].end - picked[1].pos == 16 * mb
    # The hash front's piece, on the best (only) mirror, at 5 MB/s for a second.
    now = time.monotonic()
    front = burst[1]
    front.mirror = one  # (the worker sets it when it starts the piece)
    front.pos, front.began, front.got, front.last = front.start + mb // 2, now - 1.0, 5 * mb, now
    s.inflight = {front}
    s.prefix_blocks = front.start // mb
    end = front.end
    moved = s._free_front(one, 50e6)
    assert moved is not None and moved[0] is one
    assert (moved[1].start, moved[1].end) == (front.start + mb, end)
    assert front.end == front.start + mb and s.front_moves == 1
    # Healthy (at the mirror's rate), or slow but younger than LAG: left alone.
    healthy = Piece(8 * mb, 24 * mb, 9 * mb, mirror=one, began=now - 1.0, got=50_000_000)
    healthy.last = now
    young = Piece(8 * mb, 24 * mb, 9 * mb, mirror=one, began=now - LAG / 2, got=100_000)
    young.last = now
    for p in (healthy, young):
        s.inflight, s.prefix_blocks = {p}, 9
        assert s._free_front(one, 50e6) is None and p.end == 24 * mb


def test_block_crc_matches_zlib() -> None:
    """The fetcher's CRC-32 (ISA-L when installed) gives zlib's values, chained over slices,
    so journals written by either resume with the other's check."""
    import zlib

    from modeld.download import fetch

    data = memoryview(random.Random(7).randbytes(3 * 1024 * 1024 + 17))
    crc = 0
    for i in range(0, len(data), 131072 + 5):
        crc = fetch.crc32(data[i : i + 131072 + 5], crc)
    assert crc == zlib.crc32(data)
    assert fetch.crc32(b"") == 0


def test_pieces_on_a_silent_mirror_are_moved_when_no_connection_is_free() -> None:
    """The queue is empty and every connection sits on a piece of a mirror gone silent: the
    endgame runs only on a free connection, so the rescue gives their rest back to the
    queue, for the other mirror, long before the stall timeout (a pull waited the whole
    60 s for the last four pieces). With a connection free, it leaves them to the endgame."""
    bs = 1024 * 1024
    silent = mirrors_mod.Mirror(
        URL("http://127.0.0.1:1/f"), primary=True, state=mirrors_mod.MirrorState.OK
    )
    fast = mirrors_mod.Mirror(URL("http://127.0.0.1:2/f"), state=mirrors_mod.MirrorState.OK)
    silent.conn_rate, fast.conn_rate = 30e6, 20e6
    schedule = Schedule(
        size=4 * bs,
        block_size=bs,
        piece_size=bs,
        mirrors=[silent, fast],
        done=bytearray([1, 1, 0, 0]),
        connections=2,
    )
    was = time.monotonic() - 3  # silent for 3 s
    pieces = [
        Piece(i * bs, (i + 1) * bs, i * bs, mirror=silent, began=was, last=was) for i in (2, 3)
    ]
    schedule.inflight.add(pieces[0])
    schedule._rescue()  # one connection is free: the endgame's work
    assert not schedule.queue and not pieces[0].abandoned
    schedule.inflight.add(pieces[1])
    schedule._rescue()  # none is free
    assert all(p.abandoned for p in pieces) and not schedule.inflight
    # In file order: the piece holding the hash front first.
    assert [(p.pos, p.end) for p in schedule.queue] == [(2 * bs, 3 * bs), (3 * bs, 4 * bs)]
    assert silent.conn_rate == 1.0 and silent.strikes == 0
    mirror, piece = schedule._next_piece() or (None, None)
    assert mirror is fast and piece is not None and piece.pos == 2 * bs
