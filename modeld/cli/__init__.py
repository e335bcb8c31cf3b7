"""The admin CLI, ``modeld``. It talks to the daemon only through ``modeld.client``.

Exit statuses: 0 done, 1 failed or refused (one line on stderr saying what to do),
2 bad usage or settings, 130 interrupted.

A CLI call is a fresh process, and ``list``, ``status`` and ``ps`` have a latency goal
(docs/benchmarks.md#cli-latency), so only what the verb needs is imported: the standard
library's ``argparse``, and of all the verbs' modules the one of the verb asked for
(``modeld --help`` and completion build them all). No click, rich, pydantic or aiohttp
before the request has gone out.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from modeld import __version__
from modeld.cli.common import Formatter, UsageError, VerbParser, Verbs
from modeld.errors import ModeldError, SettingsError

# verb: (module under modeld.cli, the function in it that adds the verb's parser)
VERBS: dict[str, tuple[str, str]] = {
    "bug-report": ("report", "bug_report_parser"),
    "import": ("downloads", "import_parser"),
    "key": ("keys", "key_parser"),
    "list": ("models", "list_parser"),
    "load": ("engines", "load_parser"),
    "logs": ("system", "logs_parser"),
    "prune": ("admin", "prune_parser"),
    "ps": ("engines", "ps_parser"),
    "pull": ("downloads", "pull_parser"),
    "rm": ("admin", "rm_parser"),
    "run": ("run", "run_parser"),
    "serve": ("system", "serve_parser"),
    "show": ("models", "show_parser"),
    "status": ("system", "status_parser"),
    "unload": ("engines", "unload_parser"),
    "verify": ("models", "verify_parser"),
}
# Other names for a verb (as Ollama's `ls` and `stop`); they stay out of the verb list.
ALIASES = {"ls": "list", "stop": "unload"}
# The verbs by task, in the order a newcomer meets them: `modeld` and `modeld --help` list
# them so (every verb in exactly one task).
TASKS: list[tuple[str, list[str]]] = [
    ("the daemon", ["serve", "status", "logs"]),
    ("models on disk", ["list", "show", "pull", "import", "verify", "rm", "prune"]),
    ("running models", ["run", "load", "ps", "unload"]),
    ("administration", ["key", "bug-report"]),
]

DESCRIPTION = """\
modeld: downloads, checks and serves LiteRT-LM models over a Unix socket."""

EPILOG = """\
Aliases: ls (list), stop (unload). `modeld VERB --help` gives a verb's options.
Shell completion (verbs, options, model ids from the daemon) for bash, zsh and fish:
the line to add to your shell's start-up file is in the README, under "The CLI"."""


def short_usage() -> str:
    """What a bare `modeld` prints: the verbs by task, with no verb module imported."""
    width = max(len(task) for task, _ in TASKS) + 1
    lines = [f"  {task + ':':<{width}} {', '.join(verbs)}" for task, verbs in TASKS]
    return (
        "usage: modeld [--socket PATH] VERB [ARGS]\n\nverbs:\n"
        + "\n".join(lines)
        + "\n\n`modeld --help` says what each verb does, `modeld VERB --help` its options.\n"
    )


def _verbs_by_task(sub: argparse._SubParsersAction[VerbParser], width: int) -> str:
    """The verbs section of `modeld --help`: each task's verbs with their summaries."""
    import textwrap

    summaries = {a.dest: a.help or "" for a in sub._choices_actions}
    column = max(len(v) for _, verbs in TASKS for v in verbs) + 4
    out: list[str] = []
    for task, verbs in TASKS:
        out.append(f"{task}:")
        for verb in verbs:
            wrapped = textwrap.wrap(summaries[verb], max(width - column, 30)) or [""]
            out.append(f"  {verb:<{column - 2}}{wrapped[0]}")
            out += [" " * column + line for line in wrapped[1:]]
        out.append("")
    return "\n".join(out).rstrip()


