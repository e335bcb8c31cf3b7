"""``modeld bug-report ID``: the CLI in a subprocess against a real daemon writes one file with
what an upstream issue needs (modeld/cli/report.py and modeld/api/report.py)."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.download.hub import Hub
from modeld.download.source import SourceSet
from modeld.hostinfo import runtime_version
from modeld.logs import redact_url
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, default_backend_env
from tests.support.state import MODELS, write_entry
from tests.support.wait import wait_sync

TINY = MODELS / "tiny-text.litertlm"
REVISION = "6e5c4f1e395deb959c494953478fa5cec4b8008f"


@pytest.fixture
def used_daemon(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A daemon (default backends) that imported tiny-text, loaded it and answered once."""
    registry, home = short_tmp / "registry", short_tmp / "home"
    digest, size = sha256_file(TINY)
    url = f"http://127.0.0.1:9/org/tiny-litert-lm/resolve/{REVISION}/tiny-text.litertlm"
    write_entry(registry, "tiny-text", size=size, sha256=digest, urls=[url])
    d = DaemonProcess(home=home, env=default_backend_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    assert d.cli("import", str(TINY), "tiny-text").returncode == 0
    assert d.cli("run", "tiny-text", "hello", "--max-tokens", "2").returncode == 0
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def _report(d: DaemonProcess, *args: str, cwd: Path) -> tuple[Path, str]:
    out = subprocess.run(
        [sys.executable, "-m", "modeld", "bug-report", "tiny-text", *args],
        env=d.env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    return path, path.read_text()


def test_bug_report_has_what_an_upstream_issue_needs(
    used_daemon: DaemonProcess, short_tmp: Path
) -> None:
    """One file in the working dir: host, runtime, adapter, file facts, probes, stderr, events."""
    d = used_daemon
    cwd = short_tmp / "work"
    cwd.mkdir()
    path, text = _report(d, cwd=cwd)
    assert path.parent == cwd and path.name.startswith("modeld-bug-report-tiny-text-")
    assert [p.name for p in cwd.iterdir()] == [path.name]
    digest, size = sha256_file(TINY)
    ps = d.cli_json("ps")
    shown = d.cli_json("show", "tiny-text")
    engine = ps["engines"][0]
    for fact in (
        socket.gethostname(),
        platform.python_version(),
        platform.release(),
        f"litert-lm-api {runtime_version()}",
        f"| revision | {REVISION} |",
        f"| size | {size} bytes |",
        f"| sha256 | {digest} |",
        "| verified by | registry sha256 |",
        f"- text: {shown['plans']['text']['plan']['key']}",
        f"| engine | {engine['id']} |",
        f"| pid | {engine['pid']} |",
        "| state | alive |",
    ):
        assert fact in text, fact
    gpu = shown["probes"]["gpu"]
    adapter = gpu["adapter"] if gpu["ok"] else f"none ({gpu['reason'].split(' | ')[0]})"
    assert f"| GPU adapter | {adapter.replace('|', chr(92) + '|')} |" in text
    assert ("### gpu: ok" if gpu["ok"] else "### gpu: failed: ") in text
    # The probe child's and the runner's stderr, quoted whole.
    assert "Probe child's stderr:" in text and "Its stderr:" in text
    runner_stderr = text.split("Its stderr:", 1)[1]
    assert "XNNPACK" in runner_stderr or "environment" in runner_stderr
    for event in ("installed", "gpu_probe", "engine_loaded"):
        assert f"| {event} |" in text, event


def test_bug_report_keeps_a_dead_runners_stderr(
    used_daemon: DaemonProcess, short_tmp: Path
) -> None:
    """After its runner is killed, the report still quotes its stderr and says how it died."""
    d = used_daemon
    pid = d.cli_json("ps")["engines"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_sync(lambda: d.cli_json("ps")["engines"] == [], 30.0, "the dead engine gone from ps")
    out = short_tmp / "report.md"
    path, text = _report(d, "--output", str(out), cwd=short_tmp)
    assert path == out.resolve()
    assert "| state | killed by SIGKILL (the OOM killer or kill -9)" in text
    runner_stderr = text.split("Its stderr:", 1)[1]
    assert "XNNPACK" in runner_stderr or "environment" in runner_stderr
    assert "| engine_crashed |" in text
    doc = d.cli_json("bug-report", "tiny-text", "--output", str(short_tmp / "again.md"))
    assert doc == {"path": str(short_tmp / "again.md"), "size": doc["size"]} and doc["size"] > 0


def test_bug_report_of_an_unknown_model_fails_cleanly(used_daemon: DaemonProcess) -> None:
    """An id nobody knows: exit 1, one line saying where the known ids are, no file."""
    out = used_daemon.cli("bug-report", "no-such-model")
    assert out.returncode == 1 and "modeld list" in out.stderr
    assert out.stdout == ""


def test_bug_report_to_a_path_it_cannot_write_says_so_in_one_line(
    used_daemon: DaemonProcess, short_tmp: Path
) -> None:
    """--output in a folder that does not exist, or a folder itself: exit 1, one line naming
    the path and to choose another, no traceback, no file (nor a half one) left."""
    work = short_tmp / "work é b"
    work.mkdir()
    for target in (work / "no such dir" / "r.md", work):
        out = subprocess.run(
            [sys.executable, "-m", "modeld", "bug-report", "tiny-text", "--output", str(target)],
            env=used_daemon.env,
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 1, out.stderr
        lines = out.stderr.splitlines()
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith(f"modeld: cannot write the bug report to {target}"), lines[0]
        assert "--output" in lines[0]
        assert out.stdout == ""
    assert list(work.iterdir()) == []


def test_revision_comes_from_the_pinned_url() -> None:
    """The revision is the commit pinned in the first ``/resolve/<rev>/`` URL, else none."""
    hub = f"https://huggingface.co/org/repo/resolve/{REVISION}/m.litertlm"
    mirror = "https://hf-mirror.com/org/repo/resolve/main/m.litertlm"
    revision_of = SourceSet(Hub()).revision
    assert revision_of(["https://mirror.example/m.litertlm", hub, mirror]) == REVISION
    assert revision_of(["https://example.org/files/m.litertlm"]) is None
    assert revision_of([]) is None


def test_urls_in_a_report_lose_credentials_and_queries() -> None:
    """A report is posted: a mirror's user:password and a signed URL's query stay out."""
    assert (
        redact_url("http://bob:S3cretPw@127.0.0.1:8765/m.litertlm?token=QSECRET42#x")
        == "http://(credentials)@127.0.0.1:8765/m.litertlm?(query)"
    )
    plain = f"https://huggingface.co/org/repo/resolve/{REVISION}/m.litertlm"
    assert redact_url(plain) == plain
