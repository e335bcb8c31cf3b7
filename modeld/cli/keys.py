"""``key add|list|rm``: API keys for TCP clients (``MODELD_LISTEN``).

These edit the keys file (``MODELD_API_KEYS_FILE``, default ``$MODELD_HOME/api-keys``)
directly, not through the daemon: whoever may write that file manages the keys. Run them as
the daemon's user, or as root (the file then keeps the daemon's account as its owner). The
daemon re-reads the file on its next request.
"""

from __future__ import annotations

import sys

from modeld.cli.common import Ctx, Verbs, console, emit, err_console, escape, json_flag, table

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any

    from modeld.daemon.apikeys import KeysFile


def _keys_file() -> KeysFile:
    # Imported here: every other verb (and `modeld --help`) starts without them.
    from modeld.config import load_settings
    from modeld.daemon.apikeys import KeysFile

    return KeysFile(load_settings().api_keys_path)


KEY_HELP = """API keys for TCP clients: sent as `Authorization: Bearer <key>`."""


def add(ctx: Ctx, name: str, role: str, as_json: bool) -> None:
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


def list_keys(ctx: Ctx, as_json: bool) -> None:
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


def rm(ctx: Ctx, name: str, as_json: bool) -> None:
    """Remove the key named NAME; the daemon refuses it from its next request on."""
    gone = _keys_file().remove(name)
    emit(
        as_json,
        {"removed": gone.public()},
        lambda _: console.print(f"removed key {escape(name)!r}; it no longer opens the API"),
    )


def key_parser(verbs: Verbs) -> None:
    keys = Verbs.under(verbs.group("key", KEY_HELP), "_key_verb")
    p = keys.add("add", add)
    p.add_argument("name", metavar="NAME")
    p.add_argument(
        "--role",
        choices=["use", "admin"],
        default="use",
        help="use (the default): list, show, ps, generate, chat; admin: also pull, import, "
        "rm, prune, pin.",
    )
    json_flag(p)
    json_flag(keys.add("list", list_keys))
    p = keys.add("rm", rm)
    p.add_argument("name", metavar="NAME")
    json_flag(p)
