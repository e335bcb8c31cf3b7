"""The daemon's settings (pydantic-settings): read by ``load_settings()``, checked at start.

Kept apart from ``modeld.config`` so that a CLI call or an app's client, which only need to
find the daemon, never import pydantic (a third of a second on a small machine).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from modeld.config import (
    _ORIGIN_RE,
    DURATION_HELP,
    ENV_PREFIX,
    SIZE_HELP,
    _default_admin_uids,
    _default_home,
    _list_of_words,
    config_file_path,
    default_cpu_threads,
    format_address,
    format_size,
    hf_endpoint,
    hf_home,
    hf_hub_cache,
    hf_offline,
    hf_token_fallback,
    is_loopback,
    memory_total_bytes,
    parse_address,
    parse_duration,
    parse_size,
)
from modeld.errors import SettingsError
from modeld.layout import StateDir


class _TomlSource(PydanticBaseSettingsSource):
    """Values from the TOML config file; unknown keys are typos and are refused."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path
        self.data: dict[str, Any] = {}
        if path is None:
            return
        try:
            with path.open("rb") as f:
                self.data = tomllib.load(f)
        except FileNotFoundError as e:
            raise SettingsError(
                f"config file {path} does not exist; create it or unset {ENV_PREFIX}CONFIG"
            ) from e
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise SettingsError(f"config file {path}: {e}; fix it (UTF-8 TOML)") from e
        unknown = sorted(set(self.data) - set(settings_cls.model_fields))
        if unknown:
            allowed = ", ".join(sorted(settings_cls.model_fields))
            raise SettingsError(
                f"config file {path}: unknown key {unknown[0]!r}; allowed keys: {allowed}"
            )

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self.data)


# Durations that must be more than 0 (``keep_alive`` also takes 0 and -1).
MIN_PIECE, MAX_PIECE = 64 * 1024, 1024**3
# The least each size setting takes (piece_size: MIN_PIECE): less is a unit left out
# (MODELD_MEMORY_BUDGET=4 is 4 bytes, not 4 GB), never what was meant. No engine fits a
# smaller memory budget (a runner alone takes more), and no request with an image a
# smaller body.
MIN_SIZES = {
    "memory_budget": 64 * 1024**2,
    "disk_budget": 64 * 1024,
    "max_body": 64 * 1024,
    "body_memory": 64 * 1024,
}

_TIMEOUTS = (
    "stall_timeout",
    "probe_header_timeout",
    "probe_first_byte_timeout",
    "shutdown_timeout",
    "body_timeout",
    "header_timeout",
    "idle_timeout",
    "request_timeout",
)
SizeSetting = Annotated[int, NoDecode]
DurationSetting = Annotated[float, NoDecode]


