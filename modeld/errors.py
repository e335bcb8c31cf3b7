"""One exception hierarchy for modeld.

Every error carries a stable ``code`` (what the API returns and scripts match on) and an
HTTP ``status``. Messages say what happened and what to do next. Classes also inherit a
built-in exception where one fits, so callers can catch by meaning.

This module imports nothing from the package (it is imported by everything).
"""

from __future__ import annotations

import errno

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any, ClassVar

# sqlite3's SQLITE_FULL ("database or disk is full"), as sqlite3.Error.sqlite_errorcode.
_SQLITE_FULL = 13


class ModeldError(Exception):
    """Base of every error modeld raises on purpose."""

    code: ClassVar[str] = "internal"
    status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The API's error body: ``{"error": {"code": ..., "message": ...}}``."""
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            body["details"] = self.details
        return {"error": body}


# --- bad input (400) -------------------------------------------------------------------


class BadRequest(ModeldError, ValueError):
    """The request itself is malformed: fix it and send it again."""

    code = "bad_request"
    status = 400


class SettingsError(ModeldError, ValueError):
    """A setting has a value that is not allowed; start-up stops with exit status 2."""

    code = "bad_settings"
    status = 400


class ContextLengthExceeded(BadRequest):
    """The prompt does not fit the engine's token window (the reply needs one token at least).

    ``details`` carry ``window`` (tokens) and ``prompt_tokens`` (the runtime's count), or
    ``prompt_bytes`` where the prompt was refused by its size before it was tokenized: each
    API dialect words the refusal from them (OpenAI's and Anthropic's clients match words).
    """

    code = "context_length_exceeded"


class RegistryError(ModeldError, ValueError):
    """A registry file is not a valid entry."""

    code = "bad_registry_entry"
    status = 400


# --- unknown (404) ---------------------------------------------------------------------


class NotFound(ModeldError, LookupError):
    """Something named in the request does not exist."""

    code = "not_found"
    status = 404


class NoRoute(NotFound):
    """No route has this path (``not_found``), so the request reached nothing."""


class ModelNotFound(NotFound):
    code = "model_not_found"


class ModelNotInstalled(NotFound):
    code = "model_not_installed"

    @classmethod
    def of(cls, model_id: str) -> ModelNotInstalled:
        """The refusal of a catalog model that is not installed."""
        return cls(f"model {model_id} is not installed; run `modeld pull {model_id}` first")


class DownloadNotFound(NotFound):
    code = "download_not_found"


class HubFileNotFound(NotFound):
    """The Hub has no such repository, revision or file (``pull hf://...``)."""

    code = "hub_file_not_found"


class EngineNotFound(NotFound):
    code = "engine_not_found"


# --- conflict (409) --------------------------------------------------------------------


class Conflict(ModeldError):
    """The request clashes with what modeld is doing now (a load, a download)."""

    code = "conflict"
    status = 409


class ModelInUse(Conflict):
    code = "model_in_use"


class EntryExists(Conflict):
    """A model id that ``pull hf://`` or ``import`` would write is another entry's."""

    code = "entry_exists"


class ReplacesVerified(Conflict):
    """An unverified file would replace a verified install; it never does."""

    code = "replaces_verified"


# --- method not allowed (405) ---------------------------------------------------------


class MethodNotAllowed(ModeldError):
    """The path has routes, none for this method."""

    code = "method_not_allowed"
    status = 405


# --- too slow (408) -------------------------------------------------------------------


class RequestTimeout(ModeldError):
    """The client did not send its request body within ``body_timeout``."""

    code = "request_timeout"
    status = 408


class DeadlineExceeded(ModeldError):
    """A request on a model ran past ``request_timeout``; its work was stopped there."""

    code = "deadline_exceeded"
    status = 504


# --- client gone (499) ----------------------------------------------------------------


class ClientLeft(ModeldError, ConnectionResetError):
    """The client closed its connection before its answer was complete; its work is
    cancelled. Nobody reads the answer: the status (nginx's 499, "client closed request")
    is for the log and ``modeld_http_requests_total``."""

    code = "client_left"
    status = 499


# --- too large (413) -------------------------------------------------------------------


class TooLarge(ModeldError):
    code = "too_large"
    status = 413


# --- refused by a rule (422) -----------------------------------------------------------


class Refused(ModeldError):
    """A rule forbids this request; sending it again unchanged will fail again."""

    code = "refused"
    status = 422


class BackendConstraint(Refused):
    """The file's ``backend_constraint`` forbids the asked backend plan."""

    code = "backend_constraint"


class NotEmbeddingModel(Refused):
    """``/v1/embeddings`` asked of a model that generates text."""

    code = "not_embedding_model"


class NotTextModel(Refused):
    """Text asked of an embedding model (it has a text encoder and no decoder)."""

    code = "not_text_model"


class ImageProbeFailed(Refused):
    """The plan could not run an image when probed on this host; text still runs."""

    code = "image_probe_failed"


class OverBudget(Refused):
    """The engine could never fit in the memory budget, even with everything evicted."""

    code = "over_budget"


class PinnedMemory(Refused):
    """The engine would fit in the budget, but not beside the pinned engines: waiting frees
    nothing, unloading one of them does."""

    code = "pinned_memory"


class Unverified(Refused):
    """The installed file was never vouched for by a hash; loading needs consent."""

    code = "unverified"


