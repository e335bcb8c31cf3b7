"""Log lines are safe to read: secrets redacted and control characters escaped, whoever logs."""

from __future__ import annotations

import logging
import subprocess
import sys

from modeld import logs


def test_secrets_are_redacted_and_controls_escaped() -> None:
    """Keys, bearer tokens, credential headers, URL credentials and signatures become
    ``[redacted]``; ESC, BEL, CR and newlines show as their escapes."""
    line = logs.safe(
        "b'Authorization: Bearer mdk_abcdefghijklmnop\\r' x-api-key: sk-live "
        "http://bob:pw@h/f?X-Amz-Signature=sig123&a=1 hf_ABCDEFGHIJ \x1b]0;t\x07\r\nforged"
    )
    for secret in ("mdk_abcdefghijklmnop", "sk-live", "bob:pw", "sig123", "hf_ABCDEFGHIJ"):
        assert secret not in line, line
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line and "\r" not in line
    shown = logs.safe("GET /api/\x1b]0;t\x07\r\nforged")
    assert shown == "GET /api/\\x1b]0;t\\x07\\r\\nforged", shown
    assert logs.redact_url("http://u:p@h:1/f?sig=x#y") == "http://(credentials)@h:1/f?(query)"


def test_every_logger_goes_through_the_safe_format() -> None:
    """After setup, a library's error with a key in its traceback reaches stderr redacted,
    each traceback line marked; nothing goes through logging.lastResort raw."""
    code = (
        "import logging; from modeld import logs; logs.setup('info', secrets=('tok3n-xyz',))\n"
        "try:\n raise ValueError(\"b'Authorization: Bearer mdk_SECRET\\\\r' tok3n-xyz\\nforged\")\n"
        "except ValueError:\n logging.getLogger('aiohttp.server').exception('Error handling')\n"
        "logging.getLogger('asyncio').warning('x-api-key: mdk_OTHER \\x1b[2J')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    err = done.stderr
    assert "mdk_SECRET" not in err and "mdk_OTHER" not in err and "tok3n-xyz" not in err, err
    assert "\x1b" not in err, err
    assert "ERROR aiohttp.server: Error handling" in err, err
    lines = err.splitlines()
    assert all(" ERROR " in ln or " WARNING " in ln or ln.startswith("  | ") for ln in lines), err
    assert logging.lastResort is not None  # untouched: it is simply never reached
