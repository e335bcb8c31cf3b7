"""``serve`` and ``status``."""

from __future__ import annotations

from typing import Any

import click

from modeld.cli.common import call, console, emit, json_option
from modeld.config import format_duration, format_size, load_settings


@click.command()
def serve() -> None:
    """Run the daemon in the foreground (Ctrl-C or SIGTERM stops it in order)."""
    from modeld.daemon.daemon import serve as run_daemon

    settings = load_settings()
    raise SystemExit(run_daemon(settings))


def _print_status(doc: dict[str, Any]) -> None:
    s = doc["settings"]
    console.print(f"[bold]modeld {doc['version']}[/] up {format_duration(doc['uptime'])}")
    console.print(f"  socket        {s['socket']}")
    console.print(f"  state dir     {s['home']}")
    console.print(f"  memory budget {format_size(s['memory_budget'])}")
    console.print(f"  backends      main={s['main_backend']} vision={s['vision_backend']}")
    console.print(f"  keep alive    {format_duration(s['keep_alive'])}")
    for key, section in doc.items():
        if key in ("version", "uptime", "settings") or not isinstance(section, dict):
            continue
        summary = section.get("summary")
        if summary:
            console.print(f"  {key:<13} {summary}")
        for problem in section.get("problems", []):
            console.print(f"  [yellow]! {key}: {problem}[/]")


@click.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """Show the daemon's version, settings and the state of each part."""
    doc = call(ctx, lambda c: c.status())
    emit(as_json, doc, _print_status)
