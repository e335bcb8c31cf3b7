"""``modeld.download.downloads``: the parts of the downloads registry that need no mirror."""

from __future__ import annotations

from modeld.download.downloads import failure_line


def test_a_failed_pull_names_its_model_once_in_status() -> None:
    """A failure whose message names its model at its head is shown as it is ("m1: download
    of m1 failed" said it twice); one that does not is led by the id."""
    assert failure_line("m1", "download of m1 failed: OSError(); see the log") == (
        "download of m1 failed: OSError(); see the log"
    )
    assert failure_line("m1", "model m1: sha256 mismatch") == "model m1: sha256 mismatch"
    assert failure_line("m1", "no mirror could serve the file; `modeld show m1` names it") == (
        "m1: no mirror could serve the file; `modeld show m1` names it"
    )
    assert failure_line("m1", "m10 is elsewhere: x") == "m1: m10 is elsewhere: x"
