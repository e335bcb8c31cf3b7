"""What every CLI verb shares: the client, output as tables or ``--json``, exit statuses.

Output for people uses rich markup (``[green]ok[/]``). On a terminal rich renders it; on a
pipe or a file the markup is stripped and nothing is wrapped or cut (a script reads whole
lines), and rich is never imported: a CLI call has a latency goal (docs/benchmarks.md#cli-latency).

Each verb is an ``argparse`` sub-parser built by its module's ``<verb>_parser(add)`` and run
by a function that takes the parsed namespace (``ctx``) and the verb's options by name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from modeld.client import Client

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any, TextIO, TypeVar

    from rich.console import Console

    T = TypeVar("T")
    N = TypeVar("N", int, float)

# What a verb's function receives first: the parsed command line (``--socket`` among it).
Ctx = argparse.Namespace
# A completer: the candidates for a word, asked of the daemon.
Completer = Callable[[Ctx, str], list[str]]


class UsageError(Exception):
    """Bad usage found by a verb itself (after parsing): exit 2 with its message."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their line breaks kept); options and verbs aligned.

    The width is found as ``shutil.get_terminal_size`` finds it, without importing shutil
    (and its compression modules): argparse makes a formatter for every argument added.
    """

    def __init__(self, prog: str) -> None:
        try:
            columns = int(os.environ["COLUMNS"])
        except (KeyError, ValueError):
            try:
                columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
            except (AttributeError, ValueError, OSError):  # no stdout (None), or not a tty
                columns = 80
        super().__init__(prog, max_help_position=26, width=max(columns, 40) - 2)


class VerbParser(argparse.ArgumentParser):
    """A verb's parser: options and positionals in any order (``run ID --seed 1 -``), as
    ``parse_intermixed_args`` reads them; a verb with verbs of its own parses as usual."""

    _intermixing = False

    def parse_known_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        nested = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._intermixing or nested:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


class Verbs:
    """Adds verbs to a parser: ``verbs.add(name, run)`` returns the new verb's parser;
    ``run(ctx, **options)`` runs it, its docstring is its help."""

    def __init__(self, sub: argparse._SubParsersAction[VerbParser]) -> None:
        self._sub = sub

    def add(self, name: str, run: Callable[..., None]) -> argparse.ArgumentParser:
        p = self.group(name, run.__doc__)
        p.set_defaults(_run=run)
        return p

    def group(self, name: str, doc: str | None) -> argparse.ArgumentParser:
        """A verb with verbs of its own (``key add``): add them to ``Verbs.under(it)``."""
        return self._sub.add_parser(
            name, help=summary(doc), description=cleandoc(doc), formatter_class=Formatter
        )

    @staticmethod
    def under(parser: argparse.ArgumentParser, dest: str) -> Verbs:
        sub = parser.add_subparsers(
            title="verbs", metavar="VERB", dest=dest, parser_class=VerbParser
        )
        sub.required = True
        return Verbs(sub)


def cleandoc(doc: str | None) -> str:
    """A docstring without its indentation (``inspect.cleandoc``, without importing inspect)."""
    lines = (doc or "").expandtabs().strip().splitlines()
    rest = [line for line in lines[1:] if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in rest), default=0)
    return "\n".join([lines[0].strip(), *(line[indent:] for line in lines[1:])]) if lines else ""


def summary(doc: str | None) -> str:
    """A docstring's first paragraph on one line: the verb's line in ``modeld --help``."""
    return " ".join(cleandoc(doc).split("\n\n", 1)[0].split())


def completes(action: argparse.Action, completer: Completer | str) -> argparse.Action:
    """Mark ``action`` for shell completion: a completer, or ``"file"`` for a path."""
    action.complete = completer  # type: ignore[attr-defined]
    return action


def json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", dest="as_json", action="store_true", help="Print one JSON document."
    )


def in_range(kind: type[N], low: N | None = None, high: N | None = None) -> Callable[[str], N]:
    """An argument type: an ``int`` (or a ``float``) within ``[low, high]``."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> N:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"{'' if low is None else low}..{'' if high is None else high}"
            raise argparse.ArgumentTypeError(f"{text} is not in the range {bounds}")
        return value

    return parse


