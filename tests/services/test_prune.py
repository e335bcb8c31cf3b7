"""``modeld.services.prune`` planning (pure) and ``modeld.services.remover`` carrying plans out
on a real store.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from modeld.config import load_settings
from modeld.download.journal import Block, JournalState, SqliteJournal
from modeld.metrics import Metrics
from modeld.services import prune
from modeld.services.prune import (
    DEFAULT_SELECTION,
    Activity,
    FileInfo,
    Inventory,
    Row,
    Selection,
    partial_model_id,
    plan_prune,
)
from modeld.services.remover import Remover
from modeld.store.store import Store

NOW = 1_000_000.0
DAY = 86400.0
D1, D2, D3, D4 = (c * 64 for c in "1234")


def _f(path: str, size: int, age: float = 10 * DAY) -> FileInfo:
    return FileInfo(Path(path), size, NOW - age, NOW - age)


def _row(
    mid: str, digest: str, size: int, used_days_ago: float | None, installed_days_ago: float = 100
) -> Row:
    used = None if used_days_ago is None else NOW - used_days_ago * DAY
    return Row(mid, digest, size, NOW - installed_days_ago * DAY, used)


def _inv(**kw: Any) -> Inventory:
    inv = Inventory(now=NOW, **kw)
    return inv


def _kinds(items: list[Any]) -> list[tuple[str, str | None]]:
    return [(i.kind, i.id or i.path) for i in items]


def test_partial_model_id_only_for_downloader_names() -> None:
    """Only ``<valid id>.partial`` names map to a model (and so to journal rows)."""
    assert partial_model_id("tiny.partial") == "tiny"
    assert partial_model_id("fixture-tiny") is None
    assert partial_model_id("..partial") is None
    assert partial_model_id("a b.partial") is None


def test_default_selection_never_touches_installed_models() -> None:
    """With no flags: partials and orphans go; installed models, however old, stay."""
    inv = _inv(
        rows=[_row("old", D1, 100, 400)],
        blobs={D1: _f(f"/b/sha256-{D1}", 100), D2: _f(f"/b/sha256-{D2}", 50)},
        partials=[_f("/p/x.partial", 7)],
    )
    plan = plan_prune(inv, DEFAULT_SELECTION, Activity(), pid=1)
    assert _kinds(plan.items) == [("partial", "x"), ("orphan_blob", f"/b/sha256-{D2}")]
    assert plan.total == 57
    assert plan.installed_after == plan.installed_bytes == 100


def test_partials_of_running_downloads_and_own_imports_are_kept() -> None:
    """A download's partial and rows stay; an import of this daemon stays, a dead one's goes."""
    inv = _inv(
        partials=[
            _f("/p/busy.partial", 10),
            _f("/p/idle.partial", 20),
            _f("/p/m.import-42-17", 30),
            _f("/p/m.import-7-17", 40),
        ],
        journal_keys={"busy", "idle", "stale"},
    )
    act = Activity(downloading=frozenset({"busy"}))
    plan = plan_prune(inv, Selection(partials=True), act, pid=42)
    assert _kinds(plan.items) == [
        ("partial", "idle"),
        ("partial", "/p/m.import-7-17"),
        ("journal", "stale"),
    ]
    assert "journal rows go with it" in plan.items[0].reason
    assert {(i.path, i.reason) for i in plan.kept} == {
        ("/p/busy.partial", "downloading"),
        ("/p/m.import-42-17", "an import in progress"),
    }


def test_partials_age_filter() -> None:
    """``partials_age`` keeps partials written more recently than the age."""
    inv = _inv(partials=[_f("/p/new.partial", 1, age=DAY), _f("/p/old.partial", 2, age=9 * DAY)])
    plan = plan_prune(inv, Selection(partials=True, partials_age=7 * DAY), Activity(), pid=1)
    assert _kinds(plan.items) == [("partial", "old")]


def test_orphans_rules() -> None:
    """Unused blobs, *.FAILED and stale caches go; loaded or just-placed blobs stay.

    The cache of a row whose blob is missing (D4) stays: the file may come back.
    """
    inv = _inv(
        rows=[_row("a", D1, 100, 1), _row("gone", D4, 5, 1)],
        blobs={
            D1: _f(f"/b/sha256-{D1}", 100),
            D2: _f(f"/b/sha256-{D2}", 200),
            D3: _f(f"/b/sha256-{D3}", 300, age=5),
        },
        quarantined=[_f(f"/b/sha256-{D1}.FAILED", 9)],
        caches={
            D1: _f(f"/c/{D1}", 1),
            D2: _f(f"/c/{D2}", 2),
            D4: _f(f"/c/{D4}", 4),
            "junk": _f("/c/junk", 8),
        },
    )
    plan = plan_prune(inv, Selection(orphans=True), Activity(), orphan_grace=60, pid=1)
    assert _kinds(plan.items) == [
        ("quarantined", f"/b/sha256-{D1}.FAILED"),
        ("orphan_blob", f"/b/sha256-{D2}"),
        ("orphan_cache", f"/c/{D2}"),
        ("orphan_cache", "/c/junk"),
    ]
    assert [(i.digest, i.reason) for i in plan.kept] == [
        (D3, "just placed; may be an install in progress")
    ]
    loaded = plan_prune(
        inv, Selection(orphans=True), Activity(loaded_digests=frozenset({D2})), pid=1
    )
    assert ("orphan_blob", f"/b/sha256-{D2}") not in _kinds(loaded.items)
    assert ("orphan_cache", f"/c/{D2}") not in _kinds(loaded.items)
    assert any(i.digest == D2 and i.reason == "loaded" for i in loaded.kept)


def test_unused_for_uses_last_used_else_installed_at_and_skips_busy() -> None:
    """Models idle longer than D go, never-used ones by install time; busy ones are kept."""
    inv = _inv(
        rows=[
            _row("recent", D1, 1, 1),
            _row("stale", D2, 2, 40),
            _row("never", D3, 3, None, installed_days_ago=50),
            _row("pinned", D4, 4, 90),
        ],
        blobs={d: _f(f"/b/sha256-{d}", n) for d, n in ((D1, 1), (D2, 2), (D3, 3), (D4, 4))},
    )
    act = Activity(loaded=frozenset({"pinned"}), pinned=frozenset({"pinned"}))
    plan = plan_prune(inv, Selection(unused_for=30 * DAY), act, pid=1)
    assert _kinds(plan.items) == [("model", "never"), ("model", "stale")]
    assert plan.items[0].reason.startswith("installed, never used,")
    assert [(i.id, i.reason) for i in plan.kept] == [("pinned", "pinned")]
    assert plan.installed_after == 1 + 4


def test_to_budget_removes_least_recently_used_until_under() -> None:
    """LRU models go until the bytes fit; busy ones are skipped; a shared blob counts once."""
    inv = _inv(
        rows=[
            _row("a", D1, 100, 50),
            _row("a-alias", D1, 100, 1),
            _row("b", D2, 100, 40),
            _row("c", D3, 100, 30),
            _row("d", D4, 100, 1),
        ],
        blobs={d: _f(f"/b/sha256-{d}", 100) for d in (D1, D2, D3, D4)},
        caches={D2: _f(f"/c/{D2}", 5)},
        disk_budget=250,
    )
    act = Activity(loaded=frozenset({"b"}), loaded_digests=frozenset({D2}))
    plan = plan_prune(inv, Selection(to_budget=True), act, pid=1)
    # "a" frees nothing while "a-alias" keeps its blob; "b" is loaded; "c" and then
    # "a-alias" go, and the shared blob is counted once (on "a").
    assert [(i.id, i.size) for i in plan.items] == [("a", 100), ("c", 100), ("a-alias", 0)]
    assert [(i.id, i.reason) for i in plan.kept] == [("b", "loaded")]
    assert plan.installed_bytes == 400
    assert plan.installed_after == 200
    assert plan_prune(inv, Selection(to_budget=True), Activity(), pid=1).installed_after == 200


ids = st.sampled_from(["a", "b", "c", "d", "e"])
digests = st.sampled_from([D1, D2, D3, D4])


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.builds(_row, ids, digests, st.integers(1, 100), st.none() | st.floats(0, 100)),
        unique_by=lambda r: r.id,
    ),
    blobs=st.sets(digests),
    partials=st.sets(ids),
    keys=st.sets(ids),
    loaded=st.sets(ids),
    loaded_digests=st.sets(digests),
    pinned=st.sets(ids),
    downloading=st.sets(ids),
    budget=st.integers(0, 300),
    flags=st.tuples(st.booleans(), st.booleans(), st.none() | st.floats(0, 100), st.booleans()),
)
def test_plan_never_removes_what_is_in_use(
    rows: list[Row],
    blobs: set[str],
    partials: set[str],
    keys: set[str],
    loaded: set[str],
    loaded_digests: set[str],
    pinned: set[str],
    downloading: set[str],
    budget: int,
    flags: tuple[bool, bool, float | None, bool],
) -> None:
    """For any state, no planned item is loaded, pinned or downloading, and kept ∩ planned = ∅."""
    inv = _inv(
        rows=rows,
        blobs={d: _f(f"/b/sha256-{d}", 100) for d in blobs},
        partials=[_f(f"/p/{m}.partial", 1) for m in sorted(partials)],
        journal_keys=keys,
        caches={d: _f(f"/c/{d}", 1) for d in (D1, D2, D3, D4)},
        disk_budget=budget,
    )
    act = Activity(
        frozenset(loaded), frozenset(loaded_digests), frozenset(pinned), frozenset(downloading)
    )
    sel = Selection(flags[0], 0.0, flags[1], None if flags[2] is None else flags[2] * DAY, flags[3])
    plan = plan_prune(inv, sel, act, pid=1)
    for item in plan.items:
        if item.kind == "model":
            assert item.id not in loaded | pinned | downloading
            assert item.digest not in loaded_digests
            assert sel.unused_for is not None or sel.to_budget
        elif item.kind in ("partial", "journal"):
            assert item.id not in downloading
        else:
            assert item.digest not in loaded_digests
            assert item.digest not in {r.digest for r in rows}
    assert not {(i.kind, i.path, i.id) for i in plan.items} & {
        (i.kind, i.path, i.id) for i in plan.kept
    }
    if sel.to_budget and plan.installed_after > budget:
        # Over budget after the plan only when every model left is in use.
        left = {r.id for r in rows} - {i.id for i in plan.items if i.kind == "model"}
        assert all(act.model_busy(m, next(r.digest for r in rows if r.id == m)) for m in left)


# --- the remover on a real store (no daemon) ----------------------------------------------


async def _open(home: Path, **extra: Any) -> tuple[Store, Remover]:
    settings = load_settings(home=home, socket=home / "modeld.sock", **extra)
    store = Store(home)
    await store.open()
    return store, Remover(settings, Metrics(), store)


async def _install(store: Store, home: Path, model_id: str, data: bytes) -> Any:
    import hashlib

    src = home / "partial" / f"staging-{model_id}"
    src.write_bytes(data)
    return await store.install(model_id, src, hashlib.sha256(data).hexdigest(), len(data), None)


async def test_prune_removes_partial_with_its_journal_rows(short_tmp: Path) -> None:
    """A partial and its journal rows go together; the download would restart from zero."""
    store, remover = await _open(short_tmp)
    try:
        journal = SqliteJournal(store)
        await journal.begin("m", JournalState(8, 4, None, {}, {0: Block(0, 1, "h")}))
        (short_tmp / "partial" / "m.partial").write_bytes(b"12345678")
        doc = await remover.prune(Selection(partials=True), dry_run=True)
        assert [(i["kind"], i["id"], i["size"]) for i in doc["items"]] == [("partial", "m", 8)]
        assert (short_tmp / "partial" / "m.partial").exists()
        doc = await remover.prune(Selection(partials=True), dry_run=False)
        assert doc["freed"] == 8
        assert not (short_tmp / "partial" / "m.partial").exists()
        assert await journal.load("m") is None
    finally:
        await store.close()


async def test_rm_and_prune_count_what_a_sparse_partial_holds(short_tmp: Path) -> None:
    """A partial is sparse at the entry's full size until it is filled: ``prune`` and ``rm``
    report the bytes it holds on disk, not its apparent size."""
    mib = 1024 * 1024
    store, remover = await _open(short_tmp)
    try:
        for model in ("a", "b"):
            with (short_tmp / "partial" / f"{model}.partial").open("wb") as f:
                f.truncate(40 * mib)
                f.write(os.urandom(2 * mib))
                f.flush()
                os.fsync(f.fileno())
        held = (short_tmp / "partial" / "a.partial").stat().st_blocks * 512
        assert 2 * mib <= held < 40 * mib
        doc = await remover.prune(Selection(partials=True), dry_run=True)
        assert [(i["id"], i["size"]) for i in doc["items"]] == [("a", held), ("b", held)]
        doc = await remover.remove_model("a", force=False)
        assert doc["freed"] == held
        doc = await remover.prune(Selection(partials=True), dry_run=False)
        assert doc["freed"] == held
        assert not list((short_tmp / "partial").glob("*.partial"))
    finally:
        await store.close()


async def test_orphan_left_by_a_crash_is_found_by_the_next_prune(
    short_tmp: Path, monkeypatch: Any
) -> None:
    """Row deleted, file not (a crash in between): the next ``prune --orphans`` frees the file."""
    monkeypatch.setattr(prune, "ORPHAN_GRACE", 0.0)
    store, remover = await _open(short_tmp)
    try:
        inst = await _install(store, short_tmp, "m", b"x" * 1000)
        (short_tmp / "cache" / inst.digest).mkdir()
        (short_tmp / "cache" / inst.digest / "k").write_bytes(b"c" * 10)
        await store.write(lambda c: c.execute("DELETE FROM installed WHERE id = 'm'"))
        doc = await remover.prune(Selection(orphans=True), dry_run=False)
        assert {(i["kind"], i["size"]) for i in doc["items"]} == {
            ("orphan_blob", 1000),
            ("orphan_cache", 10),
        }
        assert not inst.path.exists()
        assert not (short_tmp / "cache" / inst.digest).exists()
        assert store.last_scan is not None and store.last_scan.problems() == []
    finally:
        await store.close()


async def test_fresh_orphan_blob_is_kept_for_the_grace(short_tmp: Path) -> None:
    """A blob renamed into blobs/ a moment ago (an install before its row) is never removed."""
    store, remover = await _open(short_tmp)
    try:
        blob = short_tmp / "blobs" / f"sha256-{D1}"
        blob.write_bytes(b"y" * 10)
        doc = await remover.prune(Selection(orphans=True), dry_run=False)
        assert doc["items"] == []
        assert [k["reason"] for k in doc["kept"]] == ["just placed; may be an install in progress"]
        assert blob.exists()
    finally:
        await store.close()


async def test_unused_models_removed_row_then_file(short_tmp: Path) -> None:
    """``unused_for`` removes old models' rows and blobs; a model used recently stays."""
    store, remover = await _open(short_tmp)
    try:
        old = await _install(store, short_tmp, "old", b"o" * 300)
        new = await _install(store, short_tmp, "new", b"n" * 200)
        await store.touch("new")
        past = time.time() - 10 * DAY
        await store.write(
            lambda c: c.execute("UPDATE installed SET installed_at = ? WHERE id = 'old'", (past,))
        )
        doc = await remover.prune(Selection(unused_for=7 * DAY), dry_run=False)
        assert [(i["id"], i["size"]) for i in doc["items"]] == [("old", 300)]
        assert await store.installed("old") is None
        assert not old.path.exists()
        assert new.path.exists()
        events = [e["kind"] for e in await store.events()]
        assert "removed" in events
    finally:
        await store.close()


