"""The catalog: registry entries loaded from TOML files, validated, merged and live-reloaded.

One file per model, named ``<id>.toml`` (the format is in docs/design.md). Dirs merge in order: the
bundled ``registry/`` first, then each ``MODELD_REGISTRY`` dir; a later dir overrides an
earlier one by id. A bad file is reported (path, key, what is wrong) and skipped; it never
hides the good entries. Two files with the same id inside one dir are both refused, since
either could be the one the admin meant.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import os
import re
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from modeld import logs
from modeld.errors import ModelNotFound, ModelNotInstalled, RegistryError
from modeld.hostinfo import VERSION_PATTERN
from modeld.layout import MODEL_ID_PATTERN, MODEL_ID_RE, file_name_problem, text_problem

# One pattern for the whole package (``modeld.layout``); these names are kept for callers.
ID_PATTERN = MODEL_ID_PATTERN
ID_RE = MODEL_ID_RE
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# watchfiles waits this long for more changes before it reports a batch; its default would
# break the promise that an edit shows within a second (docs/benchmarks.md#cli-imports).
WATCH_DEBOUNCE_MS = 150
WATCH_STEP_MS = 50
WATCH_IDLE_MS = 500
WATCH_RESTART_S = 1.0

Backend = Literal["cpu", "gpu"]


def how_to_edit_entry(model_id: str) -> str:
    """How to change a model's entry on a running daemon, as messages say it: the state
    dir's own registry dir is read at once and overrides a bundled entry by id."""
    return (
        f"copy its file (`modeld show {model_id}` names it) into registry/ in the daemon's "
        "state dir (`modeld status` names that dir) and edit the copy: it is read at once and "
        "overrides the bundled entry by id (an entry in a MODELD_REGISTRY dir: edit it there)"
    )


def nearest_ids(wanted: str, known: Iterable[str], n: int = 3) -> list[str]:
    """The ids of ``known`` nearest to ``wanted``: the same id in other case
    (``gemma-4-e2b-it``) alone when there is one, else those it begins (``gemma``), then
    difflib's closest, compared without case; at most ``n``."""
    by_lower: dict[str, list[str]] = {}
    for k in sorted(set(known)):
        by_lower.setdefault(k.lower(), []).append(k)
    lowered = wanted.lower()
    same = [k for k in by_lower.get(lowered, []) if k != wanted]
    if same:
        return same[:n]
    out = [k for low, ks in by_lower.items() if low.startswith(lowered) for k in ks]
    for close in difflib.get_close_matches(lowered, list(by_lower), n=n, cutoff=0.6):
        out += [k for k in by_lower[close] if k not in out]
    return [k for k in out if k != wanted][:n]


def did_you_mean(wanted: str, known: Iterable[str]) -> str:
    """``" (did you mean X?)"`` (or ``X or Y``...) for the ids nearest ``wanted``; "" if none."""
    near = nearest_ids(wanted, known)
    if not near:
        return ""
    names = near[0] if len(near) == 1 else f"{', '.join(near[:-1])} or {near[-1]}"
    return f" (did you mean {names}?)"


class _Strict(BaseModel):
    # Unknown keys are typos; TOML already gives real ints and bools, so no coercion.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Limits(_Strict):
    """Per-model caps the pool and the generate route apply."""

    max_tokens: int | None = Field(default=None, gt=0)
    vision_max_tokens: int | None = Field(default=None, gt=0)
    max_images: int | None = Field(default=None, ge=0)
    speculative_decoding: bool | None = None


class Backends(_Strict):
    """Per-model backend preference; overrides the settings, never the file's constraints."""

    main: Backend | None = None
    vision: Backend | None = None


class Runtime(_Strict):
    """Per-model engine settings; each overrides its daemon-wide setting for this model."""

    # CPU threads of this model's engines (MODELD_CPU_THREADS otherwise).
    threads: int | None = Field(default=None, ge=1, le=256)
    # false: never warm this model's engines up at load; true: warm up every load of it;
    # absent: MODELD_WARM_UP's rule (gpu plans, pinned loads, preloads).
    warm_up: bool | None = None


