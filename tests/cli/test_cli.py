"""The CLI's own behaviour: version, usage errors, no daemon, aliases, plain output on a
pipe, shell completion, logs."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.client import Client
from modeld.config import format_size
from modeld.download.ratelimit import TokenBucket
from modeld.errors import BadRequest
from tests.cli.conftest import TINY, Tiny
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.mirror import Faults, ThreadMirror
from tests.support.state import MODELS, write_entry
from tests.support.unix import cut_off_daemon
from tests.support.wait import wait_sync


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_version() -> None:
    """`modeld --version` prints the version and exits 0."""
    result = _run("--version")
    assert result.returncode == 0
    assert "modeld" in result.stdout


def test_bad_usage_exits_2() -> None:
    """An unknown verb is a usage error: exit 2."""
    assert _run("frobnicate").returncode == 2


def test_no_daemon_one_line_exit_1(short_tmp: Path) -> None:
    """With no daemon on the socket, the CLI says how to start one in one line and exits 1."""
    env = dict(os.environ, MODELD_SOCKET=str(short_tmp / "none.sock"))
    result = _run("status", env=env)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "modeld serve" in lines[0]


def test_no_daemon_says_why_in_words(short_tmp: Path) -> None:
    """--socket naming a plain file, or a path over the 107 bytes a socket path may hold: one
    line saying why in words (it named the exception class, OSError for the long path)."""
    plain_file = short_tmp / "not a socket"
    plain_file.write_text("")
    long_path = short_tmp / ("x" * (120 - len(str(short_tmp))))
    result = _run("--socket", str(plain_file), "status")
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"modeld: no modeld answers on {plain_file} (Connection refused); start one with "
        "`modeld serve` or pass --socket\n"
    )
    result = _run("--socket", str(long_path), "status")
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"modeld: the socket path {long_path} is longer than the 107 bytes a Unix socket path "
        "may have; pass a shorter one with --socket (or MODELD_SOCKET)\n"
    )


def test_a_daemon_that_goes_away_mid_answer_is_one_line_for_any_verb(short_tmp: Path) -> None:
    """`status` whose daemon closes after half its answer: one line saying what happened and
    what to do, exit status 1, as for a daemon that is not there at all."""
    answer = (
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 900\r\n\r\n{"ver'
    )
    with cut_off_daemon(short_tmp / "cut.sock", answer) as sock:
        result = _run("--socket", str(sock), "status")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("modeld: the daemon closed the connection"), lines[0]


@contextlib.contextmanager
def _followed_pull(
    short_tmp: Path, throttle: int, **env: str
) -> Iterator[tuple[DaemonProcess, subprocess.Popen[str]]]:
    """A daemon pulling ``slow`` from a throttled loopback mirror while `modeld pull slow`
    follows it (yielded once the download runs); the daemon is killed after, if still up."""
    data = TINY.read_bytes()
    mirror = ThreadMirror(data, Faults(throttle=throttle))
    home, registry = short_tmp / "h", short_tmp / "r"
    digest = hashlib.sha256(data).hexdigest()
    write_entry(registry, "slow", size=len(data), sha256=digest, urls=[mirror.mirror.url])
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry), **env))
    d.start()
    try:
        pull = subprocess.Popen(
            [sys.executable, "-m", "modeld", "pull", "slow"],
            env=d.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def pulling() -> bool:
            with Client(d.socket) as c:
                return any(
                    x["state"] == "downloading"
                    for x in c.request("GET", "/api/downloads")["downloads"]
                )

        wait_sync(pulling, 30, "the pull running in the daemon")
        yield d, pull
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop(signal.SIGKILL)
        mirror.close()


def test_a_pull_whose_daemon_is_killed_says_to_start_it_and_pull_again(short_tmp: Path) -> None:
    """kill -9 of the daemon while `modeld pull ID` follows the download: one line saying the
    daemon went away and that `modeld pull ID` resumes, exit status 1, no traceback."""
    with _followed_pull(short_tmp, 5_000) as (d, pull):
        d.stop(signal.SIGKILL)
        _, err = pull.communicate(timeout=60)
    assert pull.returncode == 1, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("modeld: the daemon went away during the pull of slow"), lines[0]
    assert "`modeld pull slow` resumes" in lines[0]


def test_a_pull_whose_daemon_is_stopped_is_told_so_at_once(short_tmp: Path) -> None:
    """SIGTERM (or Ctrl-C of `modeld serve`) while `modeld pull ID` follows the download:
    the daemon cancels its downloads first, so the pull's stream ends with one line saying
    the daemon stopped and that `modeld pull ID` resumes, exit 1; the partial stays. The
    followed stream held the stop for twice MODELD_SHUTDOWN_TIMEOUT, and the CLI said only
    that the daemon went away."""
    with _followed_pull(short_tmp, 2_000, MODELD_SHUTDOWN_TIMEOUT="60s") as (d, pull):
        assert d.stop() == 0, d.log()[-3000:]
        _, err = pull.communicate(timeout=60)
    assert pull.returncode == 1, err
    lines = err.splitlines()
    assert lines == [
        "modeld: the daemon stopped during the pull of slow; the partial is kept: start it "
        "again, and `modeld pull slow` resumes"
    ], err
    assert (short_tmp / "h" / "partial" / "slow.partial").exists()


def test_ids_with_slashes_get_a_400_not_a_missing_route(daemon_proc) -> None:  # type: ignore[no-untyped-def]
    """The CLI escapes ids in URLs, so `pull a/b` is refused as a bad id (exit 1, one line)."""
    for args in (["pull", "a/b", "--detach"], ["pull", "../x", "--cancel"], ["unload", "a/b"]):
        result = daemon_proc.cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1
        assert "no route" not in line, line


def test_an_empty_id_is_a_bad_id_not_a_missing_route(daemon_proc) -> None:  # type: ignore[no-untyped-def]
    """`modeld show ''` (an unset shell variable) is refused as a bad id in one line, exit 1,
    for every verb that puts the id in the URL; the empty segment named another route."""
    for args in (
        ["show", ""],
        ["rm", ""],
        ["verify", ""],
        ["pull", "", "--detach"],
        ["pull", "", "--cancel"],
        ["unload", ""],
        ["bug-report", ""],
    ):
        result = daemon_proc.cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (args, result.stderr)
        assert lines[0].startswith("modeld: '' is not a valid model id"), (args, lines[0])


def test_cli_finds_the_socket_named_in_the_config_file(short_tmp: Path) -> None:
    """A `socket` set only in the config file is where both `serve` binds and the CLI looks."""
    from tests.support.daemon import DaemonProcess, daemon_env

    home = short_tmp / "h"
    sock = short_tmp / "cfg.sock"
    cfg = short_tmp / "modeld.toml"
    cfg.write_text(f'socket = "{sock}"\n')
    env = daemon_env(home, MODELD_CONFIG=str(cfg))
    env.pop("MODELD_SOCKET")
    d = DaemonProcess(home=home, env=env)
    d.env["MODELD_SOCKET"] = str(sock)  # only for the fixture's own readiness check
    d.start()
    try:
        cli_env = {k: v for k, v in env.items() if k != "MODELD_SOCKET"}
        result = subprocess.run(
            [sys.executable, "-m", "modeld", "status", "--json"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert str(sock) in result.stdout
    finally:
        d.stop()


# --- habits, against the package's one daemon (tests/cli/conftest.py) -------------------


def _tiny_cli(tiny: Tiny, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args],
        env=dict(tiny.daemon.env, **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ls_and_stop_are_list_and_unload(tiny: Tiny) -> None:
    """`ls` prints what `list` prints; `stop` unloads as `unload` does."""
    assert _tiny_cli(tiny, "ls").stdout == _tiny_cli(tiny, "list").stdout
    assert _tiny_cli(tiny, "load", "tiny-text").returncode == 0
    stopped = _tiny_cli(tiny, "stop", "tiny-text", "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["unloaded"][0]["model"] == "tiny-text"
    commands = [
        line.split()[0]
        for line in _tiny_cli(tiny, "--help").stdout.splitlines()
        if line.startswith("  ") and line.split()
    ]
    assert "list" in commands and "ls" not in commands and "stop" not in commands


def test_output_to_a_pipe_is_never_cut_nor_styled(tiny: Tiny) -> None:
    """On a pipe, in a narrow COLUMNS: `ps` shows the whole engine id, `list` whole rows, and
    neither carries markup or escape codes; `ps` explains the spare runner."""
    assert _tiny_cli(tiny, "load", "tiny-text").returncode == 0
    engine_id = json.loads(_tiny_cli(tiny, "ps", "--json").stdout)["engines"][0]["id"]
    ps = _tiny_cli(tiny, "ps", COLUMNS="20")
    assert ps.returncode == 0, ps.stderr
    assert engine_id in ps.stdout and "\x1b" not in ps.stdout and "[/" not in ps.stdout
    spare = [line for line in ps.stdout.splitlines() if line.startswith("spare runner")]
    assert not spare or "next load" in spare[0]
    listing = _tiny_cli(tiny, "list", COLUMNS="20").stdout.splitlines()
    assert listing[0].split() == ["ID", "SIZE", "STATE", "FITS", "VERIFIED", "LAST", "USED"]
    row = next(line for line in listing if line.startswith("tiny-text "))
    assert "installed" in row and "registry sha256" in row
    bad = _tiny_cli(tiny, "unload", "tiny-text", "--grace", "soon")
    assert bad.returncode == 1 and "grace='soon' is not a duration" in bad.stderr, bad.stderr
    _tiny_cli(tiny, "unload", "tiny-text", "--grace", "5s")


def test_a_closed_stdout_is_a_reader_that_left_not_a_traceback(tiny: Tiny) -> None:
    """`modeld list >&-` (a cron job, a service with stdout closed): exit 0, the output goes
    nowhere, errors still reach stderr; Python's None for stdout was a traceback."""
    for args in (["list"], ["run", "tiny-text", "hi", "--max-tokens", "2"]):
        result = subprocess.run(
            ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "modeld", *args],
            env=tiny.daemon.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, (args, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
    gone = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "modeld", "show", "nope"],
        env=tiny.daemon.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert gone.returncode == 1 and gone.stderr.startswith("modeld: no model 'nope'"), gone


