"""The Python client for apps (and the CLI): ``Client`` (sync) and ``AsyncClient`` (asyncio).

Both find the daemon as the CLI does (``find_daemon``) and raise the package's own errors
(``modeld.errors``): a daemon's error comes back as the class of its code
(``ModelNotFound``, ``Forbidden``...), a daemon that does not answer as ``DaemonUnavailable``.

    from modeld.client import Client

    with Client() as c:
        print([m["id"] for m in c.models(installed=True)["models"]])
        for record in c.generate("gemma-3-1b-it", "Why is the sky blue?"):
            print(record.get("token", ""), end="", flush=True)

Importing this module costs only the standard library: ``Client`` speaks HTTP/1.1 itself
over the socket (or TCP), and ``AsyncClient`` imports aiohttp when it is first entered. That
keeps a CLI call (a fresh process each time) short: pydantic and aiohttp alone cost more than
the rest of the call (see docs/benchmarks.md#cli-imports).
"""

from __future__ import annotations

import errno
import io
import json
import os
import socket
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlsplit

from modeld.config import client_api_key, client_socket_path, client_url
from modeld.errors import (
    BadRequest,
    DaemonDisconnected,
    DaemonUnavailable,
    ModeldError,
    SettingsError,
    SocketDenied,
    error_from_body,
)

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any, Required, TypedDict, final

    import aiohttp

    # The records of a generation, typed for callers; at run time they are plain dicts.
    @final  # no other key: `"done" in record` tells the two kinds apart
    class TokenRecord(TypedDict):
        """Text of a reply as it comes."""

        token: str

    class GenerationTimings(TypedDict, total=False):
        """Seconds a request spent in each phase (``decode_tokens_per_second`` a rate)."""

        image_prepare: float
        load: float
        engine_create: float
        warm_up: float
        queue: float
        prefill: float
        first_token: float
        decode_tokens_per_second: float
        total: float

    @final
    class FinalRecord(TypedDict, total=False):
        """A reply's last record: how it ended, its token counts, where it ran, its phases; for
        a JSON reply its diagnostics (``json``: status, raw, error)."""

        done: Required[bool]
        finish: str
        prompt_tokens: int
        tokens: int
        model: str
        engine: str
        timings: GenerationTimings
        constrained: bool
        text: str
        tool_calls: list[dict[str, Any]]
        json: dict[str, Any]

    GenerationRecord = TokenRecord | FinalRecord

# How long a request that the daemon answers at once (GET: status, list, show, ps, health)
# may wait for its answer. systemd accepts connections on modeld.socket even while the
# service fails to start; without a limit a client would wait in the backlog forever. A
# cold start through socket activation takes a few seconds.
ANSWER_TIMEOUT = 30.0
CONNECT_TIMEOUT = 5.0

# The longest status line or header the client reads (the daemon's are far shorter).
_MAX_LINE = 65536


class Endpoint:
    """Where a daemon listens: its Unix socket, or a TCP ``url`` with an API key.

    A plain class: a dataclass is built with ``exec`` at import, a cost every CLI call pays.
    """

    __slots__ = ("api_key", "socket", "url")

    def __init__(
        self, socket: Path | None = None, url: str | None = None, api_key: str | None = None
    ) -> None:
        self.socket = socket
        self.url = url
        self.api_key = api_key

    def __repr__(self) -> str:
        return f"Endpoint(socket={self.socket!r}, url={self.url!r})"

    def __str__(self) -> str:
        return str(self.socket) if self.socket is not None else str(self.url)


def find_daemon(
    socket_path: Path | str | None = None,
    *,
    url: str | None = None,
    api_key: str | None = None,
) -> Endpoint:
    """The daemon to talk to, as the CLI finds it.

    ``socket_path``, else ``url`` (TCP, with ``api_key`` or ``MODELD_API_KEY``), else
    ``MODELD_URL``, else the socket: ``MODELD_SOCKET``, the config file's ``socket``, then the
    first that exists of ``$XDG_RUNTIME_DIR/modeld.sock``, ``/run/modeld/modeld.sock`` and
    ``$MODELD_HOME/modeld.sock``.
    """
    if socket_path is not None:
        return Endpoint(socket=Path(socket_path))
    url = url or client_url()
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise SettingsError(
                f"{url!r} is not a daemon URL; give http://HOST:PORT (for https, put the TLS "
                "proxy's plain side here or use the socket)",
                key="url",
            )
        return Endpoint(url=f"http://{parts.netloc}", api_key=api_key or client_api_key())
    return Endpoint(socket=client_socket_path())