class Entry(_Strict):
    """One registry entry, exactly the registry format of docs/design.md."""

    id: str = Field(pattern=ID_PATTERN)
    display_name: str = Field(min_length=1, max_length=200)
    file_name: str = Field(min_length=1, max_length=255)
    # A file adopted from disk (``modeld import PATH`` without an entry): it has no URL, so
    # nothing to pull it from; its sha256 is the imported file's.
    local: bool = False
    urls: list[str] = Field(default_factory=list, validate_default=True)
    size: int = Field(gt=0)
    sha256: str | None = Field(default=None, pattern=SHA256_RE.pattern)
    # The oldest litert-lm release that can run this file (e.g. a newer model type);
    # a load on an older runtime is refused (runtime_too_old) before any runner starts.
    min_runtime_version: str | None = Field(default=None, pattern=VERSION_PATTERN)
    limits: Limits = Field(default_factory=Limits)
    backends: Backends = Field(default_factory=Backends)
    runtime: Runtime = Field(default_factory=Runtime)
    # Other entries of the same model (another quantization or size), by id: `pull ID`
    # takes the best of ID and these that fits the memory budget.
    variants: list[str] = Field(default_factory=list)
    # Loaded once the daemon is ready (as MODELD_PRELOAD does), kept until memory is short.
    preload: bool = False

    @field_validator("variants")
    @classmethod
    def _variant_ids(cls, v: list[str]) -> list[str]:
        for model_id in v:
            if not ID_RE.fullmatch(model_id):
                raise ValueError(f"{model_id!r} is not a model id")
        return v

    @field_validator("file_name", "display_name")
    @classmethod
    def _names(cls, v: str, info: ValidationInfo) -> str:
        # ``export`` writes the file under its name: it must never leave the target dir; and
        # both names are printed by the CLI and written into entries: text, no controls.
        check = file_name_problem if info.field_name == "file_name" else text_problem
        problem = check(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, v: list[str], info: ValidationInfo) -> list[str]:
        local = info.data.get("local") is True
        if not v and not local:
            raise ValueError("at least one URL is required (local = true: an imported file)")
        if v and local:
            raise ValueError("a local entry (local = true) has no URLs; drop one or the other")
        for url in v:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{url!r} is not an http(s) URL with a host")
        return v

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class Problem:
    """A registry file that could not be used, and why."""

    path: Path
    key: str | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: {self.key}" if self.key else str(self.path)
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "key": self.key, "message": self.message}


@dataclass(frozen=True)
class Change:
    """What one reload changed, by id."""

    added: frozenset[str]
    changed: frozenset[str]
    removed: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def bundled_registry_dir() -> Path:
    """The registry shipped with modeld.

    The files live in the repo's ``registry/``; ``modeld/registry`` is a symlink to it,
    so an editable install and a wheel (setuptools copies the files as package data)
    find them at the same place.
    """
    with contextlib.suppress(ModuleNotFoundError, TypeError):
        path = Path(str(resources.files("modeld") / "registry"))
        if path.is_dir():
            return path.resolve()
    return Path(__file__).resolve().parent.parent / "registry"


def _key_of(loc: tuple[int | str, ...]) -> str | None:
    key = ".".join(str(p) for p in loc)
    return key or None


