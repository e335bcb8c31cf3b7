"""``run ID [PROMPT|-]``: one reply, or an interactive chat when no prompt is given on a terminal.

The prompt comes from the argument, else from stdin (``-``, or any stdin that is not a
terminal: ``echo hi | modeld run ID``). With neither, on a terminal, ``run`` opens a chat: the
conversation so far goes with each turn, ``\"\"\"`` starts and ends a multi-line message, the
arrow keys recall earlier lines (readline), ``/help`` lists the commands (a line of one
word starting with ``/`` is a command, never sent), and ``/bye`` or Ctrl-D ends it. The
model is checked first: an id a request would be refused for is refused before the chat
opens or stdin is read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from modeld.cli.common import (
    Ctx,
    UsageError,
    Verbs,
    call,
    client_of,
    complete_model,
    completes,
    data_file,
    defang,
    err_console,
    escape,
    in_range,
    json_flag,
    keep_alive_arg,
)
from modeld.client import Client
from modeld.errors import ModeldError

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from modeld.client import FinalRecord, GenerationRecord

CHAT_HELP = "Chatting with {model}. /help lists the commands; /bye or Ctrl-D ends it."
# The chat's own commands: never sent to the model.
COMMANDS = """\
/help, /?             these commands
/bye, /exit, /quit    end the chat (as Ctrl-D does)
/clear                forget the conversation so far
\"\"\"                   start a message of several lines; \"\"\" again ends it
Ctrl-C                stop the reply being written; the chat goes on
Any other one word starting with / is taken for a mistyped command, not sent."""


def timings_line(final: dict[str, Any]) -> str:
    t = final.get("timings") or {}
    parts = []
    if t.get("image_prepare"):
        parts.append(f"image_prepare {t['image_prepare'] * 1000:.1f} ms")
    for key in ("load", "queue", "prefill", "first_token", "total"):
        if t.get(key) is not None:
            parts.append(f"{key} {t[key] * 1000:.1f} ms")
    if t.get("decode_tokens_per_second"):
        parts.append(f"decode {t['decode_tokens_per_second']:.1f} tok/s")
    return f"[{final.get('tokens')} tokens, {final.get('finish')}] " + ", ".join(parts)


def _reply(records: Iterable[GenerationRecord], *, echo: bool) -> dict[str, Any]:
    """Stream the tokens to stdout (when ``echo``); the final record with the whole text."""
    text: list[str] = []
    final: FinalRecord | dict[str, Any] = {}
    # On a terminal, a control character of the reply shows as its escape (a reply is the
    # daemon's bytes); into a pipe or file the reply goes as it is.
    shown = defang if sys.stdout.isatty() else str
    try:
        for rec in records:
            if "done" in rec:
                final = rec
            else:
                text.append(rec["token"])
                if echo:
                    sys.stdout.write(shown(rec["token"]))
                    sys.stdout.flush()
    except ModeldError:
        if echo and text:
            sys.stdout.write("\n")  # the error's line starts on a line of its own
        raise
    return {"text": "".join(text), **final}


def _read_message(first: str) -> str | None:
    """The rest of a message that began with ``\"\"\"`` (None at Ctrl-D)."""
    lines = [first[3:]] if first[3:] else []
    while True:
        try:
            line = input("... ")
        except EOFError:
            return None
        if line.rstrip().endswith('"""'):
            lines.append(line.rstrip()[:-3])
            return "\n".join(lines).strip("\n")
        lines.append(line)


def chat(client: Client, model_id: str, options: dict[str, Any]) -> None:
    """The interactive loop: one turn per message, the whole conversation sent each time."""
    import readline  # noqa: F401 (input() gains line editing and history)

    err_console.print(CHAT_HELP.format(model=model_id), highlight=False)
    messages: list[dict[str, str]] = []
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            sys.stdout.write("\n")
            return
        text: str | None = line
        command = line.strip()
        if command in ("/bye", "/exit", "/quit"):
            return
        if command == "/clear":
            messages.clear()
            err_console.print("conversation cleared")
            continue
        if command in ("/help", "/?"):
            err_console.print(escape(COMMANDS), highlight=False)
            continue
        if command.startswith("/") and " " not in command and len(command) > 1:
            err_console.print(
                f"unknown command {escape(command)}; /help lists the commands", highlight=False
            )
            continue
        if line.lstrip().startswith('"""'):
            text = _read_message(line.lstrip())
            if text is None:
                return
        if not text or not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        try:
            result = _reply(client.chat(model_id, messages, **options), echo=True)
        except KeyboardInterrupt:
            # Ctrl-C stops this reply only; the conversation goes on without it.
            messages.pop()
            sys.stdout.write("\n")
            err_console.print("(reply stopped)")
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": result["text"]})


def run(
    ctx: Ctx,
    *,
    model_id: str,
    prompt: str | None,
    images: list[Path] | None,
    system: str | None,
    fmt: str | None,
    max_tokens: int | None,
    temperature: float | None,
    seed: int | None,
    keep_alive: str | None,
    allow_unverified: bool,
    as_json: bool,
) -> None:
    """Generate a reply to PROMPT (or stdin: `-` or a pipe); with no prompt on a terminal,
    chat. Tokens stream to stdout, phase timings go to stderr."""
    options: dict[str, Any] = {
        "system": system,
        "format": fmt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "keep_alive": keep_alive,
        "allow_unverified": allow_unverified,
    }
    if images:
        # The CLI reads the files itself and sends their bytes (the CLI's contract).
        options["images"] = [p.read_bytes() for p in images]
    if prompt is None and sys.stdin.isatty():
        if as_json:
            raise UsageError("--json needs a prompt (an argument, or `-` for stdin)")
        with client_of(ctx) as client:
            # Refused as its first message would be (an unknown id, no install, no plan),
            # before the chat opens.
            client.check(model_id, len(images or ()), allow_unverified)
            chat(client, model_id, options)
        return
    if prompt is None or prompt == "-":
        # Refused before stdin is read (a terminal waits for Ctrl-D), as the request would be.
        call(ctx, lambda c: c.check(model_id, len(images or ()), allow_unverified))
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise UsageError("the prompt read from stdin is empty")
    text = prompt
    result = call(ctx, lambda c: _reply(c.generate(model_id, text, **options), echo=not as_json))
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
        return
    sys.stdout.write("\n")
    if "json" in result:
        err_console.print(f"json: {result['json']['status']}")
    err_console.print(timings_line(result))


def run_parser(verbs: Verbs) -> None:
    p = verbs.add("run", run)
    completes(p.add_argument("model_id", metavar="MODEL_ID"), complete_model)
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="The prompt; - reads stdin.")
    completes(
        p.add_argument(
            "--image",
            dest="images",
            action="append",
            type=data_file,
            metavar="PATH",
            help="An image to send with the prompt (repeatable).",
        ),
        "file",
    )
    p.add_argument("--system", help="A system prompt (the model's instructions).")
    p.add_argument("--format", dest="fmt", choices=["json"], help="Ask for a JSON answer.")
    p.add_argument("--max-tokens", type=in_range(int, 1), help="Cap the reply's length.")
    p.add_argument(
        "--temperature", type=in_range(float, 0.0, 100.0), help="Sampling temperature (0: greedy)."
    )
    p.add_argument("--seed", type=in_range(int, 0, 2**31 - 1), help="Sampling seed (repeatable).")
    p.add_argument(
        "--keep-alive",
        type=keep_alive_arg,
        help="Idle time before the engine stops: 30s, 5m, 0, -1.",
    )
    p.add_argument(
        "--allow-unverified", action="store_true", help="Use a file no hash vouched for."
    )
    json_flag(p)