def _path(model_id: str) -> str:
    """``model_id`` as one path segment. An empty id is refused here as the daemon refuses
    any other bad id: its empty segment would name another route (``/api/models/``)."""
    if not model_id:
        raise BadRequest(
            "'' is not a valid model id: letters, digits, '.', '_' and '-', starting with a "
            "letter or digit, at most 128 characters; see `modeld list`"
        )
    return quote(model_id, safe="")


def _unload_path(engine_or_model: str, grace: str | None) -> str:
    path = f"/api/engines/{_path(engine_or_model)}"
    return path if grace is None else f"{path}?grace={quote(grace, safe='')}"


# --- request bodies, shared by both clients ------------------------------------------------


def _pull_route(model: str, as_id: str | None, body: dict[str, Any]) -> tuple[str, Any]:
    """Path and body of a pull: ``/api/models/{id}/pull``, or ``/api/models/pull`` for a Hub
    file (``hf://...`` or a URL)."""
    body = {k: v for k, v in body.items() if v}
    if "://" in model:
        return "/api/models/pull", {"source": model, **({"id": as_id} if as_id else {}), **body}
    return f"/api/models/{_path(model)}/pull", body


def _rm_path(model_id: str, force: bool, entry: bool) -> str:
    query = "&".join(q for q, on in (("force=1", force), ("entry=1", entry)) if on)
    return f"/api/models/{_path(model_id)}" + (f"?{query}" if query else "")


def load_body(
    model: str,
    *,
    main: str | None = None,
    vision: str | None = None,
    keep_alive: str | float | None = None,
    pin: bool = False,
    allow_unverified: bool = False,
    warm_up: bool | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "pin": pin, "allow_unverified": allow_unverified}
    if warm_up is not None:
        body["warm_up"] = warm_up
    backends = {k: v for k, v in (("main", main), ("vision", vision)) if v}
    if backends:
        body["backends"] = backends
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    return body


def generation_body(
    model: str,
    *,
    prompt: str | None = None,
    messages: list[dict[str, str]] | None = None,
    system: str | None = None,
    images: list[bytes] | None = None,
    format: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: list[str] | None = None,
    keep_alive: str | float | None = None,
    allow_unverified: bool = False,
) -> dict[str, Any]:
    """The body of ``POST /api/modeld/generate``; unset fields are left to the daemon."""
    import base64  # here: only a generation needs it

    body: dict[str, Any] = {"model": model}
    if prompt is not None:
        body["prompt"] = prompt
    if messages is not None:
        body["messages"] = messages
    if images:
        body["images"] = [base64.b64encode(b).decode() for b in images]
    for key, value in (
        ("system", system),
        ("format", format),
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("seed", seed),
        ("stop", stop),
        ("keep_alive", keep_alive),
    ):
        if value is not None:
            body[key] = value
    if allow_unverified:
        body["allow_unverified"] = True
    return body


def embedding_body(
    model: str,
    inputs: str | list[str],
    *,
    dimensions: int | None = None,
    keep_alive: str | float | None = None,
    allow_unverified: bool = False,
) -> dict[str, Any]:
    """The body of ``POST /v1/embeddings`` (floats); unset fields are left to the daemon."""
    body: dict[str, Any] = {"model": model, "input": inputs, "encoding_format": "float"}
    if dimensions is not None:
        body["dimensions"] = dimensions
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if allow_unverified:
        body["allow_unverified"] = True
    return body


# modeld's own generation route (``/api/generate`` is Ollama's).
GENERATE = "/api/modeld/generate"


def generation_record(record: dict[str, Any]) -> GenerationRecord:
    """One NDJSON record of a generation, as its type; ``ProtocolError`` for anything else."""
    token = record.get("token")
    if isinstance(token, str):
        return {"token": token}
    if record.get("done") is True:
        # The daemon's final record as it sent it: its keys are FinalRecord's.
        return record  # type: ignore[return-value]
    raise ModeldError(f"the daemon sent a generation record of no known kind: {record!r:.200}")