class Settings(BaseSettings):
    """Every setting; the README's table says what each one means."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, case_sensitive=False, extra="ignore", validate_default=True
    )

    home: Path = Field(default_factory=_default_home)
    socket: Path | None = None
    registry: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    memory_budget: SizeSetting = Field(default_factory=lambda: memory_total_bytes() // 2)
    disk_budget: Annotated[int | None, NoDecode] = None
    keep_alive: DurationSetting = 300.0
    main_backend: Literal["gpu", "cpu"] = "gpu"
    # Threads of a CPU engine (``Backend.CPU(thread_count=N)``); an entry's [runtime]
    # threads wins over it.
    cpu_threads: int = Field(default_factory=default_cpu_threads, ge=1, le=256)
    # One short generation when an engine loads, where the first request would pay for
    # compilation and first touch: gpu plans, pinned loads, preloads. 0 turns it off.
    warm_up: bool = True
    # Conversations a text engine keeps after a reply, so that their next turn prefills only
    # its new text (docs/engines.md#conversations-that-continue); 0 keeps none.
    kept_conversations: int = Field(default=2, ge=0, le=64)
    vision_backend: Literal["cpu", "gpu"] = "cpu"
    download_connections: int = Field(default=8, ge=1, le=64)
    piece_size: SizeSetting = 16 * 1024**2
    stall_timeout: DurationSetting = 20.0
    # Hugging Face's conventions: HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_HUB_OFFLINE, and
    # HF_TOKEN or HF_HOME/token when MODELD_HF_TOKEN is unset (``modeld.config``).
    hf_home: Path = Field(default_factory=hf_home)
    hf_hub_cache: Path | None = None
    hf_endpoint: str = Field(default_factory=hf_endpoint)
    hf_hub_offline: bool = Field(default_factory=hf_offline)
    # A mirror's probe: its answer's headers, then its first body byte, each within this
    # (a mirror that trickles header lines is dropped instead of holding the pull).
    probe_header_timeout: DurationSetting = 10.0
    probe_first_byte_timeout: DurationSetting = 10.0
    hf_token: SecretStr | None = None
    log_level: Literal["debug", "info", "warning"] = "info"
    shutdown_timeout: DurationSetting = 10.0
    # Peers (SO_PEERCRED) allowed on the socket; both empty = whoever can open the socket.
    allow_uids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    allow_gids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    # Peers that may administer (pull, rm, import, pin, ...); other peers only *use*.
    admin_uids: Annotated[list[int], NoDecode] = Field(default_factory=_default_admin_uids)
    admin_gids: Annotated[list[int], NoDecode] = Field(default_factory=list)
    # Opt-in TCP (``host:port``, normalised); listen_public comes first: listen's check reads it.
    listen_public: bool = False
    listen: Annotated[list[str], NoDecode] = Field(default_factory=list)
    api_keys_file: Path | None = None
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Bounds on what clients may send; docs/security.md says what each one protects.
    max_body: SizeSetting = 64 * 1024**2
    body_memory: SizeSetting = 256 * 1024**2
    body_timeout: DurationSetting = 60.0
    max_connections: int = Field(default=256, ge=1, le=65536)
    header_timeout: DurationSetting = 10.0
    idle_timeout: DurationSetting = 30.0
    # A request on a model, from its start to its last byte read by the client (queue,
    # load, prefill, decode, checks, the client's reading); past it the request ends.
    request_timeout: DurationSetting = 600.0
    max_image_pixels: int = Field(default=40_000_000, ge=1)
    # Model ids loaded once the daemon is ready (besides entries with `preload = true`).
    preload: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Site caches in front of every pull (``BASE/HOST[:PORT]/PATH``), the origin the fallback.
    site_cache: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("memory_budget", "piece_size", "max_body", "body_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("memory_budget", "disk_budget", "max_body", "body_memory")
    @classmethod
    def _not_too_small(cls, v: int | None, info: ValidationInfo) -> int | None:
        least = MIN_SIZES[str(info.field_name)]
        if v is not None and v < least:
            raise ValueError(
                f"{format_size(v)} is too small to be meant (a bare number is bytes: write the "
                f"unit, as in 4GiB)"
            )
        return v

    @field_validator("piece_size")
    @classmethod
    def _piece_size(cls, v: int) -> int:
        # A download's journal keeps a record per block, and blocks are at most a piece.
        if not MIN_PIECE <= v <= MAX_PIECE:
            raise ValueError("must be from 64 KiB to 1 GiB")
        return v

    @field_validator("disk_budget", mode="before")
    @classmethod
    def _optional_size(cls, v: Any) -> int | None:
        if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
            return None
        return parse_size(v)

    @field_validator("body_memory")
    @classmethod
    def _room_for_one_body(cls, v: int, info: ValidationInfo) -> int:
        max_body = info.data.get("max_body")
        if isinstance(max_body, int) and v < max_body:
            raise ValueError(f"must be at least max_body ({max_body} bytes)")
        return v

    @field_validator("keep_alive", *_TIMEOUTS, mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator(*_TIMEOUTS)
    @classmethod
    def _positive_duration(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be a positive duration such as 30s")
        return v

    @field_validator("registry", mode="before")
    @classmethod
    def _paths(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p for p in v.split(":") if p]
        return v

    @field_validator("hf_hub_cache")
    @classmethod
    def _hub_cache(cls, v: Path | None, info: ValidationInfo) -> Path:
        home = info.data.get("hf_home")
        return v if v is not None else hf_hub_cache(home if isinstance(home, Path) else Path())

    @field_validator("hf_endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        text = v.strip().rstrip("/")
        if not re.fullmatch(r"https?://[^/\s?#]+", text):
            raise ValueError(f"{v!r} is not an http(s) URL of a host (https://huggingface.co)")
        return text

    @field_validator("hf_token")
    @classmethod
    def _token_fallbacks(cls, v: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if v is not None and v.get_secret_value().strip():
            return v
        home = info.data.get("hf_home")
        token = hf_token_fallback(home) if isinstance(home, Path) else None
        return SecretStr(token) if token else None

    @field_validator("allow_uids", "allow_gids", "admin_uids", "admin_gids", mode="before")
    @classmethod
    def _id_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [p.strip() for p in re.split(r"[:,]", v) if p.strip()]
        return v

    @field_validator("listen", "cors_origins", "preload", "site_cache", mode="before")
    @classmethod
    def _words(cls, v: Any) -> Any:
        return _list_of_words(v)

    @field_validator("listen")
    @classmethod
    def _addresses(cls, v: list[str], info: ValidationInfo) -> list[str]:
        out = []
        for text in v:
            host, port = parse_address(text)
            if not is_loopback(host) and not info.data.get("listen_public"):
                raise ValueError(
                    f"{host} is not a loopback address, so other hosts could reach the API, "
                    "keys and prompts in clear text: put TLS in front (a reverse proxy) and "
                    "set MODELD_LISTEN_PUBLIC=1 to confirm"
                )
            out.append(format_address(host, port))
        return out

    @field_validator("site_cache")
    @classmethod
    def _cache_bases(cls, v: list[str]) -> list[str]:
        out = []
        for text in v:
            base = text.rstrip("/")
            if not re.fullmatch(r"https?://[^/\s?#@]+(/[^\s?#]*)?", base):
                raise ValueError(
                    f"{text!r} is not an http(s) base URL such as http://cache.lan:8080"
                )
            out.append(base)
        return out

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            if origin != "*" and not _ORIGIN_RE.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin such as https://app.example:8443")
        return [o.lower() for o in v]

    @field_validator("allow_uids", "allow_gids", "admin_uids", "admin_gids")
    @classmethod
    def _non_negative_ids(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError("ids are 0 or more")
        return v

    @field_validator("main_backend", "vision_backend", "log_level", mode="before")
    @classmethod
    def _lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _TomlSource(settings_cls, config_file_path()))

    # --- derived paths ---------------------------------------------------------------

    @property
    def socket_path(self) -> Path:
        """``MODELD_SOCKET``, else ``$XDG_RUNTIME_DIR/modeld.sock``, else the state dir's."""
        if self.socket is not None:
            return self.socket
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        return Path(runtime) / "modeld.sock" if runtime else self.home / "modeld.sock"

    @property
    def hub_hosts(self) -> tuple[str, ...]:
        """``HOST:PORT`` of ``HF_ENDPOINT`` (the scheme's port when it names none): a hub
        (token, X-Linked-Etag) as huggingface.co is, at that port only."""
        parts = urlsplit(self.hf_endpoint)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return (f"{(parts.hostname or '').lower()}:{port}",)

    @property
    def hub_cache(self) -> Path:
        """The Hugging Face Hub's cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
        return self.hf_hub_cache if self.hf_hub_cache is not None else self.hf_home / "hub"

    @property
    def registry_dirs(self) -> list[Path]:
        """The catalog's dirs, in order: bundled (given), ``own_registry``, MODELD_REGISTRY."""
        return [self.own_registry, *self.registry]

    @property
    def own_registry(self) -> Path:
        """``$MODELD_HOME/registry``: the entries modeld writes (``pull hf://``, ``import``)."""
        return self.home / "registry"

    @property
    def listen_addresses(self) -> list[tuple[str, int]]:
        """``MODELD_LISTEN`` as ``(ip, port)`` pairs."""
        return [parse_address(a) for a in self.listen]

    @property
    def api_keys_path(self) -> Path:
        """``MODELD_API_KEYS_FILE``, else ``$MODELD_HOME/api-keys``."""
        return self.api_keys_file if self.api_keys_file is not None else self.home / "api-keys"

    @property
    def state_dir(self) -> StateDir:
        """The paths under ``MODELD_HOME``."""
        return StateDir(self.home)

    @property
    def db_path(self) -> Path:
        return self.state_dir.db

    @property
    def blobs_dir(self) -> Path:
        return self.state_dir.blobs

    @property
    def partial_dir(self) -> Path:
        return self.state_dir.partial

    @property
    def cache_dir(self) -> Path:
        return self.state_dir.cache

    def effective(self) -> dict[str, Any]:
        """The settings as shown by ``/api/status``: sizes in bytes, times in seconds."""
        return {
            "home": str(self.home),
            "socket": str(self.socket_path),
            "registry": [str(p) for p in self.registry],
            "memory_budget": self.memory_budget,
            "disk_budget": self.disk_budget,
            "keep_alive": self.keep_alive,
            "main_backend": self.main_backend,
            "cpu_threads": self.cpu_threads,
            "warm_up": self.warm_up,
            "kept_conversations": self.kept_conversations,
            "vision_backend": self.vision_backend,
            "download_connections": self.download_connections,
            "piece_size": self.piece_size,
            "stall_timeout": self.stall_timeout,
            "probe_header_timeout": self.probe_header_timeout,
            "probe_first_byte_timeout": self.probe_first_byte_timeout,
            "hf_token": "set" if self.hf_token else None,
            "hf_endpoint": self.hf_endpoint,
            "hf_home": str(self.hf_home),
            "hf_hub_cache": str(self.hf_hub_cache),
            "hf_hub_offline": self.hf_hub_offline,
            "log_level": self.log_level,
            "shutdown_timeout": self.shutdown_timeout,
            "allow_uids": list(self.allow_uids),
            "allow_gids": list(self.allow_gids),
            "admin_uids": list(self.admin_uids),
            "admin_gids": list(self.admin_gids),
            "listen": list(self.listen),
            "listen_public": self.listen_public,
            "api_keys_file": str(self.api_keys_path),
            "cors_origins": list(self.cors_origins),
            "max_body": self.max_body,
            "body_memory": self.body_memory,
            "body_timeout": self.body_timeout,
            "max_connections": self.max_connections,
            "header_timeout": self.header_timeout,
            "idle_timeout": self.idle_timeout,
            "request_timeout": self.request_timeout,
            "max_image_pixels": self.max_image_pixels,
            "preload": list(self.preload),
            "site_cache": list(self.site_cache),
            "config_file": str(p) if (p := config_file_path()) else None,
        }


