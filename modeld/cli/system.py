"""``serve``, ``status`` and ``logs``."""

from __future__ import annotations

import socket
import struct
import sys
from pathlib import Path

from modeld.cli.common import (
    Ctx,
    UsageError,
    Verbs,
    call,
    client_of,
    console,
    defang,
    emit,
    escape,
    in_range,
    json_flag,
)
from modeld.config import format_duration, format_size
from modeld.errors import DaemonUnavailable, NotFound

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any


def serve(ctx: Ctx) -> None:
    """Run the daemon in the foreground (Ctrl-C or SIGTERM stops it in order)."""
    from modeld.config import load_settings
    from modeld.daemon.daemon import serve as run_daemon

    settings = load_settings()
    raise SystemExit(run_daemon(settings))


def serve_parser(verbs: Verbs) -> None:
    verbs.add("serve", serve)


def _print_status(doc: dict[str, Any]) -> None:
    s = doc["settings"]
    console.print(
        f"[bold]modeld {escape(str(doc['version']))}[/] up {format_duration(doc['uptime'])}"
    )
    console.print(f"  socket        {escape(str(s['socket']))}")
    console.print(f"  state dir     {escape(str(s['home']))}")
    console.print(f"  memory budget {format_size(s['memory_budget'])}")
    console.print(f"  backends      main={s['main_backend']} vision={s['vision_backend']}")
    console.print(f"  keep alive    {format_duration(s['keep_alive'])}")
    for key, section in doc.items():
        if key in ("version", "uptime", "settings") or not isinstance(section, dict):
            continue
        summary = section.get("summary")
        if summary:
            console.print(f"  {escape(key):<13} {escape(str(summary))}")
        for problem in section.get("problems", []):
            console.print(f"  [yellow]! {escape(key)}: {escape(str(problem))}[/]")


def status(ctx: Ctx, as_json: bool) -> None:
    """Show the daemon's version, settings and the state of each part."""
    doc = call(ctx, lambda c: c.status())
    emit(as_json, doc, _print_status)


def status_parser(verbs: Verbs) -> None:
    json_flag(verbs.add("status", status))


def _daemon_pid(socket_path: Path) -> int:
    """The pid of the process that listens on ``socket_path`` (SO_PEERCRED)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        try:
            sock.connect(str(socket_path))
        except OSError as e:
            raise DaemonUnavailable(
                f"no modeld answers on {socket_path} ({e.strerror}); start one with "
                "`modeld serve` or pass --socket"
            ) from e
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _, _ = struct.unpack("3i", creds)
    return int(pid)


def log_command(pid: int, lines: int, follow: bool) -> list[str]:
    """How to read the log of the daemon ``pid``: its unit's journal, or the file its
    stderr goes to. Raises NotFound when neither can be named."""
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        cgroup = ""
    units = [part for part in cgroup.strip().split("/") if part.endswith(".service")]
    unit = units[-1] if units else None
    if unit is not None and not unit.startswith("user@"):
        user = ["--user"] if any(u.startswith("user@") for u in units) else []
        return ["journalctl", *user, "-u", unit, "-n", str(lines), *(["-f"] if follow else [])]
    try:
        target = str(Path(f"/proc/{pid}/fd/2").readlink())
    except OSError as e:
        raise NotFound(
            f"cannot see where the daemon (pid {pid}) logs ({e.strerror}): run `modeld logs` "
            "as the daemon's user or as root"
        ) from None
    if target.startswith("/") and not target.startswith("/dev/") and Path(target).is_file():
        return ["tail", "-n", str(lines), *(["-F"] if follow else []), target]
    raise NotFound(
        f"the daemon (pid {pid}) runs outside systemd and logs to {target}, its terminal: "
        "look there, or start it with `modeld serve 2>>FILE`"
    )


def logs(ctx: Ctx, follow: bool, lines: int) -> None:
    """Show the daemon's log: its systemd unit's journal, or the file its stderr goes to,
    with control characters escaped.

    The daemon is found as every verb finds it (--socket, MODELD_SOCKET...); it must run on
    this host, over its Unix socket.
    """
    endpoint = client_of(ctx).endpoint
    if endpoint.socket is None:
        raise UsageError("`modeld logs` reads a daemon on this host: pass --socket")
    argv = log_command(_daemon_pid(endpoint.socket), lines, follow)
    import subprocess

    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    except OSError as e:
        raise NotFound(
            f"cannot run {argv[0]} ({e.strerror}); run it yourself: {' '.join(argv)}"
        ) from None
    assert proc.stdout is not None
    try:
        # Line by line, each control character as its escape: a log line holds what peers
        # sent (a path with ESC would retitle or clear this terminal), whoever wrote it.
        for raw in proc.stdout:
            sys.stdout.write(defang(raw.decode("utf-8", "replace").rstrip("\n")) + "\n")
            sys.stdout.flush()
    finally:
        proc.kill()
        proc.wait()


def logs_parser(verbs: Verbs) -> None:
    p = verbs.add("logs", logs)
    p.add_argument("-f", "--follow", action="store_true", help="Keep printing new lines.")
    p.add_argument(
        "-n", "--lines", type=in_range(int, 0), default=100, help="How many lines (default: 100)."
    )
