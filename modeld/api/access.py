"""Who may call which route: each route has a role, *use* or *admin*, checked in one middleware.

A peer's role:
- on the Unix socket, from its credentials (``SO_PEERCRED``, ``modeld.peers``): *admin* when
  its uid is in ``MODELD_ADMIN_UIDS`` (default: root and the daemon's own uid) or one of its
  groups is in ``MODELD_ADMIN_GIDS``, else *use*. The socket's group grants *use* alone.
- on TCP (``MODELD_LISTEN``), from its API key: every request needs
  ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients send it),
  else 401 ``unauthorized``; the key's role is the peer's.

``ROUTES`` gives every route its role; ``tests/test_access.py`` fails when a registered route
is missing from it, so a new route cannot be left open by mistake (and one that is missing
anyway needs *admin*). Some *use* routes take fields that need *admin*: ``ADMIN_FIELDS``
names them once, for every route (``pin``, ``allow_unverified``), and ``check_body`` refuses
a body of a non-admin that sets one, before the body is validated (``requests.read_body``
and the OpenAI routes call it); ``tests/api/test_access.py`` walks the route table to hold
every *use* route to it. Refusals are 403 ``forbidden`` naming the role needed and how to
get it. A *use* request's ``keep_alive`` may lengthen an engine's keep-alive, not
shorten it (that would unload an engine others use): the routes pass ``administers`` on.

CORS exists on TCP only: a preflight from an origin in ``MODELD_CORS_ORIGINS`` is answered
(no key needed: browsers send none on a preflight), and responses to such an origin carry
``Access-Control-Allow-Origin``. Other origins get neither.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from aiohttp import web

from modeld import logs
from modeld.api.connections import peer_of
from modeld.api.peers import Peer, is_admin
from modeld.api.peers import enforce as enforce_allow_lists
from modeld.config import Settings
from modeld.errors import Forbidden, KeysUnusable, Unauthorized
from modeld.services.parts import Services

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A key is ``mdk_`` + 43 characters; anything far longer is not one (and is not hashed).
_MAX_KEY_CHARS = 256
_MAX_ECHOED_HEADERS = 1024


class Role(StrEnum):
    """What a peer may do: *use* models, or also *administer* the daemon."""

    USE = "use"
    ADMIN = "admin"

    def covers(self, needed: Role) -> bool:
        return self is Role.ADMIN or needed is Role.USE


@dataclass(frozen=True)
class Rule:
    """The role a route needs, and the verb a refusal names."""

    role: Role
    what: str


# Body fields only admins may set, on any route: ``pin`` holds an engine's memory for good,
# ``allow_unverified`` runs a file that no source vouched for.
ADMIN_FIELDS = ("pin", "allow_unverified")


ROUTES: dict[tuple[str, str], Rule] = {
    ("GET", "/api/health"): Rule(Role.USE, "health"),
    ("GET", "/api/status"): Rule(Role.USE, "status"),
    ("GET", "/metrics"): Rule(Role.USE, "metrics"),
    ("GET", "/api/models"): Rule(Role.USE, "list"),
    ("GET", "/api/models/{id}"): Rule(Role.USE, "show"),
    ("GET", "/api/downloads"): Rule(Role.USE, "list downloads"),
    ("GET", "/api/engines"): Rule(Role.USE, "ps"),
    ("POST", "/api/engines"): Rule(Role.USE, "load"),
    ("POST", "/api/modeld/generate"): Rule(Role.USE, "generate"),
    ("POST", "/api/models/{id}/check"): Rule(Role.USE, "check a model"),
    ("GET", "/v1/models"): Rule(Role.USE, "list models"),
    ("GET", "/v1/models/{model}"): Rule(Role.USE, "show a model"),
    ("POST", "/v1/chat/completions"): Rule(Role.USE, "chat"),
    ("POST", "/v1/completions"): Rule(Role.USE, "complete"),
    ("POST", "/v1/embeddings"): Rule(Role.USE, "embed"),
    ("POST", "/v1/messages"): Rule(Role.USE, "messages"),
    ("POST", "/v1/messages/count_tokens"): Rule(Role.USE, "count tokens"),
    ("POST", "/v1/responses"): Rule(Role.USE, "responses"),
    # Ollama's API (``modeld.api.ollama``).
    ("GET", "/api/version"): Rule(Role.USE, "version"),
    ("GET", "/api/tags"): Rule(Role.USE, "list models"),
    ("POST", "/api/show"): Rule(Role.USE, "show a model"),
    ("GET", "/api/ps"): Rule(Role.USE, "ps"),
    ("POST", "/api/chat"): Rule(Role.USE, "chat"),
    ("POST", "/api/generate"): Rule(Role.USE, "generate"),
    ("POST", "/api/embed"): Rule(Role.USE, "embed"),
    ("POST", "/api/embeddings"): Rule(Role.USE, "embed"),
    ("POST", "/api/pull"): Rule(Role.ADMIN, "pull"),
    ("DELETE", "/api/delete"): Rule(Role.ADMIN, "delete a model"),
    ("POST", "/api/models/{id}/pull"): Rule(Role.ADMIN, "pull"),
    ("POST", "/api/models/pull"): Rule(Role.ADMIN, "pull"),
    ("POST", "/api/models/import"): Rule(Role.ADMIN, "import"),
    ("POST", "/api/models/{id}/verify"): Rule(Role.ADMIN, "verify"),
    ("DELETE", "/api/models/{id}"): Rule(Role.ADMIN, "rm"),
    ("POST", "/api/prune"): Rule(Role.ADMIN, "prune"),
    ("DELETE", "/api/downloads/{id}"): Rule(Role.ADMIN, "cancel a download"),
    ("DELETE", "/api/engines/{id}"): Rule(Role.ADMIN, "unload"),
    # What admission reserves for every later load of the file, for everyone.
    ("DELETE", "/api/models/{id}/memory"): Rule(Role.ADMIN, "forget learned memory"),
    # A bug report carries runner stderr, events and the effective settings of the host.
    ("GET", "/api/models/{id}/bug-report"): Rule(Role.ADMIN, "bug-report"),
}
# A registered route missing from ROUTES (a test forbids it) is refused to all but admins.
_UNLISTED = Rule(Role.ADMIN, "this route")


class ApiKeyInfo(Protocol):
    """What the middleware needs of an API key (``modeld.daemon.apikeys.ApiKey``)."""

    @property
    def name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def created(self) -> str: ...


class KeyVerifier(Protocol):
    """Finds the key a TCP client presented (``modeld.daemon.apikeys.KeyRing``)."""

    def verify(self, presented: str) -> ApiKeyInfo | None: ...

    @property
    def refused(self) -> bool:
        """Whether the keys file is refused (owner or permissions): no key is in force."""
        ...


@dataclass(frozen=True)
class Grant:
    """What the middleware decided about one request's peer."""

    role: Role
    who: str  # for the log line: ``uid:gid:pid`` or ``key:NAME@ADDRESS``
    described: str  # for a refusal: ``uid 1001 gid 1001 (pid 42)`` or ``API key 'webui'``
    how_to_admin: str  # the setting or command that would make this peer an admin
    # Whose prompts these are, for what is kept of them between requests (a conversation
    # kept for its next turn): peers of one scope may see each other's prompts, others
    # never share. ``uid:N`` on the socket (a uid's processes can read each other's
    # memory), ``key:NAME:CREATED`` on TCP (a key removed and added again under its name is
    # another key); None: unknown, nothing is kept.
    scope: str | None = None


