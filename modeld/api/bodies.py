"""Reading a request's JSON body within bounds: size, total memory, time, depth and values.

- A body over ``max_body`` bytes is a 413 before it is read, when its length is declared.
- The bodies being read and parsed at once may hold ``body_memory`` bytes in all; a body that
  would go past it is a 503 ``busy`` with ``Retry-After``. Bodies of ``SMALL_BODY`` bytes or
  less are not counted: the connection limit already bounds them.
- A body must arrive within ``body_timeout`` (408), so a slow sender cannot hold its share.
- JSON nested deeper than ``JSON_MAX_DEPTH`` is a 400, with more than ``JSON_MAX_VALUES``
  values a 413; so is an integer of more than 4,300 digits (CPython's own limit) a 400.
- A string holding an unpaired UTF-16 surrogate (``"\\ud800"``, or its bytes in the body) is
  a 400 naming where: it is no text the runtime can take. Only a body whose bytes can yield
  one (a ``\\ud`` escape, a surrogate's UTF-8 bytes, or a body not in UTF-8) is walked.

Parsing runs off the event loop once a body is over ``SMALL_BODY``. A thread alone does not
keep the loop turning: the C parser holds the GIL for the whole document (see
docs/benchmarks.md#request-bodies). So the C parser only gets bodies that cannot hold more than
``JSON_MAX_VALUES`` values (counted from the bytes that open a value); any other body goes
to the standard library's Python scanner, which counts values and depth as it goes, stops
at the first one past a bound, and lets the loop run between its steps.
"""

from __future__ import annotations

import asyncio
import json
import json.decoder
import json.scanner
import logging
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

from modeld import logs
from modeld.config import Settings, format_duration, format_size
from modeld.errors import BadRequest, Busy, RequestTimeout, TooLarge

# A body nests a few levels (messages → content → image_url → url): 32 is far past any.
JSON_MAX_DEPTH = 32
# The most values (keys not counted) in one body: far past a long chat with parts (see
# docs/benchmarks.md#request-bodies).
JSON_MAX_VALUES = 100_000
# Bodies up to this size are parsed on the loop (cheap) and are not counted in body_memory.
SMALL_BODY = 64 * 1024

_Scan = Callable[[str, int], tuple[Any, int]]

# A surrogate (U+D800-U+DFFF) written as UTF-8 bytes; json decodes them ("surrogatepass").
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")


class _Bound(Exception):
    """A body went past a JSON bound; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _too_deep() -> _Bound:
    return _Bound(
        400, f"the body nests deeper than {JSON_MAX_DEPTH} levels; send a flat JSON object"
    )


def _too_many() -> _Bound:
    return _Bound(
        413,
        f"the body holds more than {JSON_MAX_VALUES} JSON values; send fewer messages or parts",
    )


class _CountingDecoder(json.JSONDecoder):
    """The standard library's pure-Python scanner, counting values and depth as it parses."""

    def __init__(self) -> None:
        super().__init__()
        self.values = 0
        self.depth = 0
        self._scan: _Scan | None = None
        # Undocumented in typeshed, but part of json since Python 2.6: the pure-Python scanner
        # and the container parsers it calls back.
        self.parse_array = self._array
        self.parse_object = self._object
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]

    def _counted(self, scan_once: _Scan) -> _Scan:
        """The scanner's own ``scan_once`` (the same each call), counting each value."""
        if self._scan is None:

            def scan(s: str, idx: int) -> tuple[Any, int]:
                self.values += 1
                if self.values > JSON_MAX_VALUES:
                    raise _too_many()
                return scan_once(s, idx)

            self._scan = scan
        return self._scan

    def _array(self, s_and_end: tuple[str, int], scan_once: _Scan) -> tuple[Any, int]:
        self.depth += 1
        if self.depth > JSON_MAX_DEPTH:
            raise _too_deep()
        try:
            parsed: tuple[Any, int] = json.decoder.JSONArray(  # type: ignore[attr-defined]
                s_and_end, self._counted(scan_once)
            )
            return parsed
        finally:
            self.depth -= 1

    def _object(
        self, s_and_end: tuple[str, int], strict: bool, scan_once: _Scan, *hooks: Any
    ) -> tuple[Any, int]:
        # hooks: object_hook, object_pairs_hook, memo, as the scanner passes them.
        self.depth += 1
        if self.depth > JSON_MAX_DEPTH:
            raise _too_deep()
        try:
            parsed: tuple[Any, int] = json.decoder.JSONObject(  # type: ignore[attr-defined]
                s_and_end, strict, self._counted(scan_once), *hooks
            )
            return parsed
        finally:
            self.depth -= 1


def _check_depth(doc: Any) -> None:
    """Raise ``_Bound`` when ``doc`` nests deeper than ``JSON_MAX_DEPTH`` (no recursion)."""
    stack = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        elif not isinstance(value, list):
            continue
        if depth + 1 > JSON_MAX_DEPTH:
            raise _too_deep()
        stack.extend((v, depth + 1) for v in value)


def _may_hold_surrogates(raw: bytes) -> bool:
    """Whether ``raw`` can decode to a lone surrogate (a cheap scan; images are base64)."""
    return (
        b"\\ud" in raw
        or b"\\uD" in raw
        or _SURROGATE_BYTES.search(raw) is not None
        or json.detect_encoding(raw) != "utf-8"
    )


