"""Tests for modeld.engines through the real daemon: the GPU probe as a runner opens the file,
the runtime version and adapter in every view, and ``min_runtime_version``.

The daemons here keep the default backends (main=gpu), as a user has them: on a host without
a GPU the probe must fail for the GPU's sake, never the file's, and the model runs on cpu.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeld.engine.runner.client import Runner
from modeld.engine.runner.job import Created
from modeld.hostinfo import runtime_version
from modeld.modelfile import probe as probe_mod
from modeld.modelfile.probe import ProbeResult
from modeld.modelfile.runtime import CreateSpec
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, default_backend_env, running_daemon
from tests.support.state import MODELS, install_fixture, open_store, registry_settings, write_entry
from tests.support.unix import unix_request
from tests.support.wait import process_gone, wait_until

TINY = MODELS / "tiny-text.litertlm"
HAS_GPU = Path("/dev/dri").exists() or Path("/dev/nvidia0").exists()
# What litert-lm 0.18.1 answers for a file without the .litertlm extension.
FORMAT_ERROR = "Unsupported or unknown file format"
# A GPU failure names the GPU stack (WebGPU/Dawn, its adapters, Vulkan), not the file.
ABOUT_THE_GPU = re.compile(r"WebGPU|adapter|Vulkan|GPU", re.I)


def _entry(registry: Path, model_id: str, path: Path, extra: str = "") -> None:
    digest, size = sha256_file(path)
    url = f"http://127.0.0.1:9/org/repo/resolve/0123abc/{path.name}"
    write_entry(registry, model_id, size=size, sha256=digest, urls=[url], extra=extra)


@pytest.fixture
def user_daemon(short_tmp: Path) -> Iterator[DaemonProcess]:
    """A daemon subprocess with default backends and tiny-text in its registry (not installed)."""
    registry = short_tmp / "registry"
    _entry(registry, "tiny-text", TINY)
    home = short_tmp / "home"
    d = DaemonProcess(home=home, env=default_backend_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    yield d
    assert d.stop() == 0, d.log()[-3000:]


def test_default_load_probes_the_gpu_as_a_runner_opens_the_file(
    user_daemon: DaemonProcess,
) -> None:
    """Import and a default load: the GPU probe's verdict is about the GPU, never the file."""
    d = user_daemon
    imported = d.cli_json("import", str(TINY), "tiny-text")
    digest = imported["installed"]["digest"]
    loaded = d.cli_json("load", "tiny-text")
    shown = d.cli_json("show", "tiny-text")
    gpu = shown["probes"]["gpu"]
    assert gpu["current"] is True
    assert gpu["runtime"] == runtime_version()
    assert (shown["runtime"]["package"], shown["runtime"]["version"]) == (
        "litert-lm-api",
        runtime_version(),
    )
    if gpu["ok"]:
        # A host with a usable GPU: the default plan keeps it, and names the adapter.
        assert loaded["plan"]["main"] == "gpu" and not loaded["plan"]["fell_back"]
        assert gpu["adapter"] and shown["runtime"]["adapter"] == gpu["adapter"]
    else:
        reason = gpu["reason"] or ""
        assert FORMAT_ERROR not in reason and "file format" not in reason, reason
        assert ABOUT_THE_GPU.search(reason), reason
        assert gpu["adapter"] is None and shown["runtime"]["adapter"] is None
        # main=gpu came from the settings and the file allows cpu: the engine runs there.
        assert (loaded["plan"]["main"], loaded["plan"]["fell_back"]) == ("cpu", True)
        assert loaded["adapter"] is None
    # The probe opened the runner's .litertlm link, in the runner's cache dir.
    link = d.home / "cache" / digest / "model.litertlm"
    assert link.is_symlink() and link.resolve() == (d.home / "blobs" / f"sha256-{digest}")

    ps = d.cli_json("ps")
    assert [e["id"] for e in ps["engines"]] == [loaded["id"]]
    assert ps["engines"][0]["runtime"] == runtime_version()
    assert ps["runtime"]["version"] == runtime_version()
    ran = d.cli_json("run", "tiny-text", "hello", "--max-tokens", "3")
    assert ran["tokens"] == 3 and ran["engine"] == loaded["id"]

    status = d.cli_json("status")
    assert status["runtime"]["version"] == runtime_version()
    assert status["runtime"]["adapter"] == gpu["adapter"]
    assert [r["ok"] for r in status["probes"]["results"]] == [gpu["ok"]]
    human = d.cli("status")
    assert human.returncode == 0 and f"litert-lm-api {runtime_version()}" in human.stdout
    human_show = d.cli("show", "tiny-text")
    assert f"litert-lm-api {runtime_version()}" in human_show.stdout
    human_ps = d.cli("ps")
    assert f"runtime: litert-lm-api {runtime_version()}" in human_ps.stdout


