"""The shipped systemd units: `systemd-analyze verify` clean, `security` exposure at most 2.0."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from modeld.config import Settings, parse_duration

UNITS = Path(__file__).resolve().parent.parent / "systemd"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(
    ANALYZE is None,
    reason="systemd-analyze is not installed (Debian: apt-get install -y systemd)",
)


def analyze(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    return subprocess.run(
        [ANALYZE, *args], capture_output=True, text=True, timeout=60, check=False, env=env
    )


def directives(path: Path) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit file (comments and sections dropped), repeated keys kept."""
    out: dict[str, list[str]] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


@pytest.fixture
def system_dir(short_tmp: Path) -> Path:
    """The system units with the GPU drop-in installed beside them, as in /etc/systemd/system."""
    for name in ("modeld.service", "modeld.socket"):
        shutil.copy(UNITS / name, short_tmp / name)
    (short_tmp / "modeld.service.d").mkdir()
    shutil.copy(UNITS / "gpu.conf", short_tmp / "modeld.service.d" / "gpu.conf")
    return short_tmp


def exposure(unit: Path) -> float:
    result = analyze("security", "--offline=yes", str(unit))
    assert result.returncode == 0, result.stderr
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert match, result.stdout
    return float(match.group(1))


def test_system_units_verify_clean() -> None:
    """`systemd-analyze verify` prints nothing for modeld.service and modeld.socket."""
    result = analyze("verify", str(UNITS / "modeld.service"), str(UNITS / "modeld.socket"))
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr


def test_gpu_drop_in_verifies_clean(system_dir: Path) -> None:
    """The GPU drop-in is read with the service (a typo in it would be reported) and is clean."""
    result = analyze("verify", str(system_dir / "modeld.service"))
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr
    # Prove the drop-in was loaded: a bad key in it must show up.
    with (system_dir / "modeld.service.d" / "gpu.conf").open("a") as f:
        f.write("NoSuchKey=1\n")
    assert "NoSuchKey" in analyze("verify", str(system_dir / "modeld.service")).stderr


def test_user_units_verify_clean(short_tmp: Path) -> None:
    """`systemd-analyze --user verify` prints nothing for the per-user units."""
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime), "PATH": "/usr/bin:/bin", "HOME": str(short_tmp)}
    result = analyze(
        "--user",
        "verify",
        str(UNITS / "user" / "modeld.service"),
        str(UNITS / "user" / "modeld.socket"),
        env=env,
    )
    assert result.returncode == 0 and result.stdout + result.stderr == "", result.stderr


def test_security_exposure_at_most_2(system_dir: Path) -> None:
    """The service scores at most 2.0, with and without the GPU drop-in."""
    plain = exposure(UNITS / "modeld.service")
    with_gpu = exposure(system_dir / "modeld.service")
    assert plain <= 2.0
    assert with_gpu <= 2.0
    # The drop-in really loosens the sandbox (else it would not open the GPU).
    assert with_gpu > plain


def test_service_contract() -> None:
    """Type=notify from the main pid, the directories, the socket path and the stop timeout."""
    service = directives(UNITS / "modeld.service")
    assert service["Type"] == ["notify"] and service["NotifyAccess"] == ["main"]
    for key in ("StateDirectory", "ConfigurationDirectory"):
        assert service[key] == ["modeld"]
    env = " ".join(service["Environment"])
    assert "MODELD_HOME=%S/modeld" in env and "MODELD_SOCKET=%t/modeld/modeld.sock" in env
    assert parse_duration(service["WatchdogSec"][0]) > 0
    default_shutdown = Settings.model_fields["shutdown_timeout"].default
    assert parse_duration(service["TimeoutStopSec"][0]) > default_shutdown
    # MemoryMax = budget x 1.25 + headroom; the default budget is 50% of RAM.
    memory_max = float(service["MemoryMax"][0].rstrip("%"))
    assert memory_max >= 50 * 1.25 and float(service["MemoryHigh"][0].rstrip("%")) < memory_max
    assert "MemoryDenyWriteExecute" not in service
    socket_unit = directives(UNITS / "modeld.socket")
    assert socket_unit["ListenStream"] == ["%t/modeld/modeld.sock"]
    assert socket_unit["SocketMode"] == ["0660"] and socket_unit["SocketGroup"] == ["modeld"]
    user_socket = directives(UNITS / "user" / "modeld.socket")
    assert int(user_socket["SocketMode"][0], 8) & ~0o660 == 0


def test_units_found_wanting_under_a_real_systemd() -> None:
    """What booting them under systemd showed (tests/test_systemd_boot.py), kept fixed."""
    service = directives(UNITS / "modeld.service")
    socket_unit = directives(UNITS / "modeld.socket")
    gpu = directives(UNITS / "gpu.conf")
    # DynamicUser= under an existing group of its name fails with 217/USER unless the user
    # exists too: sysusers creates user modeld (with its group, the socket's group).
    sysusers = [
        line.split()
        for line in (UNITS / "modeld.sysusers").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert [fields[:2] for fields in sysusers] == [["u", "modeld"]]
    assert service["User"] == ["modeld"] and socket_unit["SocketGroup"] == ["modeld"]
    # A preserved RuntimeDirectory= of a DynamicUser moves to the root-only /run/private:
    # /run/modeld belongs to the socket unit, open to all (the socket itself is 0660).
    assert "RuntimeDirectory" not in service and "RuntimeDirectoryPreserve" not in service
    assert socket_unit["DirectoryMode"] == ["0755"]
    # HOME comes from the unit, not from the user database.
    assert "HOME=%S/modeld" in " ".join(service["Environment"]).split()
    # In a user namespace every peer reads as 65534: allow-lists would match no one.
    assert service.get("PrivateUsers", ["no"]) == ["no"] and "PrivateUsers" not in gpu
    for unit in (service, directives(UNITS / "user" / "modeld.service")):
        # Journal lines tagged "modeld", not "env"; a failing start stops after a few tries.
        assert unit["SyslogIdentifier"] == ["modeld"]
        assert int(unit["StartLimitBurst"][0]) >= 1
        assert parse_duration(unit["StartLimitIntervalSec"][0]) > 0
