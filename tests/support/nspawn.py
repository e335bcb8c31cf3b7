"""A debootstrapped Debian booted with systemd-nspawn, driven from the host with nsenter.

Used by tests/test_systemd_boot.py. Needs root, ``systemd-nspawn`` (Debian: systemd-container),
``debootstrap`` and ``nsenter`` (util-linux). The rootfs is built once and kept in
``$MODELD_SYSTEMD_TEST_CACHE`` (default ``~/.cache/modeld-systemd-test``); each run boots an
overlay on top of it, so the cached tree never changes. The wheels that the container installs
from are fetched on the host (the container has no network) and cached there too.

Environment: ``MODELD_SYSTEMD_TEST_SUITE`` (Debian suite, default bookworm),
``MODELD_SYSTEMD_TEST_MIRROR`` (default: the first Debian mirror in the host's apt sources, else
deb.debian.org).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import psutil

SUITE = os.environ.get("MODELD_SYSTEMD_TEST_SUITE", "bookworm")
CACHE = Path(
    os.environ.get("MODELD_SYSTEMD_TEST_CACHE") or Path.home() / ".cache" / "modeld-systemd-test"
)
# On top of debootstrap's default set (which has systemd and udev: udev creates the render
# group that systemd/gpu.conf names): logind needs D-Bus, linger and `machinectl shell` need
# libpam-systemd and systemd-machined, and modeld needs python3 with venv.
PACKAGES = ("dbus", "libpam-systemd", "systemd-container", "python3", "python3-venv")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_STAMP = ".modeld-test-rootfs"


def missing() -> str | None:
    """Why the container cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, mount, systemd-nspawn)"
    need = {
        "systemd-nspawn": "systemd-container",
        "debootstrap": "debootstrap",
        "nsenter": "util-linux",
    }
    for tool, package in need.items():
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: apt-get install -y {package})"
    return None


def debian_mirror() -> str:
    """``$MODELD_SYSTEMD_TEST_MIRROR``, else the host's Debian mirror from apt's sources."""
    explicit = os.environ.get("MODELD_SYSTEMD_TEST_MIRROR")
    if explicit:
        return explicit
    sources = [Path("/etc/apt/sources.list")]
    sources_d = Path("/etc/apt/sources.list.d")
    if sources_d.is_dir():
        sources += sorted(sources_d.glob("*.list")) + sorted(sources_d.glob("*.sources"))
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        # One-line style (deb URI SUITE ...) and deb822 style (URIs: URI ...).
        pattern = r"^\s*(?:deb\s+(?:\[[^]]*\]\s+)?|URIs:\s*)(\S+)"
        for match in re.finditer(pattern, text, re.M):
            uri = match.group(1).rstrip("/")
            if uri.endswith("/debian"):
                return uri
    return "http://deb.debian.org/debian"


