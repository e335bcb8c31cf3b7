"""``key add|list|rm``: API keys for TCP clients (``MODELD_LISTEN``).

These edit the keys file (``MODELD_API_KEYS_FILE``, default ``$MODELD_HOME/api-keys``)
directly, not through the daemon: whoever may write that file manages the keys. Run them as
the daemon's user, or as root (the file then keeps the daemon's account as its owner). The
daemon re-reads the file on its next request.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from modeld.cli.common import console, emit, err_console, escape, json_option, table
from modeld.config import load_settings

if TYPE_CHECKING:
    from modeld.daemon.apikeys import KeysFile


def _keys_file() -> KeysFile:
    # Imported here: every other verb starts without it.
    from modeld.daemon.apikeys import KeysFile

    return KeysFile(load_settings().api_keys_path)


@click.group(name="key")
def key() -> None:
    """API keys for TCP clients: sent as `Authorization: Bearer <key>`."""


@key.command(name="add")
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(["use", "admin"]),
    default="use",
    show_default=True,
    help="use: list, show, ps, generate, chat; admin: also pull, import, rm, prune, pin.",
)
@json_option
def add(name: str, role: str, as_json: bool) -> None:
    """Add a key named NAME and print it (the only time it is shown)."""
    keys_file = _keys_file()
    entry, secret = keys_file.add(name, "admin" if role == "admin" else "use")
    if as_json:
        doc = {**entry.public(), "key": secret, "keys_file": str(keys_file.path)}
        emit(True, doc, lambda _: None)
        return
    # The key alone on stdout, so that `KEY=$(modeld key add NAME)` works.
    sys.stdout.write(secret + "\n")
    err_console.print(
        f"key {escape(name)!r} (role {role}) added to {escape(str(keys_file.path))}. "
        "It is shown only this once: store it now. The daemon accepts it from its next request.",
        soft_wrap=True,
    )


@key.command(name="list")
@json_option
def list_keys(as_json: bool) -> None:
    """List the keys: name, role and creation time (never the keys themselves)."""
    keys_file = _keys_file()
    doc = {"keys_file": str(keys_file.path), "keys": [k.public() for k in keys_file.entries()]}

    def human(d: dict[str, Any]) -> None:
        if not d["keys"]:
            console.print(
                f"no keys in {escape(d['keys_file'])}; add one with `modeld key add NAME`"
            )
            return
        t = table("NAME", "ROLE", "CREATED")
        for k in d["keys"]:
            t.add_row(escape(k["name"]), k["role"], k["created"])
        console.print(t)

    emit(as_json, doc, human)


@key.command(name="rm")
@click.argument("name")
@json_option
def rm(name: str, as_json: bool) -> None:
    """Remove the key named NAME; the daemon refuses it from its next request on."""
    gone = _keys_file().remove(name)
    emit(
        as_json,
        {"removed": gone.public()},
        lambda _: console.print(f"removed key {escape(name)!r}; it no longer opens the API"),
    )
