"""HTTP routes over the Unix socket; errors are ``{"error": {"code", "message"}}``.

Each capability has its own module here with an ``add_routes(app, services)`` function.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import struct
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from modeld import logs
from modeld.api import admin, downloads, engines, guards, models, openai, system
from modeld.api.bodies import BODY_LIMITS, BodyLimits
from modeld.api.connections import track_requests
from modeld.config import format_size
from modeld.errors import Busy, ModeldError, disk_full
from modeld.peers import enforce as enforce_peer
from modeld.services import Services

SERVICES: web.AppKey[Services] = web.AppKey("services", Services)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ROUTE_MODULES = [system, models, downloads, engines, admin, openai, guards]


def error_response(err: ModeldError) -> web.Response:
    """The JSON error body with the error's status (and Retry-After when busy)."""
    headers = {}
    if isinstance(err, Busy):
        headers["Retry-After"] = str(max(1, round(err.retry_after)))
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


def _plain_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


def peer_of(request: web.Request) -> str:
    """``uid:gid:pid`` of the process on the other end of the socket (SO_PEERCRED)."""
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None or sock.family != socket.AF_UNIX:
        return "-"
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return "-"
    pid, uid, gid = struct.unpack("3i", raw)
    return f"{uid}:{gid}:{pid}"


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    services = request.app[SERVICES]
    started = time.perf_counter()
    route = request.match_info.route.resource
    route_name = route.canonical if route is not None else "unmatched"
    try:
        # Allow-lists are read from services.settings on each request, so SIGHUP applies them.
        enforce_peer(services.settings, request.transport)
        response = await handler(request)
    except ModeldError as e:
        response = error_response(e)
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
        response = _plain_error(e.status, code, message)
    except (OSError, sqlite3.OperationalError) as e:
        full = disk_full(e)
        if full is None:
            logging.getLogger("modeld").exception(
                "unhandled error on %s %s", request.method, request.path
            )
            response = _plain_error(500, "internal", "internal error; see the daemon's log")
        else:
            response = error_response(full)
    except Exception:
        logging.getLogger("modeld").exception(
            "unhandled error on %s %s", request.method, request.path
        )
        response = _plain_error(500, "internal", "internal error; see the daemon's log")
    elapsed = time.perf_counter() - started
    services.metrics.http_requests.labels(route_name, str(response.status)).inc()
    services.metrics.http_latency.labels(route_name).observe(elapsed)
    logs.event(
        "request",
        logging.DEBUG if route_name in ("/api/health", "/metrics") else logging.INFO,
        method=request.method,
        path=request.path,
        status=response.status,
        seconds=elapsed,
        peer=peer_of(request),
    )
    return response


def make_app(services: Services) -> web.Application:
    """The aiohttp application with every capability's routes."""
    app = web.Application(
        middlewares=[track_requests, _errors_and_metrics],
        client_max_size=services.settings.max_body,
    )
    app[SERVICES] = services
    app[BODY_LIMITS] = BodyLimits(services.settings)
    for module in ROUTE_MODULES:
        module.add_routes(app, services)
    return app
