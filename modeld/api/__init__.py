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
from modeld.api import access, admin, downloads, engines, guards, models, openai, report, system
from modeld.api.access import KeyVerifier, describe_peer
from modeld.api.bodies import BODY_LIMITS, BodyLimits
from modeld.api.connections import track_requests
from modeld.config import format_size
from modeld.errors import Busy, ClientLeft, ModeldError, Unauthorized, disk_full
from modeld.services.parts import Services

SERVICES: web.AppKey[Services] = web.AppKey("services", Services)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTE_MODULES = [system, models, downloads, engines, admin, openai, report, guards]


def _wants_openai_shape(request: web.Request) -> bool:
    """Whether the request is on an OpenAI route (``/v1/...``), whose errors add ``type``."""
    return request.path == "/v1" or request.path.startswith("/v1/")


def error_response(err: ModeldError, openai_shape: bool = False) -> web.Response:
    """The JSON error body with the error's status (and Retry-After when busy); with
    ``openai_shape``, in OpenAI's shape (``type`` and ``param`` added)."""
    headers = {}
    if isinstance(err, Busy):
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    if isinstance(err, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="modeld"'
    if openai_shape:
        shaped = openai.error_body(err.status, err.code, err.message)
        return web.json_response(shaped, status=err.status, headers=headers)
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


def _plain_error(status: int, code: str, message: str, openai_shape: bool) -> web.Response:
    if openai_shape:
        return web.json_response(openai.error_body(status, code, message), status=status)
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    services = request.app[SERVICES]
    started = time.perf_counter()
    route = request.match_info.route.resource
    route_name = route.canonical if route is not None else "unmatched"
    # Errors raised before an OpenAI route's handler (no key, a refused origin, no such
    # route or method) reach OpenAI clients too: the same shape as the handlers' own.
    shape = _wants_openai_shape(request)
    try:
        response = await handler(request)
    except ModeldError as e:
        response = error_response(e, shape)
    except web.HTTPException as e:
        code = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}.get(
            e.status, "bad_request" if e.status < 500 else "internal"
        )
        message = {
            404: f"no route {request.method} {request.path}; see the README's API table",
            405: f"{request.method} is not allowed on {request.path}",
            413: f"request body over MODELD_MAX_BODY ({format_size(services.settings.max_body)}); "
            "send smaller images or fewer of them",
        }.get(e.status, e.reason)
        response = _plain_error(e.status, code, message, shape)
    except (OSError, sqlite3.OperationalError) as e:
        full = disk_full(e)
        if full is None:
            logging.getLogger("modeld").exception(
                "unhandled error on %s %s", request.method, request.path
            )
            response = _plain_error(500, "internal", "internal error; see the daemon's log", shape)
        else:
            response = error_response(full, shape)
    except Exception:
        logging.getLogger("modeld").exception(
            "unhandled error on %s %s", request.method, request.path
        )
        response = _plain_error(500, "internal", "internal error; see the daemon's log", shape)
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