class CorruptModel(Refused):
    """The file is not a valid ``.litertlm`` (bad magic, truncated, sections out of bounds)."""

    code = "corrupt_model"

    def __init__(self, message: str, *, problem: str | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        # What is wrong with the file, without the advice: a caller that knows where the file
        # came from (an import, an install) words its own. None where no other advice fits.
        self.problem = problem


class IntegrityError(Refused):
    """Bytes on disk or from a mirror do not match the expected size or digest."""

    code = "integrity"


class RuntimeTooOld(Refused):
    """The entry's ``min_runtime_version`` is newer than the installed LiteRT-LM runtime."""

    code = "runtime_too_old"


class DigestConflict(IntegrityError):
    """Two sources vouch for different sha256s for the same file (entry, hub, kept answer)."""

    code = "digest_conflict"


class HubAccessDenied(Refused):
    """The Hub refused the file without a token, or with this one (gated or private repo)."""

    code = "hub_access_denied"


class Offline(Refused):
    """``HF_HUB_OFFLINE=1``: modeld does not touch the network."""

    code = "offline"


class LocalEntry(Refused):
    """A local entry (an imported file) has no URL: there is nothing to pull it from."""

    code = "local_entry"


class EntryNotRemovable(Refused):
    """``rm --entry`` of an entry modeld did not write (bundled, or in a MODELD_REGISTRY dir)."""

    code = "entry_not_removable"


class HeldBack(Refused):
    """A model crashed its engine repeatedly and is held back for a while."""

    code = "held_back"


# --- busy (503) ------------------------------------------------------------------------


class Busy(ModeldError):
    """Capacity is taken right now; retry after ``retry_after`` seconds."""

    code = "busy"
    status = 503

    def __init__(self, message: str, retry_after: float = 1.0, **details: Any) -> None:
        super().__init__(message, **details)
        self.retry_after = retry_after


class KeysUnusable(ModeldError):
    """The daemon's API keys file is refused (owner or permissions): no key is in force."""

    code = "keys_unusable"
    status = 503


class ShuttingDown(Busy):
    code = "shutting_down"


class EngineUnloaded(Busy):
    """An admin unloaded the engine before this request was served (its grace ran out);
    sent again, the request starts a fresh engine."""

    code = "engine_unloaded"


# --- failures (500/502/507) ------------------------------------------------------------


class EngineError(ModeldError, RuntimeError):
    """The LiteRT-LM runtime reported a failure; the message carries its own reason."""

    code = "engine_error"
    status = 500


class EngineCrashed(EngineError):
    """An engine's runner process died (a signal or an unexpected exit)."""

    code = "engine_crashed"


class DownloadError(ModeldError, OSError):
    """A download could not finish; the partial file is kept for resume."""

    code = "download_failed"
    status = 502


class DiskFull(DownloadError):
    """No space left where modeld writes: a download, an import, or the state database."""

    code = "disk_full"
    status = 507


def disk_full(exc: BaseException) -> DiskFull | None:
    """``exc`` as a ``DiskFull`` when it says a disk is full (ENOSPC, EDQUOT, SQLITE_FULL)."""
    if isinstance(exc, DiskFull):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" writing {exc.filename}" if exc.filename else ""
        return DiskFull(
            f"no space left on the disk{where}; free space (`modeld prune` removes partial "
            "downloads and unused files) and try again"
        )
    if getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL:
        return DiskFull(
            "the state database cannot grow: its disk is full; free space (`modeld prune` "
            "removes partial downloads and unused files) and try again"
        )
    return None


class DatabaseUnusable(ModeldError, OSError):
    """The state database cannot be opened or written; start-up stops without touching it."""

    code = "database_unusable"
    status = 500


class StateTooNew(DatabaseUnusable):
    """The state database was written by a newer modeld (its schema version is unknown here)."""

    code = "state_too_new"


class DaemonUnavailable(ModeldError, ConnectionError):
    """The CLI or client could not reach a daemon on the socket."""

    code = "daemon_unavailable"
    status = 503


class SocketDenied(DaemonUnavailable, PermissionError):
    """The client may not open the daemon's socket (file mode, group, or a closed directory)."""

    code = "socket_denied"


class DaemonDisconnected(DaemonUnavailable, ConnectionResetError):
    """The daemon closed the connection before its answer was complete: it stopped or
    crashed mid-answer (a pull followed, a reply streamed)."""

    code = "daemon_disconnected"


def _all_subclasses(cls: type[ModeldError]) -> list[type[ModeldError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def error_from_body(status: int, body: Any) -> ModeldError:
    """Rebuild the error a daemon sent (``{"error": {"code", "message"}}``) on the client side."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return ModeldError(f"daemon answered HTTP {status} without an error body")
    code = str(err.get("code", "internal"))
    message = str(err.get("message", f"HTTP {status}"))
    raw_details = err.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    by_code = {c.code: c for c in _all_subclasses(ModeldError)}
    cls = by_code.get(code)
    if cls is None:
        # An unknown code from a newer daemon: keep its code and status.
        error = ModeldError(message, **details)
        error.code = code  # type: ignore[misc]
        error.status = status  # type: ignore[misc]
        return error
    return cls(message, **details)


# --- forbidden (403) -------------------------------------------------------------------


class Forbidden(ModeldError, PermissionError):
    """The peer may not do this: not in the allow-list, or its role is *use* and this needs
    *admin*. The message names the setting (or the key's role) that would allow it."""

    code = "forbidden"
    status = 403


# --- unauthorized (401) ----------------------------------------------------------------


class Unauthorized(ModeldError, PermissionError):
    """A TCP request without a valid API key (``Authorization: Bearer <key>`` or
    ``x-api-key: <key>``)."""

    code = "unauthorized"
    status = 401


# --- removal (500) ---------------------------------------------------------------------


class RemoveFailed(ModeldError, OSError):
    """``rm`` or ``prune`` could not delete a file (permissions, a busy mount)."""

    code = "remove_failed"
    status = 500