def _allowed(field: str) -> str:
    if field in _TIMEOUTS:
        return "a duration above 0 such as 30s, 5m or 1h30m"
    allowed = {
        "memory_budget": SIZE_HELP + ", at least 64 MiB",
        "disk_budget": SIZE_HELP + ", at least 64 KiB",
        "piece_size": SIZE_HELP + ", from 64 KiB to 1 GiB",
        "keep_alive": DURATION_HELP,
        "stall_timeout": DURATION_HELP,
        "probe_header_timeout": DURATION_HELP,
        "probe_first_byte_timeout": DURATION_HELP,
        "shutdown_timeout": DURATION_HELP,
        "max_body": SIZE_HELP + ", at least 64 KiB",
        "body_memory": SIZE_HELP + ", at least max_body",
        "body_timeout": DURATION_HELP,
        "header_timeout": DURATION_HELP,
        "idle_timeout": DURATION_HELP,
        "request_timeout": DURATION_HELP,
        "max_connections": "a whole number from 1 to 65536",
        "max_image_pixels": "a whole number of pixels (width times height), 1 or more",
        "main_backend": "gpu or cpu",
        "vision_backend": "cpu or gpu",
        "log_level": "debug, info or warning",
        "download_connections": "a whole number from 1 to 64",
        "cpu_threads": "a whole number from 1 to 256",
        "warm_up": "1 or 0 (true or false)",
        "kept_conversations": "a whole number from 0 to 64",
        "registry": "directories separated by ':'",
        "allow_uids": "numeric uids separated by ':' or ',' (a list in TOML)",
        "allow_gids": "numeric gids separated by ':' or ',' (a list in TOML)",
        "admin_uids": "numeric uids separated by ':' or ',' (a list in TOML)",
        "admin_gids": "numeric gids separated by ':' or ',' (a list in TOML)",
        "listen": "host:port pairs (IP or localhost; [::1]:PORT for IPv6) separated by ','",
        "listen_public": "1 or 0 (true or false)",
        "cors_origins": "origins such as https://app.example:8443 separated by ',', or *",
        "preload": "model ids separated by ','",
        "site_cache": "http(s) base URLs of site caches separated by ','",
        "hf_endpoint": "an http(s) URL of a host, such as https://huggingface.co",
        "hf_hub_offline": "1 or 0 (true or false)",
    }
    return allowed.get(field, "see the README's settings table")


# Pydantic's error types, in the words of the rest of modeld ({...}: the error's context).
_REASONS = {
    "int_parsing": "not a whole number",
    "int_from_float": "not a whole number",
    "float_parsing": "not a number",
    "bool_parsing": "not 1 or 0 (true or false)",
    "greater_than_equal": "must be {ge} or more",
    "greater_than": "must be more than {gt}",
    "less_than_equal": "must be {le} or less",
    "literal_error": "not one of the allowed values",
}


def _reason(err: Any) -> str:
    """A validation error's reason in the words of the rest of modeld, not pydantic's."""
    words = _REASONS.get(str(err.get("type")))
    if words is not None:
        return words.format(**(err.get("ctx") or {}))
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")


def load_settings(**overrides: Any) -> Settings:
    """Read the settings, or raise SettingsError with one line naming key, value and rule."""
    try:
        return Settings(**overrides)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else "?"
        env_key = ENV_PREFIX + field.upper()
        source = env_key if env_key in os.environ else f"{field} (config file)"
        value = err.get("input")
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        reason = _reason(err)
        raise SettingsError(
            f"{source}={value!s}: {reason}; allowed: {_allowed(field)}", key=field
        ) from None
