"""The shipped units under a real systemd: a Debian container booted with systemd-nspawn.

The install follows the README's "Running as a service" steps to the letter (INSTALL and
USER_INSTALL below are those lines, ``sudo`` dropped; only the ``pip install`` reads a local
wheelhouse, as the container has no network). Needs root, systemd-nspawn and debootstrap; not
in the default run: ``sudo .venv/bin/python -m pytest -m systemd tests/test_systemd_boot.py``.
The first run debootstraps Debian into the cache (see tests/support/nspawn.py), a few minutes; later
runs boot in seconds. The watchdog test idles for two minutes.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import nspawn

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "models" / "tiny-text.litertlm"
SYSTEM_SOCKET = "/run/modeld/modeld.sock"

_reason = nspawn.missing()
pytestmark = [
    pytest.mark.systemd,
    # The first run debootstraps (minutes); the watchdog test idles for two minutes.
    pytest.mark.timeout(2400),
    pytest.mark.skipif(_reason is not None, reason=_reason or ""),
]

# The README's system-wide steps, run as root in /srv/modeld (a copy of the repository's
# systemd/ directory). alice is the user who is given access.
INSTALL = """
install -m 0644 systemd/modeld.sysusers /usr/lib/sysusers.d/modeld.conf
systemd-sysusers
usermod -aG modeld alice
python3 -m venv /opt/modeld/venv
/opt/modeld/venv/bin/pip install --no-index --find-links /srv/modeld/wheels /srv/modeld/{wheel}
ln -s /opt/modeld/venv/bin/modeld /usr/local/bin/modeld
install -m 0644 systemd/modeld.service systemd/modeld.socket /etc/systemd/system/
install -D -m 0644 systemd/gpu.conf /etc/systemd/system/modeld.service.d/gpu.conf
systemctl daemon-reload
systemctl enable --now modeld.socket
"""

# The README's per-user steps, run by alice in /srv/modeld in her login session (lingering, so
# her manager runs without a session too).
USER_INSTALL = """
mkdir -p ~/.config/systemd/user
cp systemd/user/modeld.service systemd/user/modeld.socket ~/.config/systemd/user/
systemctl --user daemon-reload
systemctl --user enable --now modeld.socket
"""


def _entry(size: int, sha256: str) -> str:
    return (
        'id = "tiny-text"\ndisplay_name = "tiny-text"\nfile_name = "tiny-text.litertlm"\n'
        f'urls = ["http://127.0.0.1:9/tiny-text.litertlm"]\nsize = {size}\nsha256 = "{sha256}"\n'
    )


@pytest.fixture(scope="module")
def machine() -> Iterator[nspawn.Machine]:
    """A booted Debian with modeld installed by the README's steps; alice, bob, carol exist."""
    nspawn.CACHE.mkdir(parents=True, exist_ok=True)
    base = nspawn.rootfs(nspawn.CACHE / "debootstrap.log")
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=nspawn.CACHE))
    try:
        wheel, deps = nspawn.wheelhouse(base, REPO, run_dir / "build")
        with nspawn.booted(base, run_dir) as m:
            srv = m.root / "srv" / "modeld"
            srv.mkdir(parents=True)
            shutil.copytree(REPO / "systemd", srv / "systemd")
            shutil.copytree(deps, srv / "wheels")
            shutil.copy(wheel, srv / wheel.name)
            shutil.copy(FIXTURE, srv / FIXTURE.name)
            data = FIXTURE.read_bytes()
            # The admin's own registry dir with the fixture's entry, named in the config file.
            etc = m.root / "etc" / "modeld"
            (etc / "registry").mkdir(parents=True)
            (etc / "registry" / "tiny-text.toml").write_text(
                _entry(len(data), hashlib.sha256(data).hexdigest())
            )
            (etc / "modeld.toml").write_text('registry = ["/etc/modeld/registry"]\n')
            # alice gets access; bob never does; carol joins while "logged in".
            m.sh("useradd -m alice && useradd -m bob && useradd -m carol")
            m.sh("set -e\ncd /srv/modeld\n" + INSTALL.format(wheel=wheel.name), timeout=600)
            yield m
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def show(m: nspawn.Machine, unit: str, *props: str) -> dict[str, str]:
    out = m.sh(f"systemctl show {unit} " + " ".join(f"-p {p}" for p in props)).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def journal(m: nspawn.Machine, *args: str) -> str:
    return m.sh("journalctl --no-pager " + " ".join(args), check=False).stdout


