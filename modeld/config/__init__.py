"""Settings: the only place that reads the environment or the config file.

This module is light (no pydantic): what a client needs to find the daemon, and the size and
duration formats. ``Settings`` and ``load_settings`` live in ``modeld.config.settings`` and
are imported from here on first use.

Environment variables (prefix ``MODELD_``) win over the TOML config file, which uses the same
names in lower case without the prefix. The file is ``$MODELD_CONFIG``, else
``$XDG_CONFIG_HOME/modeld/modeld.toml``, else ``/etc/modeld/modeld.toml`` (the first that
exists; a ``MODELD_CONFIG`` naming a missing file is an error).
"""

from __future__ import annotations

import math
import os
import pwd
import re
from collections.abc import Mapping
from pathlib import Path

from modeld.errors import SettingsError

TYPE_CHECKING = False  # `typing` stays unimported at run time (a CLI call's cost)
if TYPE_CHECKING:
    from typing import Any

    from modeld.config.settings import Settings, load_settings

__all__ = ["Settings", "load_settings"]  # and every public name below


def __getattr__(name: str) -> Any:
    # `from modeld.config import Settings` still works; pydantic loads only then.
    if name in ("Settings", "load_settings"):
        from modeld.config import settings

        return getattr(settings, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ENV_PREFIX = "MODELD_"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_HELP = "bytes, or a number with B, KB, MB, GB (powers of 10) or KiB, MiB, GiB (powers of 2)"

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
DURATION_HELP = "a duration such as 30s, 5m, 1h30m, 0 (at once) or -1 (never)"


def parse_size(value: str | int | float) -> int:
    """Parse ``4GiB``, ``500MB``, ``1024`` (bytes) into a byte count; raise ValueError."""
    if isinstance(value, bool):
        raise ValueError("not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError("not a size")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ValueError("not a size")
        return int(value)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError("not a size")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


RATE_HELP = (
    "bytes per second, or a number with K, M or G (powers of 2, as curl's --limit-rate: "
    "500K, 10M, 1.5G); the units of a size (10MB, 10MiB) and a trailing /s are taken too"
)
_CURL_RATE_UNITS = {"k": 1024, "m": 1024**2, "g": 1024**3}


def parse_rate(value: str) -> int:
    """Parse a ``--limit-rate`` such as ``10M`` or ``500K`` (curl's units, powers of 2),
    ``10MB/s`` or ``1048576`` into bytes per second (at least 1); raise ValueError."""
    text = value.strip()
    text = text.removesuffix("/s").removesuffix("/S")
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None:
        raise ValueError("not a rate")
    if unit in _CURL_RATE_UNITS:
        rate = int(float(match.group(1)) * _CURL_RATE_UNITS[unit])
    else:
        rate = parse_size(text)
    if rate < 1:
        raise ValueError("not a rate")
    return rate


def parse_duration(value: str | int | float) -> float:
    """Parse ``5m``, ``30s``, ``1h30m``, ``0``, ``-1`` (never) into seconds; raise ValueError.

    A bare number is seconds. Any negative value means "never" and is returned as -1.
    """
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, int | float):
        # math.isfinite() of an int past the float range raises OverflowError.
        if isinstance(value, int) and abs(value) > 2**1023:
            raise ValueError("not a duration")
        if not math.isfinite(value):
            raise ValueError("not a duration")
        return -1.0 if value < 0 else float(value)
    text = value.strip().lower()
    if re.fullmatch(r"-\d+(?:\.\d+)?[a-z]*", text):
        return -1.0
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        # float() also takes "nan", "inf" and "1e400": none of them is a duration.
        if not math.isfinite(number):
            raise ValueError("not a duration")
        return number
    parts = _DURATION_PART_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError("not a duration")
    return sum(float(n) * _DURATION_UNITS[u] for n, u in parts)


def format_size(n: int | float) -> str:
    """Human size with binary units, e.g. ``1.5 GiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float | None) -> str:
    """Human duration, e.g. ``4m 10s``; ``never`` for a negative value."""
    if seconds is None or seconds < 0:
        return "never"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h {m}m"
    if m:
        return f"{m}m {sec}s"
    return f"{sec}s"


def parse_address(text: str) -> tuple[str, int]:
    """``127.0.0.1:8080``, ``[::1]:8080`` or ``localhost:8080`` as ``(ip, port)``; ValueError.

    Only IP literals and ``localhost`` (127.0.0.1): a name that resolves at start-up could
    listen somewhere else than the setting says. Port 0 picks a free port (logged at start).
    """
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{text!r} is not host:port")
    if int(port) > 65535:
        raise ValueError(f"{text!r}: the port must be from 0 (any free one) to 65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        host = "127.0.0.1"
    import ipaddress  # here: only the daemon parses addresses, and a client call is timed

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{text!r}: the host must be an IP address or localhost") from None
    return str(ip), int(port)


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal) is a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_ORIGIN_RE = re.compile(
    r"^https?://[A-Za-z0-9.-]+(?::\d{1,5})?$|^https?://\[[0-9A-Fa-f:.]+\](?::\d{1,5})?$"
)


def _list_of_words(v: Any) -> Any:
    """A list from the environment: items separated by ``,`` or whitespace."""
    if isinstance(v, str):
        return [p for p in re.split(r"[,\s]+", v) if p]
    return v


def _default_admin_uids() -> list[int]:
    # root and whoever runs the daemon: the service's own account administers itself.
    return sorted({0, os.getuid()})


def _user_home(env: Mapping[str, str]) -> Path | None:
    """``$HOME``, else the user database's entry; None where neither names one.

    Unlike ``Path.home()`` this does not raise: a service's dynamic user is only in the user
    database where nss-systemd is installed, and it needs no home when ``MODELD_HOME`` is set.
    """
    home = env.get("HOME")
    if home:
        return Path(home)
    try:
        return Path(pwd.getpwuid(os.getuid()).pw_dir)
    except KeyError:
        return None


def _xdg(name: str, fallback: str, env: Mapping[str, str] | None = None) -> Path | None:
    environ = os.environ if env is None else env
    value = environ.get(name)
    if value:
        return Path(value)
    home = _user_home(environ)
    return home / fallback if home is not None else None


def _default_home() -> Path:
    """``$XDG_DATA_HOME/modeld``; only asked for when ``MODELD_HOME`` is not set."""
    data = _xdg("XDG_DATA_HOME", ".local/share")
    if data is None:
        raise SettingsError(
            f"no home directory for uid {os.getuid()} ($HOME is unset and the user database "
            f"has no entry); set {ENV_PREFIX}HOME to the state directory",
            key="home",
        )
    return data / "modeld"


# Hugging Face's own conventions, honoured as its tools do (huggingface_hub's constants).
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE_WORDS = ("1", "on", "yes", "true")


def hf_home() -> Path:
    """``$HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``."""
    explicit = os.environ.get("HF_HOME")
    if explicit:
        return Path(explicit)
    cache = _xdg("XDG_CACHE_HOME", ".cache")
    return (cache if cache is not None else Path("/nonexistent")) / "huggingface"


def hf_hub_cache(home: Path) -> Path:
    """The Hub's download cache: ``$HF_HUB_CACHE``, else ``HF_HOME/hub``."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(explicit) if explicit else home / "hub"


def hf_endpoint() -> str:
    """``$HF_ENDPOINT`` (a mirror of the Hub), else huggingface.co."""
    return os.environ.get("HF_ENDPOINT") or HF_DEFAULT_ENDPOINT


def hf_offline() -> bool:
    """``HF_HUB_OFFLINE=1``: no network at all."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE_WORDS


def hf_token_fallback(home: Path) -> str | None:
    """The token Hugging Face's tools use when ``MODELD_HF_TOKEN`` is unset: ``$HF_TOKEN``,
    else the file ``$HF_TOKEN_PATH`` (default ``HF_HOME/token``, what ``hf auth login``
    writes)."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    path = Path(os.environ.get("HF_TOKEN_PATH") or home / "token")
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token or None


def memory_total_bytes() -> int:
    """The smaller of MemTotal (psutil) and this process's cgroup memory limit (which psutil
    does not read)."""
    import psutil  # late: the CLI's start-up does without it (docs/benchmarks.md#cli-imports)

    total = int(psutil.virtual_memory().total)
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < total:
            total = int(raw)
    return total


# What a child process (a runner, a probe) gets of the daemon's environment: what Python,
# the dynamic linker, the locale and the GPU stacks read, nothing else. No MODELD_* (the
# settings are the daemon's), no HF_* or other credentials: a child runs the runtime on a
# downloaded file and never needs them.
_CHILD_ENV_NAMES = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR",
        "PYTHONPATH", "PYTHONHOME", "PYTHONDONTWRITEBYTECODE", "PYTHONSAFEPATH",
        "LD_LIBRARY_PATH", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_DIRS",
        "XDG_CONFIG_DIRS", "COVERAGE_PROCESS_START",
        # Not a secret: it names the state dir whose runner this is (ps, the fault tests).
        "MODELD_HOME",
    }
)  # fmt: skip
_CHILD_ENV_PREFIXES = (
    "LC_", "CUDA_", "NVIDIA_", "VK_", "MESA_", "__GLX_", "__EGL_", "LIBGL_", "OCL_",
    "ROCR_", "HIP_", "GLOG_", "TF_CPP_", "COV_CORE_",
)  # fmt: skip
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "CREDENTIAL", "_KEY")


