"""Tests for modeld.catalog.catalog: strict entries, merging dirs, bad files reported, live
reload.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from modeld.catalog.catalog import (
    Catalog,
    Change,
    Entry,
    bundled_registry_dir,
    load_file,
    nearest_ids,
    outdated,
)
from modeld.errors import ModelNotFound
from tests.support.state import write_entry
from tests.support.wait import wait_until

GOOD = """
id = "m1"
display_name = "Model one"
file_name = "m1.litertlm"
urls = ["https://example.org/m1.litertlm", "http://127.0.0.1:9/m1.litertlm"]
size = 1234
sha256 = "{sha}"
min_runtime_version = "0.18.1"
variants = ["m1-int4", "m1.small"]

[limits]
max_tokens = 4096
vision_max_tokens = 3072
max_images = 1
speculative_decoding = false

[backends]
main = "gpu"
vision = "cpu"

[runtime]
threads = 4
warm_up = false
""".replace("{sha}", "a" * 64)

# The real files: repository, pinned revision, file name and size (sources in registry/).
REAL = {
    "gemma-4-E2B-it": (
        "litert-community/gemma-4-E2B-it-litert-lm",
        "6e5c4f1e395deb959c494953478fa5cec4b8008f",
        "gemma-4-E2B-it.litertlm",
        2_588_147_712,
        "181938105e0eefd105961417e8da75903eacda102c4fce9ce90f50b97139a63c",
    ),
    "gemma-4-E4B-it": (
        "litert-community/gemma-4-E4B-it-litert-lm",
        "28299f30ee4d43294517a4ac93abd6163412f07f",
        "gemma-4-E4B-it.litertlm",
        3_659_530_240,
        "0b2a8980ce155fd97673d8e820b4d29d9c7d99b8fa6806f425d969b145bd52e0",
    ),
    "gemma-3n-E2B-it": (
        "google/gemma-3n-E2B-it-litert-lm",
        "ba9ca88da013b537b6ed38108be609b8db1c3a16",
        "gemma-3n-E2B-it-int4.litertlm",
        3_655_827_456,
        "2ed7bc3a0026c93d5b8a4544b352d9d00cd66ff0bac3ef6a20ac3d2cba4010d6",
    ),
    "gemma-3n-E4B-it": (
        "google/gemma-3n-E4B-it-litert-lm",
        "297ed75955702dec3503e00c2c2ecbbf475300bc",
        "gemma-3n-E4B-it-int4.litertlm",
        4_919_541_760,
        "2e67a6cd51dfe0f793431e6bd4ed8d029c88e10f52ca0469ad38445e3cd3c1f4",
    ),
}


def _write(d: Path, name: str, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(text)
    return p


def test_bundled_entries_are_pinned_real_files() -> None:
    """The bundled registry has the four real models, pinned to a revision on both hosts,
    each with the sha256 of the LFS object at that revision."""
    cat = Catalog([bundled_registry_dir()])
    assert cat.problems == []
    assert sorted(e.id for e in cat.entries()) == sorted(REAL)
    for model_id, (repo, rev, fname, size, sha) in REAL.items():
        e = cat.get(model_id)
        assert e.size == size
        assert e.file_name == fname
        path = f"/{repo}/resolve/{rev}/{fname}"
        assert e.urls == [f"https://huggingface.co{path}", f"https://hf-mirror.com{path}"]
        assert e.sha256 == sha
    e2b = cat.get("gemma-4-E2B-it")
    assert (e2b.limits.max_tokens, e2b.limits.vision_max_tokens) == (4096, 3072)
    assert (e2b.limits.max_images, e2b.limits.speculative_decoding) == (1, False)


def test_bundled_entries_cite_their_sources() -> None:
    """Each bundled file says in a comment where its revision and size come from, and
    names at least two public sources (repository, then path) for its sha256."""
    for path in bundled_registry_dir().glob("*.toml"):
        text = path.read_text()
        assert "model_allowlists" in text, path
        bullet = re.search(r"^# - sha256:.*?(?=^# - |^[^#])", text, re.M | re.S)
        assert bullet is not None, path
        cited = re.findall(r"^#     (\S+/\S+)\n#       (\S+)", bullet.group(0), re.M)
        assert len({repo for repo, _ in cited}) >= 2, (path, cited)


def test_good_entry_parses_every_field(tmp_path: Path) -> None:
    """A complete entry loads with its limits and backends."""
    entry, problems = load_file(_write(tmp_path, "m1.toml", GOOD))
    assert problems == []
    assert isinstance(entry, Entry)
    assert entry.sha256 == "a" * 64
    assert entry.backends.main == "gpu"
    assert entry.limits.max_images == 1
    assert entry.min_runtime_version == "0.18.1"
    assert (entry.runtime.threads, entry.runtime.warm_up) == (4, False)
    assert entry.variants == ["m1-int4", "m1.small"]


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("size = 1234", 'size = 1234\ncolour = "red"', "colour"),
        ("[limits]\n", "[limits]\nmax_tokenz = 3\n", "limits.max_tokenz"),
        ('id = "m1"', 'id = "-m1"', "id"),
        ('id = "m1"', 'id = "m1/x"', "id"),
        ('"m1.litertlm"', '"../m1.litertlm"', "file_name"),
        ('"m1.litertlm"', '"sub/m1.litertlm"', "file_name"),
        ('"m1.litertlm"', '"..\\\\m1.litertlm"', "file_name"),
        ('"https://example.org/m1.litertlm", ', '"ftp://example.org/m1", ', "urls"),
        ('"https://example.org/m1.litertlm", ', '"file:///etc/passwd", ', "urls"),
        ("size = 1234", "size = 0", "size"),
        ("size = 1234", "size = -5", "size"),
        ("size = 1234", 'size = "1234"', "size"),
        ("a" * 64, "A" * 64, "sha256"),
        ("a" * 64, "a" * 63, "sha256"),
        ('main = "gpu"', 'main = "tpu"', "backends.main"),
        ("max_tokens = 4096", "max_tokens = 0", "limits.max_tokens"),
        ('display_name = "Model one"\n', "", "display_name"),
        ("urls = [", "urls = []\nx = [", "urls"),
        ('"0.18.1"', '"latest"', "min_runtime_version"),
        ('"0.18.1"', '">=0.18"', "min_runtime_version"),
        ('"0.18.1"', "0.18", "min_runtime_version"),
        ("threads = 4", "threads = 0", "runtime.threads"),
        ("threads = 4", 'threads = "4"', "runtime.threads"),
        ("warm_up = false", 'warm_up = "no"', "runtime.warm_up"),
        ("[runtime]\n", "[runtime]\nthreadz = 2\n", "runtime.threadz"),
        ('"m1-int4"', '"m1 int4"', "variants"),
    ],
)
def test_bad_entry_is_reported_with_its_key(tmp_path: Path, old: str, new: str, key: str) -> None:
    """Each kind of bad value is refused, naming the file and the key."""
    assert old in GOOD
    path = _write(tmp_path, "m1.toml", GOOD.replace(old, new, 1))
    cat = Catalog([tmp_path])
    assert "m1" not in cat
    assert any(p.path == path and p.key == key for p in cat.problems), cat.problems


def test_file_must_be_named_after_its_id(tmp_path: Path) -> None:
    """``other.toml`` holding id m1 is refused."""
    _write(tmp_path, "other.toml", GOOD)
    cat = Catalog([tmp_path])
    assert len(cat) == 0
    assert cat.problems[0].key == "id"
    assert "file name" in cat.problems[0].message


def test_bad_toml_syntax_is_reported_and_good_entries_stay(tmp_path: Path) -> None:
    """A file that is not TOML is skipped; the good file next to it still loads."""
    bad = _write(tmp_path, "broken.toml", "id = \n[[[")
    _write(tmp_path, "m1.toml", GOOD)
    cat = Catalog([tmp_path])
    assert cat.get("m1").size == 1234
    assert [p.path for p in cat.problems] == [bad]
    assert "TOML" in cat.problems[0].message
    status = cat.status()
    assert status["entries"] == 1
    assert str(bad) in status["problems"][0]
    assert "1 problem" in status["summary"]


def test_duplicate_id_in_one_dir_refuses_both(tmp_path: Path) -> None:
    """Two files with the same id in one dir are both errors; neither entry is used."""
    _write(tmp_path, "m1.toml", GOOD)
    _write(tmp_path, "copy.toml", GOOD)
    cat = Catalog([tmp_path])
    assert "m1" not in cat
    dup = [p for p in cat.problems if "more than once" in p.message]
    assert {p.path.name for p in dup} == {"m1.toml", "copy.toml"}


def test_later_dir_overrides_earlier_by_id(tmp_path: Path) -> None:
    """A ``MODELD_REGISTRY`` dir's entry replaces the bundled one with the same id."""
    first, second = tmp_path / "a", tmp_path / "b"
    _write(first, "m1.toml", GOOD)
    write_entry(first, "only-a", size=1)
    override = write_entry(second, "m1", size=99)
    cat = Catalog([first, second])
    assert cat.get("m1").size == 99
    assert cat.source_of("m1") == override
    assert cat.get("only-a").size == 1