def root_json(m: nspawn.Machine, command: str) -> Any:
    return json.loads(m.sh(f"modeld {command} --json").stdout)


def wait_journal(m: nspawn.Machine, needle: str, *args: str, timeout: float = 30.0) -> str:
    """The journal (with ``args``) once it holds ``needle``; journald writes a little late."""
    deadline = time.monotonic() + timeout
    while True:
        text = journal(m, *args)
        if needle in text or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def runner_pids(m: nspawn.Machine, user: str) -> list[int]:
    """``modeld.engine.runner.child`` processes of ``user`` in the container."""
    script = (
        "import os, pwd\n"
        f"uid = pwd.getpwnam({user!r}).pw_uid\n"
        "for p in os.listdir('/proc'):\n"
        "    try:\n"
        "        cmd = open(f'/proc/{p}/cmdline', 'rb').read()\n"
        "        owner = os.stat(f'/proc/{p}').st_uid\n"
        "    except (OSError, ValueError):\n"
        "        continue\n"
        "    if p.isdigit() and owner == uid and b'modeld.engine.runner.child' in cmd:\n"
        "        print(p)\n"
    )
    out = m.sh(f"python3 -c {shlex.quote(script)}").stdout
    return [int(p) for p in out.split()]


def test_socket_activation_starts_the_service_and_ready_is_reached(
    machine: nspawn.Machine,
) -> None:
    """The first connection starts modeld.service, which becomes active only on READY=1."""
    m = machine
    assert show(m, "modeld.socket", "ActiveState")["ActiveState"] == "active"
    assert show(m, "modeld.service", "ActiveState")["ActiveState"] == "inactive"
    listing = m.sh("stat -c '%U:%G %a' /run/modeld /run/modeld/modeld.sock").stdout.split()
    assert listing == ["root:root", "755", "root:modeld", "660"]

    rc, out = m.login("alice", "modeld status --json")
    assert rc == 0, out + journal(m, "-u", "modeld", "-n", "50")
    assert json.loads(out)["settings"]["socket"] == SYSTEM_SOCKET

    state = show(m, "modeld.service", "ActiveState", "SubState", "StatusText", "NRestarts")
    assert state["ActiveState"] == "active" and state["SubState"] == "running", state
    assert state["StatusText"] == f"serving on {SYSTEM_SOCKET}", state
    assert state["NRestarts"] == "0", state
    # The directory stays the socket unit's: no move into the root-only /run/private.
    assert m.sh("stat -c '%F %U:%G %a' /run/modeld").stdout.strip() == "directory root:root 755"
    # The journal tags the daemon's lines "modeld", and the peer is alice as she is (no user
    # namespace mapping her to 65534).
    alice = m.sh("id -u alice").stdout.strip()
    text = wait_journal(m, f"peer={alice}:", "-t", "modeld", "-o", "cat")
    assert f"ready socket={SYSTEM_SOCKET}" in text, text
    assert "path=/api/status status=200" in text and f"peer={alice}:" in text, text
    assert journal(m, "-t", "env", "-o", "cat").strip() == ""


def test_only_members_of_the_socket_group_get_in_and_others_are_told_why(
    machine: nspawn.Machine,
) -> None:
    """bob (not in group modeld) is told to join it; carol, added during her session, to log
    in again; once she logs in again she gets in."""
    m = machine
    rc, out = m.login("bob", "modeld status")
    assert rc == 1
    assert "permission denied on /run/modeld/modeld.sock" in out, out
    assert "join group modeld (`sudo usermod -aG modeld bob`)" in out, out

    m.sh("usermod -aG modeld carol")
    stale = m.sh("setpriv --reuid carol --regid carol --clear-groups modeld status", check=False)
    assert stale.returncode == 1
    assert "you are in group modeld, but this login session is not yet" in stale.stderr

    rc, out = m.login("carol", "modeld status --json")
    assert rc == 0, out
    assert json.loads(out)["settings"]["socket"] == SYSTEM_SOCKET