GRANT: web.RequestKey[Grant] = web.RequestKey("grant", Grant)


def rule_of(request: web.Request) -> Rule | None:
    """The rule of the route ``request`` matched; None when it matched none (404/405 follow)."""
    resource = request.match_info.route.resource
    if resource is None:
        return None
    method = "GET" if request.method == "HEAD" else request.method
    return ROUTES.get((method, resource.canonical), _UNLISTED)


def _socket_of(request: web.Request) -> Any:
    return request.transport.get_extra_info("socket") if request.transport else None


def on_unix_socket(request: web.Request) -> bool:
    sock = _socket_of(request)
    return sock is not None and sock.family == socket.AF_UNIX


def describe_peer(request: web.Request) -> str:
    """The peer for the log line when no grant was made: ``uid:gid:pid``, ``tcp:ADDRESS``."""
    if GRANT in request:
        return request[GRANT].who
    if on_unix_socket(request):
        peer = peer_of(request)
        return str(peer) if peer is not None else "-"
    return f"tcp:{request.remote or '-'}"


def _unix_grant(settings: Settings, peer: Peer | None) -> Grant:
    described = (
        f"uid {peer.uid} gid {peer.gid} (pid {peer.pid})"
        if peer is not None
        else "a peer whose credentials cannot be read"
    )
    return Grant(
        role=Role.ADMIN if is_admin(settings, peer) else Role.USE,
        who=str(peer) if peer is not None else "-",
        described=described,
        how_to_admin=(
            "add the uid to MODELD_ADMIN_UIDS or one of its groups to MODELD_ADMIN_GIDS "
            "(admin_uids/admin_gids in the config file), then reload the daemon (SIGHUP)"
        ),
        scope=f"uid:{peer.uid}" if peer is not None else None,
    )


def _unauthorized(request: web.Request, reason: str, message: str) -> Unauthorized:
    # Never the presented value, not even a prefix: a key in a log is a key given away.
    logs.event(
        "unauthorized",
        logging.WARNING,
        reason=reason,
        remote=request.remote,
        method=request.method,
        path=request.path,
    )
    return Unauthorized(message)


_HOW_TO_GET_A_KEY = (
    "create one on the daemon's host with `modeld key add NAME` and send it as "
    "`Authorization: Bearer <key>` (or `x-api-key: <key>`)"
)


