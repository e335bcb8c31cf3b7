"""Settings: env over file, sizes and durations, one-line errors, exit status 2."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modeld.config import (
    _cgroup_cpus,
    client_socket_path,
    config_file_path,
    default_cpu_threads,
    load_settings,
    parse_duration,
    parse_size,
)
from modeld.errors import SettingsError
from tests.support.daemon import serve_to_exit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", 1024),
        ("4GiB", 4 * 1024**3),
        ("500MB", 500 * 10**6),
        ("2 KiB", 2048),
        ("1.5GB", 1_500_000_000),
        ("10b", 10),
        (7, 7),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    """Sizes accept bytes, decimal and binary units."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "-1", "4XB", "", "GiB", "1e9"])
def test_parse_size_rejects(text: str) -> None:
    """Anything that is not a size is refused."""
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5m", 300),
        ("30s", 30),
        ("0", 0),
        ("-1", -1),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("12", 12),
        ("-5m", -1),
    ],
)
def test_parse_duration(text: str, expected: float) -> None:
    """Durations accept units, 0 (at once) and negatives (never)."""
    assert parse_duration(text) == expected


@given(st.text(max_size=12))
def test_parse_size_never_crashes(text: str) -> None:
    """Arbitrary text either parses to a non-negative int or raises ValueError."""
    with contextlib.suppress(ValueError):
        assert parse_size(text) >= 0