@pytest.mark.skipif(HAS_GPU, reason="this host has a GPU device; the failure case needs none")
async def test_gpu_probe_is_the_runners_own_engine_creation(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU probe creates the gpu engine in a runner with the very spec a load gives it (no
    probe child, no second creation); without a GPU that runner's failure is recorded with
    the runtime's reason and its log, the runner is gone, and the plan falls back to cpu with
    otherwise the same spec."""
    home, registry = clean_env / "home", clean_env / "registry"
    inst = install_fixture(home, "tiny-text", TINY, registry=registry)
    probed: list[dict[str, Any]] = []
    created: list[tuple[int, dict[str, Any]]] = []
    real_probe, real_create = probe_mod.probe_spec, Runner.create

    async def probe_spec(spec: CreateSpec, *args: Any, **kwargs: Any) -> ProbeResult:
        probed.append(spec.to_json())
        return await real_probe(spec, *args, **kwargs)

    async def create(self: Runner, spec: CreateSpec) -> Created:
        created.append((self.pid, spec.to_json()))
        return await real_create(self, spec)

    monkeypatch.setattr(probe_mod, "probe_spec", probe_spec)
    monkeypatch.setattr(Runner, "create", create)
    settings = registry_settings(home, registry, main_backend="gpu")
    async with running_daemon(settings) as d, d.client() as c:
        view = await c.request("POST", "/api/engines", {"model": "tiny-text"})
        shown = await c.model("tiny-text")
    assert probed == []
    assert [s["backend"] for _, s in created] == ["gpu", "cpu"]
    (gpu_pid, gpu), (cpu_pid, cpu) = created
    assert gpu["path"] == str(home / "cache" / inst.digest / "model.litertlm")
    assert gpu["cache_dir"] == str(home / "cache" / inst.digest)
    assert gpu["warm_up"] is True  # the probe's reply is the runner's warm-up
    assert {**cpu, "warm_up": None} == {**gpu, "backend": "cpu", "warm_up": None}
    assert view["plan"]["main"] == "cpu" and view["plan"]["fell_back"] is True
    assert view["pid"] == cpu_pid != gpu_pid
    await wait_until(lambda: process_gone(gpu_pid))
    row = shown["probes"]["gpu"]
    assert row["ok"] is False and row["current"] is True
    assert "WebGPU" in row["reason"] or "adapter" in row["reason"], row


async def test_stale_probe_result_is_probed_again(clean_env: Path) -> None:
    """A GPU failure recorded by the old probe (blob path) decides nothing: probed again."""
    home, registry = clean_env / "home", clean_env / "registry"
    inst = install_fixture(home, "tiny-text", TINY, registry=registry)
    async with open_store(home) as store:
        await store.record_probe(
            inst.digest, "gpu", False, f"INVALID_ARGUMENT: {FORMAT_ERROR}", method=1
        )
    settings = registry_settings(home, registry, main_backend="gpu")
    async with running_daemon(settings) as d, d.client() as c:
        before = await c.model("tiny-text")
        assert before["probes"]["gpu"]["current"] is False
        assert before["plans"]["text"]["needs_probe"] == ["gpu"]
        await c.request("POST", "/api/engines", {"model": "tiny-text"})
        after = (await c.model("tiny-text"))["probes"]["gpu"]
    assert after["current"] is True
    assert FORMAT_ERROR not in (after["reason"] or "")


def test_min_runtime_version_is_enforced_at_load(short_tmp: Path) -> None:
    """An entry needing a newer runtime is refused (runtime_too_old) naming both versions."""
    registry, home = short_tmp / "registry", short_tmp / "home"
    _entry(registry, "needs-new", TINY, extra='min_runtime_version = "99.1"\n')
    _entry(registry, "needs-old", TINY, extra='min_runtime_version = "0.18"\n')
    for model_id in ("needs-new", "needs-old"):
        install_fixture(home, model_id, TINY)
    d = DaemonProcess(home=home, env=default_backend_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        refused = d.cli("load", "needs-new", "--main", "cpu")
        assert refused.returncode == 1
        message = refused.stderr
        assert "needs litert-lm-api >= 99.1" in message
        assert f"this host has litert-lm-api {runtime_version()}" in message
        assert "pip install -U 'litert-lm-api>=99.1'" in message
        status, body = unix_request(
            d.socket, "POST", "/api/engines", {"model": "needs-new", "backends": {"main": "cpu"}}
        )
        assert (status, body["error"]["code"]) == (422, "runtime_too_old")
        assert body["error"]["details"] == {
            "model": "needs-new",
            "installed": runtime_version(),
            "needed": "99.1",
        }
        shown = d.cli_json("show", "needs-new")
        assert shown["entry"]["min_runtime_version"] == "99.1"
        assert shown["plans"]["text"]["error"]["code"] == "runtime_too_old"
        assert d.cli_json("ps")["engines"] == []
        ok = d.cli_json("load", "needs-old", "--main", "cpu")
        assert ok["plan"]["main"] == "cpu" and ok["state"] == "ready"
    finally:
        assert d.stop() == 0, d.log()[-3000:]


def test_rm_and_an_admin_reset_forget_learned_memory(short_tmp: Path) -> None:
    """A served request teaches the file's peak; `unload --forget-memory` and `rm` forget it,
    so the next load reserves the file's estimate again."""
    import sqlite3
    import time

    from tests.support.daemon import daemon_env

    home, registry = short_tmp / "home", short_tmp / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))

    def rows() -> int:
        with sqlite3.connect(f"file:{home / 'modeld.db'}?mode=ro", uri=True) as db:
            return int(db.execute("SELECT count(*) FROM memory").fetchone()[0])

    def learns() -> None:
        assert d.cli("run", "tiny-text", "hello", "--max-tokens", "3").returncode == 0
        deadline = time.monotonic() + 30
        while rows() == 0:
            assert time.monotonic() < deadline, "no peak was learned"
            time.sleep(0.1)

    d.start()
    try:
        learns()
        reset = d.cli_json("unload", "tiny-text", "--forget-memory")
        assert reset["memory"]["forgot"] >= 1 and rows() == 0
        assert [e["id"] for e in reset["unloaded"]] == ["tiny-text:cpu"]
        learns()
        assert d.cli("rm", "tiny-text", "--force").returncode == 0
        assert rows() == 0
    finally:
        d.stop()