def _vectors(doc: dict[str, Any]) -> list[list[float]]:
    return [d["embedding"] for d in sorted(doc["data"], key=lambda d: d["index"])]


def _record(line: bytes) -> dict[str, Any] | None:
    """One NDJSON record; an error record is raised as the daemon's error."""
    line = line.strip()
    if not line:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        raise ModeldError(f"the daemon sent a record that is not JSON: {line[:80]!r}") from None
    if isinstance(record, dict) and "error" in record and len(record) == 1:
        raise error_from_body(500, record)
    if not isinstance(record, dict):
        raise ModeldError(f"the daemon sent a record that is not an object: {line[:80]!r}")
    return record


def _decode(status: int, content_type: str, data: bytes) -> Any:
    decoded: Any = None
    if content_type.startswith("application/json") and data:
        decoded = json.loads(data)
    if status >= 400:
        raise error_from_body(status, decoded)
    return decoded if decoded is not None else data.decode(errors="replace")


def _no_answer(where: Endpoint, seconds: float) -> DaemonUnavailable:
    return DaemonUnavailable(
        f"modeld on {where} took the connection but sent no answer in {seconds:g} s; the "
        "service may be failing to start: see `systemctl status modeld` and "
        "`journalctl -u modeld` (add --user for your own unit)"
    )


def _cut_off() -> DaemonDisconnected:
    return DaemonDisconnected(
        "the daemon closed the connection before its answer was complete: it stopped or "
        "crashed (`modeld logs` shows why); once it runs again (`modeld serve`, or its "
        "service), retry"
    )


# What a Unix socket's path may hold (sun_path, less its NUL).
_SUN_PATH_MAX = 107


def _unreachable(where: Endpoint, err: BaseException) -> DaemonUnavailable:
    os_error = getattr(err, "os_error", err)
    denied = isinstance(os_error, OSError) and os_error.errno in (errno.EACCES, errno.EPERM)
    if where.socket is not None and denied:
        return socket_denied(where.socket)
    if where.socket is None:
        return DaemonUnavailable(
            f"no modeld answers on {where} ({err.__class__.__name__}); check MODELD_URL and "
            "that the daemon listens there (MODELD_LISTEN)"
        )
    if len(os.fsencode(where.socket)) > _SUN_PATH_MAX:
        return DaemonUnavailable(
            f"the socket path {where.socket} is longer than the {_SUN_PATH_MAX} bytes a Unix "
            "socket path may have; pass a shorter one with --socket (or MODELD_SOCKET)"
        )
    why = os_error.strerror if isinstance(os_error, OSError) and os_error.strerror else None
    return DaemonUnavailable(
        f"no modeld answers on {where} ({why or err.__class__.__name__}); "
        "start one with `modeld serve` or pass --socket"
    )


# --- the sync client --------------------------------------------------------------------


