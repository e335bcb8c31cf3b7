"""Helpers for the daemon's child processes (runners, probes); imports only the standard library.

A runner child imports this before the runtime, so it must stay cheap to import.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only).

    A runner or probe left running after the daemon was killed with -9 would hold memory (GPU
    memory, for a probe) forever. ``parent`` is the pid the parent passed on the command line;
    when the parent died before ``prctl`` took effect this process exits at once. Comparing
    with that pid rather than with 1 keeps this right under a subreaper or when the daemon is
    PID 1.
    """
    expected = parent if parent is not None else os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected:
        os._exit(1)
