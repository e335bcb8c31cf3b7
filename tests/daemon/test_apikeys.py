"""The API keys file: kept hashed and private, managed by `modeld key`, re-read on change."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from modeld.daemon.apikeys import KEY_PREFIX, KeyRing, KeysFile, hash_key, read_keys
from modeld.errors import Conflict, NotFound, SettingsError
from tests.support.daemon import daemon_env


def test_add_keeps_only_a_digest_in_a_private_file(tmp_path: Path) -> None:
    """`add` returns a fresh high-entropy key once; the 0600 file holds its sha256, not the key."""
    keys = KeysFile(tmp_path / "state" / "api-keys")
    entry, key = keys.add("webui")
    other_entry, other = keys.add("ops", "admin")
    assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43 and key != other
    assert stat.S_IMODE(keys.path.stat().st_mode) == 0o600
    text = keys.path.read_text()
    assert key not in text and other not in text
    assert entry.sha256 == hash_key(key) and entry.sha256 in text
    assert [(k.name, k.role) for k in keys.entries()] == [("webui", "use"), ("ops", "admin")]
    assert other_entry.role == "admin"
    # No temporary file is left beside it.
    assert sorted(p.name for p in keys.path.parent.iterdir()) == ["api-keys"]


def test_add_and_remove_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    """A taken or malformed name, an unknown role or an unknown key is a clear error."""
    keys = KeysFile(tmp_path / "api-keys")
    keys.add("webui")
    with pytest.raises(Conflict, match="modeld key rm webui"):
        keys.add("webui")
    with pytest.raises(SettingsError, match="not a key name"):
        keys.add("../x")
    with pytest.raises(SettingsError, match="not a role"):
        keys.add("x", "root")  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="modeld key list"):
        keys.remove("nobody")
    assert keys.remove("webui").name == "webui"
    assert keys.entries() == []


def test_keyring_rereads_the_file_when_it_changes(tmp_path: Path) -> None:
    """The daemon's view follows `add` and `rm` on the next check, without a restart."""
    keys = KeysFile(tmp_path / "api-keys")
    ring = KeyRing(keys.path)
    assert ring.verify("mdk_anything") is None
    _, key = keys.add("webui")
    found = ring.verify(key)
    assert found is not None and (found.name, found.role) == ("webui", "use")
    # The digest from the file (or from anywhere else) is not a key.
    assert ring.verify(hash_key(key)) is None
    assert ring.verify(key + "x") is None
    keys.remove("webui")
    assert ring.verify(key) is None


def test_keyring_refuses_a_file_others_can_read_or_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A keys file with group/other bits, or owned by another uid, grants nothing (logged)."""
    keys = KeysFile(tmp_path / "api-keys")
    _, key = keys.add("webui")
    ring = KeyRing(keys.path)
    assert ring.verify(key) is not None
    keys.path.chmod(0o644)
    with caplog.at_level(logging.ERROR, logger="modeld"):
        assert ring.verify(key) is None
    assert "chmod 600" in caplog.text
    assert ring.status()["problems"]
    with pytest.raises(SettingsError, match="chmod 600"):
        read_keys(keys.path)
    keys.path.chmod(0o600)
    assert ring.verify(key) is not None
    if os.geteuid() == 0:
        os.chown(keys.path, 4242, 4242)
        assert ring.verify(key) is None
        assert "owned by uid 4242" in ring.status()["problems"][0]


def test_a_corrupt_keys_file_is_refused_with_a_fix(tmp_path: Path) -> None:
    """A file that is not the keys format names itself and what to do; the daemon grants nothing."""
    path = tmp_path / "api-keys"
    path.write_text('{"version": 1, "keys": [{"name": "x", "role": "root"}]}')
    path.chmod(0o600)
    with pytest.raises(SettingsError, match="key #1"):
        read_keys(path)
    assert KeyRing(path).verify("mdk_x") is None


def key_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modeld", "key", *args],
        env=daemon_env(home),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_key_cli_prints_the_key_once_and_never_lists_it(short_tmp: Path) -> None:
    """`key add` prints the key alone on stdout; `key list` shows names, roles and dates only."""
    home = short_tmp / "home"
    added = key_cli(home, "add", "webui")
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert key.startswith(KEY_PREFIX) and added.stdout == key + "\n"
    assert "shown only this once" in added.stderr
    admin = json.loads(key_cli(home, "add", "ops", "--role", "admin", "--json").stdout)
    assert admin["role"] == "admin" and admin["key"].startswith(KEY_PREFIX)
    listed = key_cli(home, "list", "--json")
    assert listed.returncode == 0
    doc = json.loads(listed.stdout)
    assert doc["keys_file"] == str(home / "api-keys")
    assert [(k["name"], k["role"]) for k in doc["keys"]] == [("webui", "use"), ("ops", "admin")]
    assert all(set(k) == {"name", "role", "created"} for k in doc["keys"])
    human = key_cli(home, "list")
    for secret in (key, admin["key"], hash_key(key)):
        assert secret not in listed.stdout + human.stdout + human.stderr
    dup = key_cli(home, "add", "webui")
    assert dup.returncode == 1 and "exists" in dup.stderr
    assert key_cli(home, "rm", "webui").returncode == 0
    gone = key_cli(home, "rm", "webui")
    assert gone.returncode == 1 and "no key named 'webui'" in gone.stderr
    bad = key_cli(home, "add", "x", "--role", "root")
    assert bad.returncode == 2


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_root_writes_the_file_for_the_daemons_account(tmp_path: Path) -> None:
    """`sudo modeld key add` on a service's state dir leaves the file owned by that account."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 4242, 4243)
    keys = KeysFile(state / "api-keys")
    keys.add("webui")
    st = keys.path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (4242, 4243, 0o600)
    keys.add("ops")
    assert keys.path.stat().st_uid == 4242