def test_missing_dir_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    """A registry dir that does not exist is reported; the others load."""
    write_entry(tmp_path / "a", "x", size=1)
    cat = Catalog([tmp_path / "a", tmp_path / "nope"])
    assert "x" in cat
    assert cat.problems[0].path == tmp_path / "nope"


def test_unknown_id_raises_model_not_found(tmp_path: Path) -> None:
    """``get`` of an unknown id raises ModelNotFound with a hint."""
    with pytest.raises(ModelNotFound, match="modeld list"):
        Catalog([tmp_path]).get("nope")


def test_outdated_when_sha256_or_size_changes(tmp_path: Path) -> None:
    """An install is outdated when the entry names another sha256, or another size."""
    write_entry(tmp_path, "m", size=10, sha256="b" * 64)
    e = Catalog([tmp_path]).get("m")
    assert not outdated(e, "b" * 64, 10)
    assert outdated(e, "c" * 64, 10)
    write_entry(tmp_path, "m", size=10)
    e = Catalog([tmp_path]).get("m")
    assert not outdated(e, "c" * 64, 10)
    assert outdated(e, "c" * 64, 11)
    assert not outdated(None, "c" * 64, 11)


def test_reload_reports_changes_to_listeners(tmp_path: Path) -> None:
    """``reload`` swaps in the new entries and tells listeners what changed."""
    write_entry(tmp_path, "a", size=1)
    write_entry(tmp_path, "b", size=1)
    cat = Catalog([tmp_path])
    seen: list[Change] = []
    cat.listeners.append(seen.append)
    write_entry(tmp_path, "b", size=2)
    write_entry(tmp_path, "c", size=1)
    (tmp_path / "a.toml").unlink()
    change = cat.reload()
    assert (change.added, change.changed, change.removed) == (
        frozenset({"c"}),
        frozenset({"b"}),
        frozenset({"a"}),
    )
    assert seen == [change]
    assert not cat.reload()