def test_shell_completion_offers_the_daemons_model_ids(tiny: Tiny) -> None:
    """Completion's protocol: a model id from the daemon's catalog, a verb."""
    result = _tiny_cli(
        tiny, _MODELD_COMPLETE="bash_complete", COMP_WORDS="modeld show tin", COMP_CWORD="2"
    )
    assert result.returncode == 0, result.stderr
    assert "plain,tiny-text" in result.stdout.splitlines()
    verbs = _tiny_cli(
        tiny, _MODELD_COMPLETE="bash_complete", COMP_WORDS="modeld pu", COMP_CWORD="1"
    )
    assert "plain,pull" in verbs.stdout.splitlines()

    # `verify` takes an installed model only; `bug-report` any model id.
    def offered(words: str) -> list[str]:
        done = _tiny_cli(tiny, _MODELD_COMPLETE="bash_complete", COMP_WORDS=words, COMP_CWORD="2")
        return done.stdout.splitlines()

    assert "plain,tiny-text" in offered("modeld verify t")
    assert offered("modeld verify g") == [], "a catalog model not installed is offered"
    assert any("gemma" in v for v in offered("modeld show g"))  # it is in the catalog
    assert "plain,tiny-text" in offered("modeld bug-report tin")


def _in_shell(tiny: Tiny, short_tmp: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a shell with the daemon's environment and a ``modeld`` on PATH, as an installed
    one would be."""
    wrapper = short_tmp / "modeld"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} -m modeld "$@"\n')
    wrapper.chmod(0o755)
    env = dict(tiny.daemon.env, PATH=f"{short_tmp}:{os.environ['PATH']}")
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_bash_script_completes_through_modeld(tiny: Tiny, short_tmp: Path) -> None:
    """The script `bash_source` prints, run by bash: TAB after `modeld show tin` offers the
    daemon's model, after `modeld import ` the shell's own file completion."""
    script = (
        'eval "$(_MODELD_COMPLETE=bash_source modeld)"\n'
        "COMP_WORDS=(modeld show tin); COMP_CWORD=2; _modeld_completion modeld\n"
        'echo "ids: ${COMPREPLY[*]}"\n'
        "COMP_WORDS=(modeld pull --de); COMP_CWORD=2; _modeld_completion modeld\n"
        'echo "options: ${COMPREPLY[*]}"\n'
    )
    result = _in_shell(tiny, short_tmp, ["bash", "-c", script])
    assert result.returncode == 0, result.stderr
    assert "ids: tiny-text" in result.stdout.splitlines()
    assert "options: --detach" in result.stdout.splitlines()


# zsh completes only in an interactive shell with its line editor: a second zsh drives one
# on a pseudo-terminal (zpty), loads compinit and the script `zsh_source` prints, types
# `modeld show tiny-t` and TAB, and waits for the line to read `tiny-text` (READY is typed
# as RE""ADY so that the echo of the typed line does not match it).
ZSH_DRIVER = r"""
zmodload zsh/zpty zsh/datetime
# Read what the terminal shows until it matches $1, for at most 20 s; print it if it never does.
expect() {
  local seen= chunk= deadline=$(( EPOCHREALTIME + 20 ))
  while (( EPOCHREALTIME < deadline )); do
    chunk=; zpty -rt z chunk && seen+=$chunk
    [[ $seen == $~1 ]] && return 0
    sleep 0.05
  done
  print -r -- "NEVER SAW $1 IN: ${(q+)seen}"; return 1
}
zpty -b z 'zsh -f -i'
zpty -w z 'PS1="> "; autoload -U compinit; compinit -u -D'
zpty -w z 'eval "$(_MODELD_COMPLETE=zsh_source modeld)"; echo RE""ADY'
expect '*READY*' || exit 1
zpty -w -n z $'modeld show tiny-t\t'
expect '*tiny-text*' && print -r -- COMPLETED
zpty -w -n z $'\x15modeld pull --de\t'  # ^U empties the line (^C would drop typeahead)
expect '*--detach*' && print -r -- OPTION
zpty -d z
"""


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed (apt install zsh)")
def test_the_zsh_script_completes_through_modeld(tiny: Tiny, short_tmp: Path) -> None:
    """TAB in a real interactive zsh after `modeld show tiny-t` completes the daemon's model;
    after `modeld pull --de`, the option."""
    result = _in_shell(tiny, short_tmp, ["zsh", "-f", "-c", ZSH_DRIVER])
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["COMPLETED", "OPTION"], (result.stdout, result.stderr)


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed (apt install fish)")
def test_the_fish_script_completes_through_modeld(tiny: Tiny, short_tmp: Path) -> None:
    """fish's own completion engine (`complete -C`) with the script `fish_source` prints."""
    script = (
        "_MODELD_COMPLETE=fish_source modeld | source\n"
        'complete -C "modeld show tin"\n'
        "echo SPLIT\n"
        'complete -C "modeld pull --de"\n'
    )
    result = _in_shell(tiny, short_tmp, ["fish", "--no-config", "-c", script])
    assert result.returncode == 0, result.stderr
    ids, options = result.stdout.split("SPLIT\n")
    assert ids.split() == ["tiny-text"], result.stdout
    assert options.split() == ["--detach"], result.stdout


def _listed(tiny: Tiny, model_id: str) -> None:
    """Wait until the daemon's catalog has re-read the registry and lists ``model_id``."""
    with Client(tiny.socket) as c:
        deadline = time.monotonic() + 30
        while model_id not in [m["id"] for m in c.models()["models"]]:  # live reload
            assert time.monotonic() < deadline, "the registry file was never read"
            select.select([], [], [], 0.05)


def test_status_gives_the_store_size_in_binary_units(tiny: Tiny) -> None:
    """`modeld status`'s store line gives the installed bytes as KiB/MiB/GiB, like the rest
    of the human output; `--json` keeps the bytes."""
    doc = json.loads(_tiny_cli(tiny, "status", "--json").stdout)["store"]
    result = _tiny_cli(tiny, "status")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.lstrip().startswith("store "))
    size = format_size(doc["installed_bytes"])
    assert size.endswith("KiB")
    assert f"{doc['installed']} installed model(s), {size} in " in line, line
    assert "bytes" not in line


