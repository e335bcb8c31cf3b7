"""Wiring, start-up and ordered shutdown of the daemon.

Start-up: settings → umask 077 → state dir and its lock → the database checked (never
changed when unusable) → the parts (``root.Root``, in dependency order) → the socket (its
directory checked, bound never more open than 0660) and the opt-in TCP listeners
(``MODELD_LISTEN``, API keys) → serving. Shutdown on SIGTERM/SIGINT (uvicorn's order): stop
accepting, let in-flight requests finish within ``shutdown_timeout``, cancel the rest,
stop the parts (the reverse of their start), remove the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import IO, Any

from aiohttp import web

from modeld import logs
from modeld.api import make_app
from modeld.api.connections import ConnectionGuard, GuardedSite
from modeld.config import Settings, format_address, is_loopback
from modeld.daemon.activation import inherited_listeners
from modeld.daemon.apikeys import KeyRing
from modeld.daemon.lifecycle import Reloader
from modeld.daemon.notify import Notifier
from modeld.daemon.root import Root
from modeld.errors import Conflict, ModeldError, SettingsError
from modeld.services.parts import Services
from modeld.store.schema import check_database

# sun_path is 108 bytes on Linux, including the terminating NUL.
_MAX_SOCKET_PATH = 107
# Never more open than 0660: the umask is in force from bind() on, so there is no window.
_SOCKET_UMASK = 0o117


def _claim_socket_path(path: Path) -> None:
    """Remove a stale socket left by a dead daemon; refuse if a live one answers."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SettingsError(
            f"{path} exists and is not a socket; move it away or set MODELD_SOCKET elsewhere"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        logs.event("stale_socket_removed", path=str(path))
        return
    except OSError as e:
        raise Conflict(f"cannot check the socket {path}: {e}; remove it if no daemon runs") from e
    finally:
        probe.close()
    raise Conflict(
        f"another modeld is already serving on {path}; stop it first or set MODELD_SOCKET"
    )


