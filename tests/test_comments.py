"""Comments say why in one sentence: no measured figure in a comment or docstring under modeld/.

A figure (a time, a rate, a ratio, a multiple, a percentage, an approximate size) goes stale
with the next benchmark run and makes commits that only re-sync comments; it lives in
docs/benchmarks.md, which a comment may point to (``see docs/benchmarks.md#section``).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "modeld"
_NUMBER = r"(?<![\w./])\d[\d,]*(?:\.\d+)?"
_SIZE = r"(?:[KMGT]i?B|bytes|B)"
FIGURE = re.compile(
    "|".join(
        (
            rf"{_NUMBER}\s?(?:ms|µs|us|ns)\b",  # a time below a second
            rf"{_NUMBER}\.\d+\s?s\b|{_NUMBER}\s?(?:CPU-)?s\b(?= (?:more|less|after|per|of))",
            rf"{_NUMBER}\s?(?:{_SIZE}|req|tok(?:en)?s?|CPU-s)/s\b",  # a rate
            rf"{_NUMBER}\s?(?:%|\u00d7)|{_NUMBER}x(?![\w.])",  # a share, a multiple (x or the sign)
            rf"{_NUMBER}\s?{_SIZE}? (?:of|against|out of) {_NUMBER}\b",  # a ratio
            rf"~\s?{_NUMBER}",  # an approximate figure
            rf"[+]{_NUMBER}\s?{_SIZE}",  # a measured growth
        )
    )
)
# A link to the figures, and a literal (``10MB/s``: a value a setting takes), are no figure.
_SPARED = re.compile(r"docs/benchmarks\.md(?:#[\w-]+)?|``[^`]*``")


def comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and every line of every docstring in ``path``."""
    source = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        doc = ast.get_docstring(node, clean=False)
        if doc is not None:
            first = node.body[0].lineno
            yield from ((first + i, line) for i, line in enumerate(doc.splitlines()))


def figures(text: str) -> list[str]:
    return [m.group(0) for m in FIGURE.finditer(_SPARED.sub("", text))]


def test_the_pattern_finds_figures_and_spares_settings() -> None:
    """Measured figures are found; a setting's value or a format example is not one."""
    for text in (
        "cut throughput by 4 % (336 against 351 req/s)",
        "6 to 8 in 40,000 were lost, 0.55 s each",
        "hashing ran at 1.24 GB/s, ~10x faster",
        "took 3-4 ms of CPU",
        "+14 MiB PSS at create",
        "77 MB of 512 was left",
    ):
        assert figures(text), text
    for text in (
        "``MODELD_KEEP_ALIVE`` (``5m``, ``30s``) as a duration",
        "blocks of ``BLOCK_SIZE`` bytes; HTTP/1.x heads; at most 10 redirects; ``10MB/s``",
        "see docs/benchmarks.md#downloads for the figures",
        "sun_path holds 108 bytes with its NUL; an address (<object at 0x...>)",
    ):
        assert not figures(text), text


def test_no_measured_figure_in_a_comment() -> None:
    """No comment or docstring under modeld/ carries a measured figure."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in comments(path):
            if hits := figures(text):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {hits} in {text.strip()}")
    assert not found, "move these figures to docs/benchmarks.md:\n" + "\n".join(found)


def _anchor(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading (GitHub's rule, for plain text)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_the_figures_names_a_section() -> None:
    """Each ``docs/benchmarks.md#section`` a comment points to is a heading of that file."""
    docs = (PACKAGE.parent / "docs" / "benchmarks.md").read_text()
    anchors = {_anchor(line.lstrip("#")) for line in docs.splitlines() if line.startswith("#")}
    links = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in comments(path):
            links += [(path.name, line, m) for m in re.findall(r"benchmarks\.md#([\w-]+)", text)]
    assert links
    assert not [link for link in links if link[2] not in anchors], anchors
