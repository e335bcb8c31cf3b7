"""Completion's candidates from the parser (no daemon: the ids' completers offer nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _readme_lines() -> dict[str, str]:
    """The README's completion lines, by shell (its code spans that load the script)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    spans = re.findall(r"`([^`]*_MODELD_COMPLETE=\w+_source modeld[^`]*)`", readme)
    return {re.search(r"(\w+)_source", s).group(1): s for s in spans}  # type: ignore[union-attr]


@pytest.mark.parametrize("shell", ["bash", "fish"])
def test_the_readmes_completion_line_says_when_modeld_is_not_on_path(
    shell: str, short_tmp: Path
) -> None:
    """Run in the shell as written in the README: with `modeld` on PATH it defines the
    completion quietly; without, it says so on stderr and its status is not 0 (it printed
    bash's "command not found" and exited 0)."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    line = _readme_lines()[shell]
    shown = "complete -p modeld" if shell == "bash" else "complete -c modeld"
    here = str(Path(sys.executable).parent)  # the venv's bin/, where `modeld` is
    env = {"HOME": str(short_tmp), "MODELD_SOCKET": str(short_tmp / "none.sock")}
    for path, works in ((f"{here}:/usr/bin:/bin", True), ("/usr/bin:/bin", False)):
        result = subprocess.run(
            [shell, "-c", f"{line}\n{shown}" if works else line],
            env={**env, "PATH": path},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if works:
            assert result.returncode == 0 and result.stderr == "", result.stderr
            assert "modeld" in result.stdout, result.stdout
        else:
            assert result.returncode != 0, result
            assert "modeld is not on PATH: no completion" in result.stderr, result.stderr