async def test_to_budget_without_a_budget_is_refused(short_tmp: Path) -> None:
    """``to_budget`` with no ``MODELD_DISK_BUDGET`` is a 422 that names the setting."""
    from modeld.errors import Refused

    store, remover = await _open(short_tmp)
    try:
        try:
            await remover.prune(Selection(to_budget=True), dry_run=True)
        except Refused as e:
            assert "MODELD_DISK_BUDGET" in e.message
        else:
            raise AssertionError("no error")
    finally:
        await store.close()


async def test_to_budget_trims_lru(short_tmp: Path) -> None:
    """With a 250 KiB budget, the least recently used of three 100 KiB models goes."""
    store, remover = await _open(short_tmp, disk_budget="250KiB")
    try:
        for i, m in enumerate(("first", "second", "third")):
            await _install(store, short_tmp, m, bytes([i]) * 102400)
        await store.touch("second")
        await store.touch("third")
        doc = await remover.prune(Selection(to_budget=True), dry_run=False)
        assert [i["id"] for i in doc["items"]] == ["first"]
        assert doc["installed_after"] == 204800
        assert sorted(i.model_id for i in await store.list_installed()) == ["second", "third"]
        assert os.listdir(short_tmp / "blobs").__len__() == 2
    finally:
        await store.close()
