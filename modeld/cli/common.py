"""What every CLI verb shares: the client, output as tables or ``--json``, exit statuses."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from modeld.client import Client
from modeld.config import client_socket_path

T = TypeVar("T")

# soft_wrap: long paths stay on one line when output goes to a pipe or a log (width 80).
console = Console(soft_wrap=True)
err_console = Console(stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


def socket_of(ctx: click.Context) -> Path:
    explicit = ctx.find_root().params.get("socket")
    return client_socket_path(Path(explicit) if explicit else None)


def call(ctx: click.Context, fn: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``fn`` with a connected client on the daemon's socket."""

    async def go() -> T:
        async with Client(socket_of(ctx)) as client:
            return await fn(client)

    return asyncio.run(go())


def emit(as_json: bool, data: Any, human: Callable[[Any], None]) -> None:
    """Print ``data`` as one JSON document, or for people with ``human``."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        human(data)


def table(*columns: str) -> Table:
    t = Table(box=None, header_style="bold", pad_edge=False)
    for c in columns:
        t.add_column(c)
    return t