def rootfs(log: Path) -> Path:
    """The cached Debian tree, debootstrapped on first use (a few minutes)."""
    base = CACHE / SUITE
    want = f"{SUITE} {' '.join(PACKAGES)}\n"
    stamp = base / _STAMP
    if stamp.is_file() and stamp.read_text() == want:
        return base
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = CACHE / f"{SUITE}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with log.open("ab") as out:
        subprocess.run(
            [
                "debootstrap",
                f"--include={','.join(PACKAGES)}",
                SUITE,
                str(partial),
                debian_mirror(),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=True,
        )
    (partial / _STAMP).write_text(want)
    shutil.rmtree(base, ignore_errors=True)
    partial.rename(base)
    return base


def _python_of(root: Path) -> str:
    """``3.11`` for the rootfs's python3."""
    target = os.readlink(root / "usr/bin/python3")
    match = re.fullmatch(r"python(3\.\d+)", target)
    assert match, target
    return match.group(1)


def _glibc_of(root: Path) -> int:
    """The minor version of the rootfs's glibc (36 for 2.36)."""
    out = subprocess.run(
        ["chroot", str(root), "getconf", "GNU_LIBC_VERSION"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    match = re.search(r"2\.(\d+)", out)
    assert match, out
    return int(match.group(1))


def wheelhouse(root: Path, repo: Path, dest: Path) -> tuple[Path, Path]:
    """The modeld wheel built from ``repo`` and a directory of its dependencies' wheels.

    Both are for the rootfs's python and glibc, whatever the host runs. The dependencies are
    cached by (python, glibc, dependency list); modeld's own wheel is built on every call.
    """
    src = dest / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    for name in ("modeld", "registry"):
        shutil.copytree(
            repo / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(dest), str(src)],
        capture_output=True,
        timeout=600,
        check=True,
    )
    (wheel,) = dest.glob("modeld-*.whl")

    python = _python_of(root)
    glibc = _glibc_of(root)
    with (repo / "pyproject.toml").open("rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    key = hashlib.sha256("\n".join(sorted(deps)).encode()).hexdigest()[:12]
    deps_dir = CACHE / f"wheels-py{python}-glibc2.{glibc}-{key}"
    if not deps_dir.is_dir():
        partial = Path(tempfile.mkdtemp(prefix="wheels-", dir=CACHE))
        arch = platform.machine()
        platforms = [f"manylinux2014_{arch}"] + [
            f"manylinux_2_{minor}_{arch}" for minor in range(17, glibc + 1)
        ]
        subprocess.run(
            [
                *pip,
                "download",
                "--dest",
                str(partial),
                "--only-binary=:all:",
                "--implementation",
                "cp",
                "--python-version",
                python,
                "--abi",
                "cp" + python.replace(".", ""),
                *(arg for p in platforms for arg in ("--platform", p)),
                str(wheel),
            ],
            capture_output=True,
            timeout=1200,
            check=True,
        )
        for stale in partial.glob("modeld-*.whl"):
            stale.unlink()
        partial.rename(deps_dir)
    return wheel, deps_dir


class Machine:
    """One booted container: run commands as root (nsenter) or in a user's login session."""

    def __init__(self, root: Path, name: str, console_log: Path) -> None:
        self.root = root
        self.name = name
        self.console_log = console_log
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.leader = 0

    def boot(self, timeout: float = 300.0) -> None:
        """Start systemd in the container and wait until the boot is finished."""
        command = [
            "systemd-nspawn",
            f"--directory={self.root}",
            f"--machine={self.name}",
            "--boot",
            "--register=no",
            # Loopback only: the container installs from the wheels it is given.
            "--private-network",
            "--console=passive",
        ]
        if not Path("/run/systemd/system").exists():
            # The host does not run systemd: no manager to ask for a scope; use ours.
            command.append("--keep-unit")
        with self.console_log.open("ab") as out:
            self.nspawn = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while not self.leader:
            if self.nspawn.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"systemd-nspawn did not boot:\n{self.console()}")
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.nspawn.pid).children():
                    if child.name() == "systemd":
                        self.leader = child.pid
            time.sleep(0.1)
        while True:
            # Until systemd has opened its private socket, systemctl cannot connect at all.
            result = self.sh(
                "systemctl is-system-running --wait",
                timeout=max(1.0, deadline - time.monotonic()),
                check=False,
            )
            if result.stdout.strip() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if result.stdout.strip() not in ("running", "degraded"):
            raise RuntimeError(
                f"boot ended {result.stdout.strip()!r} ({result.stderr.strip()}):\n"
                + self.console()
            )

    def console(self) -> str:
        return self.console_log.read_text(errors="replace")[-4000:]

    def sh(
        self, script: str, *, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run ``script`` with /bin/sh as root inside the container; stdout and stderr apart."""
        result = subprocess.run(
            [
                "nsenter",
                f"--target={self.leader}",
                "--all",
                "--",
                "/usr/bin/env",
                "-i",
                f"PATH={PATH}",
                "LANG=C.UTF-8",
                "/bin/sh",
                "-c",
                script,
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{script!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def login(self, user: str, script: str, *, timeout: float = 120.0) -> tuple[int, str]:
        """Run ``script`` in a login session of ``user`` (``machinectl shell user@``).

        Returns the exit status and the output (stdout and stderr together: a terminal).
        machinectl does not pass the exit status on, so the script echoes it last.
        """
        wrapped = f"(\n{script}\n)\necho __rc=$?"
        result = self.sh(
            f"machinectl --quiet shell {user}@ /bin/sh -c {shlex.quote(wrapped)}",
            timeout=timeout,
            check=False,
        )
        # A terminal: CRLF line ends, and colour and line-erase sequences from systemctl.
        output = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stdout.replace("\r\n", "\n"))
        match = re.search(r"^__rc=(\d+)\n?\Z", output, re.M)
        if match is None:
            raise AssertionError(f"no exit status from {user}'s session:\n{output}{result.stderr}")
        return int(match.group(1)), output[: match.start()]

    def poweroff(self, timeout: float = 90.0) -> None:
        if self.nspawn is None or self.nspawn.poll() is not None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.sh("systemctl poweroff", check=False, timeout=30)
        try:
            self.nspawn.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.nspawn.kill()
            self.nspawn.wait(timeout=30)


@contextlib.contextmanager
def booted(base: Path, run_dir: Path) -> Iterator[Machine]:
    """Boot an overlay of ``base`` (changes go to ``run_dir``); power off and unmount after."""
    upper, work, root = run_dir / "upper", run_dir / "work", run_dir / "root"
    for d in (upper, work, root):
        d.mkdir()
    subprocess.run(
        [
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"lowerdir={base},upperdir={upper},workdir={work}",
            str(root),
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    machine = Machine(root, f"modeld-test-{os.getpid()}", run_dir / "console.log")
    try:
        machine.boot()
        yield machine
    finally:
        machine.poweroff()
        subprocess.run(["umount", "--lazy", str(root)], timeout=60, check=False)
