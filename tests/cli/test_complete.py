"""Completion's candidates from the parser (no daemon: the ids' completers offer nothing)."""

from __future__ import annotations

from pathlib import Path

from modeld.cli import build_parser
from modeld.cli.complete import SCRIPTS, candidates


def _offered(line: str, incomplete: str = "") -> list[str]:
    return candidates(build_parser(), line.split(), incomplete)


def test_verbs_and_their_options() -> None:
    """The verbs at the first word (aliases left out), a verb's options after a dash."""
    verbs = _offered("", "p")
    assert verbs == ["plain,prune", "plain,ps", "plain,pull"]
    assert "plain,--detach" in _offered("pull tiny-text", "--")
    assert _offered("ls", "--inst") == ["plain,--installed"]  # an alias reaches its verb


def test_values_of_options_paths_and_nested_verbs() -> None:
    """An option's choices, a path for `import` and `--image`, `key`'s own verbs."""
    assert _offered("load tiny-text --main") == ["plain,cpu", "plain,gpu"]
    assert _offered("import") == ["file,"]
    assert _offered("run tiny-text --image") == ["file,"]
    assert _offered("key") == ["plain,add", "plain,list", "plain,rm"]
    assert _offered("key add bob --role", "a") == ["plain,admin"]
    assert _offered("frobnicate") == []


def test_no_daemon_no_ids(short_tmp: Path) -> None:
    """With no daemon on the socket, a model id completes to nothing (and raises nothing)."""
    line = f"--socket {short_tmp / 'none.sock'} show"
    assert _offered(line, "t") == []


def test_a_script_for_each_shell() -> None:
    """bash, zsh and fish each get a function that calls back `modeld`."""
    for name, script in SCRIPTS.items():
        shell = name.removesuffix("_source")
        assert f"_MODELD_COMPLETE={shell}_complete" in script
