"""The API dialects the daemon speaks, and each one's error shape: errors are shaped here alone.

Every route is registered with the dialect it speaks (``route``). The error middleware
(``modeld.api``) turns whatever refuses a request (a ``ModeldError`` from a handler, the
access check, an unknown path or method, a body over ``MODELD_MAX_BODY``) into that dialect's
error response (``Dialect.response``); a path that matched no route is answered in the
dialect whose ``prefixes`` it starts with. A stream that fails after it started words its
last event with the same ``Dialect.shape``.

Each adapter module defines its own dialect next to its routes (``openai.OPENAI``,
``anthropic.ANTHROPIC``, ``ollama.OLLAMA``); the native one is here. Another dialect is one
more ``Dialect``: its shape, its unmatched-path prefixes, and its routes registered with it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from modeld.errors import Busy, ModeldError, Unauthorized

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# An error as a dialect answers it: the HTTP status and the JSON body.
Shaped = tuple[int, dict[str, Any]]


def native_shape(err: ModeldError) -> Shaped:
    """modeld's own ``{"error": {"code", "message"[, "details"]}}``."""
    return err.status, err.to_dict()


@dataclass(frozen=True)
class Dialect:
    """One wire format: how it words errors, and which unmatched paths are its."""

    name: str
    shape: Callable[[ModeldError], Shaped] = native_shape
    # A path that matched no route is this dialect's when it starts with one of these.
    prefixes: tuple[str, ...] = ()
    # Headers every error response of this dialect carries (beside Retry-After and
    # WWW-Authenticate, which every dialect sends).
    headers: dict[str, str] = field(default_factory=dict)

    def owns(self, path: str) -> int:
        """The length of the longest of ``prefixes`` that ``path`` is under (0: none)."""
        return max(
            (len(p) for p in self.prefixes if path == p or path.startswith(p.rstrip("/") + "/")),
            default=0,
        )

    def response(self, err: ModeldError) -> web.Response:
        """The error response: this dialect's body, and the headers a refusal needs."""
        status, body = self.shape(err)
        headers = dict(self.headers)
        if isinstance(err, Busy):
            headers["Retry-After"] = str(max(1, round(err.retry_after)))
        if isinstance(err, Unauthorized):
            headers["WWW-Authenticate"] = 'Bearer realm="modeld"'
        return web.json_response(body, status=status, headers=headers)


NATIVE = Dialect("native")

# The dialect of each route, by its path as registered (``route``).
ROUTE_DIALECTS: web.AppKey[dict[str, Dialect]] = web.AppKey("route_dialects", dict)


def route(
    app: web.Application, method: str, path: str, handler: Handler, dialect: Dialect = NATIVE
) -> None:
    """Register ``handler`` for ``method`` ``path``, speaking ``dialect``."""
    table = app.setdefault(ROUTE_DIALECTS, {})
    known = table.setdefault(path, dialect)
    if known is not dialect:
        raise ValueError(f"{path} is {known.name}'s; it cannot also speak {dialect.name}")
    app.router.add_route(method, path, handler)


def dialect_of(request: web.Request, dialects: Sequence[Dialect]) -> Dialect:
    """The dialect ``request`` speaks: its route's, else that of the longest prefix of
    ``dialects`` its path starts with, else the native one."""
    resource = request.match_info.route.resource
    table = request.app.get(ROUTE_DIALECTS, {})
    if resource is not None and resource.canonical in table:
        return table[resource.canonical]
    path = request.path
    best = max(dialects, key=lambda d: d.owns(path), default=NATIVE)
    return best if best.owns(path) else NATIVE
