"""README.md and docs/*.md stay true: the repository paths they name exist, and the `modeld`
commands they show parse with the real command line parser."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from modeld.cli import ALIASES, VERBS, build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Where a path that names a repository file starts.
TOP = ("modeld/", "tests/", "docs/", "bench/", "registry/", "systemd/", ".ci/")
ROOT_FILES = ("pyproject.toml", "constraints.txt", "README.md", ".pre-commit-config.yaml")

_FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.M | re.S)
# Fences whose every line is a shell command; in others (output, TOML, Python) only a line
# that starts with the prompt ``$ `` is one.
SHELL = ("sh", "bash", "shell", "console")
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# What ends a command in a shell line: a comment, a pipe, a list, a redirection.
_END = re.compile(r"\s(?:#|\||&&|;|>|2>|<)\s?|\)$|\)\s")


def _text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def _spans(text: str, own: bool = False) -> list[str]:
    """Inline code spans outside fenced blocks; ``own``: not those that name another
    project's file (Ollama's `docs/api.md`)."""
    prose = _FENCE.sub("", text)
    return [
        m.group(1)
        for m in _SPAN.finditer(prose)
        if not (own and prose[: m.start()].endswith("'s "))
    ]


def _block_lines(text: str, shell_only: bool = False) -> list[str]:
    """The lines of fenced code blocks, continuation lines joined; ``shell_only``: only
    the shell commands among them (see ``SHELL``)."""
    out: list[str] = []
    for kind, block in _FENCE.findall(text):
        lines = block.replace("\\\n", " ").splitlines()
        if shell_only and kind.strip() not in SHELL:
            lines = [line for line in lines if line.startswith("$ ")]
        out += lines
    return out


def _paths(doc: Path) -> set[str]:
    """What ``doc`` names as a repository path: links to files, and code spans or words of
    code blocks that start with a top-level dir of the repository (or name a root file)."""
    text = _text(doc)
    found: set[str] = set()
    for target in _LINK.findall(text):
        if "://" not in target and not target.startswith("mailto:"):
            found.add(str((doc.parent / target).resolve().relative_to(REPO)))
    words = [w for span in _spans(text, own=True) for w in span.split()]
    words += [w for line in _block_lines(text) for w in line.split()]
    for raw in words:
        word = raw.strip("\"'(),;:").removesuffix(".")
        if any(c in word for c in "$<{…") or "://" in word:
            continue
        if word.startswith(TOP) or word in ROOT_FILES:
            found.add(word.split(":", 1)[0].split("#", 1)[0])
    return found


def _bare_python_files(doc: Path) -> set[str]:
    """Code spans that are a bare Python file name (``test_runner.py``, ``errors.py``)."""
    return {s for s in _spans(_text(doc)) if re.fullmatch(r"[\w*]+\.py", s)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_repository_path_named_exists(doc: Path) -> None:
    """A path into the repository that a document names exists (a glob matches a file);
    a bare Python file name is a file of the repository."""
    missing = [p for p in sorted(_paths(doc)) if not any(REPO.glob(p.rstrip("/") or "."))]
    missing += [
        name
        for name in sorted(_bare_python_files(doc))
        if not any(p for p in REPO.rglob(name) if ".venv" not in p.parts)
    ]
    assert missing == [], f"{doc.name} names what the repository lacks: {missing}"


def _commands(doc: Path) -> list[tuple[list[str], bool]]:
    """Every `modeld ...` command the document shows, as words, and whether a code block
    shows it (else prose names it): where ``modeld`` (or a ``bin/modeld``) is the command of
    a shell line or of a part of one (after ``&&``, ``|``, ``$(``...), leading ``VAR=value``
    and ``sudo`` skipped, up to a comment or redirection."""
    text = _text(doc)
    out: list[tuple[list[str], bool]] = []
    sources = [(s, False) for s in _spans(text)]
    sources += [(s, True) for s in _block_lines(text, shell_only=True)]
    for source, in_block in sources:
        if source.lstrip().startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;|\||\$\(|`|\)", source.removeprefix("$ ")):
            try:
                words = shlex.split(part, comments=True)
            except ValueError:
                words = part.split()
            while words and (re.fullmatch(r"\w+=\S*", words[0]) or words[0] == "sudo"):
                words = words[1:]
            if words and (words[0] == "modeld" or words[0].endswith("bin/modeld")):
                cut = next((i for i, w in enumerate(words) if w.startswith((">", "2>"))), None)
                out.append((["modeld", *words[1:cut]], in_block))
    return out


def _is_synopsis(command: str) -> bool:
    """A usage line (``modeld run ID [PROMPT|-]``), not a command to run."""
    return any(c in command for c in "[]…|")


def _verb(words: list[str]) -> str | None:
    """The verb of ``modeld`` + ``words`` (its options before it skipped)."""
    i = 0
    while i < len(words):
        if words[i] == "--socket":
            i += 2
        elif re.fullmatch(r"[A-Za-z][\w-]*", words[i]):
            return words[i]
        else:  # an option, a ratio (`modeld / curl`), an ellipsis (`sudo modeld …`)
            return None
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_cli_command_shown_parses(doc: Path) -> None:
    """Each verb a document shows exists and answers `modeld VERB --help`; each whole
    command (not a usage line) parses with the real parser, a file it names on the
    reader's machine apart."""
    verbs: set[str] = set()
    bad: list[str] = []
    for words, in_block in _commands(doc):
        command = " ".join(words)
        verb = _verb(words[1:])
        if verb is None:
            continue
        if ALIASES.get(verb, verb) not in VERBS:
            bad.append(f"{command}: no verb {verb!r}")
            continue
        verbs.add(ALIASES.get(verb, verb))
        # A usage line, or a verb named in prose (`modeld key`), is not a command to run.
        if _is_synopsis(command) or words[-1] == verb:
            continue
        at = words.index(verb)
        argv = [*words[1:at], ALIASES.get(verb, verb), *words[at + 1 :]]
        at -= 1
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                build_parser([argv[at]]).parse_args(argv)
        except SystemExit as e:
            # A file the command names is the reader's (`modeld import /media/usb/...`);
            # prose may name a verb with some of its options (`modeld rm --force`).
            fine = ["does not exist"] + ([] if in_block else ["arguments are required"])
            if e.code not in (0, None) and not any(f in said.getvalue() for f in fine):
                bad.append(f"{command}: {said.getvalue().strip().splitlines()[-1]}")
    assert bad == [], f"{doc.name}: commands that do not parse: {bad}"
    for verb in sorted(verbs):
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as done:
            build_parser([verb]).parse_args([verb, "--help"])
        assert done.value.code == 0 and f"usage: modeld {verb}" in shown.getvalue(), verb


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(doc: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+\s+(.*)$", _FENCE.sub("", _text(doc)), re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_link_to_a_section_finds_it(doc: Path) -> None:
    """A link to ``doc.md#section`` (or ``#section`` of the same file) names a heading that
    is there."""
    broken = []
    for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", _text(doc)):
        linked = doc if not target else (doc.parent / target).resolve()
        if linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target}#{anchor}")
    assert broken == [], f"{doc.name} links to sections that are not there: {broken}"