async def test_live_reload_add_change_remove_and_bad_file(tmp_path: Path) -> None:
    """With the watcher running, file edits show in the catalog without a reload call."""
    write_entry(tmp_path, "a", size=1)
    cat = Catalog([tmp_path])
    await cat.start()
    try:
        assert cat.status()["watching"]
        write_entry(tmp_path, "b", size=5)
        await wait_until(lambda: "b" in cat)
        write_entry(tmp_path, "b", size=6)
        await wait_until(lambda: "b" in cat and cat.get("b").size == 6)
        (tmp_path / "a.toml").unlink()
        await wait_until(lambda: "a" not in cat)
        _write(tmp_path, "bad.toml", "size = [")
        await wait_until(lambda: bool(cat.problems))
        assert "b" in cat
        (tmp_path / "bad.toml").unlink()
        await wait_until(lambda: not cat.problems)
    finally:
        await cat.stop()
        await cat.stop()  # idempotent
    assert not cat.status()["watching"]


async def test_watcher_that_fails_watches_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch that fails (here: a dir gone between the listing and the watch, so watchfiles
    raises) is logged, the catalog reloads, and live reload works again after the restart."""
    write_entry(tmp_path, "a", size=1)
    cat = Catalog([tmp_path])
    real = cat._watched
    calls: list[int] = []

    def vanished_once() -> list[Path]:
        calls.append(1)
        return [tmp_path / "gone", *real()] if len(calls) == 1 else real()

    monkeypatch.setattr(cat, "_watched", vanished_once)
    monkeypatch.setattr("modeld.catalog.catalog.WATCH_RESTART_S", 0.05)
    failed: list[str] = []
    monkeypatch.setattr(
        "modeld.catalog.catalog.logs.event",
        lambda name, *a, **kw: failed.append(str(kw.get("error"))) if "watch" in name else None,
    )
    await cat.start()
    try:
        await wait_until(lambda: len(calls) >= 2)
        assert failed and "gone" in failed[0]
        write_entry(tmp_path, "b", size=5)
        await wait_until(lambda: "b" in cat)
        assert cat.status()["watching"]
    finally:
        await cat.stop()


def test_non_utf8_file_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    """A registry file that is not UTF-8 is reported and skipped; the good entries stay."""
    write_entry(tmp_path, "good", size=10)
    (tmp_path / "bad.toml").write_bytes(b'id = "bad"\ndisplay_name = "caf\xe9"\n')
    entry, problems = load_file(tmp_path / "bad.toml")
    assert entry is None
    assert "UTF-8" in problems[0].message
    catalog = Catalog([tmp_path])
    assert catalog.get("good").size == 10
    assert any("UTF-8" in p.message for p in catalog.problems)


def test_written_entries_read_back_or_are_refused(tmp_path: Path) -> None:
    """An entry modeld writes is TOML that reads back as the same entry, a name past U+FFFF
    included (JSON's surrogate escapes are no TOML); names with controls, '..' or no UTF-8
    are refused as entries, and a comment line's controls are escaped."""

    cat = Catalog([tmp_path / "own"], own=tmp_path / "own")
    entry = Entry(
        id="modelb",
        display_name='modelb\U0001f600 "q" \\',
        file_name="modelb\U0001f600.litertlm",
        local=True,
        size=10,
        sha256="0" * 64,
    )
    path = cat.write_entry(entry, "pulled hf://o/r/f@ma\x01in\nsecond line")
    assert cat.get("modelb") == entry
    assert "\\x01" in path.read_text() and "\x01" not in path.read_text()
    for bad in ("a..b.litertlm", "a\x1bb.litertlm", "x\udcff.litertlm", "a/b.litertlm"):
        with pytest.raises(ValueError):
            Entry(id="x", display_name="x", file_name=bad, local=True, size=1)


def test_nearest_ids_put_the_same_id_in_other_case_first() -> None:
    """An id in other case is named alone; else the ids it begins, then the closest by
    difflib, at most three; nothing when nothing is near."""
    known = ["gemma-4-E2B-it", "gemma-4-E4B-it", "gemma-3n-E2B-it", "gemma-3n-E4B-it", "tiny"]
    assert nearest_ids("gemma-4-e2b-it", known) == ["gemma-4-E2B-it"]
    assert nearest_ids("gemma-4-E2B-itt", known)[0] == "gemma-4-E2B-it"
    assert nearest_ids("gemma", known) == ["gemma-3n-E2B-it", "gemma-3n-E4B-it", "gemma-4-E2B-it"]
    assert nearest_ids("tiyn", known) == ["tiny"]
    assert nearest_ids("qqqqqqqq", known) == []
    assert nearest_ids("tiny", known) == []  # itself is no suggestion


def test_an_unknown_id_is_refused_with_the_nearest_known_ones(tmp_path: Path) -> None:
    """``get`` of an id the catalog lacks names the nearest ids it has, and where all are."""
    d = tmp_path / "reg"
    write_entry(d, "tiny-text", size=10, sha256="a" * 64)
    cat = Catalog([d])
    with pytest.raises(ModelNotFound) as info:
        cat.get("Tiny-Text")
    assert info.value.message == (
        "no model 'Tiny-Text' in the catalog (did you mean tiny-text?); "
        "`modeld list` shows the known ids"
    )


async def test_a_registry_dir_made_after_start_is_read_live(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry dir that does not exist is a problem (in status, logged as a warning);
    made while the watcher runs, its entries show without a reload call or a restart."""
    own, later = tmp_path / "own", tmp_path / "later"
    with caplog.at_level(logging.INFO, logger="modeld"):
        cat = Catalog([own, later], own=own)  # as the daemon has it
    (problem,) = cat.status()["problems"]
    assert str(later) in problem and "does not exist" in problem
    (record,) = [r for r in caplog.records if "registry_problem" in r.getMessage()]
    assert record.levelno == logging.WARNING
    await cat.start()
    try:
        # The watcher is live once an edit in a watched dir shows (and has read what was
        # there when it began).
        write_entry(own, "o", size=5)
        await wait_until(lambda: "o" in cat)
        write_entry(later, "m", size=5)
        await wait_until(lambda: "m" in cat)
        assert cat.status()["problems"] == []
    finally:
        await cat.stop()
