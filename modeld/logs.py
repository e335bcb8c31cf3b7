"""Structured logging: one line per event, ``event key=value ...`` (journald-friendly).

Every log line is safe to read, whichever logger wrote it (modeld's, or a library's such as
``aiohttp.server`` and ``asyncio``, whose messages carry a peer's bytes):

- secrets are redacted (``redact``): API keys and bearer tokens, the HF token, the values of
  credential headers, the user and password of a URL, the signature of a signed URL;
- control characters are escaped (``escape``): a peer's ESC, BEL or CR in a path would
  otherwise retitle, clear or forge lines of the terminal that replays the log;
- a traceback's lines after the first start with ``  | ``, so no line of it can pass for a
  record of its own.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_LOGGER = logging.getLogger("modeld")

# What a terminal acts on rather than shows: C0 and C1 controls (ESC starts a sequence that
# can retitle the window, move the cursor or hide text), the line and paragraph separators,
# and the bidi controls that reorder what follows them ("Trojan Source").
_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)

# Secrets a message may carry, each with what stands in its place.
_SECRET_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # Credential headers, in any quoting (``Authorization: ...``, ``'x-api-key': '...'``).
    (
        re.compile(
            r"(?i)((?:proxy-)?authorization|x-api-key|cookie|set-cookie)"
            r"(['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n,}]+"
        ),
        r"\1\2[redacted]",
    ),
    (re.compile(r"(?i)\b(bearer|basic)(\s+)[A-Za-z0-9._~+/=-]{4,}"), r"\1\2[redacted]"),
    (re.compile(r"\bmdk_[A-Za-z0-9_-]+"), "mdk_[redacted]"),
    (re.compile(r"\bhf_[A-Za-z0-9]{6,}"), "hf_[redacted]"),
    (re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://)[^/\s@'\"]+@"), r"\1[redacted]@"),
    (
        re.compile(
            r"(?i)([?&](?:x-amz-[a-z-]+|signature|sig|token|access_token|api_key|key|"
            r"key-pair-id|policy|expires)=)[^&\s'\"#]+"
        ),
        r"\1[redacted]",
    ),
]
# Values the daemon knows to be secret (the HF token), redacted wherever they appear.
_SECRETS: set[str] = set()


def add_secret(value: str | None) -> None:
    """Redact ``value`` from every log line from now on."""
    if value and len(value) >= 4:
        _SECRETS.add(value)


def redact(text: str) -> str:
    """``text`` with the secrets it may carry replaced by ``[redacted]``."""
    for secret in _SECRETS:
        text = text.replace(secret, "[redacted]")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def escape(text: str) -> str:
    """``text`` with each control character written as its escape (``\\x1b``, ``\\n``)."""
    return _CONTROL.sub(lambda m: ascii(m.group())[1:-1], text)


def safe(text: str) -> str:
    """``text`` fit for a log line: secrets redacted, control characters escaped."""
    return escape(redact(text))


def redact_url(url: str) -> str:
    """``url`` without what may be a secret: its user and password, and its query (a signed
    URL carries its signature there), each replaced by a marker."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(a URL that does not parse)"
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if port is not None:
        host = f"{host}:{port}"
    if parts.username is not None or parts.password is not None:
        host = f"(credentials)@{host}"
    query = "(query)" if parts.query else ""
    return urlunsplit((parts.scheme, host, parts.path, query, ""))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".") or "0"
    text = str(value)
    if not text or any(c in text for c in ' "=') or _CONTROL.search(text):
        return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'
    return text


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event line."""
    if _LOGGER.isEnabledFor(level):
        parts = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
        _LOGGER.log(level, "%s %s", name, parts)


class SafeFormatter(logging.Formatter):
    """``TIME LEVEL MESSAGE``: secrets redacted, control characters escaped; a library's
    record names its logger; a traceback's lines are marked as its own (``  | ``)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.name != _LOGGER.name and not record.name.startswith(_LOGGER.name + "."):
            message = f"{record.name}: {message}"
        record.message = safe(message)
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        blocks = []
        if record.exc_info:
            blocks.append(self.formatException(record.exc_info))
        if record.stack_info:
            blocks.append(self.formatStack(record.stack_info))
        for block in blocks:
            line += "".join(f"\n  | {safe(part)}" for part in block.splitlines())
        return line


def setup(level: str, secrets: tuple[str | None, ...] = ()) -> None:
    """Send modeld's log lines to stderr at ``level`` (debug, info or warning), and every
    other logger's warnings and errors through the same safe format (none reaches
    ``logging.lastResort``, which prints a library's message raw); ``secrets`` are redacted
    wherever they appear."""
    for secret in secrets:
        add_secret(secret)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(SafeFormatter())
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level.upper())
    _LOGGER.propagate = False
    root = logging.getLogger()
    others = logging.StreamHandler(sys.stderr)
    others.setFormatter(SafeFormatter())
    others.setLevel(logging.WARNING)
    root.handlers[:] = [others]
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
