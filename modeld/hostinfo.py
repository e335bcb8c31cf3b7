"""Facts about this host and its LiteRT-LM runtime, for status views and bug reports.

The runtime's version is read from the installed package's metadata (``litert-lm``), not by
importing the runtime (a large package, docs/benchmarks.md#engine-memory): the daemon itself
never loads it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import re
import socket
import sys
from pathlib import Path
from typing import Any

# The runtime API that modeld imports (``litert_lm``) ships as ``litert-lm-api``; the
# ``litert-lm`` CLI package depends on it. Either one's version is the runtime's.
RUNTIME_PACKAGE = "litert-lm-api"
_RUNTIME_DISTRIBUTIONS = (RUNTIME_PACKAGE, "litert-lm")
# "0.18.1", "0.19.0rc1", "1.2": the numeric release part decides an order.
_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
VERSION_PATTERN = r"^\d+(\.\d+){0,2}$"
# How a probe is run. Results recorded by an older method (or another runtime version) are
# not trusted: before method 2 the probe opened the blob without its ``.litertlm`` name,
# which the runtime refuses on every host ("Unsupported or unknown file format").
PROBE_METHOD = 2


@functools.cache
def runtime_version() -> str | None:
    """The installed runtime's version, or None where the package is missing."""
    for name in _RUNTIME_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of ``version`` (``0.19.0rc1`` -> ``(0, 19, 0)``), or None."""
    m = _RELEASE.match(version)
    if m is None:
        return None
    parts = tuple(int(p) for p in m.group(1).split("."))
    # 0.19 and 0.19.0 are the same release: trailing zeros never decide.
    while len(parts) > 1 and parts[-1] == 0:
        parts = parts[:-1]
    return parts


def at_least(installed: str | None, needed: str) -> bool:
    """Whether ``installed`` is ``needed`` or newer (a missing or odd version is not)."""
    have = release(installed) if installed else None
    want = release(needed)
    return have is not None and want is not None and have >= want


def _os_release() -> str | None:
    for path in (Path("/etc/os-release"), Path("/usr/lib/os-release")):
        try:
            text = path.read_text()
        except OSError:
            continue
        fields = dict(
            line.split("=", 1) for line in text.splitlines() if "=" in line and line[:1] != "#"
        )
        name = fields.get("PRETTY_NAME") or fields.get("NAME")
        if name:
            return name.strip().strip('"')
    return None


def host_facts() -> dict[str, Any]:
    """Host, OS, kernel, CPU and Python: what an upstream bug report asks for first."""
    uname = platform.uname()
    return {
        "hostname": socket.gethostname(),
        "os": _os_release() or uname.system,
        "kernel": f"{uname.system} {uname.release}",
        "machine": uname.machine,
        "cpus": os.cpu_count(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "python_executable": sys.executable,
        "runtime": RUNTIME_PACKAGE,
        "runtime_version": runtime_version(),
    }
