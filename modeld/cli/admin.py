"""``rm`` and ``prune``. The daemon does the removing; the CLI asks and waits.

Ctrl-C while waiting exits 130; the daemon still finishes the removal it started (each
item is removed whole or not at all), so nothing is left half done.
"""

from __future__ import annotations

from pathlib import Path

from modeld.cli.common import (
    Ctx,
    UsageError,
    Verbs,
    call,
    complete_installed,
    completes,
    console,
    emit,
    err_console,
    escape,
    json_flag,
    table,
)
from modeld.config import format_size, parse_duration
from modeld.errors import RemoveFailed

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any

_KIND_LABEL = {
    "partial": "partial",
    "journal": "journal",
    "quarantined": "quarantined",
    "orphan_blob": "orphan file",
    "orphan_cache": "orphan cache",
    "model": "model",
}


def _what(item: dict[str, Any]) -> str:
    if item["kind"] == "model" and item["id"]:
        return str(item["id"])
    if item["path"]:
        # Relative to the state dir (blobs/, partial/, cache/); --json has the full path.
        p = Path(item["path"])
        return f"{p.parent.name}/{p.name}"
    return str(item["id"] or "-")


def _items_table(items: list[dict[str, Any]]) -> None:
    t = table("KIND", "WHAT", "SIZE", "REASON")
    t.columns[1].overflow = "fold"
    t.columns[2].no_wrap = True
    for i in items:
        t.add_row(
            _KIND_LABEL.get(i["kind"], i["kind"]),
            escape(_what(i)),
            format_size(i["size"]),
            escape(i["reason"]),
        )
    console.print(t)


def _print_prune(doc: dict[str, Any]) -> None:
    items, kept = doc["items"], doc["kept"]
    if items:
        _items_table(items)
    else:
        console.print("nothing to remove")
    if doc["dry_run"]:
        console.print(f"would free {format_size(doc['total'])} ({len(items)} item(s)); dry run")
    else:
        console.print(f"freed {format_size(doc['freed'])} ({len(items)} item(s))")
    if kept:
        console.print("[yellow]kept (in use):[/]")
        _items_table(kept)
    budget = doc["disk_budget"]
    if doc["selection"]["to_budget"] and budget is not None:
        over = doc["installed_after"] > budget
        style = "red" if over else "green"
        console.print(
            f"installed models: {format_size(doc['installed_after'])} of the "
            f"[{style}]{format_size(budget)}[/] disk budget"
            + (" (still over: what is left is in use)" if over else "")
        )


def _check_duration(name: str, value: str | None) -> None:
    if value is None or (name == "--partials" and value == "all"):
        return
    try:
        ok = parse_duration(value) >= 0
    except ValueError:
        ok = False
    if not ok:
        raise UsageError(f"{name}: {value!r} is not a duration such as 7d, 12h or 30m")


def rm(ctx: Ctx, model_id: str, force: bool, entry: bool, as_json: bool) -> None:
    """Remove an installed model (and its partial download); refused while in use.

    With --entry, also its entry in $MODELD_HOME/registry (a bundled entry is never removed).
    """
    doc = call(ctx, lambda c: c.remove(model_id, force=force, entry=entry))

    def human(d: dict[str, Any]) -> None:
        done = []
        if d["cancelled_download"]:
            done.append("cancelled its download")
        if d["unloaded"]:
            done.append("unloaded " + escape(", ".join(map(str, d["unloaded"]))))
        kinds = escape(", ".join(sorted({str(i["kind"]) for i in d["removed"]}))) or "nothing"
        line = f"removed {escape(d['id'])} ({kinds}), freed {format_size(d['freed'])}"
        if d.get("entry_removed"):
            done.append(f"removed its entry {escape(d['entry_removed'])}")
        console.print(line + (f"; {'; '.join(done)}" if done else ""))

    emit(as_json, doc, human)


def rm_parser(verbs: Verbs) -> None:
    p = verbs.add("rm", rm)
    completes(p.add_argument("model_id", metavar="ID"), complete_installed)
    p.add_argument(
        "--force", action="store_true", help="Unload the model or cancel its download first."
    )
    p.add_argument(
        "--entry",
        action="store_true",
        help="Also remove the entry modeld wrote for it (pull hf://, import of a bare file).",
    )
    json_flag(p)


def prune(
    ctx: Ctx,
    *,
    dry_run: bool,
    partials: str | None,
    orphans: bool,
    unused_for: str | None,
    to_budget: bool,
    as_json: bool,
) -> None:
    """Free disk space; with no selection, --partials --orphans (never installed models)."""
    _check_duration("--partials", partials)
    _check_duration("--unused-for", unused_for)
    body: dict[str, Any] = {"dry_run": dry_run}
    if partials is not None:
        body["partials"] = True if partials == "all" else partials
    if orphans:
        body["orphans"] = True
    if unused_for is not None:
        body["unused_for"] = unused_for
    if to_budget:
        body["to_budget"] = True
    doc = call(ctx, lambda c: c.prune(body))
    emit(as_json, doc, _print_prune)
    if doc["errors"]:
        for e in doc["errors"]:
            err_console.print(f"[red]! {escape(e['message'])}[/]")
        raise RemoveFailed(
            f"{len(doc['errors'])} item(s) could not be removed (see above); "
            "fix their permissions and prune again"
        )


def prune_parser(verbs: Verbs) -> None:
    p = verbs.add("prune", prune)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="List what would go and the total; remove nothing.",
    )
    p.add_argument(
        "--partials",
        nargs="?",
        const="all",
        default=None,
        metavar="AGE",
        help="Partial downloads not in progress (all, or only those older than AGE, e.g. 7d).",
    )
    p.add_argument(
        "--orphans", action="store_true", help="Files no model uses, *.FAILED, stale caches."
    )
    p.add_argument("--unused-for", metavar="D", help="Installed models not used for D (e.g. 30d).")
    p.add_argument(
        "--to-budget",
        action="store_true",
        help="LRU installed models until under MODELD_DISK_BUDGET.",
    )
    json_flag(p)
