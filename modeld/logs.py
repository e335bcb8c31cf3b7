"""Structured logging: one line per event, ``event key=value ...`` (journald-friendly)."""

from __future__ import annotations

import logging
import sys
from typing import Any

_LOGGER = logging.getLogger("modeld")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}".rstrip("0").rstrip(".") or "0"
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one structured event line."""
    if _LOGGER.isEnabledFor(level):
        parts = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
        _LOGGER.log(level, "%s %s", name, parts)


def setup(level: str) -> None:
    """Send modeld's log lines to stderr at ``level`` (debug, info or warning)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level.upper())
    _LOGGER.propagate = False
