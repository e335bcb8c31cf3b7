"""``pull ID [--detach] [--cancel]`` with a progress bar, and ``import PATH [ID]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from modeld.cli.common import (
    Column,
    Ctx,
    Table,
    UsageError,
    Verbs,
    call,
    complete_model,
    completes,
    console,
    emit,
    err_console,
    escape,
    existing_file,
    json_flag,
)
from modeld.client import Client
from modeld.config import RATE_HELP, format_size, parse_rate
from modeld.errors import DaemonDisconnected

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any


def _rate(text: str) -> int:
    try:
        return parse_rate(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate: {RATE_HELP}") from None


def _cap(record: dict[str, Any]) -> str:
    rate = record.get("limit_rate")
    return f"capped at {format_size(rate)}/s" if rate else ""


def _mirror_table(record: dict[str, Any]) -> Table:
    t = Table([Column(c) for c in ("host", "state", "speed", "conns", "got")], show_header=False)
    for m in record.get("mirrors", []):
        state = (
            m["state"]
            if not m.get("reason") or m["state"] == "ok"
            else (f"{m['state']} ({m['reason']})")
        )
        t.add_row(
            f"  {m['host']}",
            state,
            f"{format_size(m['speed'])}/s",
            f"{m['connections']} conn",
            format_size(m["received"]),
        )
    return t


def _print_entry(record: dict[str, Any]) -> None:
    entry = record.get("entry")
    if entry:
        console.print(
            f"entry {escape(entry['path'])}: {escape(entry['source'])} at commit {entry['commit']}"
        )


def _print_done(record: dict[str, Any]) -> None:
    inst = record.get("installed") or {}
    _print_entry(record)
    if record.get("already"):
        console.print(f"{record['id']} is already installed ({inst.get('path', '')})")
        return
    if record.get("adopted"):
        console.print(
            f"[green]installed[/] {record['id']} from the Hugging Face cache "
            f"({escape(record['adopted'])}, {format_size(inst.get('size', 0))}), sha256 "
            f"{inst.get('digest')}, verified by {inst.get('verified_by')}"
        )
        return
    verified = record.get("verified_by") or (
        f"[yellow]unverified[/] (no source vouched for it; `modeld verify {record['id']}` "
        "says what can)"
    )
    console.print(
        f"[green]installed[/] {record['id']}: {format_size(record['size'])}, "
        f"sha256 {record.get('digest')}, verified by {verified}"
    )
    for m in record.get("mirrors", []):
        if m["state"] == "stream_only":
            console.print(f"  mirror ignores Range requests: {escape(m['host'])}")
    if record.get("from_zero"):
        console.print(f"  fetched from byte 0, not resumed: {escape(record['from_zero'])}")
    elif record.get("resumed"):
        console.print(f"  resumed from {format_size(record['resumed'])} already on disk")
    if record.get("repaired"):
        console.print(f"  repaired {record['repaired']} blocks a mirror sent wrong")
    if record.get("limit_rate"):
        console.print(f"  {_cap(record)}")


def _print_choice(record: dict[str, Any]) -> None:
    choice = record.get("choice")
    if choice and choice["chosen"] != choice["asked"]:
        console.print(f"pulling {choice['chosen']}: {escape(choice['reason'])}")
    elif choice and not choice["fit"]["fits"]:
        err_console.print(
            f"[yellow]! {choice['asked']} needs about {format_size(choice['fit']['needs'])}, "
            f"over the memory budget {format_size(choice['fit']['budget'])}: it will not load "
            "until MODELD_MEMORY_BUDGET allows it[/]"
        )


def _follow(
    client: Client,
    model_id: str,
    as_json: bool,
    force: bool,
    *,
    as_id: str | None,
    limit_rate: int | None,
) -> dict[str, Any]:
    records = client.pull(model_id, force=force, as_id=as_id, limit_rate=limit_rate)
    last: dict[str, Any] = next(records, {})  # the request has reached the daemon
    if not as_json:
        _print_choice(last)
    if as_json or not console.is_terminal():
        # A pipe or a log gets the outcome, not a redrawn bar.
        for last in records:  # noqa: B007 (the last record is the outcome)
            pass
        return last
    # rich only now: the bar costs nothing before the daemon has the request.
    from rich.console import Group
    from rich.live import Live
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[state]}"),
        console=console.rich,
    )
    task = progress.add_task(last.get("id", model_id), total=None, state="starting")
    with Live(Group(progress), console=console.rich, refresh_per_second=8, transient=True) as live:
        record = last
        while record:
            last = record
            if record.get("already") or record.get("adopted") or "size" not in record:
                break
            state = ", ".join(filter(None, (record["state"], _cap(record))))
            progress.update(
                task,
                total=record["size"],
                completed=record.get("arrived", record["completed"]),
                state=state,
            )
            live.update(Group(progress, _mirror_table(record).rich()))
            record = next(records, {})
    return last


def pull(
    ctx: Ctx,
    *,
    model_id: str,
    detach: bool,
    cancel: bool,
    force: bool,
    as_id: str | None,
    limit_rate: int | None,
    as_json: bool,
) -> None:
    """Download a model from its mirrors, verified, resuming what is already there.

    A model that can never fit the memory budget is refused before any byte is fetched;
    with variants in its entry, the best one that fits is taken instead. A Hub file
    (hf://ORG/REPO/FILE.litertlm[@REVISION], or its https://.../resolve/... URL) gets an
    entry pinned to the revision's commit in $MODELD_HOME/registry first, then is pulled;
    a copy in the Hugging Face cache is adopted, verified, instead of downloaded.
    """
    is_source = "://" in model_id
    if as_id is not None and not is_source:
        raise UsageError("--id names the entry of a Hub file (hf://...); not of an ID")
    if cancel and is_source:
        raise UsageError("cancel a download by its model id (`modeld pull ID --cancel`)")
    if cancel:
        doc = call(ctx, lambda c: c.cancel_pull(model_id))
        emit(
            as_json,
            doc,
            lambda d: console.print(
                f"cancelled {model_id} at {format_size(d.get('arrived', d['completed']))} of "
                f"{format_size(d['size'])}; the partial is kept, `modeld pull {model_id}` resumes"
            ),
        )
        return
    if detach:
        doc = call(
            ctx,
            lambda c: c.pull_detached(model_id, force=force, as_id=as_id, limit_rate=limit_rate),
        )

        def human(d: dict[str, Any]) -> None:
            _print_choice(d)
            got = d["id"]
            if d.get("already") or d.get("adopted"):
                _print_done(d)  # its entry line too
                return
            _print_entry(d)
            console.print(
                f"pulling {got} in the daemon{' (' + _cap(d) + ')' if _cap(d) else ''}; "
                f"follow it with `modeld pull {got}`"
                f", cancel it with `modeld pull {got} --cancel`"
            )

        emit(as_json, doc, human)
        return
    try:
        record = call(
            ctx,
            lambda c: _follow(c, model_id, as_json, force, as_id=as_id, limit_rate=limit_rate),
        )
    except KeyboardInterrupt:
        err_console.print(
            f"left the progress view; the download goes on in the daemon. "
            f"Cancel it with `modeld pull {model_id} --cancel`"
        )
        sys.exit(130)
    except DaemonDisconnected as e:
        raise DaemonDisconnected(
            f"the daemon went away during the pull of {model_id} (`modeld logs` shows why); "
            f"start it again, and `modeld pull {model_id}` resumes from what is on disk"
        ) from e
    emit(as_json, record, _print_done)


def pull_parser(verbs: Verbs) -> None:
    p = verbs.add("pull", pull)
    completes(p.add_argument("model_id", metavar="ID|hf://ORG/REPO/FILE[@REV]"), complete_model)
    p.add_argument(
        "--detach", action="store_true", help="Start (or join) the download and return at once."
    )
    p.add_argument(
        "--cancel", action="store_true", help="Cancel the running download (the partial stays)."
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="Download even a model that can never fit the budget.",
    )
    p.add_argument("--id", dest="as_id", metavar="ID", help="The id of the entry a Hub file gets.")
    p.add_argument(
        "--limit-rate",
        type=_rate,
        metavar="RATE",
        help="Cap the download's total rate, over all its connections (500K, 10M: as "
        "curl's). Joining a running pull sets its cap from then on.",
    )
    json_flag(p)


def import_(ctx: Ctx, path: Path, model_id: str | None, as_json: bool) -> None:
    """Adopt a local .litertlm file (checked like a download); ID defaults from its name."""
    doc = call(ctx, lambda c: c.import_file(path, model_id))

    def human(d: dict[str, Any]) -> None:
        inst = d["installed"]
        how = "cloned (copy-on-write)" if inst.get("linked") else "copied"
        verified = inst.get("verified_by") or (
            f"[yellow]unverified[/] (no source vouched for it; `modeld verify {d['id']}` "
            "says what can)"
        )
        console.print(
            f"imported {d['id']} ({how}, {format_size(inst['size'])}), verified by {verified}"
        )

    emit(as_json, doc, human)


def import_parser(verbs: Verbs) -> None:
    p = verbs.add("import", import_)
    completes(p.add_argument("path", metavar="PATH", type=existing_file), "file")
    p.add_argument("model_id", metavar="ID", nargs="?")
    json_flag(p)