def _named(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _check_text(doc: Any) -> None:
    """A 400 naming a string (or key) of ``doc`` with an unpaired surrogate (no recursion)."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, f"a key of {path or 'the body'}")
                stack.append((item, _named(path, key)))
        elif isinstance(value, list):
            stack.extend((item, _named(path, i)) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_string(value, f'"{path}"' if path else "the body")


def _check_string(text: str, where: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = text[e.start]
        raise BadRequest(
            f"{where}: is not valid text: it holds an unpaired UTF-16 surrogate "
            f"\\u{ord(char):04x}; send valid UTF-8"
        ) from None


def decode(raw: bytes) -> Any:
    """``raw`` parsed as JSON within the depth and value bounds, else a clear 400 or 413."""
    doc = _decode(raw)
    if _may_hold_surrogates(raw):
        _check_text(doc)
    return doc


def _decode(raw: bytes) -> Any:
    try:
        # Upper bounds: each value but the first follows ``[ { , :``, and each level of
        # nesting opens with ``[`` or ``{`` (in a string too, which only raises the bound).
        opens = raw.count(b"[") + raw.count(b"{")
        if 1 + opens + raw.count(b",") + raw.count(b":") <= JSON_MAX_VALUES:
            doc = json.loads(raw)
            if opens > JSON_MAX_DEPTH:
                _check_depth(doc)
            return doc
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")
        return _CountingDecoder().decode(text)
    except _Bound as e:
        reason = "json_values" if e.status == 413 else "json_depth"
        logs.event("body_refused", logging.WARNING, reason=reason, size=len(raw))
        if e.status == 413:
            raise TooLarge(e.message) from None
        raise BadRequest(e.message) from None
    except RecursionError:
        logs.event("body_refused", logging.WARNING, reason="json_depth", size=len(raw))
        raise BadRequest(_too_deep().message) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON ({str(e)[:120]}); send a JSON object") from None
    except ValueError as e:
        # int() refuses more than sys.get_int_max_str_digits() digits (CVE-2020-10735).
        if "digits" not in str(e):
            raise
        raise BadRequest(
            f"the body has a number of more than {sys.get_int_max_str_digits()} digits; "
            "numbers in modeld's requests fit in 10 digits"
        ) from None


class BodyLimits:
    """The body bounds of one daemon, and the bytes of bodies being read right now."""

    def __init__(self, settings: Settings) -> None:
        self.max_body = settings.max_body
        self.memory = settings.body_memory
        self.timeout = settings.body_timeout
        self.in_use = 0

    @contextmanager
    def reserve(self, size: int) -> Iterator[None]:
        """Hold ``size`` bytes of ``body_memory`` (none for a small body), else 503 busy."""
        if size <= SMALL_BODY:
            yield
            return
        if self.in_use + size > self.memory:
            logs.event(
                "body_refused",
                logging.WARNING,
                reason="body_memory",
                size=size,
                in_use=self.in_use,
                limit=self.memory,
            )
            raise Busy(
                f"{format_size(self.in_use)} of request bodies are being read now and this "
                f"one would pass MODELD_BODY_MEMORY ({format_size(self.memory)}); retry shortly",
                retry_after=1.0,
            )
        self.in_use += size
        try:
            yield
        finally:
            self.in_use -= size


BODY_LIMITS: web.AppKey[BodyLimits] = web.AppKey("body_limits", BodyLimits)


def over_max_body(max_body: int) -> str:
    """What a body over ``MODELD_MAX_BODY`` is told, whatever made it large."""
    return (
        f"the request body is over MODELD_MAX_BODY ({format_size(max_body)}); send less (a "
        "shorter prompt or conversation, fewer or smaller images), or raise the daemon's "
        "MODELD_MAX_BODY"
    )


def _too_large(limits: BodyLimits, size: int | None) -> TooLarge:
    logs.event("body_refused", logging.WARNING, reason="max_body", size=size, limit=limits.max_body)
    return TooLarge(over_max_body(limits.max_body))


async def read_json(request: web.Request, *, optional: bool = False) -> dict[str, Any]:
    """The JSON object in the body (``{}`` when empty and ``optional``), within the bounds."""
    limits = request.app[BODY_LIMITS]
    declared = request.content_length
    if declared is not None and declared > limits.max_body:
        raise _too_large(limits, declared)
    # A chunked body declares no length: it may grow to max_body.
    size = declared if declared is not None else (limits.max_body if request.body_exists else 0)
    with limits.reserve(size):
        try:
            async with asyncio.timeout(limits.timeout):
                raw = await request.read()
        except TimeoutError:
            logs.event("body_refused", logging.WARNING, reason="body_timeout", size=declared)
            raise RequestTimeout(
                f"the request body did not arrive within MODELD_BODY_TIMEOUT "
                f"({format_duration(limits.timeout)}); send it at once"
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise _too_large(limits, None) from None
        if not raw.strip():
            if optional:
                return {}
            raise BadRequest("the body is empty; send a JSON object")
        body = decode(raw) if len(raw) <= SMALL_BODY else await asyncio.to_thread(decode, raw)
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body
