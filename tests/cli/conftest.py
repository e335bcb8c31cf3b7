"""One real daemon for the CLI and client tests: tiny-text and an embedding model (tiny-embed's
file) installed, TCP on with keys."""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modeld.daemon.apikeys import KeysFile
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.mirror import Faults, ThreadMirror
from tests.support.state import MODELS, install_fixture, write_entry

TINY = MODELS / "tiny-text.litertlm"
EMBED_ID = "embed-tiny"


@dataclass
class Tiny:
    daemon: DaemonProcess
    port: int
    use_key: str
    admin_key: str
    mirror: ThreadMirror
    registry: Path

    @property
    def socket(self) -> Path:
        return self.daemon.home / "modeld.sock"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="package")
def tiny() -> Iterator[Tiny]:
    """tiny-text and EMBED_ID (tiny-embed's file, an embedding model) installed; `pulled`
    (tiny-text's bytes) on a loopback mirror, not installed."""
    root = Path(tempfile.mkdtemp(prefix="md-", dir="/tmp"))
    home, registry = root / "home", root / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    # Its own id, not "tiny-...": the completion tests expect `tin` to offer tiny-text alone.
    install_fixture(home, EMBED_ID, MODELS / "tiny-embed.litertlm", registry=registry)
    data = TINY.read_bytes()
    mirror = ThreadMirror(data, Faults())
    write_entry(
        registry,
        "pulled",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        urls=[mirror.mirror.url],
    )
    keys = KeysFile(home / "api-keys")
    _, use_key = keys.add("app")
    _, admin_key = keys.add("ops", "admin")
    env = daemon_env(home, MODELD_LISTEN="127.0.0.1:0", MODELD_REGISTRY=str(registry))
    d = DaemonProcess(home=home, env=env)
    d.start()
    match = re.search(r"listening address=127\.0\.0\.1:(\d+)", d.log())
    assert match, d.log()
    try:
        yield Tiny(d, int(match.group(1)), use_key, admin_key, mirror, registry)
    finally:
        d.stop()
        mirror.close()
        shutil.rmtree(root, ignore_errors=True)
