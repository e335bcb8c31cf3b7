"""The admin CLI, ``modeld``. It talks to the daemon only through ``modeld.client``.

Exit statuses: 0 done, 1 failed or refused (one line on stderr saying what to do),
2 bad usage or settings, 130 interrupted.
"""

from __future__ import annotations

import sys

import click

from modeld import __version__
from modeld.cli import admin, downloads, engines, keys, models, report, system
from modeld.cli.common import err_console
from modeld.errors import ModeldError, SettingsError

VERB_MODULES = [system, models, downloads, engines, admin, report, keys]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="modeld")
@click.option(
    "--socket",
    type=click.Path(dir_okay=False),
    default=None,
    help="Daemon socket (default: MODELD_SOCKET, else the first that exists of "
    "$XDG_RUNTIME_DIR/modeld.sock, /run/modeld/modeld.sock, $MODELD_HOME/modeld.sock).",
)
def cli(socket: str | None) -> None:
    """modeld: downloads, checks and serves LiteRT-LM models over a Unix socket."""


for _module in VERB_MODULES:
    _commands = [c for n in dir(_module) if isinstance(c := getattr(_module, n), click.Command)]
    # A group's subcommands (`key rm`) are not verbs of their own (`rm`).
    _nested = {id(s) for g in _commands if isinstance(g, click.Group) for s in g.commands.values()}
    for _obj in _commands:
        if _obj.name is not None and id(_obj) not in _nested:
            cli.add_command(_obj)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and turn outcomes into the CLI's exit statuses."""
    try:
        cli.main(args=argv, prog_name="modeld", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("interrupted")
        sys.exit(130)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if isinstance(e, click.UsageError) else 1)
    except SettingsError as e:
        sys.stderr.write(f"modeld: {e.message}\n")
        sys.exit(2)
    except ModeldError as e:
        sys.stderr.write(f"modeld: {e.message}\n")
        sys.exit(1)
    sys.exit(0)
