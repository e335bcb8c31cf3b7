"""``pull ID [--detach] [--cancel]`` with a progress bar, and ``import PATH [ID]``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import click
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
from rich.table import Table

from modeld.cli.common import call, console, emit, err_console, json_option
from modeld.client import Client
from modeld.config import format_size


def _mirror_table(record: dict[str, Any]) -> Table:
    t = Table(box=None, show_header=False, pad_edge=False)
    for column in ("host", "state", "speed", "conns", "got"):
        t.add_column(column)
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


def _print_done(record: dict[str, Any]) -> None:
    inst = record.get("installed") or {}
    if record.get("already"):
        console.print(f"{record['id']} is already installed ({inst.get('path', '')})")
        return
    verified = record.get("verified_by") or (
        f"[yellow]unverified[/] (no source vouched for it; `modeld verify {record['id']}` "
        "says what can)"
    )
    console.print(
        f"[green]installed[/] {record['id']}: {format_size(record['size'])}, "
        f"sha256 {record.get('digest')}, verified by {verified}"
    )
    if record.get("resumed"):
        console.print(f"  resumed from {format_size(record['resumed'])} already on disk")
    if record.get("repaired"):
        console.print(f"  repaired {record['repaired']} blocks a mirror sent wrong")


async def _follow(client: Client, model_id: str, as_json: bool) -> dict[str, Any]:
    last: dict[str, Any] = {}
    if as_json:
        async for record in client.stream(
            "POST", f"/api/models/{quote(model_id, safe='')}/pull", {}
        ):
            last = record
        return last
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[state]}"),
        console=console,
    )
    task = progress.add_task(model_id, total=None, state="starting")
    with Live(Group(progress), console=console, refresh_per_second=8, transient=True) as live:
        async for record in client.stream(
            "POST", f"/api/models/{quote(model_id, safe='')}/pull", {}
        ):
            last = record
            if record.get("already"):
                break
            progress.update(
                task, total=record["size"], completed=record["completed"], state=record["state"]
            )
            live.update(Group(progress, _mirror_table(record)))
    return last


@click.command()
@click.argument("model_id", metavar="ID")
@click.option("--detach", is_flag=True, help="Start (or join) the download and return at once.")
@click.option("--cancel", is_flag=True, help="Cancel the running download (the partial stays).")
@json_option
@click.pass_context
def pull(ctx: click.Context, model_id: str, detach: bool, cancel: bool, as_json: bool) -> None:
    """Download a model from its mirrors, verified, resuming what is already there."""
    if cancel:
        doc = call(ctx, lambda c: c.request("DELETE", f"/api/downloads/{quote(model_id, safe='')}"))
        emit(
            as_json,
            doc,
            lambda d: console.print(
                f"cancelled {model_id} at {format_size(d['completed'])} of "
                f"{format_size(d['size'])}; the partial is kept, `modeld pull {model_id}` resumes"
            ),
        )
        return
    if detach:
        doc = call(
            ctx,
            lambda c: c.request(
                "POST", f"/api/models/{quote(model_id, safe='')}/pull", {"detach": True}
            ),
        )
        emit(
            as_json,
            doc,
            lambda d: console.print(
                f"{model_id} is already installed"
                if d.get("already")
                else f"pulling {model_id} in the daemon; follow it with `modeld pull {model_id}`"
                f", cancel it with `modeld pull {model_id} --cancel`"
            ),
        )
        return
    try:
        record = call(ctx, lambda c: _follow(c, model_id, as_json))
    except KeyboardInterrupt:
        err_console.print(
            f"left the progress view; the download goes on in the daemon. "
            f"Cancel it with `modeld pull {model_id} --cancel`"
        )
        sys.exit(130)
    emit(as_json, record, _print_done)


@click.command(name="import")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("model_id", metavar="[ID]", required=False)
@json_option
@click.pass_context
def import_(ctx: click.Context, path: Path, model_id: str | None, as_json: bool) -> None:
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
