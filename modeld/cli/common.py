"""What every CLI verb shares: the client, output as tables or ``--json``, exit statuses.

Output for people uses rich markup (``[green]ok[/]``). On a terminal rich renders it; on a
pipe or a file the markup is stripped and nothing is wrapped or cut (a script reads whole
lines), and rich is never imported: a CLI call aims at 100 ms.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, TypeVar

import click

from modeld.client import Client

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")

# rich's markup: a tag is [style] or [/...]; a backslash before it makes it literal text.
_TAG = re.compile(r"(\\*)\[([a-z#/@][^[]*?)]")
_ESCAPE = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def escape(text: str) -> str:
    """Make ``text`` print as itself through markup (what ``rich.markup.escape`` does)."""
    text = _ESCAPE.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", text)
    if text.endswith("\\") and not text.endswith("\\\\"):
        text += "\\"
    return text


def plain(text: str) -> str:
    """``text`` without its markup: tags dropped, escaped brackets kept as text."""

    def one(m: re.Match[str]) -> str:
        slashes = m.group(1)
        if len(slashes) % 2:
            return slashes[: len(slashes) // 2] + f"[{m.group(2)}]"
        return slashes[: len(slashes) // 2]

    return _TAG.sub(one, text)


class Column:
    # Plain classes here: a dataclass costs an exec at import, paid by every CLI call.
    def __init__(self, header: str, overflow: str = "ellipsis", no_wrap: bool = False) -> None:
        self.header = header
        self.overflow = overflow
        self.no_wrap = no_wrap


class Table:
    """Rows of markup cells: rich's table on a terminal, aligned plain columns elsewhere."""

    def __init__(self, columns: list[Column], *, show_header: bool = True) -> None:
        self.columns = columns
        self.rows: list[tuple[str, ...]] = []
        self.show_header = show_header

    def add_row(self, *cells: str) -> None:
        self.rows.append(cells)

    def plain_lines(self) -> list[str]:
        rows = [tuple(plain(c) for c in r) for r in self.rows]
        if self.show_header:
            rows.insert(0, tuple(c.header for c in self.columns))
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.columns))]
        return [
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
        ]

    def rich(self) -> Any:
        from rich.table import Table as RichTable

        t = RichTable(box=None, header_style="bold", pad_edge=False, show_header=self.show_header)
        for c in self.columns:
            t.add_column(c.header, overflow=c.overflow, no_wrap=c.no_wrap)  # type: ignore[arg-type]
        for r in self.rows:
            t.add_row(*r)
        return t


class Out:
    """``print`` for people: rich on a terminal, plain whole lines elsewhere."""

    def __init__(self, stream: Callable[[], TextIO], *, stderr: bool = False) -> None:
        self._stream = stream
        self._stderr = stderr
        self._rich: Console | None = None

    def is_terminal(self) -> bool:
        return self._stream().isatty()

    @property
    def rich(self) -> Console:
        if self._rich is None:
            from rich.console import Console

            # soft_wrap: long paths stay on one line even on a terminal.
            self._rich = Console(stderr=self._stderr, soft_wrap=not self._stderr)
        return self._rich

    def print(self, item: str | Table = "", **options: Any) -> None:
        if self.is_terminal():
            self.rich.print(item.rich() if isinstance(item, Table) else item, **options)
            return
        lines = item.plain_lines() if isinstance(item, Table) else [plain(str(item))]
        self._stream().write("".join(line + "\n" for line in lines))


console = Out(lambda: sys.stdout)
err_console = Out(lambda: sys.stderr, stderr=True)

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


def client_of(ctx: click.Context) -> Client:
    explicit = ctx.find_root().params.get("socket")
    return Client(Path(explicit) if explicit else None)


def call(ctx: click.Context, fn: Callable[[Client], T]) -> T:
    """Run ``fn`` with a client for the daemon (``--socket``, else as ``find_daemon``)."""
    with client_of(ctx) as client:
        return fn(client)


def emit(as_json: bool, data: Any, human: Callable[[Any], None]) -> None:
    """Print ``data`` as one JSON document, or for people with ``human``."""
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    else:
        human(data)


def table(*columns: str) -> Table:
    return Table([Column(c) for c in columns])


def _complete(ctx: click.Context, incomplete: str, ids: Callable[[Client], list[str]]) -> list[Any]:
    from click.shell_completion import CompletionItem

    try:
        names = call(ctx, ids)
    except Exception:
        return []
    return [CompletionItem(n) for n in sorted(names) if n.startswith(incomplete)]


def complete_model(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of a model id: the daemon's catalog."""
    return _complete(ctx, incomplete, lambda c: [m["id"] for m in c.models()["models"]])


def complete_installed(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of an installed model's id."""
    return _complete(
        ctx, incomplete, lambda c: [m["id"] for m in c.models(installed=True)["models"]]
    )


def complete_loaded(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
    """Shell completion of a loaded engine's id, or its model's."""

    def ids(c: Client) -> list[str]:
        engines = c.engines()["engines"]
        return sorted({e["id"] for e in engines} | {e["model"] for e in engines if "model" in e})

    return _complete(ctx, incomplete, ids)
