"""The admin CLI, ``modeld``. It talks to the daemon only through ``modeld.client``.

Exit statuses: 0 done, 1 failed or refused (one line on stderr saying what to do),
2 bad usage or settings, 130 interrupted.

Each verb's module is imported only when that verb runs (``modeld --help`` imports them
all): ``modeld status`` loads neither rich nor pydantic nor aiohttp.
"""

from __future__ import annotations

import importlib
import sys

import click

from modeld import __version__
from modeld.errors import ModeldError, SettingsError

# verb: (module under modeld.cli, the click command's attribute name)
VERBS: dict[str, tuple[str, str]] = {
    "serve": ("system", "serve"),
    "status": ("system", "status"),
    "logs": ("system", "logs"),
    "list": ("models", "list_"),
    "show": ("models", "show"),
    "verify": ("models", "verify"),
    "pull": ("downloads", "pull"),
    "import": ("downloads", "import_"),
    "ps": ("engines", "ps"),
    "load": ("engines", "load"),
    "unload": ("engines", "unload"),
    "run": ("run", "run"),
    "rm": ("admin", "rm"),
    "prune": ("admin", "prune"),
    "bug-report": ("report", "bug_report"),
    "key": ("keys", "key"),
}
# Other names for a verb (as Ollama's `ls` and `stop`); they stay out of the verb list.
ALIASES = {"ls": "list", "stop": "unload"}


class LazyGroup(click.Group):
    """A group that imports a verb's module when the verb is asked for."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(VERBS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        name = ALIASES.get(cmd_name, cmd_name)
        if name not in VERBS:
            return None
        module, attr = VERBS[name]
        command = getattr(importlib.import_module(f"modeld.cli.{module}"), attr)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="modeld")
@click.option(
    "--socket",
    type=click.Path(dir_okay=False),
    default=None,
    help="Daemon socket (default: MODELD_SOCKET, else the first that exists of "
    "$XDG_RUNTIME_DIR/modeld.sock, /run/modeld/modeld.sock, $MODELD_HOME/modeld.sock; "
    "MODELD_URL with MODELD_API_KEY reaches a daemon over TCP instead).",
)
def cli(socket: str | None) -> None:
    """modeld: downloads, checks and serves LiteRT-LM models over a Unix socket.

    Aliases: ls (list), stop (unload). Shell completion (model ids from the daemon):
    eval "$(_MODELD_COMPLETE=bash_source modeld)" in ~/.bashrc (zsh_source, fish_source).
    """


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI and turn outcomes into the CLI's exit statuses."""
    try:
        cli.main(args=argv, prog_name="modeld", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        _say("interrupted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(2 if isinstance(e, click.UsageError) else 1)
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