class _Response:
    """One HTTP/1.1 response read from a socket: status, headers, then its body."""

    def __init__(self, sock: socket.socket, stream: io.BufferedReader) -> None:
        self._sock = sock
        self._stream = stream
        line = self._line()
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ModeldError(f"the daemon answered something that is not HTTP: {line[:80]!r}")
        self.status = int(parts[1])
        self.headers: dict[str, str] = {}
        while (header := self._line()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()

    def _line(self) -> bytes:
        line = self._stream.readline(_MAX_LINE)
        if not line:
            raise _cut_off()
        return line

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "")

    def chunks(self) -> Iterator[bytes]:
        """The body as it arrives (chunked, by Content-Length, or until the daemon closes)."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int(self._line().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = self._stream.read(size)
                if len(data) < size:
                    raise _cut_off()
                self._stream.readline(_MAX_LINE)
                yield data
        elif "content-length" in self.headers:
            length = int(self.headers["content-length"])
            data = self._stream.read(length)
            if len(data) < length:
                raise _cut_off()
            if data:
                yield data
        else:
            while data := self._stream.read1(65536):
                yield data

    def read(self) -> bytes:
        return b"".join(self.chunks())

    def lines(self) -> Iterator[bytes]:
        pending = b""
        for chunk in self.chunks():
            pending += chunk
            *complete, pending = pending.split(b"\n")
            yield from complete
        if pending:
            yield pending

    def close(self) -> None:
        self._stream.close()
        self._sock.close()


def connect_unix(path: Path | str, timeout: float) -> socket.socket:
    """Connect to a Unix socket, waiting up to ``timeout`` while its backlog is full.

    With a timeout set (``settimeout``) a Unix socket connects non-blocking, and a full
    backlog (a flood of connections the daemon has not accepted yet) fails at once with
    EAGAIN. A blocking connect waits for room instead; ``SO_SNDTIMEO`` bounds that wait.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    seconds = max(timeout, 0.001)
    sock.setsockopt(
        socket.SOL_SOCKET,
        socket.SO_SNDTIMEO,
        struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000)),
    )
    try:
        sock.connect(str(path))
    except BlockingIOError as e:  # still no room when SO_SNDTIMEO ran out
        sock.close()
        raise TimeoutError(errno.ETIMEDOUT, "the socket's backlog stayed full") from e
    except BaseException:
        sock.close()
        raise
    sock.settimeout(timeout)
    return sock