def test_import_of_a_file_that_is_no_model_says_to_choose_one(tiny: Tiny, short_tmp: Path) -> None:
    """`modeld import` of a file that is not a LiteRT-LM model names the file and says to
    choose a .litertlm file, not to pull an id that no entry has."""
    passwd = short_tmp / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n" * 20)
    result = _tiny_cli(tiny, "import", str(passwd))
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "modeld: file passwd: not a LiteRT-LM file (starts with b'root:x:0', expected "
        "b'LITERTLM'); it was not imported: choose a LiteRT-LM model (a .litertlm file)"
    ]


def test_a_keep_alive_that_is_no_duration_is_bad_usage(tiny: Tiny) -> None:
    """`load`/`run --keep-alive forever` is bad usage, exit 2, with what a keep-alive looks
    like (it was exit 1, as a refusal); nothing is generated."""
    for args in (
        ["load", "tiny-text", "--keep-alive", "forever"],
        ["run", "tiny-text", "hello", "--keep-alive", "5 min"],
    ):
        result = _tiny_cli(tiny, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert "is not a duration: use e.g. 30s, 5m, 0 or -1" in result.stderr, result.stderr
        assert result.stdout == ""


def test_a_keys_file_that_is_a_directory_is_one_line_for_key_verbs(
    tiny: Tiny, short_tmp: Path
) -> None:
    """MODELD_API_KEYS_FILE naming a directory: `key add|list|rm` say it is no regular file
    in one line, exit 2 (bad settings); it was a traceback (IsADirectoryError)."""
    folder = short_tmp / "keys dir é"
    folder.mkdir()
    for args in (["key", "add", "app2"], ["key", "list"], ["key", "rm", "app"]):
        result = _tiny_cli(tiny, *args, MODELD_API_KEYS_FILE=str(folder))
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (args, result.stderr)
        assert lines[0] == f"modeld: API keys file {folder} is not a regular file; point it at one"
    assert list(folder.iterdir()) == []


def test_prune_to_budget_without_one_says_to_set_it_and_reload(tiny: Tiny) -> None:
    """`prune --to-budget` with no disk budget: one line, exit 1, saying to set disk_budget
    in the config file and reload (it is applied live); it said only to set the variable
    and restart the daemon."""
    result = _tiny_cli(tiny, "prune", "--to-budget", "--dry-run")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "set disk_budget" in lines[0] and "reload the daemon" in lines[0], lines[0]
    assert "MODELD_DISK_BUDGET" in lines[0], lines[0]


def test_cancel_with_no_pull_running_says_so(tiny: Tiny) -> None:
    """`modeld pull ID --cancel` with nothing running says that no pull of ID is running, and
    points at no command that would start one."""
    result = _tiny_cli(tiny, "pull", "tiny-text", "--cancel")
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "modeld: no pull of 'tiny-text' is running, so there is none to cancel; "
        "`modeld status` lists the pulls that are"
    ]