def _presented_key(request: web.Request) -> str:
    """The key a TCP request presents: ``Authorization: Bearer <key>``, else ``x-api-key``
    (how Anthropic's clients send it); 401 when neither holds one."""
    header = request.headers.get("Authorization")
    if header is None:
        api_key = request.headers.get("x-api-key")
        if api_key is None:
            raise _unauthorized(
                request, "missing", f"this listener needs an API key; {_HOW_TO_GET_A_KEY}"
            )
        token = api_key.strip()
        if not token or len(token) > _MAX_KEY_CHARS:
            raise _unauthorized(
                request, "malformed", f"the x-api-key header holds no key; {_HOW_TO_GET_A_KEY}"
            )
        return token
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token or len(token) > _MAX_KEY_CHARS:
        raise _unauthorized(
            request,
            "malformed",
            f"the Authorization header is not `Bearer <key>`; {_HOW_TO_GET_A_KEY}",
        )
    return token


def _key_grant(request: web.Request, keys: KeyVerifier | None) -> Grant:
    token = _presented_key(request)
    key = keys.verify(token) if keys is not None else None
    if key is None and keys is not None and keys.refused:
        # Not the client's fault: a 401 would send it looking for another key.
        logs.event("keys_file_refused", logging.WARNING, remote=request.remote, path=request.path)
        raise KeysUnusable(
            "the daemon cannot use its API keys file (its owner or permissions are wrong), so "
            "it accepts no key until the admin of its host fixes the file; `modeld status` "
            "there says how"
        )
    if key is None:
        raise _unauthorized(
            request,
            "unknown_key",
            "the API key is not valid (never issued, or removed); `modeld key list` on the "
            "daemon's host shows the keys in force",
        )
    return Grant(
        role=Role(key.role),
        who=f"key:{key.name}@{request.remote or '-'}",
        described=f"API key {key.name!r}",
        how_to_admin="use a key with the admin role (`modeld key add NAME --role admin`)",
        scope=f"key:{key.name}:{key.created}",
    )


def _refusal(grant: Grant, what: str) -> Forbidden:
    return Forbidden(
        f"{what} needs the admin role; {grant.described} has the {grant.role} role: "
        f"{grant.how_to_admin}"
    )


def administers(request: web.Request) -> bool:
    """Whether the request's peer has the *admin* role (False when none was granted)."""
    grant: Grant | None = request.get(GRANT)
    return grant is not None and grant.role is Role.ADMIN


def scope_of(request: web.Request) -> str | None:
    """Whose prompts the request's are (``Grant.scope``); None when no grant was made."""
    grant: Grant | None = request.get(GRANT)
    return grant.scope if grant is not None else None


def require_admin(request: web.Request, what: str) -> None:
    """Refuse (403) ``what`` to a peer without the *admin* role, as a route's rule would."""
    grant: Grant | None = request.get(GRANT)
    if grant is None:
        raise Forbidden(f"{what} needs the admin role")
    if grant.role is not Role.ADMIN:
        raise _refusal(grant, what)


def check_body(request: web.Request, body: dict[str, Any]) -> None:
    """Refuse (403) a body that sets a field of ``ADMIN_FIELDS`` (to anything but false or
    null) unless the peer is an admin; called on the decoded body, before its validation."""
    grant: Grant | None = request.get(GRANT)
    if grant is not None and grant.role is Role.ADMIN:
        return
    asked = [f for f in ADMIN_FIELDS if body.get(f) not in (None, False)]
    if not asked:
        return
    rule = rule_of(request) or _UNLISTED
    if grant is None:
        raise Forbidden(f"{rule.what} with {', '.join(asked)} needs the admin role")
    raise _refusal(grant, f"{rule.what} with {' and '.join(asked)}")


def _origin_allowed(settings: Settings, origin: str) -> bool:
    return "*" in settings.cors_origins or origin.lower() in settings.cors_origins


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


def _preflight(request: web.Request, settings: Settings) -> web.Response:
    origin = request.headers["Origin"]
    if not _origin_allowed(settings, origin):
        raise Forbidden(
            f"origin {origin[:100]!r} is not allowed; add it to MODELD_CORS_ORIGINS "
            "(cors_origins in the config file) and restart or reload the daemon"
        )
    asked = request.headers.get("Access-Control-Request-Headers", "")[:_MAX_ECHOED_HEADERS]
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": "GET, POST, DELETE",
            "Access-Control-Allow-Headers": asked or "authorization, content-type",
            "Access-Control-Max-Age": "600",
        },
    )


def install(app: web.Application, services: Services, keys: KeyVerifier | None) -> None:
    """Add the access middleware (inside the error middleware) and the CORS headers."""

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        # Settings are read per request, so a SIGHUP applies new lists and origins at once.
        settings = services.settings
        if on_unix_socket(request):
            peer = peer_of(request)
            enforce_allow_lists(settings, peer)
            grant = _unix_grant(settings, peer)
        elif _is_preflight(request):
            return _preflight(request, settings)
        else:
            grant = _key_grant(request, keys)
        request[GRANT] = grant
        rule = rule_of(request)
        if rule is not None and not grant.role.covers(rule.role):
            raise _refusal(grant, rule.what)
        return await handler(request)

    async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or on_unix_socket(request):
            return
        if _origin_allowed(services.settings, origin):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After, WWW-Authenticate"
            response.headers.add("Vary", "Origin")

    app.middlewares.append(authorize)
    app.on_response_prepare.append(cors_headers)
