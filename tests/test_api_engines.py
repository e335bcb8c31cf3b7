"""Engines and generation through a real daemon, real runners and the tiny real models."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from modeld.client import Client
from modeld.config import load_settings
from modeld.errors import BackendConstraint, EngineCrashed
from tests.conftest import DaemonProcess, daemon_env, install_fixture, running_daemon

MODELS = Path(__file__).resolve().parent / "models"
FIXTURES = ("tiny-text", "tiny-text-b", "vision-cpu-ok", "gemma3n-like")


def setup_home(root: Path) -> tuple[Path, Path]:
    home, registry = root / "home", root / "registry"
    for name in FIXTURES:
        install_fixture(home, name, MODELS / f"{name}.litertlm", registry=registry)
    return home, registry


def settings_for(root: Path, **kw: Any) -> Any:
    home, registry = setup_home(root)
    kw.setdefault("main_backend", "cpu")
    return load_settings(home=home, socket=home / "modeld.sock", registry=[registry], **kw)


async def generate(client: Client, **body: Any) -> tuple[str, dict[str, Any]]:
    body.setdefault("max_tokens", 8)
    text, final = [], {}
    async for rec in client.stream("POST", "/api/generate", body):
        if "token" in rec:
            text.append(rec["token"])
        else:
            final = rec
    return "".join(text), final


def loads_metric(metrics: str, model: str) -> float:
    m = re.search(rf'modeld_engine_loads_total\{{model="{model}",result="ok"\}} ([0-9.]+)', metrics)
    return float(m.group(1)) if m else 0.0


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def test_lazy_load_and_cold_burst_makes_one_runner(clean_env: Path) -> None:
    """No engine until the first request; 50 concurrent cold requests load exactly one."""
    async with running_daemon(settings_for(clean_env)) as d, d.client() as c:
        assert (await c.request("GET", "/api/engines"))["engines"] == []
        results = await asyncio.gather(
            *(generate(c, model="tiny-text", prompt=f"hi {i}") for i in range(50))
        )
        assert all(final["done"] and final["tokens"] == 8 for _, final in results)
        engines = (await c.request("GET", "/api/engines"))["engines"]
        assert len(engines) == 1 and engines[0]["requests"] == 50
        assert loads_metric(await c.request("GET", "/metrics"), "tiny-text") == 1.0
        t = results[0][1]["timings"]
        assert set(t) >= {"load", "queue", "prefill", "first_token", "total"}
        assert t["total"] >= t["first_token"] > 0


async def test_budget_two_of_three_evicts_lru_idle(clean_env: Path) -> None:
    """With a budget for two engines, the third load evicts the least recently used idle one."""
    settings = settings_for(clean_env)
    # Measure with all three loaded: PSS of the shared runtime pages is split between the
    # runners, so this is the smallest each one reserves; two of them fit in 2.6 times it.
    async with running_daemon(settings) as d, d.client() as c:
        for model in ("tiny-text", "tiny-text-b", "vision-cpu-ok"):
            await generate(c, model=model, prompt="x")
        await asyncio.sleep(1.5)  # the watcher has measured every runner by now
        one = max(e["reserved"] for e in (await c.request("GET", "/api/engines"))["engines"])
    budget = int(one * 2.6)
    settings = settings.model_copy(update={"memory_budget": budget})
    async with running_daemon(settings) as d, d.client() as c:
        for model in ("tiny-text", "tiny-text-b", "tiny-text", "vision-cpu-ok"):
            await generate(c, model=model, prompt="x")
            doc = await c.request("GET", "/api/engines")
            real = sum(_pss(e["pid"]) for e in doc["engines"]) + _pss(doc["spare"]["pid"])
            assert doc["used"] <= budget and real <= budget
        doc = await c.request("GET", "/api/engines")
        loaded = {e["model"] for e in doc["engines"]}
        assert {"tiny-text", "vision-cpu-ok"} <= loaded
        assert doc["max_used"] <= budget
        # Only the least recently used idle engine may have gone. (Whether it had to go
        # depends on how other processes on the host share the runtime's pages: usually it
        # does; either way the budget above held.)
        evicted = {ev["engine"] for ev in doc["recent_evictions"]}
        assert evicted <= {"tiny-text-b:cpu"}
        assert bool(evicted) == ("tiny-text-b" not in loaded)


def _pss(pid: int | None) -> int:
    from modeld.runner import read_memory

    return read_memory(pid)[0] if pid else 0


async def test_keep_alive_expiry_and_explicit_load_unload(clean_env: Path) -> None:
    """A short keep-alive stops the engine when idle; load/unload work on request."""
    async with running_daemon(settings_for(clean_env)) as d, d.client() as c:
        await generate(c, model="tiny-text", prompt="x", keep_alive="1s")
        assert len((await c.request("GET", "/api/engines"))["engines"]) == 1
        await asyncio.sleep(1.6)
        assert (await c.request("GET", "/api/engines"))["engines"] == []
        view = await c.request("POST", "/api/engines", {"model": "tiny-text", "pin": True})
        assert view["state"] == "ready" and view["pinned"] and view["pss"] > 0
        out = await c.request("DELETE", "/api/engines/tiny-text")
        assert [e["id"] for e in out["unloaded"]] == ["tiny-text:cpu"]
        assert (await c.request("GET", "/api/engines"))["engines"] == []


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
async def test_runner_killed_mid_request(clean_env: Path, sig: signal.Signals) -> None:
    """kill -9 / SIGSEGV of a runner mid-request: engine_crashed, daemon fine, next one reloads."""
    async with running_daemon(settings_for(clean_env)) as d, d.client() as c:
        view = await c.request("POST", "/api/engines", {"model": "tiny-text"})
        pid = view["pid"]
        os.kill(pid, signal.SIGSTOP)  # the request is surely inside the runner when it dies
        task = asyncio.ensure_future(generate(c, model="tiny-text", prompt="x", max_tokens=50))
        await asyncio.sleep(0.3)
        os.kill(pid, sig)
        os.kill(pid, signal.SIGCONT)
        with pytest.raises(EngineCrashed) as info:
            await task
        assert sig.name in info.value.message and "tiny-text" in info.value.message
        assert (await c.health())["status"] == "ok"
        _, final = await generate(c, model="tiny-text", prompt="again")
        assert final["done"]
        new = (await c.request("GET", "/api/engines"))["engines"][0]
        assert new["pid"] != pid and "crashed" in (new["last_eviction"] or "")


async def test_vision_cpu_on_gpu_only_encoder_is_refused_before_any_runner(
    clean_env: Path,
) -> None:
    """Gemma-3n-like with an image and vision=cpu is refused; no engine is created."""
    buf = io.BytesIO()
    Image.new("RGB", (1200, 800), "red").save(buf, format="PNG")
    image = base64.b64encode(buf.getvalue()).decode()
    async with running_daemon(settings_for(clean_env)) as d, d.client() as c:
        with pytest.raises(BackendConstraint) as info:
            await generate(c, model="gemma3n-like", prompt="what is this?", images=[image])
        assert "vision" in info.value.message and "gpu" in info.value.message
        assert (await c.request("GET", "/api/engines"))["engines"] == []
        assert loads_metric(await c.request("GET", "/metrics"), "gemma3n-like") == 0.0
        # Text only on the same file is fine: vision is not loaded, so not checked.
        _, final = await generate(c, model="gemma3n-like", prompt="hi")
        assert final["done"]


async def test_json_format_final_record_classifies(clean_env: Path) -> None:
    """format=json uses constrained decoding and classifies the output in the final record."""
    async with running_daemon(settings_for(clean_env)) as d, d.client() as c:
        text, final = await generate(c, model="tiny-text", prompt="json", format="json")
        assert final["json"]["raw"] == text
        assert final["json"]["status"] in ("complete", "truncated", "not_json", "empty")
        assert final["constrained"] is True


async def test_default_gpu_falls_back_to_cpu_after_failed_probe(clean_env: Path) -> None:
    """With main=gpu (the default) on a GPU-less host, the probe fails and cpu is used."""
    async with running_daemon(settings_for(clean_env, main_backend="gpu")) as d, d.client() as c:
        _, final = await generate(c, model="tiny-text", prompt="x")
        assert final["engine"] == "tiny-text:cpu"
        engine = (await c.request("GET", "/api/engines"))["engines"][0]
        assert engine["plan"]["fell_back"] is True


def test_cli_run_and_daemon_kill_leaves_no_runner(short_tmp: Path) -> None:
    """`modeld run` streams tokens and timings; kill -9 of the daemon leaves no runner."""
    home, registry = setup_home(short_tmp)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(registry)))
    d.start()
    try:
        out = d.cli("run", "tiny-text", "hello", "--max-tokens", "6")
        assert out.returncode == 0, out.stderr
        assert "6 tokens" in out.stderr and "first_token" in out.stderr
        doc = d.cli_json("run", "tiny-text", "hello", "--max-tokens", "4")
        assert doc["tokens"] == 4 and doc["done"]
        ps = d.cli_json("ps")
        pids = [e["pid"] for e in ps["engines"]] + [ps["spare"]["pid"]]
        pids = [p for p in pids if p]
        assert pids and all(_alive(p) for p in pids)
        assert d.cli("unload", "nope").returncode == 1
    finally:
        d.stop(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), json.dumps(pids)
