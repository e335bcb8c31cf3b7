"""Tests for modeld.hostinfo: the runtime's version, version order, and the host's facts."""

from __future__ import annotations

import importlib.metadata
import platform
import socket

import pytest

from modeld.hostinfo import at_least, host_facts, release, runtime_version


def test_runtime_version_is_the_installed_package() -> None:
    """The version comes from the litert-lm package's metadata."""
    assert runtime_version() == importlib.metadata.version("litert-lm-api")


@pytest.mark.parametrize(
    ("installed", "needed", "ok"),
    [
        ("0.18.1", "0.18", True),
        ("0.18.1", "0.18.1", True),
        ("0.18.1", "0.18.2", False),
        ("0.18.1", "0.19", False),
        ("0.19.0", "0.19", True),
        ("0.19.0rc1", "0.19", True),
        ("1.0", "0.19.3", True),
        ("0.9", "0.10", False),
        (None, "0.1", False),
        ("garbage", "0.1", False),
    ],
)
def test_at_least_orders_releases_numerically(installed: str | None, needed: str, ok: bool) -> None:
    """Versions compare by their numeric release (0.9 < 0.10); unknown ones never pass."""
    assert at_least(installed, needed) is ok


def test_release_ignores_trailing_zeros_and_suffixes() -> None:
    """0.19, 0.19.0 and 0.19.0rc1 are one release; text without a number is none."""
    assert release("0.19") == release("0.19.0") == release("0.19.0rc1") == (0, 19)
    assert release("v2.1") == (2, 1)
    assert release("latest") is None


def test_host_facts_name_host_os_python_and_runtime() -> None:
    """What a bug report's first table shows."""
    facts = host_facts()
    assert facts["hostname"] == socket.gethostname()
    assert facts["python"].endswith(platform.python_version())
    assert facts["kernel"] == f"{platform.system()} {platform.release()}"
    assert facts["runtime_version"] == runtime_version()
    assert facts["os"]
