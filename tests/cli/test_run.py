"""``modeld run``: the prompt from stdin, and the interactive chat on a terminal (a real pty)."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from modeld.client import Client
from tests.cli.conftest import Tiny
from tests.support.unix import cut_off_daemon


def _cli(tiny: Tiny, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args],
        env=tiny.daemon.env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_prompt_comes_from_a_pipe_or_dash(tiny: Tiny) -> None:
    """`echo hi | modeld run ID` and `modeld run ID -` read the prompt from stdin; the
    sampling options reach the daemon (a seeded greedy reply is the same twice)."""
    args = ("run", "tiny-text", "--max-tokens", "4", "--seed", "7", "--temperature", "0")
    piped = _cli(tiny, *args, "--json", stdin="hello there\n")
    dashed = _cli(tiny, *args, "-", "--json", "--system", "be brief", stdin="hello there\n")
    assert piped.returncode == 0, piped.stderr
    assert dashed.returncode == 0, dashed.stderr
    first, second = json.loads(piped.stdout), json.loads(dashed.stdout)
    assert first["done"] and second["done"]
    again = json.loads(_cli(tiny, *args, "--json", stdin="hello there\n").stdout)
    assert again["text"] == first["text"]
    empty = _cli(tiny, "run", "tiny-text", stdin="")
    assert empty.returncode == 2 and "empty" in empty.stderr


def test_the_timing_line_is_one_line_on_a_pipe(tiny: Tiny) -> None:
    """Not a terminal: stderr's timing line is never wrapped, and carries no markup."""
    result = _cli(tiny, "run", "tiny-text", "hello", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[") and "total" in lines[0]


def test_an_image_that_is_a_device_is_bad_usage(tiny: Tiny) -> None:
    """`--image /dev/zero` is refused before anything is read (exit 2, the path named): the
    CLI reads an image whole, and that read never ended while memory grew."""
    result = _cli(tiny, "run", "tiny-text", "hi", "--image", "/dev/zero")
    assert result.returncode == 2, result.stderr
    assert "'/dev/zero' is a device, not a file; give an image file" in result.stderr
    assert result.stdout == ""


def test_a_daemon_that_goes_away_mid_reply_is_one_line_not_a_traceback(short_tmp: Path) -> None:
    """A daemon that closes the connection after the first chunk of a reply: the tokens so far
    end their line, then one line says what happened and what to do, exit status 1."""
    record = b'{"token": "hel"}\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
    answer = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(record), record)
    with cut_off_daemon(short_tmp / "cut.sock", answer) as sock:
        result = subprocess.run(
            [sys.executable, "-m", "modeld", "--socket", str(sock), "run", "tiny-text", "hi"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 1, result.stderr
    assert result.stdout == "hel\n"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("modeld: the daemon closed the connection"), lines[0]
    assert "retry" in lines[0]


def _read_until(fd: int, needle: bytes | None, deadline: float) -> bytes:
    """What the pty shows until ``needle`` (None: until the child closes it)."""
    seen = b""
    while needle is None or needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {seen!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the pty
                break
            if not chunk:
                break
            seen += chunk
    return seen


def _on_a_pty(tiny: Tiny, *args: str) -> tuple[int, int]:
    """``modeld ARGS`` started on a new pty: (its pid, the pty's fd)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI on the pty
        os.execve(sys.executable, [sys.executable, "-m", "modeld", *args], tiny.daemon.env)
    return pid, fd


def test_no_prompt_on_a_terminal_opens_a_chat(tiny: Tiny) -> None:
    """On a pty: a chat opens; each turn is answered, a \"\"\" block is one message, /help and
    /? list the commands, a mistyped one is named; no command reaches the model; /bye ends it
    with exit status 0. The second turn continues the conversation the engine kept after the
    first reply (the chat sends the reply back as it got it), and `ps` says so."""
    with Client(tiny.socket) as c:
        before = _requests(c)
        continued = _continued(c)
    pid, fd = _on_a_pty(tiny, "run", "tiny-text", "--max-tokens", "3")
    deadline = time.monotonic() + 120
    try:
        banner = _read_until(fd, b">>> ", deadline)
        assert b"Chatting with tiny-text" in banner and b"/help" in banner
        os.write(fd, b"hello\n")
        _read_until(fd, b">>> ", deadline)
        os.write(fd, b'"""first line\nsecond line"""\n')
        block = _read_until(fd, b">>> ", deadline)
        assert b"... " in block
        for command in (b"/help", b"/?"):
            os.write(fd, command + b"\n")
            listed = _read_until(fd, b">>> ", deadline)
            assert b"/clear" in listed and b"/bye" in listed and b"Ctrl-C" in listed, listed
        os.write(fd, b"/hlep\n")
        assert b"unknown command /hlep; /help" in _read_until(fd, b">>> ", deadline)
        os.write(fd, b"/bye\n")
        tail = _read_until(fd, None, deadline)
        status = _wait(pid, deadline)
    finally:
        os.close(fd)
    assert status == 0, tail
    with Client(tiny.socket) as c:
        assert _requests(c) == before + 2  # two turns answered; the commands sent nothing
        assert _continued(c) == continued + 1
    ps = _cli(tiny, "ps")
    assert "CONTINUED" in ps.stdout and f"{continued + 1}/" in ps.stdout, ps.stdout


def test_a_model_that_cannot_answer_is_refused_before_the_chat_opens(tiny: Tiny) -> None:
    """An id the catalog lacks (with the nearest known ids), or a model not installed: one
    line, the error a request gets, exit 1, before "Chatting with" on a terminal and before
    stdin is read otherwise."""
    cases = [
        ("tiny-txt", "no model 'tiny-txt' in the catalog (did you mean tiny-text?)"),
        ("gemma-4-e2b-it", "did you mean gemma-4-E2B-it"),
        ("gemma-4-E2B-it", "not installed; run `modeld pull gemma-4-E2B-it` first"),
    ]
    for model, said in cases:
        pid, fd = _on_a_pty(tiny, "run", model)
        deadline = time.monotonic() + 60
        try:
            shown = _read_until(fd, None, deadline)
            status = _wait(pid, deadline)
        finally:
            os.close(fd)
        assert status == 1 and said.encode() in shown, shown
        assert b"Chatting" not in shown and b">>> " not in shown
        # `-` with a stdin that stays open: refused without reading it (stdin never ends).
        waiting = subprocess.Popen(
            [sys.executable, "-m", "modeld", "run", model, "-"],
            env=tiny.daemon.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert waiting.wait(timeout=60) == 1
        finally:
            if waiting.poll() is None:
                waiting.kill()
            waiting.wait()
        assert waiting.stdin is not None and waiting.stderr is not None
        waiting.stdin.close()
        err = waiting.stderr.read()
        waiting.stderr.close()
        assert len(err.strip().splitlines()) == 1, err
        assert said in err, err


def _wait(pid: int, deadline: float) -> int | None:
    """The child's exit status; None (and the child killed) if it is still running at
    ``deadline``."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        select.select([], [], [], 0.05)  # a pause between polls, not a synchronisation
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


def _requests(c: Client) -> int:
    return sum(e["requests"] for e in c.engines()["engines"] if e["model"] == "tiny-text")


def _continued(c: Client) -> int:
    engines = c.engines()["engines"]
    return sum(e["conversations"]["continued"] for e in engines if e["model"] == "tiny-text")
