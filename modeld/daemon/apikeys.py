"""API keys for TCP clients: the keys file (``modeld key``) and the daemon's view of it.

The file (``MODELD_API_KEYS_FILE``, default ``$MODELD_HOME/api-keys``) is JSON, mode 0600::

    {"version": 1, "keys": [{"name": "webui", "role": "use",
                             "created": "2026-11-30T20:04:05Z", "sha256": "<64 hex>"}]}

A key is ``mdk_`` and 43 URL-safe characters: 256 random bits, printed once by
``modeld key add`` and never stored. The file keeps its sha256 only. A fast hash is enough
because the key is random, not a password: there is no dictionary to try, and a copy of the
file (or of anything logged) is not a key. The daemon compares digests in constant time.

The daemon re-reads the file when it changes (``stat``: inode, size, mtime), so ``key add``
and ``key rm`` take effect on the next request, without a restart. It uses the file only
while it is a regular file owned by the daemon's uid or root with no group or other
permission bits; otherwise every key is refused, and the log line says how to fix it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from modeld import logs
from modeld.errors import Conflict, NotFound, SettingsError

KEY_PREFIX = "mdk_"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
NAME_HELP = "letters, digits, '.', '_' and '-', starting with a letter or digit, at most 64"
ROLES = ("use", "admin")
KeyRole = Literal["use", "admin"]
_DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
_FORMAT_VERSION = 1
# A keys file is a few hundred bytes per key; anything huge is not one.
_MAX_FILE_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ApiKey:
    """One key as the file keeps it: never the key itself."""

    name: str
    role: str
    created: str
    sha256: str

    def public(self) -> dict[str, str]:
        """What ``key list`` shows: name, role, created (not even the digest)."""
        return {"name": self.name, "role": self.role, "created": self.created}


def hash_key(key: str) -> str:
    """The digest the file keeps for ``key``."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def new_key() -> str:
    """A fresh key: ``mdk_`` and 256 random bits, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _check_private(path: Path, st: os.stat_result, owners: set[int] | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SettingsError(f"API keys file {path} is not a regular file; point it at one")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SettingsError(
            f"API keys file {path} has mode {mode:04o}; other users could read or change "
            f"it: run `chmod 600 {path}`"
        )
    if owners is not None and st.st_uid not in owners:
        raise SettingsError(
            f"API keys file {path} is owned by uid {st.st_uid}, not by the daemon's account "
            f"or root; run `chown {os.geteuid()} {path}` (or recreate it with `modeld key add`)"
        )


def _parse(path: Path, raw: bytes) -> list[ApiKey]:
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SettingsError(
            f"API keys file {path} is not JSON ({e}); fix it or remove it and add keys again"
        ) from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or doc.get("version") != _FORMAT_VERSION:
        raise SettingsError(
            f'API keys file {path} is not {{"version": 1, "keys": [...]}}; '
            "fix it or remove it and add keys again"
        )
    keys: list[ApiKey] = []
    for i, entry in enumerate(entries):
        ok = (
            isinstance(entry, dict)
            and set(entry) == {"name", "role", "created", "sha256"}
            and all(isinstance(v, str) for v in entry.values())
            and NAME_RE.fullmatch(entry["name"])
            and entry["role"] in ROLES
            and _DIGEST_RE.fullmatch(entry["sha256"])
        )
        if not ok:
            raise SettingsError(
                f"API keys file {path}: key #{i + 1} is not "
                '{"name", "role": "use"|"admin", "created", "sha256"}; fix or remove it'
            )
        keys.append(ApiKey(**entry))
    return keys


def read_keys(path: Path, owners: set[int] | None = None) -> list[ApiKey]:
    """The keys in ``path`` ([] when it does not exist); SettingsError saying how to fix it.

    ``owners``: the uids the file may belong to (the daemon checks; the CLI leaves it to the
    file's permissions).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SettingsError(
            f"cannot read the API keys file {path} ({e.strerror}); run the command as the "
            "daemon's user, or fix the file's owner"
        ) from None
    try:
        # Checked before reading: a directory opens, and only its read fails.
        _check_private(path, os.fstat(fd), owners)
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SettingsError(
            f"cannot read the API keys file {path} ({e.strerror}); point it at a readable file"
        ) from None
    finally:
        os.close(fd)
    if len(raw) > _MAX_FILE_BYTES:
        raise SettingsError(f"API keys file {path} is over 1 MiB; it is not a keys file")
    return _parse(path, raw) if raw.strip() else []