def test_pull_limit_rate_caps_the_whole_download(tiny: Tiny) -> None:
    """`pull --limit-rate 128K`: every progress record carries the cap, and the K bytes take
    at least (K - connections x one capped read) / rate seconds. A lower bound on the time: a
    loaded machine only makes it longer."""
    data = TINY.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    url = tiny.mirror.mirror.url
    write_entry(tiny.registry, "capped", size=len(data), sha256=digest, urls=[url])
    _listed(tiny, "capped")
    rate = 128 * 1024
    start = time.monotonic()
    started = _tiny_cli(tiny, "pull", "capped", "--limit-rate", "128K", "--detach", "--json")
    assert started.returncode == 0, started.stderr
    with Client(tiny.socket) as c:
        connections = c.status()["settings"]["download_connections"]
        records = list(c.pull("capped"))  # joins the job; no cap given keeps its cap
    took = time.monotonic() - start
    assert records[-1]["state"] == "installed" and records[-1]["digest"] == digest
    assert {r["limit_rate"] for r in records} == {rate}
    floor = (len(data) - connections * TokenBucket(rate).read_size) / rate
    assert floor > 1.0 and took >= floor, (took, floor)
    assert _tiny_cli(tiny, "rm", "capped").returncode == 0


def test_pull_limit_rate_refuses_what_is_not_a_rate(tiny: Tiny) -> None:
    """A bad --limit-rate is a usage error naming the units; the API refuses 0 with a 400."""
    for bad in ("10X", "0", "-5K", "fast"):
        result = _tiny_cli(tiny, "pull", "tiny-text", f"--limit-rate={bad}")
        assert result.returncode == 2, result.stderr
        assert "is not a rate" in result.stderr and "10M" in result.stderr
    with Client(tiny.socket) as c, pytest.raises(BadRequest, match="limit_rate"):
        c.request("POST", "/api/models/tiny-text/pull", {"limit_rate": 0, "detach": True})