class Client:
    """A sync client for one daemon: ``with Client() as c: c.status()``.

    Each call is one request on its own connection (a Unix socket connects in microseconds).
    GET requests must be answered within ``answer_timeout``. Other requests may rightly take
    long (a load, a pull), so before the first of them the client checks that the daemon
    answers ``/api/health`` within that time.
    """

    def __init__(
        self,
        socket_path: Path | str | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self.endpoint = find_daemon(socket_path, url=url, api_key=api_key)
        self.connect_timeout = connect_timeout
        self.answer_timeout = answer_timeout
        self._answered = False

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Nothing stays open between calls; here for symmetry with ``AsyncClient``."""

    def _connect(self) -> socket.socket:
        where = self.endpoint
        try:
            if where.socket is not None:
                return connect_unix(where.socket, self.connect_timeout)
            parts = urlsplit(str(where.url))
            return socket.create_connection(
                (str(parts.hostname), parts.port or 80), timeout=self.connect_timeout
            )
        except TimeoutError as e:
            raise _no_answer(where, self.connect_timeout) from e
        except OSError as e:
            raise _unreachable(where, e) from e

    def _send(self, method: str, path: str, body: Any, *, quick: bool) -> _Response:
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", "Host: modeld", "Connection: close"]
        if body is not None:
            head.append("Content-Type: application/json")
        if payload or method not in ("GET", "HEAD", "DELETE"):
            head.append(f"Content-Length: {len(payload)}")
        if self.endpoint.api_key is not None:
            head.append(f"Authorization: Bearer {self.endpoint.api_key}")
        sock = self._connect()
        try:
            sock.settimeout(self.answer_timeout if quick else None)
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + payload)
            response = _Response(sock, sock.makefile("rb"))
        except TimeoutError as e:
            sock.close()
            raise _no_answer(self.endpoint, self.answer_timeout) from e
        except DaemonDisconnected:
            sock.close()
            raise
        except OSError as e:
            sock.close()
            raise _unreachable(self.endpoint, e) from e
        self._answered = True
        return response

    def _ensure_answering(self) -> None:
        """Before a request that may take long: the daemon answers a quick one in time."""
        if not self._answered:
            self.request("GET", "/api/health")

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON, or raise the daemon's error."""
        quick = method == "GET"
        if not quick:
            self._ensure_answering()
        response = self._send(method, path, body, quick=quick)
        try:
            data = response.read()
        except TimeoutError as e:
            raise _no_answer(self.endpoint, self.answer_timeout) from e
        except ModeldError:  # the daemon's own (some are OSErrors), or a cut-off
            raise
        except OSError as e:  # ECONNRESET: the daemon died with our bytes unread
            raise _cut_off() from e
        finally:
            response.close()
        return _decode(response.status, response.content_type, data)

    def stream(self, method: str, path: str, body: Any = None) -> Iterator[dict[str, Any]]:
        """Send one request and yield its NDJSON records; an error record is raised."""
        self._ensure_answering()
        response = self._send(method, path, body, quick=False)
        try:
            if response.status >= 400:
                _decode(response.status, response.content_type, response.read())
            for line in response.lines():
                record = _record(line)
                if record is not None:
                    yield record
        except ModeldError:  # the daemon's own (some are OSErrors), or a cut-off
            raise
        except OSError as e:  # ECONNRESET: the daemon died with our bytes unread
            raise _cut_off() from e
        finally:
            response.close()

    # --- the API, one method per route ---------------------------------------------------

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", "/api/health")
        return result

    def status(self) -> dict[str, Any]:
        """``GET /api/status``: version, settings, and each part's summary and problems."""
        result: dict[str, Any] = self.request("GET", "/api/status")
        return result

    def models(self, installed: bool = False) -> dict[str, Any]:
        """``GET /api/models``: ``{"models": [...], "problems": [...]}`` with install state."""
        result: dict[str, Any] = self.request(
            "GET", "/api/models?installed=1" if installed else "/api/models"
        )
        return result

    def show(self, model_id: str) -> dict[str, Any]:
        """``GET /api/models/{id}``: entry, install state, sections, plans, probes."""
        result: dict[str, Any] = self.request("GET", f"/api/models/{_path(model_id)}")
        return result

    def bug_report(self, model_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self.request("GET", f"/api/models/{_path(model_id)}/bug-report")
        return result

    def verify(self, model_id: str) -> dict[str, Any]:
        """``POST /api/models/{id}/verify``: re-hash the installed file."""
        result: dict[str, Any] = self.request("POST", f"/api/models/{_path(model_id)}/verify")
        return result

    def remove(self, model_id: str, *, force: bool = False, entry: bool = False) -> dict[str, Any]:
        """``DELETE /api/models/{id}``: remove the install and its partial (``force`` unloads;
        ``entry``: also the entry modeld wrote for it, by ``pull hf://`` or ``import``)."""
        result: dict[str, Any] = self.request("DELETE", _rm_path(model_id, force, entry))
        return result

    def prune(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """``POST /api/prune`` with ``dry_run``, ``partials``, ``orphans``, ``unused_for``..."""
        result: dict[str, Any] = self.request("POST", "/api/prune", body or {})
        return result

    def pull(
        self,
        model_id: str,
        *,
        force: bool = False,
        as_id: str | None = None,
        limit_rate: int | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Download a model; yields progress records (``state``, ``completed``, ``size``,
        ``mirrors``, ``limit_rate``) until the last one, whose ``state`` is ``installed``
        (with ``already`` when there was nothing to download). ``model_id`` may be a Hub
        file (``hf://ORG/REPO/FILE[@REV]`` or its resolve URL): its entry is made first,
        under ``as_id`` or an id from REPO/FILE. ``limit_rate``: cap the download's total
        rate, in bytes/s (``modeld.config.parse_rate`` reads ``10M``)."""
        body = {"force": force, "limit_rate": limit_rate}
        return self.stream("POST", *_pull_route(model_id, as_id, body))

    def pull_detached(
        self,
        model_id: str,
        *,
        force: bool = False,
        as_id: str | None = None,
        limit_rate: int | None = None,
    ) -> dict[str, Any]:
        """Start (or join) a download in the daemon and return at once (``force``: even a
        model that can never fit the memory budget; ``limit_rate`` as for ``pull``)."""
        body = {"detach": True, "force": force, "limit_rate": limit_rate}
        result: dict[str, Any] = self.request("POST", *_pull_route(model_id, as_id, body))
        return result

    def cancel_pull(self, model_id: str) -> dict[str, Any]:
        """Cancel a running download; its partial stays for a later pull to resume."""
        result: dict[str, Any] = self.request("DELETE", f"/api/downloads/{_path(model_id)}")
        return result

    def import_file(self, path: Path | str, model_id: str | None = None) -> dict[str, Any]:
        """``POST /api/models/import``: open ``path`` as this process and pass the open file
        to the daemon (``SCM_RIGHTS``), so it reads exactly what this user may read."""
        if self.endpoint.socket is None:
            raise BadRequest("import passes an open file: it needs the daemon's socket")
        fd = _open_model_file(path)
        try:
            self._ensure_answering()
            body = {"fd": True, "name": Path(path).name, "id": model_id}
            try:
                status, decoded = _send_with_fd(self.endpoint.socket, body, fd, self.answer_timeout)
            except TimeoutError as e:
                raise _no_answer(self.endpoint, self.answer_timeout) from e
            except DaemonDisconnected:
                raise
            except OSError as e:
                raise _unreachable(self.endpoint, e) from e
        finally:
            os.close(fd)
        if status >= 400:
            raise error_from_body(status, decoded)
        if not isinstance(decoded, dict):
            raise _cut_off()
        result: dict[str, Any] = decoded
        return result

    def engines(self) -> dict[str, Any]:
        """``GET /api/engines``: loaded engines, the memory budget, the runtime."""
        result: dict[str, Any] = self.request("GET", "/api/engines")
        return result

    def load(self, model: str, **options: Any) -> dict[str, Any]:
        """Load a model's engine now: ``main``, ``vision``, ``keep_alive``, ``pin``,
        ``allow_unverified``; returns the engine's view."""
        result: dict[str, Any] = self.request("POST", "/api/engines", load_body(model, **options))
        return result

    def unload(self, engine_or_model: str, grace: str | None = None) -> dict[str, Any]:
        """Stop an engine (or every engine of a model) after its in-flight requests, which
        get ``grace`` (a duration; the daemon's default when None)."""
        result: dict[str, Any] = self.request("DELETE", _unload_path(engine_or_model, grace))
        return result

    def forget_memory(self, model_id: str) -> dict[str, Any]:
        """``DELETE /api/models/{id}/memory``: forget the memory learned for its file (admin)."""
        result: dict[str, Any] = self.request("DELETE", f"/api/models/{_path(model_id)}/memory")
        return result

    def check(self, model: str, images: int = 0, allow_unverified: bool = False) -> dict[str, Any]:
        """``POST /api/models/{id}/check``: the engine a generation request for ``model`` (with
        ``images`` images) would get, or the error it would get before its prompt is read."""
        body = {"images": images, "allow_unverified": allow_unverified}
        result: dict[str, Any] = self.request("POST", f"/api/models/{_path(model)}/check", body)
        return result

    def generate(self, model: str, prompt: str, **options: Any) -> Iterator[GenerationRecord]:
        """Stream a reply: ``TokenRecord`` records, then one ``FinalRecord``. Options:
        ``system``, ``images`` (bytes), ``format``, ``max_tokens``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``, ``stop``, ``keep_alive``, ``allow_unverified``."""
        body = generation_body(model, prompt=prompt, **options)
        return map(generation_record, self.stream("POST", GENERATE, body))

    def chat(
        self, model: str, messages: list[dict[str, str]], **options: Any
    ) -> Iterator[GenerationRecord]:
        """Like ``generate`` for a conversation: ``messages`` of ``{"role", "content"}``."""
        if not messages:
            raise BadRequest("chat needs at least one message")
        body = generation_body(model, messages=messages, **options)
        return map(generation_record, self.stream("POST", GENERATE, body))

    def embed(self, model: str, inputs: str | list[str], **options: Any) -> list[list[float]]:
        """One vector per input, in order, from an embedding model (``/v1/embeddings``).
        Options: ``dimensions`` (a shorter vector, normalised), ``keep_alive``,
        ``allow_unverified``. A model that generates text raises ``NotEmbeddingModel``."""
        return _vectors(
            self.request("POST", "/v1/embeddings", embedding_body(model, inputs, **options))
        )

    model = show  # the name the async client has always had


# --- the async client -------------------------------------------------------------------


class AsyncClient:
    """An asyncio client: ``async with AsyncClient() as c: await c.status()``.

    The same methods as ``Client``, as coroutines; ``pull``, ``generate`` and ``chat`` are
    async iterators. aiohttp is imported when the client is entered.
    """

    def __init__(
        self,
        socket_path: Path | str | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        answer_timeout: float = ANSWER_TIMEOUT,
    ) -> None:
        self.endpoint = find_daemon(socket_path, url=url, api_key=api_key)
        self.socket_path = self.endpoint.socket
        self.connect_timeout = connect_timeout
        self.answer_timeout = answer_timeout
        self._answered = False
        self._session: aiohttp.ClientSession | None = None
        self._base = self.endpoint.url or "http://modeld"

    async def __aenter__(self) -> AsyncClient:
        import aiohttp  # here: apps that use only the sync client never load it

        connector: aiohttp.BaseConnector
        if self.endpoint.socket is not None:
            connector = aiohttp.UnixConnector(path=str(self.endpoint.socket))
        else:
            connector = aiohttp.TCPConnector()
        headers = {}
        if self.endpoint.api_key is not None:
            headers["Authorization"] = f"Bearer {self.endpoint.api_key}"
        self._session = aiohttp.ClientSession(
            connector=connector,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
        )
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use AsyncClient as an async context manager")
        return self._session

    def _unavailable(self, err: Exception) -> DaemonUnavailable:
        import aiohttp

        if isinstance(err, aiohttp.ServerTimeoutError | TimeoutError):
            return _no_answer(self.endpoint, self.answer_timeout)
        return _unreachable(self.endpoint, err)

    async def _ensure_answering(self) -> None:
        if not self._answered:
            await self.request("GET", "/api/health")

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        """Send one request; return the decoded JSON, or raise the daemon's error."""
        import aiohttp

        quick = method == "GET"
        if not quick:
            await self._ensure_answering()
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self.connect_timeout,
            sock_read=self.answer_timeout if quick else None,
        )
        try:
            async with self.session.request(
                method, self._base + path, json=body, timeout=timeout
            ) as resp:
                try:
                    data = await resp.read()
                except aiohttp.ClientPayloadError as e:
                    raise _cut_off() from e
                status = resp.status
                ctype = resp.content_type
        except DaemonDisconnected:
            raise
        except (aiohttp.ClientConnectionError, OSError, TimeoutError) as e:
            raise self._unavailable(e) from e
        self._answered = True
        return _decode(status, ctype, data)

    async def stream(
        self, method: str, path: str, body: Any = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Send one request and yield its NDJSON records; an error record is raised."""
        import aiohttp

        await self._ensure_answering()
        try:
            resp = await self.session.request(method, self._base + path, json=body)
        except (aiohttp.ClientConnectionError, OSError) as e:
            raise self._unavailable(e) from e
        try:
            if resp.status >= 400:
                _decode(resp.status, resp.content_type, await resp.read())
            async for raw in resp.content:
                record = _record(raw)
                if record is not None:
                    yield record
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise _cut_off() from e
        finally:
            resp.release()

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/api/health")
        return result

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/api/status")
        return result

    async def models(self, installed: bool = False) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "GET", "/api/models?installed=1" if installed else "/api/models"
        )
        return result

    async def show(self, model_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", f"/api/models/{_path(model_id)}")
        return result

    model = show

    async def bug_report(self, model_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "GET", f"/api/models/{_path(model_id)}/bug-report"
        )
        return result

    async def verify(self, model_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", f"/api/models/{_path(model_id)}/verify")
        return result

    async def remove(
        self, model_id: str, *, force: bool = False, entry: bool = False
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("DELETE", _rm_path(model_id, force, entry))
        return result

    async def prune(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("POST", "/api/prune", body or {})
        return result

    def pull(
        self, model_id: str, *, as_id: str | None = None, limit_rate: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        return self.stream("POST", *_pull_route(model_id, as_id, {"limit_rate": limit_rate}))

    async def import_file(self, path: Path | str, model_id: str | None = None) -> dict[str, Any]:
        """As ``Client.import_file``; the blocking send runs in a thread."""
        import asyncio

        sync = Client(self.endpoint.socket, answer_timeout=self.answer_timeout)
        sync.endpoint = self.endpoint
        return await asyncio.to_thread(sync.import_file, path, model_id)

    async def engines(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("GET", "/api/engines")
        return result

    async def load(self, model: str, **options: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self.request(
            "POST", "/api/engines", load_body(model, **options)
        )
        return result

    async def unload(self, engine_or_model: str, grace: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.request("DELETE", _unload_path(engine_or_model, grace))
        return result

    async def check(
        self, model: str, images: int = 0, allow_unverified: bool = False
    ) -> dict[str, Any]:
        body = {"images": images, "allow_unverified": allow_unverified}
        result: dict[str, Any] = await self.request(
            "POST", f"/api/models/{_path(model)}/check", body
        )
        return result

    async def generate(
        self, model: str, prompt: str, **options: Any
    ) -> AsyncIterator[GenerationRecord]:
        body = generation_body(model, prompt=prompt, **options)
        async for record in self.stream("POST", GENERATE, body):
            yield generation_record(record)

    async def chat(
        self, model: str, messages: list[dict[str, str]], **options: Any
    ) -> AsyncIterator[GenerationRecord]:
        if not messages:
            raise BadRequest("chat needs at least one message")
        body = generation_body(model, messages=messages, **options)
        async for record in self.stream("POST", GENERATE, body):
            yield generation_record(record)

    async def embed(self, model: str, inputs: str | list[str], **options: Any) -> list[list[float]]:
        body = embedding_body(model, inputs, **options)
        return _vectors(await self.request("POST", "/v1/embeddings", body))


def _open_model_file(path: Path | str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise BadRequest(f"{path}: {e.strerror}; give a file you can read") from None
    import stat

    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadRequest(f"{path} is not a regular file; import reads model files only")
    return fd


def _send_with_fd(
    socket_path: Path, body: dict[str, Any], fd: int, answer_timeout: float
) -> tuple[int, Any]:
    """One HTTP/1.1 request whose file descriptor follows the daemon's ``100 Continue``.

    The descriptor rides on one byte sent after the 100, never with the request itself: the
    daemon pauses its HTTP reader first, so the byte reaches its ``recvmsg``. A final answer
    instead of the 100 (a refusal) is returned as it is. The import itself may take as long
    as copying the file does, so only the 100 has a deadline.
    """
    payload = json.dumps(body).encode()
    head = (
        "POST /api/models/import HTTP/1.1\r\nHost: modeld\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    with connect_unix(socket_path, answer_timeout) as s:
        s.sendall(head + payload)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise _cut_off()
            data += chunk
        if data.startswith(b"HTTP/1.1 100"):
            data = data.partition(b"\r\n\r\n")[2]
            socket.send_fds(s, [b"\0"], [fd])
            s.settimeout(None)
        while chunk := s.recv(65536):
            data += chunk
    head_raw, _, raw = data.partition(b"\r\n\r\n")
    parts = head_raw.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise _cut_off()  # closed after the 100, before its answer
    status = int(parts[1])
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, None


# --- why a socket is closed to this process ----------------------------------------------


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def socket_denied(socket_path: Path) -> SocketDenied:
    """Why this process may not open the daemon's socket, and what to do about it."""
    import grp
    import stat

    for directory in reversed(socket_path.parents):
        if not os.access(directory, os.X_OK):
            try:
                st = directory.stat()
                how = (
                    f"{_user_name(st.st_uid)}:{_group_name(st.st_gid)} "
                    f"{stat.S_IMODE(st.st_mode):04o}"
                )
            except OSError:
                how = "not searchable"
            return SocketDenied(
                f"permission denied on {socket_path}: its directory {directory} ({how}) is "
                "closed to you; the socket's directories must be searchable (0755): ask the "
                "admin to check where the service puts its socket"
            )
    try:
        st = socket_path.stat()
    except OSError as e:
        return SocketDenied(f"permission denied on {socket_path} ({e.strerror})")
    owner = _user_name(st.st_uid)
    group = _group_name(st.st_gid)
    mode = stat.S_IMODE(st.st_mode)
    user = _user_name(os.getuid())
    where = f"permission denied on {socket_path} ({owner}:{group} {mode:04o})"
    if st.st_gid in os.getgroups() or st.st_gid == os.getgid():
        return SocketDenied(f"{where}: the group may not write it; make it 0660")
    try:
        members = grp.getgrgid(st.st_gid).gr_mem
    except KeyError:
        members = []
    if user in members:
        return SocketDenied(
            f"{where}: you are in group {group}, but this login session is not yet: log in "
            f"again (or run `newgrp {group}`)"
        )
    return SocketDenied(
        f"{where}: join group {group} (`sudo usermod -aG {group} {user}`), then log in again"
    )
