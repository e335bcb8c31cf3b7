"""Shell completion: verbs, options, and model ids asked of the daemon.

``eval "$(_MODELD_COMPLETE=bash_source modeld)"`` (or ``zsh_source``, ``fish_source``) prints a
script that defines the shell's completion function. On TAB that function runs ``modeld``
again with ``_MODELD_COMPLETE=<shell>_complete``, ``COMP_WORDS`` (the command line's words)
and ``COMP_CWORD`` (the index of the word being completed); ``modeld`` then prints one
``type,value`` line per candidate: ``plain,tiny-text``, or ``file,`` to let the shell
complete a path.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from modeld.cli.common import Ctx

BASH = """\
_modeld_completion() {
    local IFS=$'\\n' line
    COMPREPLY=()
    for line in $(env COMP_WORDS="${COMP_WORDS[*]}" COMP_CWORD=$COMP_CWORD \\
            _MODELD_COMPLETE=bash_complete "$1"); do
        case "$line" in
            file,*) compopt -o default ;;
            plain,*) COMPREPLY+=("${line#plain,}") ;;
        esac
    done
    return 0
}
complete -o nosort -F _modeld_completion modeld
"""

ZSH = """\
#compdef modeld
_modeld_completion() {
    local -a values
    local line
    for line in ${(f)"$(env COMP_WORDS="${words[*]}" COMP_CWORD=$((CURRENT - 1)) \\
            _MODELD_COMPLETE=zsh_complete modeld)"}; do
        case "$line" in
            file,*) _files; return ;;
            plain,*) values+=("${line#plain,}") ;;
        esac
    done
    compadd -Q -a values
}
compdef _modeld_completion modeld
"""

FISH = """\
function _modeld_completion
    set -l words (commandline -opc) (commandline -ct)
    for line in (env COMP_WORDS="$words" COMP_CWORD=(math (count $words) - 1) \\
            _MODELD_COMPLETE=fish_complete modeld)
        switch $line
            case 'file,*'
                __fish_complete_path (commandline -ct)
            case 'plain,*'
                string sub -s 7 -- $line
        end
    end
end
complete --no-files --command modeld --arguments '(_modeld_completion)'
"""

SCRIPTS = {"bash_source": BASH, "zsh_source": ZSH, "fish_source": FISH}


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def candidates(parser: argparse.ArgumentParser, words: list[str], incomplete: str) -> list[str]:
    """What may come at ``incomplete`` after ``words`` (the words before it, no program
    name): ``plain,VALUE`` lines, or ``file,``."""
    ctx = Ctx(socket=None)
    positionals = [a for a in parser._actions if not a.option_strings]
    pending: argparse.Action | None = None  # an option whose value comes next
    for word in words:
        if pending is not None:
            if pending.dest == "socket":
                ctx.socket = word
            pending = None
            continue
        if word.startswith("-") and word != "-":
            action = parser._option_string_actions.get(word.split("=", 1)[0])
            if action is not None and _takes_value(action) and "=" not in word:
                pending = action
            continue
        if not positionals:
            continue
        action = positionals[0]
        if isinstance(action, argparse._SubParsersAction):
            from modeld.cli import ALIASES

            chosen = action.choices.get(ALIASES.get(word, word))
            if chosen is None:
                return []
            parser = chosen
            positionals = [a for a in parser._actions if not a.option_strings]
            continue
        if action.nargs not in ("*", "+"):
            positionals = positionals[1:]
    if pending is not None:
        return _values(ctx, pending, incomplete)
    if incomplete.startswith("-"):
        options = sorted(o for o in parser._option_string_actions if o.startswith(incomplete))
        return [f"plain,{o}" for o in options]
    return _values(ctx, positionals[0], incomplete) if positionals else []


def _values(ctx: Ctx, action: argparse.Action, incomplete: str) -> list[str]:
    if isinstance(action, argparse._SubParsersAction):
        names = list(action.choices)
    elif action.choices is not None:
        names = [str(c) for c in action.choices]
    else:
        complete: Callable[[Ctx, str], list[str]] | str | None = getattr(action, "complete", None)
        if complete == "file":
            return ["file,"]
        names = complete(ctx, incomplete) if callable(complete) else []
    return [f"plain,{n}" for n in names if n.startswith(incomplete)]


def complete(instruction: str, build: Callable[[], argparse.ArgumentParser]) -> None:
    """Print the shell's script (``*_source``), or the candidates (``*_complete``)."""
    if instruction in SCRIPTS:
        sys.stdout.write(SCRIPTS[instruction])
        return
    words = os.environ.get("COMP_WORDS", "").split()
    try:
        cword = int(os.environ.get("COMP_CWORD", ""))
    except ValueError:
        cword = len(words)
    incomplete = words[cword] if cword < len(words) else ""
    for line in candidates(build(), words[1:cword], incomplete):
        sys.stdout.write(line + "\n")