def keep_alive_arg(text: str) -> str:
    """An argument type: a keep-alive the daemon takes (``30s``, ``5m``, ``0``, ``-1``),
    checked here so that a typo is bad usage (exit 2), and passed on as written."""
    from modeld.config import parse_duration
    from modeld.errors import ModeldError

    try:
        parse_duration(text)
    except (ValueError, ModeldError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: use e.g. 30s, 5m, 0 or -1 (never)"
        ) from None
    return text


def existing_file(text: str) -> Path:
    """An argument type: a path to a file that exists and that this user may read."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable by you")
    return path


def data_file(text: str) -> Path:
    """An argument type: as ``existing_file``, and no device: the CLI reads it whole, and
    ``/dev/zero`` never ends. A pipe (``<(curl ...)``) is taken."""
    path = existing_file(text)
    if path.is_char_device() or path.is_block_device():
        raise argparse.ArgumentTypeError(f"{text!r} is a device, not a file; give an image file")
    return path


# rich's markup: a tag is [style] or [/...]; a backslash before it makes it literal text.
_TAG = re.compile(r"(\\*)\[([a-z#/@][^[]*?)]")
_ESCAPE = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


# What a terminal acts on rather than shows: C0 and C1 controls but tab and newline (ESC
# starts a sequence that can retitle the window, move the cursor or hide text) and the bidi
# controls that reorder what follows them ("Trojan Source").
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def defang(text: str) -> str:
    """``text`` with each control character shown as its escape (``\\x1b``), not acted on."""
    return _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], text)


def escape(text: str) -> str:
    """Make ``text`` print as itself through markup (what ``rich.markup.escape`` does), with
    each control character shown as its escape (``\\x1b``, ``\\u202e``), not acted on:
    catalog entries, messages and paths come from others."""
    text = defang(text)
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
        self.rows.append(tuple(defang(c) for c in cells))

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
        # Whatever a line holds that came from the daemon (or a daemon that only poses as
        # one), a control character in it reaches no terminal but as its escape.
        if isinstance(item, str):
            item = defang(item)
        if self.is_terminal():
            self.rich.print(item.rich() if isinstance(item, Table) else item, **options)
            return
        lines = item.plain_lines() if isinstance(item, Table) else [plain(str(item))]
        self._stream().write("".join(line + "\n" for line in lines))


console = Out(lambda: sys.stdout)
err_console = Out(lambda: sys.stderr, stderr=True)


def client_of(ctx: Ctx) -> Client:
    explicit = getattr(ctx, "socket", None)
    return Client(Path(explicit) if explicit else None)


def call(ctx: Ctx, fn: Callable[[Client], T]) -> T:
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


def _complete(ctx: Ctx, incomplete: str, ids: Callable[[Client], list[str]]) -> list[str]:
    try:
        names = call(ctx, ids)
    except Exception:
        return []
    return [n for n in sorted(names) if n.startswith(incomplete)]


def complete_model(ctx: Ctx, incomplete: str) -> list[str]:
    """Shell completion of a model id: the daemon's catalog."""
    return _complete(ctx, incomplete, lambda c: [m["id"] for m in c.models()["models"]])


def complete_installed(ctx: Ctx, incomplete: str) -> list[str]:
    """Shell completion of an installed model's id."""
    return _complete(
        ctx, incomplete, lambda c: [m["id"] for m in c.models(installed=True)["models"]]
    )


def complete_loaded(ctx: Ctx, incomplete: str) -> list[str]:
    """Shell completion of a loaded engine's id, or its model's."""

    def ids(c: Client) -> list[str]:
        engines = c.engines()["engines"]
        return sorted({e["id"] for e in engines} | {e["model"] for e in engines if "model" in e})

    return _complete(ctx, incomplete, ids)
