"""HTTP routes over the Unix socket (and opt-in TCP); errors are ``{"error": {"code", "message"}}``.

Each capability has its own module here with an ``add_routes(app, services)`` function. Who
may call which route is decided in one place, ``access``.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from modeld import logs
from modeld.api import (
    access,
    admin,
    anthropic,
    downloads,
    engines,
    guards,
    models,
    ollama,
    openai,
    report,
    responses,
    system,
)
from modeld.api.access import KeyVerifier, describe_peer
from modeld.api.bodies import BODY_LIMITS, BodyLimits, over_max_body
from modeld.api.connections import track_requests
from modeld.api.dialects import Dialect, dialect_of
from modeld.errors import (
    BadRequest,
    ClientLeft,
    MethodNotAllowed,
    ModeldError,
    NoRoute,
    TooLarge,
    disk_full,
)
from modeld.services.parts import Services

SERVICES: web.AppKey[Services] = web.AppKey("services", Services)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTE_MODULES = [
    system,
    models,
    downloads,
    engines,
    admin,
    openai,
    responses,
    anthropic,
    ollama,
    report,
    guards,
]


# Every dialect spoken besides the native one: a path that matched no route is answered in
# the dialect it belongs to (``Dialect.prefixes``).
DIALECTS: list[Dialect] = [openai.OPENAI, anthropic.ANTHROPIC, ollama.OLLAMA]


def _refusal(request: web.Request, e: web.HTTPException, max_body: int) -> ModeldError:
    """aiohttp's own refusal (no route, no such method, a body over the limit) as an error."""
    if e.status == 404:
        return NoRoute(f"no route {request.method} {request.path}; see the README's API table")
    if e.status == 405:
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}")
    if e.status == 413:
        return TooLarge(over_max_body(max_body))
    err = BadRequest(e.reason) if e.status < 500 else ModeldError(e.reason)
    err.status = e.status  # type: ignore[misc]
    return err


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    services = request.app[SERVICES]
    started = time.perf_counter()
    route = request.match_info.route.resource
    route_name = route.canonical if route is not None else "unmatched"
    # Errors raised before a route's handler (no key, a refused origin, no such route or
    # method) are shaped in the route's dialect too: one place shapes them all.
    dialect = dialect_of(request, DIALECTS)
    try:
        response = await handler(request)
    except ModeldError as e:
        response = dialect.response(e)
    except web.HTTPException as e:
        response = dialect.response(_refusal(request, e, services.settings.max_body))
    except (OSError, sqlite3.OperationalError) as e:
        refusal: ModeldError | None = disk_full(e)
        if refusal is None:
            logging.getLogger("modeld").exception(
                "unhandled error on %s %s", request.method, request.path
            )
            refusal = ModeldError("internal error; see the daemon's log")
        response = dialect.response(refusal)
    except Exception:
        logging.getLogger("modeld").exception(
            "unhandled error on %s %s", request.method, request.path
        )
        response = dialect.response(ModeldError("internal error; see the daemon's log"))
    elapsed = time.perf_counter() - started
    metrics = services.metrics
    metrics.child(metrics.http_requests, route_name, str(response.status)).inc()
    metrics.child(metrics.http_latency, route_name).observe(elapsed)
    logs.event(
        # A client that left (499) is no error: its work was cancelled, nobody was answered.
        "client_left" if response.status == ClientLeft.status else "request",
        logging.DEBUG if route_name in ("/api/health", "/metrics") else logging.INFO,
        method=request.method,
        path=request.path,
        status=response.status,
        seconds=elapsed,
        peer=describe_peer(request),
    )
    return response


def make_app(services: Services, keys: KeyVerifier | None = None) -> web.Application:
    """The aiohttp application with every capability's routes; ``keys`` checks TCP clients."""
    app = web.Application(
        middlewares=[track_requests, _errors_and_metrics],
        client_max_size=services.settings.max_body,
    )
    app[SERVICES] = services
    app[BODY_LIMITS] = BodyLimits(services.settings)
    # Before the routes' own middlewares (the id check): who may call comes first.
    access.install(app, services, keys)
    for module in ROUTE_MODULES:
        module.add_routes(app, services)
    return app