def test_env_wins_over_file(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment variable overrides the same key in the config file."""
    cfg = clean_env / "modeld.toml"
    cfg.write_text('keep_alive = "30s"\nmemory_budget = "1GiB"\nregistry = ["/r1", "/r2"]\n')
    monkeypatch.setenv("MODELD_CONFIG", str(cfg))
    monkeypatch.setenv("MODELD_KEEP_ALIVE", "-1")
    s = load_settings()
    assert s.keep_alive == -1
    assert s.memory_budget == 1024**3
    assert s.registry == [Path("/r1"), Path("/r2")]


def test_xdg_config_file_is_found(clean_env: Path) -> None:
    """Without MODELD_CONFIG, $XDG_CONFIG_HOME/modeld/modeld.toml is read."""
    cfg = clean_env / "xdg-config" / "modeld" / "modeld.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('vision_backend = "gpu"\n')
    assert load_settings().vision_backend == "gpu"


def test_unknown_file_key_is_an_error(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in the config file is refused, naming the key."""
    cfg = clean_env / "modeld.toml"
    cfg.write_text("keep_alvie = 3\n")
    monkeypatch.setenv("MODELD_CONFIG", str(cfg))
    with pytest.raises(SettingsError, match="keep_alvie"):
        load_settings()


def test_registry_env_is_colon_separated(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MODELD_REGISTRY splits on ':'."""
    monkeypatch.setenv("MODELD_REGISTRY", "/a:/b")
    assert load_settings().registry == [Path("/a"), Path("/b")]


def test_memory_default_is_half_of_memory(clean_env: Path) -> None:
    """The memory budget defaults to half of the smaller of MemTotal and the cgroup limit."""
    from modeld.config import memory_total_bytes

    assert load_settings().memory_budget == memory_total_bytes() // 2


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("MODELD_MEMORY_BUDGET", "lots", "MODELD_MEMORY_BUDGET=lots"),
        ("MODELD_MEMORY_BUDGET", "4", "MODELD_MEMORY_BUDGET=4: 4 B is too small to be meant"),
        ("MODELD_MAIN_BACKEND", "npu", "MODELD_MAIN_BACKEND=npu"),
        ("MODELD_KEEP_ALIVE", "soon", "MODELD_KEEP_ALIVE=soon"),
        ("MODELD_DOWNLOAD_CONNECTIONS", "0", "MODELD_DOWNLOAD_CONNECTIONS=0"),
    ],
)
def test_bad_value_exits_2_with_one_line(
    clean_env: Path, key: str, value: str, needle: str
) -> None:
    """`modeld serve` with a bad setting exits 2 with one line naming key, value and rule."""
    import os

    env = dict(os.environ, **{key: value})
    result = serve_to_exit(env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert needle in lines[0]
    assert "allowed" in lines[0]


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        (
            "MODELD_HEADER_TIMEOUT",
            "0",
            "MODELD_HEADER_TIMEOUT=0: must be a positive duration such as 30s; allowed: a "
            "duration above 0 such as 30s, 5m or 1h30m",
        ),
        ("MODELD_DOWNLOAD_CONNECTIONS", "abc", "=abc: not a whole number; allowed: a whole"),
        ("MODELD_DOWNLOAD_CONNECTIONS", "0", "=0: must be 1 or more; allowed:"),
        ("MODELD_DOWNLOAD_CONNECTIONS", "65", "=65: must be 64 or less; allowed:"),
        ("MODELD_ALLOW_UIDS", "x", "=x: not a whole number; allowed: numeric uids"),
        ("MODELD_LOG_LEVEL", "loud", "=loud: not one of the allowed values; allowed: debug"),
        ("MODELD_LISTEN_PUBLIC", "maybe", "=maybe: not 1 or 0 (true or false); allowed"),
        ("MODELD_PIECE_SIZE", "1", "=1: must be from 64 KiB to 1 GiB; allowed:"),
        ("MODELD_PIECE_SIZE", "2GiB", "must be from 64 KiB to 1 GiB"),
        # A size too small to be meant: a unit left out (4 bytes for 4 GB).
        ("MODELD_MEMORY_BUDGET", "4", "=4: 4 B is too small to be meant (a bare number is"),
        ("MODELD_MEMORY_BUDGET", "63MiB", "too small to be meant"),
        ("MODELD_DISK_BUDGET", "50", "=50: 50 B is too small to be meant"),
        ("MODELD_MAX_BODY", "1000", "=1000: 1000 B is too small to be meant"),
    ],
)
def test_a_bad_value_is_told_in_modelds_words(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, key: str, value: str, said: str
) -> None:
    """The reason is modeld's, not pydantic's ("Input should be ..."), and the rule of a
    duration that must be above 0 does not offer 0 or -1; a piece of one byte (a journal
    record per byte) is refused."""
    monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError) as got:
        load_settings()
    assert said in got.value.message and "Input should" not in got.value.message


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "NaN"])
def test_parse_duration_rejects_non_finite(text: str) -> None:
    """float() takes nan/inf/1e400; none of them is a duration (they would reach JSON as NaN)."""
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_non_utf8_config_file_is_one_line_exit_2(clean_env: Path) -> None:
    """A config file that is not UTF-8 stops start-up with one line and exit 2, no traceback."""
    import os

    cfg = clean_env / "modeld.toml"
    cfg.write_bytes(b'log_level = "caf\xe9"\n')
    env = dict(os.environ, MODELD_CONFIG=str(cfg))
    result = serve_to_exit(env)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "UTF-8" in result.stderr


def test_no_home_directory_is_needed_when_modeld_home_is_set(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user without $HOME or a user database entry (a DynamicUser where nss-systemd is
    missing) loads its settings when MODELD_HOME is set, and is told to set it otherwise."""
    import pwd

    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for key in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setenv("MODELD_HOME", str(clean_env / "state"))
    assert load_settings().home == clean_env / "state"
    assert config_file_path() in (None, Path("/etc/modeld/modeld.toml"))
    assert client_socket_path().name == "modeld.sock"

    monkeypatch.delenv("MODELD_HOME")
    with pytest.raises(SettingsError, match="set MODELD_HOME"):
        load_settings()


def test_the_cli_finds_the_users_own_daemon_before_the_system_one(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$XDG_RUNTIME_DIR/modeld.sock (e.g. the `systemctl --user` unit) is found before
    /run/modeld/modeld.sock; without it the system socket; MODELD_SOCKET beats both."""
    import modeld.config

    system = clean_env / "system.sock"
    system.touch()
    monkeypatch.setattr(modeld.config, "SYSTEM_SOCKET", system)
    runtime = clean_env / "runtime"
    runtime.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    assert client_socket_path() == system
    (runtime / "modeld.sock").touch()
    assert client_socket_path() == runtime / "modeld.sock"
    monkeypatch.setenv("MODELD_SOCKET", str(system))
    assert client_socket_path() == system


def _cpu(sysfs: Path, cpu: int, package: int, core: int) -> None:
    topology = sysfs / f"cpu{cpu}" / "topology"
    topology.mkdir(parents=True)
    (topology / "physical_package_id").write_text(f"{package}\n")
    (topology / "core_id").write_text(f"{core}\n")


def test_default_cpu_threads_counts_physical_performance_cores(tmp_path: Path) -> None:
    """SMT siblings count once, only P-cores count on a hybrid CPU; never less than 1."""
    usable = sorted(os.sched_getaffinity(0))
    separate = tmp_path / "separate" / "cpu"
    for cpu in usable:
        _cpu(separate, cpu, 0, cpu)
    quota = _cgroup_cpus()  # a CPU quota on this test's cgroup caps every count
    assert default_cpu_threads(separate) == min(len(usable), quota or len(usable))
    siblings = tmp_path / "smt" / "cpu"
    for cpu in usable:
        _cpu(siblings, cpu, 0, 0)  # every usable CPU is a thread of one core
    assert default_cpu_threads(siblings) == 1
    hybrid = tmp_path / "hybrid" / "cpu"
    for cpu in usable:
        _cpu(hybrid, cpu, 0, cpu)
    (hybrid.parent / "cpu_core").mkdir()
    (hybrid.parent / "cpu_core" / "cpus").write_text(f"{usable[0]}\n")
    assert default_cpu_threads(hybrid) == 1


def test_cpu_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """MODELD_CPU_THREADS wins over the machine's count; 0 stops start-up naming the key."""
    monkeypatch.setenv("MODELD_CPU_THREADS", "3")
    assert load_settings().cpu_threads == 3
    monkeypatch.setenv("MODELD_CPU_THREADS", "0")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "MODELD_CPU_THREADS=0" in str(info.value) and "1 to 256" in str(info.value)


def test_hugging_face_conventions(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MODELD_HF_TOKEN, else HF_TOKEN, else the token file (HF_TOKEN_PATH, default
    HF_HOME/token); HF_ENDPOINT (its host is a hub host), HF_HUB_OFFLINE, HF_HUB_CACHE."""
    home = clean_env / "hf-home"
    home.mkdir()
    assert load_settings(home=clean_env).hf_token is None
    (home / "token").write_text("hf_from_file\n")
    settings = load_settings(home=clean_env)
    assert settings.hf_token is not None
    assert settings.hf_token.get_secret_value() == "hf_from_file"
    assert settings.hf_endpoint == "https://huggingface.co"
    assert settings.hub_cache == home / "hub"
    assert settings.hf_hub_offline is False
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:8123/")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(clean_env / "cache"))
    settings = load_settings(home=clean_env)
    assert settings.hf_token is not None
    assert settings.hf_token.get_secret_value() == "hf_from_env"
    assert settings.hf_endpoint == "http://127.0.0.1:8123"
    assert settings.hub_hosts == ("127.0.0.1:8123",)
    assert settings.hf_hub_offline is True
    assert settings.hub_cache == clean_env / "cache"
    assert settings.effective()["hf_token"] == "set"
    monkeypatch.setenv("MODELD_HF_TOKEN", "hf_modeld")
    settings = load_settings(home=clean_env)
    assert settings.hf_token is not None
    assert settings.hf_token.get_secret_value() == "hf_modeld"
    monkeypatch.setenv("HF_ENDPOINT", "ftp://mirror")
    with pytest.raises(SettingsError, match=r"HF_ENDPOINT|hf_endpoint"):
        load_settings(home=clean_env)


def test_probe_timeouts(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MODELD_PROBE_HEADER_TIMEOUT and _FIRST_BYTE_TIMEOUT: 10 s each by default, durations,
    carried into the downloader's tuning; 0 stops start-up naming the key."""
    from modeld.download.job import Tuning

    s = load_settings()
    assert (s.probe_header_timeout, s.probe_first_byte_timeout) == (10.0, 10.0)
    monkeypatch.setenv("MODELD_PROBE_HEADER_TIMEOUT", "1m")
    monkeypatch.setenv("MODELD_PROBE_FIRST_BYTE_TIMEOUT", "2.5s")
    tuning = Tuning.from_settings(load_settings())
    assert (tuning.probe_header_timeout, tuning.probe_first_byte_timeout) == (60.0, 2.5)
    assert load_settings().effective()["probe_first_byte_timeout"] == 2.5
    monkeypatch.setenv("MODELD_PROBE_HEADER_TIMEOUT", "0")
    with pytest.raises(SettingsError) as info:
        load_settings()
    assert "MODELD_PROBE_HEADER_TIMEOUT=0" in str(info.value)