def test_logs_shows_the_file_the_daemons_stderr_goes_to(tiny: Tiny) -> None:
    """A daemon outside systemd that logs to a file: `modeld logs` tails that file."""
    result = _tiny_cli(tiny, "logs", "-n", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert 0 < len(lines) <= 5
    assert all(line in tiny.daemon.log() for line in lines)


def test_logs_needs_the_socket() -> None:
    """Over TCP there is no log to read here: a usage error that says so."""
    result = _run("logs", env=dict(os.environ, MODELD_URL="http://127.0.0.1:9"))
    assert result.returncode == 2 and "--socket" in result.stderr


def test_a_pull_that_reaches_no_mirror_leaves_nothing_and_says_how_to_add_one(
    tiny: Tiny,
) -> None:
    """Every mirror refuses the connection: the pull gives up after two tries per host,
    leaves no partial, and the one line names MODELD_REGISTRY and the entry's urls."""
    with socket.socket() as closed:  # a loopback port that nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    write_entry(
        tiny.registry,
        "offline",
        size=50_000_000,
        sha256="a" * 64,
        urls=["http://127.0.0.1:9/offline.litertlm", f"http://127.0.0.1:{port}/o.litertlm"],
    )
    _listed(tiny, "offline")
    result = _tiny_cli(tiny, "pull", "offline")
    assert result.returncode == 1
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert "no mirror could be reached" in line and "2 tries" in line
    assert "MODELD_REGISTRY" in line and "`urls`" in line
    assert not list((tiny.daemon.home / "partial").glob("offline*"))
    partials = json.loads(_tiny_cli(tiny, "prune", "--dry-run", "--json").stdout)["items"]
    assert not [i for i in partials if "offline" in (i["path"] or "")]