def child_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a runner or probe child starts with (see ``_CHILD_ENV_NAMES``)."""
    source = os.environ if environ is None else environ
    return {
        name: value
        for name, value in source.items()
        if (name in _CHILD_ENV_NAMES or name.startswith(_CHILD_ENV_PREFIXES))
        and not any(word in name.upper() for word in _SECRET_WORDS)
    }


def runner_data_limit(memory_budget: int) -> int:
    """A runner's ``RLIMIT_DATA``: twice the memory budget, at least ``RUNNER_DATA_FLOOR``.

    The limit counts private address space, touched or not (allocator arenas, thread
    stacks, the runtime's reservations), which at real size is well above what the budget
    counts (PSS): a limit of the budget itself made the runtime's ``pthread_create`` fail
    with an engine that fitted, and its request never end (see docs/benchmarks.md, "Pool").
    Twice the budget still stops one runaway runner before it takes every other process's
    memory.
    """
    return max(2 * memory_budget, RUNNER_DATA_FLOOR)


# The least data limit a runner gets, however small the budget (Python and the runtime's
# own allocations, before any model).
RUNNER_DATA_FLOOR = 1 << 30


def _read_ints(path: Path) -> list[int]:
    """A sysfs CPU list such as ``0-3,8,10-11`` as numbers; empty where it cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return []
    out: list[int] = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return []
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _cgroup_cpus() -> int | None:
    """The cgroup v2 CPU quota as whole CPUs (``cpu.max`` ``200000 100000`` is 2), or None."""
    try:
        fields = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    # "max 100000" is no quota.
    if len(fields) != 2 or not fields[0].isdigit() or not fields[1].isdigit():
        return None
    quota, period = fields
    if int(period) == 0:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def default_cpu_threads(sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The CPU engines' thread count when ``MODELD_CPU_THREADS`` is not set.

    One thread per physical core this process may run on: SMT siblings share a core's
    vector units, so a second thread per core adds contention, not throughput
    (bench/bench_threads.py). On a hybrid CPU (Intel P- and E-cores, where the kernel lists
    ``/sys/devices/cpu_core/cpus``) only performance cores count: the decode waits for its
    slowest thread. The CPU affinity and a cgroup CPU quota cap the count; at least 1.
    """
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    if not allowed:
        allowed = set(range(os.cpu_count() or 1))
    performance = set(_read_ints(sysfs.parent / "cpu_core" / "cpus"))
    if performance & allowed:
        allowed &= performance
    cores: set[tuple[str, str] | int] = set()
    for cpu in allowed:
        topology = sysfs / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            cores.add(cpu)  # no topology (some containers): count the CPU itself
            continue
        cores.add((package, core))
    count = len(cores)
    quota = _cgroup_cpus()
    if quota is not None:
        count = min(count, quota)
    return max(1, count)


def config_file_path(environ: dict[str, str] | None = None) -> Path | None:
    """The config file in effect, or None when there is none."""
    env = os.environ if environ is None else environ
    explicit = env.get(ENV_PREFIX + "CONFIG")
    if explicit:
        return Path(explicit)
    user_config = _xdg("XDG_CONFIG_HOME", ".config", env)
    candidates = [
        *([user_config / "modeld" / "modeld.toml"] if user_config is not None else []),
        Path("/etc/modeld/modeld.toml"),
    ]
    return next((p for p in candidates if p.is_file()), None)


SYSTEM_SOCKET = Path("/run/modeld/modeld.sock")


def client_socket_path(explicit: Path | None = None) -> Path:
    """Where the CLI looks for the daemon.

    ``--socket``, else ``MODELD_SOCKET``, else the config file's ``socket``, else the first
    of ``$XDG_RUNTIME_DIR/modeld.sock`` (the user's own daemon, e.g. the ``systemctl --user``
    unit), ``/run/modeld/modeld.sock`` (the system service) and ``$MODELD_HOME/modeld.sock``
    (``home`` from the config file when the variable is unset) that exists, else the path
    ``modeld serve`` would bind on these defaults.
    """
    if explicit is not None:
        return explicit
    env_socket = os.environ.get(ENV_PREFIX + "SOCKET")
    if env_socket:
        return Path(env_socket)
    file_values = _config_file_values()
    if isinstance(file_values.get("socket"), str) and file_values["socket"]:
        return Path(file_values["socket"])
    home_env = os.environ.get(ENV_PREFIX + "HOME")
    file_home = file_values.get("home")
    home: Path | None
    if home_env:
        home = Path(home_env)
    elif isinstance(file_home, str) and file_home:
        home = Path(file_home)
    else:
        data = _xdg("XDG_DATA_HOME", ".local/share")
        home = data / "modeld" if data is not None else None
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    user_socket = Path(runtime) / "modeld.sock" if runtime else None
    home_socket = home / "modeld.sock" if home is not None else None
    candidates = [p for p in (user_socket, SYSTEM_SOCKET, home_socket) if p is not None]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    return user_socket or home_socket or SYSTEM_SOCKET


def _config_file_values() -> dict[str, Any]:
    """The config file's keys, best effort: the CLI must not fail on a file only serve checks."""
    path = config_file_path()
    if path is None:
        return {}
    import tomllib  # here: only where a config file exists (it pulls in datetime)

    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):
        return {}


def client_url() -> str | None:
    """``MODELD_URL``: a daemon over TCP (``http://127.0.0.1:11500``) instead of the socket."""
    return os.environ.get(ENV_PREFIX + "URL") or None


def client_api_key() -> str | None:
    """``MODELD_API_KEY``: the key a client sends over TCP (``Authorization: Bearer``)."""
    return os.environ.get(ENV_PREFIX + "API_KEY") or None