class KeysFile:
    """Adds, lists and removes keys in the file (what ``modeld key`` does)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def entries(self) -> list[ApiKey]:
        return read_keys(self.path)

    def add(self, name: str, role: KeyRole = "use") -> tuple[ApiKey, str]:
        """Add a key named ``name``; return its entry and the key (shown this once only)."""
        if not NAME_RE.fullmatch(name):
            raise SettingsError(f"{name[:70]!r} is not a key name: {NAME_HELP}")
        if role not in ROLES:
            raise SettingsError(f"{role!r} is not a role: use or admin")
        with self._locked():
            keys = read_keys(self.path)
            if any(k.name == name for k in keys):
                raise Conflict(
                    f"a key named {name!r} exists; remove it first (`modeld key rm {name}`) "
                    "or choose another name"
                )
            key = new_key()
            created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            entry = ApiKey(name=name, role=role, created=created, sha256=hash_key(key))
            self._write([*keys, entry])
        return entry, key

    def remove(self, name: str) -> ApiKey:
        """Remove the key named ``name``; the daemon refuses it from its next request on."""
        with self._locked():
            keys = read_keys(self.path)
            gone = [k for k in keys if k.name == name]
            if not gone:
                raise NotFound(f"no key named {name[:70]!r}; `modeld key list` shows the keys")
            self._write([k for k in keys if k.name != name])
        return gone[0]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One writer at a time: an exclusive lock on the file's directory."""
        directory = self.path.parent
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _owner(self) -> tuple[int, int] | None:
        """Who the file must belong to when root writes it: its owner, else the directory's.

        So ``sudo modeld key add`` on a service's state dir leaves a file the service can read.
        """
        if os.geteuid() != 0:
            return None
        for candidate in (self.path, self.path.parent):
            try:
                st = candidate.stat()
            except FileNotFoundError:
                continue
            return st.st_uid, st.st_gid
        return None

    def _write(self, keys: list[ApiKey]) -> None:
        doc: dict[str, Any] = {"version": _FORMAT_VERSION, "keys": [asdict(k) for k in keys]}
        directory = self.path.parent
        # mkstemp creates the file 0600: the keys are never readable by others, not even briefly.
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            owner = self._owner()
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            Path(tmp).replace(self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class KeyRing:
    """The daemon's keys: re-read when the file changes, checked in constant time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._signature: tuple[int, ...] | None = None
        self._keys: list[ApiKey] = []
        self._problem: str | None = None
        self._loaded = False

    def _stat_signature(self) -> tuple[int, ...] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError as e:
            return (-1, e.errno or 0)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode, st.st_uid)

    def refresh(self) -> None:
        """Re-read the file if it changed since the last read."""
        signature = self._stat_signature()
        if self._loaded and signature == self._signature:
            return
        self._signature, self._loaded = signature, True
        try:
            self._keys = read_keys(self.path, owners={os.geteuid(), 0})
            self._problem = None
        except SettingsError as e:
            # Fail closed: a file we cannot trust grants nothing.
            self._keys, self._problem = [], e.message
            logs.event("api_keys_refused", logging.ERROR, path=str(self.path), message=e.message)
            return
        logs.event("api_keys_loaded", path=str(self.path), keys=len(self._keys))

    @property
    def refused(self) -> bool:
        """Whether the file is refused (owner, permissions, contents): no key is in force."""
        self.refresh()
        return self._problem is not None

    def verify(self, presented: str) -> ApiKey | None:
        """The key whose digest matches ``presented``, or None."""
        self.refresh()
        digest = hash_key(presented)
        found = None
        # Every entry is compared, each in constant time: the timing says nothing of which.
        for key in self._keys:
            if hmac.compare_digest(key.sha256, digest):
                found = key
        return found

    def status(self) -> dict[str, Any]:
        """For ``/api/status``: the file, how many keys it holds, and why it is refused."""
        self.refresh()
        return {
            "keys_file": str(self.path),
            "keys": len(self._keys),
            "problems": [self._problem] if self._problem else [],
        }