def test_control_characters_from_a_catalog_entry_are_shown_not_acted_on(short_tmp: Path) -> None:
    """A display name holding a terminal escape sequence and a bidi override makes the entry
    invalid (names are text without controls), and `modeld status` names the problem with
    the characters as escapes (``\\x1b``, ``\\u202e``): another user's catalog entry cannot
    retitle the terminal, hide text or reorder what the CLI prints."""
    home, registry = short_tmp / "h", short_tmp / "r"
    entry = write_entry(registry, "evil", size=1000)
    evil = 'display_name = "Evil\\u001b]0;pwned\\u0007 \\u009b2J \\u202eedoc"'
    entry.write_text(entry.read_text().replace('display_name = "evil"', evil))
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        shown = d.cli("show", "evil")
        assert shown.returncode == 1 and "no model 'evil'" in shown.stderr, shown.stderr
        status = d.cli("status")
        out = status.stdout + status.stderr
        assert "evil.toml" in out and "control character" in out, out
        assert not any(c in out for c in "\x1b\x07\x9b\u202e")
    finally:
        d.stop()


def test_an_unknown_id_gets_the_nearest_known_ones_from_every_verb(tiny: Tiny) -> None:
    """A mistyped id names the nearest known ids (the same id in other case first), whichever
    verb took it: pull, show, load, run, verify, rm, rm --entry; one line, exit 1."""
    verbs = [
        ("pull", "gemma-4-e2b-it"),
        ("show", "gemma-4-e2b-it"),
        ("load", "Tiny-Text"),
        ("run", "tiny-txt", "hi"),
        ("verify", "tiny-txt"),
        ("rm", "tiny-txt"),
        ("rm", "tiny-txt", "--entry"),
    ]
    for verb, wanted, *rest in verbs:
        result = _tiny_cli(tiny, verb, wanted, *rest)
        assert result.returncode == 1, (verb, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        near = "gemma-4-E2B-it" if wanted.startswith("gemma") else "tiny-text"
        assert f"did you mean {near}" in lines[0], (verb, lines[0])
    # Nothing near: no guess, only where the known ids are.
    far = _tiny_cli(tiny, "show", "qqqqqqqq")
    assert far.returncode == 1 and "did you mean" not in far.stderr
    assert "`modeld list` shows the known ids" in far.stderr


def _modeld(*args: str) -> subprocess.CompletedProcess[str]:
    """``modeld ARGS`` with no daemon anywhere (a socket path that does not exist)."""
    env = dict(os.environ, MODELD_SOCKET="/nonexistent/modeld.sock")
    return subprocess.run(
        [sys.executable, "-m", "modeld", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_bare_modeld_prints_the_verbs_by_task() -> None:
    """`modeld` alone: a short usage on stderr with every verb once, under its task, in the
    order of TASKS; exit 2 (bad usage), as `modeld --socket PATH` alone."""
    from modeld.cli import TASKS, VERBS

    assert sorted(v for _, verbs in TASKS for v in verbs) == sorted(VERBS)
    for args in ((), ("--socket", "/x.sock")):
        result = _modeld(*args)
        assert result.returncode == 2 and result.stdout == ""
        lines = result.stderr.splitlines()
        assert lines[0] == "usage: modeld [--socket PATH] VERB [ARGS]"
        for task, verbs in TASKS:
            (line,) = [x for x in lines if x.strip().startswith(f"{task}:")]
            assert line.split(":", 1)[1].split() == [f"{v}," for v in verbs[:-1]] + verbs[-1:]
        assert "modeld VERB --help" in result.stderr


def test_help_lists_the_verbs_by_task_without_reading_the_settings() -> None:
    """`modeld --help` lists each verb with its summary under its task, in the order of
    TASKS, not alphabetically; and it imports neither the settings (pydantic) nor aiohttp."""
    from modeld.cli import TASKS

    result = _modeld("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    shown = [x.split()[0] for x in lines if x.startswith("  ") and not x.startswith("   ")]
    listed = [x for x in shown if not x.startswith("-")]
    assert listed == [v for _, verbs in TASKS for v in verbs], listed
    for task, _ in TASKS:
        assert f"\n{task}:\n" in result.stdout
    code = (
        "import sys, modeld.cli\n"
        "try:\n    modeld.cli.main(['--help'])\n"
        "except SystemExit:\n    pass\n"
        "heavy = ('modeld.config.settings', 'pydantic', 'aiohttp')\n"
        "print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stderr.strip() == "[]", out.stderr


def test_a_removed_import_is_told_to_import_again_not_to_pull(tiny: Tiny, short_tmp: Path) -> None:
    """A file imported under a local entry, then removed: run, load, verify and show say to
    import the file again (a pull of a local entry is refused), never `modeld pull`."""
    path = short_tmp / "mine.litertlm"
    shutil.copyfile(MODELS / "tiny-text-b.litertlm", path)
    assert _tiny_cli(tiny, "import", str(path), "mine").returncode == 0
    try:
        assert _tiny_cli(tiny, "rm", "mine").returncode == 0
        for args in (["run", "mine", "hi"], ["load", "mine"], ["verify", "mine"]):
            result = _tiny_cli(tiny, *args)
            assert result.returncode == 1, (args, result.stderr)
            assert "`modeld import PATH mine`" in result.stderr, (args, result.stderr)
            assert "modeld pull" not in result.stderr, (args, result.stderr)
        shown = json.loads(_tiny_cli(tiny, "show", "mine", "--json").stdout)
        said = shown["plans"]["text"]["error"]["message"]
        assert "`modeld import PATH mine`" in said and "modeld pull" not in said, said
    finally:
        _tiny_cli(tiny, "rm", "mine", "--entry")
