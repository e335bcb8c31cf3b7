"""``import`` against hostile files and peers: the file is opened once, by whoever asks.

The real daemon runs as root; the CLI passes the open file over the socket (``SCM_RIGHTS``);
a second uid is the real CLI under ``setpriv`` (and stdlib HTTP from a forked child).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from modeld.client import _send_with_fd
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, daemon_env
from tests.support.peer import PEER_GID, PEER_UID, needs_root, peer_cli, requests_as_peer
from tests.support.state import MODELS, install_fixture, write_entry
from tests.support.unix import unix_http, unix_request

TINY = MODELS / "tiny-text.litertlm"
OTHER = MODELS / "tiny-text-b.litertlm"  # another real model of the same size
# Twice what the temp file system has free: a copy of it could only fill the disk.
HUGE = 2 * shutil.disk_usage("/tmp").free


@pytest.fixture
def daemon(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A root daemon whose registry has tiny-text (with its sha256) and loose (none), and
    whose socket the peer uid reaches through its group; the peer is an admin."""
    short_tmp.chmod(0o755)
    home, registry, run = short_tmp / "home", short_tmp / "registry", short_tmp / "run"
    run.mkdir(mode=0o755)
    digest, size = sha256_file(TINY)
    write_entry(registry, "tiny-text", size=size, sha256=digest)
    write_entry(registry, "loose", size=size)
    write_entry(registry, "huge", size=HUGE)
    d = DaemonProcess(
        home=home,
        env=daemon_env(
            home,
            MODELD_SOCKET=str(run / "modeld.sock"),
            MODELD_REGISTRY=str(registry),
            MODELD_ADMIN_UIDS=f"0,{PEER_UID}",
        ),
    )
    d.start()
    os.chown(d.socket, 0, PEER_GID)
    try:
        yield d
    finally:
        d.stop()


def no_partials(d: DaemonProcess) -> bool:
    return not list((d.home / "partial").glob("*.import-*"))


@needs_root
def test_import_reads_what_the_peer_may_read(daemon: DaemonProcess, short_tmp: Path) -> None:
    """The CLI opens the file as its user: a peer imports its own 0600 file, cannot import
    root's, and a path import from that peer is refused alike for a secret and a missing
    file (no size, no existence)."""
    own = short_tmp / "mine"
    own.mkdir(mode=0o700)
    mine = own / "tiny-text.litertlm"
    shutil.copyfile(TINY, mine)
    mine.chmod(0o600)
    os.chown(own, PEER_UID, PEER_GID)
    os.chown(mine, PEER_UID, PEER_GID)
    imported = peer_cli(daemon, "import", str(mine), "--json")
    assert imported.returncode == 0, imported.stderr
    assert '"verified_by": "registry sha256"' in imported.stdout

    secret = short_tmp / "secret.litertlm"
    shutil.copyfile(TINY, secret)
    secret.chmod(0o600)
    refused = peer_cli(daemon, "import", str(secret), "tiny-text")
    assert refused.returncode != 0
    assert "not readable" in refused.stderr and str(TINY.stat().st_size) not in refused.stderr

    answers = requests_as_peer(
        daemon.socket,
        [
            ("POST", "/api/models/import", {"path": str(secret), "id": "loose"}),
            ("POST", "/api/models/import", {"path": str(short_tmp / "nothing"), "id": "loose"}),
        ],
    )
    (s1, b1), (s2, b2) = answers
    assert s1 == s2 == 403, answers
    assert b1["error"]["message"] == b2["error"]["message"]
    assert "modeld import PATH" in b1["error"]["message"]
    assert no_partials(daemon)


@needs_root
def test_path_import_never_follows_links_blocks_or_fills(
    daemon: DaemonProcess, short_tmp: Path
) -> None:
    """A path that is (or links to) a FIFO or /dev/zero is refused at once, the daemon
    keeps answering, and nothing is written; a passed descriptor of a pipe is refused too."""
    fifo = short_tmp / "fifo"
    os.mkfifo(fifo)
    to_fifo, to_zero = short_tmp / "to-fifo.litertlm", short_tmp / "to-zero.litertlm"
    to_fifo.symlink_to(fifo)
    to_zero.symlink_to("/dev/zero")
    for path in (fifo, to_fifo, to_zero, Path("/dev/zero")):
        status, body = unix_request(
            daemon.socket, "POST", "/api/models/import", {"path": str(path), "id": "loose"}
        )
        assert status == 400, (path, status, body)
        assert unix_http(daemon.socket, timeout=5.0)[0] == 200
    r, w = os.pipe()
    try:
        status, body = _send_with_fd(daemon.socket, {"fd": True, "name": "x.litertlm"}, r, 10.0)
    finally:
        os.close(r)
        os.close(w)
    assert status == 400 and "not a regular file" in body["error"]["message"]
    assert no_partials(daemon)
    assert unix_request(daemon.socket, "GET", "/api/models/loose")[1]["installed"] is None


@needs_root
def test_sparse_file_cannot_fill_the_disk(daemon: DaemonProcess, short_tmp: Path) -> None:
    """A sparse file of an entry's (huge) apparent size, with a real header, is refused by
    the free-space check before a byte is copied: 507 disk_full."""
    sparse = short_tmp / "huge.litertlm"
    with sparse.open("wb") as f:
        f.write(TINY.read_bytes()[: 64 * 1024])
        f.truncate(HUGE)
    result = daemon.cli("import", str(sparse), "huge")
    assert result.returncode == 1
    assert "free" in result.stderr and "modeld prune" in result.stderr, result.stderr
    status, body = unix_request(
        daemon.socket, "POST", "/api/models/import", {"path": str(sparse), "id": "huge"}
    )
    assert status == 507 and body["error"]["code"] == "disk_full"
    assert no_partials(daemon)


@pytest.fixture
def verified_loose(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A daemon with ``loose`` (an entry without sha256) installed as verified by a hub."""
    home, registry = short_tmp / "home", short_tmp / "registry"
    install_fixture(home, "loose", TINY, verified_by="huggingface.co X-Linked-Etag")
    write_entry(registry, "loose", size=TINY.stat().st_size)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        yield d
    finally:
        d.stop()


def test_unverified_file_never_replaces_a_verified_install(
    verified_loose: DaemonProcess,
) -> None:
    """Importing another file under a verified model's id is refused (409); the verified
    blob stays, and pull still answers with it. The same bytes keep their verification."""
    d = verified_loose
    refused = d.cli("import", str(OTHER), "loose")
    assert refused.returncode == 1
    assert "installed verified" in refused.stderr, refused.stderr
    shown = d.cli_json("show", "loose")
    digest, _ = sha256_file(TINY)
    assert shown["installed"]["digest"] == digest
    assert shown["installed"]["verified_by"] == "huggingface.co X-Linked-Etag"
    again = d.cli_json("import", str(TINY), "loose")
    assert again["installed"]["verified_by"] == "huggingface.co X-Linked-Etag"
    pulled = d.cli_json("pull", "loose")
    assert pulled["already"] is True and pulled["installed"]["digest"] == digest
