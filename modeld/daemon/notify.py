"""The systemd notify protocol (``sd_notify``) without python-systemd.

The service manager passes ``NOTIFY_SOCKET`` (a filesystem path, or ``@name`` for the
abstract namespace) and, when ``WatchdogSec=`` is set, ``WATCHDOG_USEC`` (and perhaps
``WATCHDOG_PID``). Each message is one datagram of ``KEY=VALUE`` lines. These variables are
the service manager's protocol, not settings, so they are read here rather than in
``config.py``; they are removed from the environment once read so that runner and probe
child processes never talk to the service manager in the daemon's name (``NotifyAccess=main``
would drop their messages anyway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import MutableMapping

from modeld import logs

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
# A stuck service manager must not freeze the event loop for long; sd_notify blocks too.
_SEND_TIMEOUT = 1.0


def _address(raw: str) -> str | bytes | None:
    """The socket address: a path, or ``@name`` → ``\\0name`` (Linux abstract namespace)."""
    if raw.startswith("@"):
        return b"\0" + os.fsencode(raw[1:])
    if raw.startswith("/"):
        return raw
    # sd_notify also ignores anything else (e.g. vsock: addresses, which modeld does not need).
    return None


class Notifier:
    """Sends READY/STATUS/STOPPING/RELOADING/WATCHDOG to the service manager, if there is one.

    Every method is a no-op returning False when the daemon was not started by a service
    manager that asked for notifications, so the daemon calls them unconditionally.
    """

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self._target = _address(address) if address else None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] | None = None, *, unset: bool = True
    ) -> Notifier:
        """Read ``NOTIFY_SOCKET``/``WATCHDOG_USEC``/``WATCHDOG_PID`` (and unset them)."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        watchdog: int | None = None
        raw_usec = env.get("WATCHDOG_USEC", "")
        raw_pid = env.get("WATCHDOG_PID", "")
        # WATCHDOG_PID names the process the watchdog is meant for; another pid means the
        # variables were inherited by accident (sd_watchdog_enabled applies the same rule).
        if raw_usec.isdigit() and (not raw_pid or raw_pid == str(os.getpid())):
            watchdog = int(raw_usec)
        if unset:
            for key in _ENV_KEYS:
                env.pop(key, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._target is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between pings: half of ``WATCHDOG_USEC`` (systemd's recommendation)."""
        return self.watchdog_usec / 2e6 if self.watchdog_usec else None

    def send(self, *lines: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` lines; False if there is no manager or it failed."""
        if self._target is None:
            return False
        payload = "\n".join(lines).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.settimeout(_SEND_TIMEOUT)
            self._sock.sendto(payload, self._target)
        except OSError as e:
            logs.event("notify_failed", logging.WARNING, socket=self.address, error=str(e))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: start-up (or a reload) has finished and requests are served."""
        return self.send("READY=1", *([f"STATUS={status}"] if status else []))

    def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (systemd ≥ 253 requires it for notify-reload)."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        lines = ["RELOADING=1", f"MONOTONIC_USEC={usec}"]
        return self.send(*lines, *([f"STATUS={status}"] if status else []))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """A free-form ``STATUS=`` line, shown by ``systemctl status``."""
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the daemon is alive."""
        return self.send("WATCHDOG=1")

    async def watchdog_loop(self) -> None:
        """Ping every half ``WATCHDOG_USEC`` until cancelled.

        The pings come from a task on the daemon's event loop, so they stop exactly when the
        loop stops turning (a blocking call, a deadlock): then systemd kills and restarts us.
        """
        interval = self.watchdog_interval
        if interval is None or not self.enabled:
            return
        while True:
            self.watchdog()
            await asyncio.sleep(interval)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