def test_reload_keeps_the_engines(machine: nspawn.Machine) -> None:
    """`systemctl reload modeld` applies a changed config file and keeps the loaded engine."""
    m = machine
    m.sh("modeld import /srv/modeld/tiny-text.litertlm tiny-text", timeout=300)
    m.sh("modeld load tiny-text --main cpu", timeout=300)
    before = root_json(m, "ps")["engines"]
    assert [e["id"] for e in before] == ["tiny-text:cpu"] and before[0]["state"] == "ready"
    main_pid = show(m, "modeld.service", "MainPID")["MainPID"]
    assert root_json(m, "status")["settings"]["keep_alive"] == 300

    (m.root / "etc/modeld/modeld.toml").write_text(
        'registry = ["/etc/modeld/registry"]\nkeep_alive = "10m"\n'
    )
    m.sh("systemctl reload modeld")

    assert root_json(m, "status")["settings"]["keep_alive"] == 600
    after = root_json(m, "ps")["engines"]
    assert [(e["id"], e["pid"], e["state"]) for e in after] == [
        ("tiny-text:cpu", before[0]["pid"], "ready")
    ]
    assert show(m, "modeld.service", "MainPID")["MainPID"] == main_pid
    reply = json.loads(m.sh("modeld run tiny-text hello --max-tokens 4 --json", timeout=300).stdout)
    assert reply["done"] is True and reply["tokens"] >= 1, reply
    assert [e["pid"] for e in root_json(m, "ps")["engines"]] == [before[0]["pid"]]


def test_watchdog_does_not_fire_in_two_idle_minutes(machine: nspawn.Machine) -> None:
    """Two idle minutes (4 x WatchdogSec): WATCHDOG=1 keeps coming, no restart, same process."""
    m = machine
    props = ("MainPID", "NRestarts", "WatchdogUSec", "WatchdogTimestampMonotonic")
    before = show(m, "modeld.service", *props)
    assert before["WatchdogUSec"] == "30s", before
    pings = {before["WatchdogTimestampMonotonic"]}
    start = time.monotonic()
    # Idle on purpose: what matters is what systemd sees while nothing happens. Sampled every
    # 5 s: systemd keeps the time of the last ping, so each new value is a ping that arrived.
    while time.monotonic() - start < 120:
        time.sleep(5)
        state = show(m, "modeld.service", *props)
        assert (state["MainPID"], state["NRestarts"]) == (before["MainPID"], "0"), state
        pings.add(state["WatchdogTimestampMonotonic"])
    assert len(pings) >= 3, pings
    assert "watchdog timeout" not in journal(m, "-u", "modeld").lower()


def test_stop_leaves_no_runner(machine: nspawn.Machine) -> None:
    """`systemctl stop modeld` ends cleanly (no SIGKILL at the timeout) with no runner left."""
    m = machine
    assert runner_pids(m, "modeld"), "the engine and the spare runner should be running"
    m.sh("systemctl stop modeld.service")
    state = show(m, "modeld.service", "ActiveState", "Result", "ExecMainStatus")
    assert state == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    assert runner_pids(m, "modeld") == []


def test_user_unit_under_systemctl_user(machine: nspawn.Machine) -> None:
    """alice's own daemon (systemctl --user, lingering) answers, and her `modeld` finds it
    before the system one."""
    m = machine
    m.sh("loginctl enable-linger alice")
    rc, out = m.login("alice", "set -e\ncd /srv/modeld\n" + USER_INSTALL)
    assert rc == 0, out
    rc, out = m.login("alice", "systemctl --user is-active modeld.socket && modeld status --json")
    assert rc == 0, out
    uid = m.sh("id -u alice").stdout.strip()
    doc = json.loads(out[out.index("{") :])
    assert doc["settings"]["socket"] == f"/run/user/{uid}/modeld.sock"
    assert doc["settings"]["home"] == str(Path("/home", "alice", ".local/share/modeld"))
    rc, out = m.login(
        "alice", "systemctl --user --no-pager show modeld -p ActiveState -p StatusText"
    )
    assert rc == 0 and "ActiveState=active" in out, out
    assert f"StatusText=serving on /run/user/{uid}/modeld.sock" in out, out
    # MODELD_SOCKET still reaches the system daemon (started again by its socket).
    rc, out = m.login("alice", f"MODELD_SOCKET={SYSTEM_SOCKET} modeld status --json")
    assert rc == 0, out
    assert json.loads(out)["settings"]["socket"] == SYSTEM_SOCKET
    assert m.sh("stat -c '%F %U:%G %a' /run/modeld").stdout.strip() == "directory root:root 755"
    assert runner_pids(m, "alice"), "alice's daemon has its own spare runner"