def load_file(path: Path) -> tuple[Entry | None, list[Problem]]:
    """Parse and validate one registry file; usable only when no problem is returned."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        return None, [Problem(path, None, f"not valid TOML ({e}); fix the syntax")]
    except UnicodeDecodeError as e:
        return None, [
            Problem(path, None, f"not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8")
        ]
    except OSError as e:
        return None, [Problem(path, None, f"cannot be read ({e.strerror or e})")]
    try:
        entry = Entry.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = _key_of(err["loc"])
            if err["type"] == "extra_forbidden":
                msg = "unknown key (a typo?); see the registry format in docs/design.md"
            elif err["type"] == "missing":
                msg = "required key is missing"
            else:
                msg = str(err["msg"]).removeprefix("Value error, ")
            problems.append(Problem(path, key, msg))
        return None, problems
    if path.name != f"{entry.id}.toml":
        # The entry is still returned, so a duplicate id in the dir is found for both files.
        return entry, [
            Problem(path, "id", f"id {entry.id!r} must match the file name ({entry.id}.toml)")
        ]
    return entry, []


def load_dir(directory: Path) -> tuple[dict[str, tuple[Entry, Path]], list[Problem]]:
    """Every good entry of one dir, by id, and the problems of the bad files."""
    problems: list[Problem] = []
    if not directory.is_dir():
        return {}, [
            Problem(
                directory,
                None,
                "registry dir does not exist; create it (it is read once it exists) or fix "
                "MODELD_REGISTRY",
            )
        ]
    found: dict[str, list[tuple[Entry, Path, bool]]] = {}
    for path in sorted(directory.glob("*.toml")):
        # Editors' temp files (``.#x.toml``) and hidden files are not entries.
        if path.name.startswith(".") or not path.is_file():
            continue
        entry, errs = load_file(path)
        problems += errs
        if entry is not None:
            found.setdefault(entry.id, []).append((entry, path, not errs))
    entries: dict[str, tuple[Entry, Path]] = {}
    for model_id, hits in found.items():
        if len(hits) == 1:
            entry, path, good = hits[0]
            if good:
                entries[model_id] = (entry, path)
            continue
        names = ", ".join(p.name for _, p, _ in hits)
        for _, path, _ in hits:
            problems.append(
                Problem(
                    path,
                    "id",
                    f"id {model_id!r} is defined more than once in this dir ({names}); keep one",
                )
            )
    return entries, problems


class Catalog:
    """The merged, validated registry; ``get`` never sees a bad entry.

    ``own`` is the dir modeld writes entries into (``$MODELD_HOME/registry``: ``pull hf://``,
    ``import`` of a file without an entry); it is one of ``dirs``, made at ``start``, and its
    absence before then is no problem.
    """

    def __init__(self, dirs: Sequence[Path], *, own: Path | None = None) -> None:
        self.dirs = [Path(d) for d in dirs]
        self.own = own
        self._entries: dict[str, Entry] = {}
        self._sources: dict[str, Path] = {}
        self.problems: list[Problem] = []
        self.listeners: list[Callable[[Change], None]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self.reload()

    # --- reading ---------------------------------------------------------------------

    def get(self, model_id: str) -> Entry:
        """The entry of ``model_id``, else its refusal (``unknown``)."""
        entry = self._entries.get(model_id)
        if entry is None:
            raise self.unknown(model_id)
        return entry

    def unknown(self, model_id: str, where: str = "in the catalog") -> ModelNotFound:
        """The refusal of an id the catalog does not know, naming the nearest known ids:
        every route that takes an id resolves it here."""
        return ModelNotFound(
            f"no model {model_id[:140]!r} {where}{did_you_mean(model_id, self._entries)}; "
            "`modeld list` shows the known ids"
        )

    def how_to_install(self, model_id: str) -> str:
        """The command that installs ``model_id``: a local entry (``modeld import`` wrote
        it) has no URL to pull from, so its file is imported again."""
        entry = self._entries.get(model_id)
        if entry is not None and entry.local:
            return f"`modeld import PATH {model_id}` (its entry is local: no URL to pull from)"
        return f"`modeld pull {model_id}`"

    def not_installed(self, model_id: str) -> ModelNotFound | ModelNotInstalled:
        """The refusal of a request for ``model_id`` when nothing of it is installed."""
        if model_id not in self._entries:
            return self.unknown(model_id)
        return ModelNotInstalled(
            f"model {model_id} is not installed; run {self.how_to_install(model_id)} first"
        )

    def find(self, model_id: str) -> Entry | None:
        return self._entries.get(model_id)

    def source_of(self, model_id: str) -> Path | None:
        return self._sources.get(model_id)

    def entries(self) -> list[Entry]:
        return [self._entries[k] for k in sorted(self._entries)]

    def __contains__(self, model_id: object) -> bool:
        return model_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # --- loading ---------------------------------------------------------------------

    def reload(self) -> Change:
        """Read every dir again; swap in the result at once (readers never see a half)."""
        entries: dict[str, Entry] = {}
        sources: dict[str, Path] = {}
        problems: list[Problem] = []
        for directory in self.dirs:
            if directory == self.own and not directory.is_dir():
                continue
            found, errs = load_dir(directory)
            problems += errs
            for model_id, (entry, path) in found.items():
                entries[model_id] = entry
                sources[model_id] = path
        old = self._entries
        change = Change(
            added=frozenset(entries.keys() - old.keys()),
            changed=frozenset(k for k in entries.keys() & old.keys() if entries[k] != old[k]),
            removed=frozenset(old.keys() - entries.keys()),
        )
        self._entries, self._sources = entries, sources
        if [str(p) for p in problems] != [str(p) for p in self.problems]:
            for p in problems:
                logs.event(
                    "registry_problem",
                    logging.WARNING,
                    path=str(p.path),
                    key=p.key,
                    message=p.message,
                )
        self.problems = problems
        if change:
            logs.event(
                "catalog_reloaded",
                entries=len(entries),
                added=",".join(sorted(change.added)) or None,
                changed=",".join(sorted(change.changed)) or None,
                removed=",".join(sorted(change.removed)) or None,
            )
            for listener in self.listeners:
                listener(change)
        return change

    def status(self) -> dict[str, Any]:
        """The ``catalog`` section of ``/api/status``."""
        n = len(self._entries)
        summary = f"{n} model{'s' if n != 1 else ''} from {len(self.dirs)} registry dir(s)"
        if self.problems:
            summary += f"; {len(self.problems)} problem(s) in the registry dirs"
        return {
            "summary": summary,
            "entries": n,
            "dirs": [str(d) for d in self.dirs],
            "watching": self._watcher is not None and not self._watcher.done(),
            "problems": [str(p) for p in self.problems],
            "problem_details": [p.to_dict() for p in self.problems],
        }

    # --- modeld's own entries --------------------------------------------------------

    def is_own(self, model_id: str) -> bool:
        """Whether the entry in effect for ``model_id`` is a file of the ``own`` dir."""
        source = self._sources.get(model_id)
        return self.own is not None and source is not None and source.parent == self.own

    def write_entry(self, entry: Entry, comment: str) -> Path:
        """Write ``entry`` as ``own/<id>.toml`` (atomically: a reader sees the old file or the
        new one) and reload; ``comment`` heads the file. Returns the file's path."""
        if self.own is None:
            raise RegistryError("this catalog has no registry dir of its own to write to")
        self.own.mkdir(parents=True, exist_ok=True)
        path = self.own / f"{entry.id}.toml"
        head = "".join(f"# {logs.escape(line)}\n" for line in comment.split("\n"))
        text = head + entry_toml(entry)
        # Written only when it reads back as the same entry: never a file the catalog refuses.
        try:
            back = Entry.model_validate(tomllib.loads(text))
        except (tomllib.TOMLDecodeError, ValidationError) as e:
            back, why = None, str(e).splitlines()[0]
        else:
            why = "it reads back as another entry"
        if back != entry:
            raise RegistryError(
                f"the entry of {entry.id} would not read back as written ({why}); nothing was "
                "written: choose another id or file name"
            )
        atomic_write(path, text)
        self.reload()
        return path

    def put_back(self, model_id: str, text: str) -> Path:
        """Write ``text`` (a file ``write_entry`` wrote before) back as ``own/<id>.toml`` and
        reload: the entry a refused change replaced. Returns the file's path."""
        if self.own is None:
            raise RegistryError("this catalog has no registry dir of its own to write to")
        path = self.own / f"{model_id}.toml"
        atomic_write(path, text)
        self.reload()
        return path

    def remove_entry(self, model_id: str) -> Path:
        """Delete ``own/<id>.toml`` and reload (``is_own`` must hold); returns its path."""
        path = self._sources.get(model_id)
        if path is None or not self.is_own(model_id):
            raise RegistryError(f"the entry of {model_id} is not one modeld wrote")
        path.unlink(missing_ok=True)
        fsync_dir(path.parent)
        self.reload()
        return path

    # --- live reload -----------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start watching the registry dirs (``own`` made first, so it is watched too)."""
        if self.own is not None:
            self.own.mkdir(parents=True, exist_ok=True)
        if self._watcher is None or self._watcher.done():
            self._stop = asyncio.Event()
            self._watcher = asyncio.create_task(self._watch(self._stop), name="catalog-watch")

    async def stop(self) -> None:
        """Stop watching (idempotent)."""
        task, self._watcher = self._watcher, None
        if self._stop is not None:
            self._stop.set()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _watched(self) -> list[Path]:
        return [d for d in self.dirs if d.is_dir()]

    async def _watch(self, stop: asyncio.Event) -> None:
        # A failed watch (a watched dir vanished, inotify limits) never stops the catalog:
        # it reloads what is on disk now and watches again after a second, for as long
        # as the daemon runs.
        watching = AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            wait=wait_fixed(WATCH_RESTART_S),
            before_sleep=self._watch_failed,
        )
        while not stop.is_set():
            async for attempt in watching:
                with attempt:
                    await self._watch_once(stop)

    def _watch_failed(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        logs.event("catalog_watch_failed", error=f"{type(exc).__name__}: {exc}")
        self.reload()

    async def _watch_once(self, stop: asyncio.Event) -> None:
        from watchfiles import awatch

        paths = self._watched()
        if stop.is_set():
            return
        if not paths:
            # Nothing to watch yet: look again for a dir made meanwhile.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_RESTART_S)
            self.reload()
            return
        caught_up = False
        async for changes in awatch(
            *paths,
            stop_event=stop,
            debounce=WATCH_DEBOUNCE_MS,
            step=WATCH_STEP_MS,
            watch_filter=_toml_filter,
            recursive=False,
            # An empty batch every WATCH_IDLE_MS tells that the watcher is live:
            # the first one triggers a catch-up reload for edits made while it
            # was being set up.
            yield_on_timeout=True,
            rust_timeout=WATCH_IDLE_MS,
        ):
            if changes or not caught_up:
                caught_up = True
                self.reload()
            if self._watched() != paths:
                # A registry dir made (or removed) since this watch began: read it now,
                # and watch again over the dirs that exist.
                self.reload()
                return


# A TOML basic string's escapes: the short ones, and ``\uXXXX`` for other controls.
_TOML_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}
_TOML_ESCAPED = re.compile('["\\\\\x00-\x1f\x7f]')


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string. JSON's escapes are not TOML's: JSON writes a character
    past U+FFFF as two surrogate escapes, which TOML refuses; here it is written as itself."""
    escaped = _TOML_ESCAPED.sub(
        lambda m: _TOML_ESCAPES.get(m.group(), f"\\u{ord(m.group()):04x}"), text
    )
    return f'"{escaped}"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        if not value:
            return "[]"
        return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def entry_toml(entry: Entry) -> str:
    """The registry file of ``entry`` (the format of docs/design.md), defaults left out."""
    doc = entry.model_dump(mode="json", exclude_defaults=True)
    doc = {"id": entry.id, **doc}  # id first, as in the bundled files
    lines: list[str] = []
    tables: list[str] = []
    for key, value in doc.items():
        if isinstance(value, dict):
            if value:
                body = "".join(f"{k} = {_toml_value(v)}\n" for k, v in value.items())
                tables.append(f"\n[{key}]\n{body}")
            continue
        lines.append(f"{key} = {_toml_value(value)}\n")
    return "".join(lines) + "".join(tables)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a hidden temp file, fsync'd and renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _toml_filter(_change: Any, path: str) -> bool:
    return path.endswith(".toml")


def outdated(entry: Entry | None, digest: str, size: int) -> bool:
    """Whether an installed file is no longer the one the entry describes.

    True when the entry names another sha256 or another size (an entry without sha256
    that moved to a new revision changes its size, as the E2B file did).
    """
    if entry is None:
        return False
    if entry.sha256 is not None and entry.sha256 != digest:
        return True
    return entry.size != size