def _check_ancestors(directory: Path) -> None:
    """``directory`` and every directory above it must be this uid's or root's, and writable
    by others only when sticky (``/tmp``): their owner, or anyone who may write there, could
    otherwise rename the socket's directory away and put their own in its place."""
    uid = os.geteuid()
    real = directory.resolve()
    for above in (real, *real.parents):
        st = above.stat()
        if st.st_uid not in (uid, 0):
            raise SettingsError(
                f"the socket's directory {directory} is under {above}, which belongs to uid "
                f"{st.st_uid}, not to uid {uid} (this daemon) or root, so its owner could "
                "replace the socket's directory; set MODELD_SOCKET to a path in a directory of "
                "yours, such as $XDG_RUNTIME_DIR"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise SettingsError(
                f"the socket's directory {directory} is under {above}, which is writable by "
                f"others (mode {stat.S_IMODE(st.st_mode):o}), so anyone could replace the "
                f"socket's directory; run `chmod o-w {above}` or set MODELD_SOCKET to a path "
                "in a private directory"
            )


def check_socket_dir(directory: Path) -> None:
    """The socket's directory must be this uid's or root's, and not writable by others; the
    directories above it must be this uid's or root's too (``_check_ancestors``).

    Whoever can write to it can replace the socket with their own between two starts (and
    clients would talk to them), or swap it for a symlink while the daemon sets its mode.
    """
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise SettingsError(f"MODELD_SOCKET: {directory} is not a directory; choose another path")
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise SettingsError(
            f"the socket's directory {directory} belongs to uid {st.st_uid}, not to uid {uid} "
            "(this daemon) or root, so its owner could replace the socket; set MODELD_SOCKET "
            "to a path in a directory of yours, such as $XDG_RUNTIME_DIR"
        )
    if st.st_mode & stat.S_IWOTH:
        raise SettingsError(
            f"the socket's directory {directory} is writable by others "
            f"(mode {stat.S_IMODE(st.st_mode):o}), so anyone could replace the socket; "
            f"run `chmod o-w {directory}` or set MODELD_SOCKET to a path in a private directory"
        )
    _check_ancestors(directory.parent)


def _set_socket_mode(path: Path, mode: int) -> None:
    """chmod the socket just bound through a descriptor of that very file.

    ``chmod(path)`` would follow a symlink put in its place. ``fchmod`` on the listening
    socket's own descriptor changes only the kernel's socket inode on Linux, not the file
    clients connect through, so the file is opened ``O_PATH|O_NOFOLLOW`` and changed
    through ``/proc/self/fd``.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
            raise Conflict(
                f"{path} was replaced right after it was bound; find out who writes to "
                f"{path.parent}, then start again"
            )
        Path(f"/proc/self/fd/{fd}").chmod(mode)
    finally:
        os.close(fd)


def bind_socket(path: Path) -> socket.socket:
    """Bind and listen on ``path`` with mode 0660 from the first instant."""
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise SettingsError(
            f"MODELD_SOCKET={path}: longer than {_MAX_SOCKET_PATH} bytes; choose a shorter path"
        )
    if not path.parent.exists():
        # Checked before a directory is made in it, then once it exists.
        _check_ancestors(next((d for d in path.parents if d.exists()), Path("/")))
        path.parent.mkdir(parents=True, exist_ok=True)
    check_socket_dir(path.parent)
    _claim_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(_SOCKET_UMASK)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    try:
        _set_socket_mode(path, 0o660)
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """Listen on ``host:port`` (an IP literal; port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise Conflict(
            f"cannot listen on {format_address(host, port)} ({e.strerror}); stop what uses "
            "it or choose another address in MODELD_LISTEN"
        ) from e
    sock.setblocking(False)
    return sock


def _check_inherited_tcp(settings: Settings, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    if not is_loopback(host) and not settings.listen_public:
        raise SettingsError(
            f"the service manager passed a TCP socket on {format_address(host, port)}, not a "
            "loopback address, so other hosts could reach the API, keys and prompts in clear "
            "text: put TLS in front (a reverse proxy) and set MODELD_LISTEN_PUBLIC=1 to confirm"
        )


def tcp_listeners(settings: Settings, inherited: list[socket.socket]) -> list[socket.socket]:
    """The TCP sockets to serve: those the service manager passed, else ``MODELD_LISTEN``'s."""
    for sock in inherited:
        _check_inherited_tcp(settings, sock)
    if inherited:
        if settings.listen:
            logs.event("listen_ignored", listen=",".join(settings.listen), reason="inherited")
        return inherited
    out: list[socket.socket] = []
    try:
        for host, port in settings.listen_addresses:
            out.append(bind_tcp(host, port))
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def lock_state_dir(home: Path) -> IO[str]:
    """Take an exclusive lock on the state dir: one daemon per ``MODELD_HOME``."""
    home.mkdir(parents=True, exist_ok=True)
    lock = (home / "daemon.lock").open("a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        lock.close()
        if e.errno in (errno.EAGAIN, errno.EACCES):
            raise Conflict(
                f"another modeld already uses the state dir {home}; stop it or set MODELD_HOME"
            ) from e
        raise
    return lock


def make_state_dir(d: Path) -> None:
    """Create one state dir; refuse a path that is not a directory, or one that every user
    may write to (any local user could then swap a model file or the database)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        mode = d.stat().st_mode
    except FileExistsError:
        raise SettingsError(
            f"the state path {d} is a file, not a directory; set MODELD_HOME to a directory"
        ) from None
    except OSError as e:
        raise SettingsError(
            f"cannot make the state dir {d}: {e.strerror}; set MODELD_HOME to a directory "
            "this user may write"
        ) from e
    if mode & stat.S_IWOTH:
        raise SettingsError(
            f"the state dir {d} is writable by every user (mode {stat.S_IMODE(mode):04o}), "
            f"so any local user could replace its models or database; run `chmod o-w {d}`"
        )


def open_state_dir(settings: Settings) -> IO[str]:
    """Create the state dirs, lock them, and check the database; return the held lock."""
    for d in (settings.home, settings.blobs_dir, settings.partial_dir, settings.cache_dir):
        make_state_dir(d)
    lock = lock_state_dir(settings.home)
    try:
        # Before any part opens it: a database modeld cannot use stops start-up untouched.
        check_database(settings.db_path)
    except BaseException:
        lock.close()
        raise
    return lock


async def run(
    settings: Settings,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    notifier: Notifier | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT (or ``stop`` is set), then shut down in order.

    SIGHUP reloads what can change live (``lifecycle.LIVE_FIELDS``) and the registry.
    """
    notifier = notifier or Notifier.from_environ()
    lock = open_state_dir(settings)
    root = Root(settings)
    services = root.services
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloader = _reloads(services, notifier, loop)
    # Pings from the event loop itself: they stop when the loop stops turning.
    watchdog = asyncio.create_task(notifier.watchdog_loop())
    keys = root.keys
    runner = web.AppRunner(
        make_app(services, keys),
        handle_signals=False,
        access_log=None,
        shutdown_timeout=settings.shutdown_timeout,
        # aiohttp's idle timeout: a connection with no request running is closed after it.
        keepalive_timeout=settings.idle_timeout,
    )
    sock: socket.socket | None = None
    inherited = False
    try:
        notifier.status("starting: loading catalog and store")
        async with root:
            try:
                await runner.setup()
                # Sockets passed by systemd (modeld.socket) win; otherwise bind our own.
                passed = inherited_listeners()
                sock = passed.unix
                inherited = sock is not None
                sock = sock or bind_socket(settings.socket_path)
                # One guard for every listener: the connection bound is the daemon's.
                guard = ConnectionGuard(settings)
                await GuardedSite(runner, sock, guard).start()
                tcp = await _serve_tcp(runner, services, passed.tcp, keys, guard)
                # READY only now: the sockets accept and every part (catalog, store) started.
                _announce_ready(services, notifier, str(sock.getsockname()), tcp, inherited)
                if ready is not None:
                    ready.set()
                await _serve_until(stop, services)
                logs.event("stopping", reason="signal")
                notifier.stopping("stopping: finishing requests, stopping engines")
            finally:
                services.stopping = True
                # Downloads first: a pull stream a client follows ends only with its job, so
                # the wait for in-flight handlers below lasted the whole shutdown_timeout, and
                # again as its handler was cancelled. Their partials and journals are kept.
                await services.downloads.stop()
                # Stops accepting, waits for in-flight handlers up to shutdown_timeout,
                # cancels the rest; then leaving ``root`` stops the parts, the last started
                # first, each even if another failed.
                await runner.cleanup()
    finally:
        # An inherited socket's path belongs to modeld.socket: removing it would break the
        # next activation.
        if sock is not None and not inherited:
            with contextlib.suppress(OSError):
                settings.socket_path.unlink()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await reloader.close()
        watchdog.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog
        lock.close()
        logs.event("stopped")
        notifier.close()


async def _serve_until(stop: asyncio.Event, services: Services) -> None:
    """Wait for ``stop``, preloading models meanwhile (a preload still running is cancelled)."""
    preloading = asyncio.create_task(_preload(services))
    try:
        await stop.wait()
    finally:
        preloading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await preloading


async def _preload(services: Services) -> None:
    """Load MODELD_PRELOAD's models, then the entries marked ``preload = true``, one at a
    time, each kept loaded (keep-alive never; still evicted for memory). A model that cannot
    load is logged and skipped: the daemon serves on."""
    marked = [e.id for e in services.catalog.entries() if e.preload]
    for model_id in dict.fromkeys([*services.settings.preload, *marked]):
        try:
            view = await services.inference.load(
                model_id,
                backends=None,
                keep_alive=-1,
                pin=False,
                allow_unverified=False,
                may_shorten_keep_alive=True,
                preload=True,
            )
        except ModeldError as e:
            logs.event(
                "preload_failed", logging.WARNING, model=model_id, code=e.code, reason=e.message
            )
            continue
        logs.event("preloaded", model=model_id, engine=view["id"])


def _announce_ready(
    services: Services, notifier: Notifier, where: str, tcp: list[str], inherited: bool
) -> None:
    logs.event(
        "ready",
        socket=where,
        tcp=",".join(tcp) or None,
        version=services.version,
        pid=os.getpid(),
        inherited=inherited,
    )
    notifier.ready(f"serving on {' and '.join([where, *tcp])}")


def _reloads(services: Services, notifier: Notifier, loop: asyncio.AbstractEventLoop) -> Reloader:
    """SIGHUP reloads the settings; the last reload's outcome is the status's ``reload``."""
    reloader = Reloader(services, notifier)
    services.reload_status = reloader.status
    loop.add_signal_handler(signal.SIGHUP, reloader.request)
    return reloader


async def _serve_tcp(
    runner: web.AppRunner,
    services: Services,
    passed: list[socket.socket],
    keys: KeyRing,
    guard: ConnectionGuard,
) -> list[str]:
    """Start the TCP listeners; return their addresses (the port chosen for port 0)."""
    addresses: list[str] = []
    for tcp_sock in tcp_listeners(services.settings, passed):
        await GuardedSite(runner, tcp_sock, guard).start()
        address = format_address(*tcp_sock.getsockname()[:2])
        addresses.append(address)
        logs.event("listening", address=address, keys_file=str(keys.path))
    if not addresses:
        return addresses

    def tcp_status() -> dict[str, Any]:
        doc = keys.status()
        summary = f"{', '.join(addresses)} ({doc['keys']} API keys in {doc['keys_file']})"
        return {"summary": summary, "listen": addresses, **doc}

    services.tcp_status = tcp_status
    if keys.status()["keys"] == 0:
        logs.event(
            "no_api_keys",
            logging.WARNING,
            path=str(keys.path),
            fix="every TCP request gets 401 until `modeld key add NAME` adds a key",
        )
    return addresses


def serve(settings: Settings) -> int:
    """Run the daemon; return the process exit status."""
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    logs.setup(settings.log_level, secrets=(token,))
    # Everything the daemon creates in its state dir is its own: dirs 0700, files 0600. The
    # socket's mode is set apart (0660, at bind).
    os.umask(0o077)
    notifier = Notifier.from_environ()
    try:
        asyncio.run(run(settings, notifier=notifier))
    except ModeldError as e:
        # The CLI prints the message as its one line on stderr; logging it too would print
        # it twice there (and twice in the journal).
        notifier.status(f"failed: {e.message}")
        raise
    return 0
