"""A strict reply's check against its schema: a verdict, or a bounded refusal to give one."""

from __future__ import annotations

import threading
import time

import pytest

from modeld.schemacheck import CheckFailed, CheckTimeout, reply_problem

BACKTRACKS = {"type": "object", "patternProperties": {"^(a|a)*$": {"type": "integer"}}}


def test_a_matching_reply_has_no_problem_and_a_mismatch_says_where() -> None:
    """Patterns are matched: a key or value that matches passes, one that does not is named."""
    schema = {
        "type": "object",
        "properties": {"day": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}},
        "patternProperties": {"^n_": {"type": "integer"}},
    }
    assert reply_problem(schema, {"day": "2026-12-05", "n_a": 1}) is None
    problem = reply_problem(schema, {"day": "5 Dec"})
    assert problem is not None and problem.startswith("at day:") and "does not match" in problem
    problem = reply_problem(schema, {"n_b": "x"})
    assert problem is not None and problem.startswith("at n_b:")


def test_a_backtracking_pattern_is_stopped_at_its_bound() -> None:
    """A pattern that backtracks on the reply's key ends in ``CheckTimeout``, not a hang."""
    with pytest.raises(CheckTimeout, match="took over"):
        reply_problem(BACKTRACKS, {"a" * 64 + "b": 1}, seconds=0.2)


def test_a_backtracking_check_leaves_other_threads_running() -> None:
    """While a pattern backtracks, the runner's other threads (its socket reader) still run:
    the match gives the GIL up."""
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())
            stop.wait(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        began = time.monotonic()
        with pytest.raises(CheckTimeout):
            reply_problem(BACKTRACKS, {"a" * 64 + "b": 1}, seconds=0.5)
        ended = time.monotonic()
    finally:
        stop.set()
        ticker.join()
    # Ticks well inside the check, not only at its edges.
    middle = (began + ended) / 2
    assert any(abs(t - middle) < (ended - began) / 4 for t in ticks)


def test_a_reference_loop_is_a_failed_check() -> None:
    """A schema that refers to itself without end cannot be checked: said, not a crash."""
    with pytest.raises(CheckFailed):
        reply_problem({"$ref": "#"}, {})