SOCKET_HELP = (
    "Daemon socket (default: MODELD_SOCKET, else the first that exists of "
    "$XDG_RUNTIME_DIR/modeld.sock, /run/modeld/modeld.sock, $MODELD_HOME/modeld.sock; "
    "MODELD_URL with MODELD_API_KEY reaches a daemon over TCP instead)."
)


def verb_of(argv: Sequence[str]) -> int | None:
    """Where the verb is in ``argv``: the first word that is neither an option nor
    ``--socket``'s value; None when there is none (``modeld --help``)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--socket":
            i += 2
            continue
        if word == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not word.startswith("-"):
            return i
        i += 1
    return None


def build_parser(verbs: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser, with the sub-parsers of ``verbs`` (default: all)."""
    parser = argparse.ArgumentParser(
        prog="modeld", description=DESCRIPTION, epilog=EPILOG, formatter_class=Formatter
    )
    parser.add_argument("--version", action="version", version=f"modeld {__version__}")
    parser.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    # The verbs are listed by task in the description (``_verbs_by_task``), not by argparse.
    sub = parser.add_subparsers(
        metavar="VERB", dest="_verb_name", parser_class=VerbParser, help=argparse.SUPPRESS
    )
    sub.required = True
    # Set after the verbs' parsers took their prog ("modeld run") from the parser's.
    parser.usage = "%(prog)s [-h] [--version] [--socket PATH] VERB [ARGS]"

    for name in verbs if verbs is not None else VERBS:
        module, attr = VERBS[name]
        adder: object = getattr(importlib.import_module(f"modeld.cli.{module}"), attr)
        assert callable(adder)
        adder(Verbs(sub))
    if verbs is None:
        width = Formatter("modeld")._width
        parser.description = f"{DESCRIPTION}\n\n{_verbs_by_task(sub, width)}"
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``, building only the asked verb's parser when the verb is known; nothing
    but ``--socket``: the short usage (exit 2)."""
    at = verb_of(argv)
    bare = [a for i, a in enumerate(argv) if a != "--socket" and argv[i - 1 : i] != ["--socket"]]
    if at is None and not bare:
        sys.stderr.write(short_usage())
        raise SystemExit(2)
    verbs: list[str] | None = None
    if at is not None:
        name = ALIASES.get(argv[at], argv[at])
        if name in VERBS:
            argv = [*argv[:at], name, *argv[at + 1 :]]
            verbs = [name]
    return build_parser(verbs).parse_args(argv)


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")


def run(argv: list[str]) -> None:
    if "_MODELD_COMPLETE" in os.environ:
        from modeld.cli.complete import complete

        complete(os.environ["_MODELD_COMPLETE"], build_parser)
        return
    ns = parse(argv)
    options = {k: v for k, v in vars(ns).items() if not k.startswith("_") and k != "socket"}
    ns._run(ns, **options)


def _open_closed_streams() -> None:
    """Started with stdout or stderr closed (`modeld run ID hi >&-`, a cron job), Python has
    None for them: write that output to /dev/null, as to a reader that is gone. It also
    keeps descriptors 1 and 2 from a socket the CLI opens."""
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, Path(os.devnull).open("r" if name == "stdin" else "w"))  # noqa: SIM115


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and turn outcomes into the CLI's exit statuses."""
    args = sys.argv[1:] if argv is None else argv
    _open_closed_streams()
    try:
        run(args)
    except KeyboardInterrupt:
        _say("interrupted")
        sys.exit(130)
    except UsageError as e:
        verb = verb_of(args)
        prog = f"modeld {ALIASES.get(args[verb], args[verb])}" if verb is not None else "modeld"
        _say(f"{prog}: error: {e.message}")
        sys.exit(2)
    except SettingsError as e:
        _say(f"modeld: {e.message}")
        sys.exit(2)
    except ModeldError as e:
        _say(f"modeld: {e.message}")
        sys.exit(1)
    except BrokenPipeError:
        # `modeld list | head -1`: the reader left; that is not a failure of ours.
        sys.stderr.close()
        sys.exit(0)
    sys.exit(0)
