"""``/metrics`` reports downloads, the engine pool and requests, fed by a real pull and generate."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modeld.client import AsyncClient
from modeld.config import load_settings
from modeld.store.store import sha256_file
from tests.support.daemon import running_daemon
from tests.support.mirror import Faults, start_mirrors
from tests.support.state import write_entry

MODEL = Path(__file__).resolve().parent / "models" / "tiny-text.litertlm"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(socket: Path) -> Samples:
    """Every sample of ``/metrics`` by (name, sorted labels)."""
    transport = httpx.AsyncHTTPTransport(uds=str(socket))
    async with httpx.AsyncClient(transport=transport) as http:
        text = (await http.get("http://modeld/metrics")).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over every label set that includes ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


async def until(socket: Path, check: Any, within: float = 10.0) -> Samples:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        samples = await scrape(socket)
        if check(samples) or asyncio.get_running_loop().time() > deadline:
            return samples
        await asyncio.sleep(0.1)


async def generate(c: AsyncClient, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny-text", "prompt": "hi", "max_tokens": 8, **body}
    final: dict[str, Any] = {}
    async for rec in c.stream("POST", "/api/modeld/generate", body):
        if "token" not in rec:
            final = rec
    return final


@pytest.fixture
async def pulled(clean_env: Path) -> Any:
    """A daemon whose registry points at a test mirror that drops once and is throttled."""
    data = MODEL.read_bytes()
    # Dropped once after 100 kB (an error of class "transient"), then 250 kB/s: the pull
    # lasts long enough (> 0.5 s) for a per-mirror speed to be measured.
    (mirror,) = await start_mirrors(
        data, Faults(throttle=250_000, drop_after=100_000, drop_times=1)
    )
    registry = clean_env / "registry"
    digest, size = sha256_file(MODEL)
    write_entry(registry, "tiny-text", size=size, sha256=digest, urls=[mirror.url])
    home = clean_env / "home"
    settings = load_settings(
        home=home, socket=home / "modeld.sock", registry=[registry], main_backend="cpu"
    )
    try:
        async with running_daemon(settings) as d:
            yield d, mirror, registry
    finally:
        await mirror.stop()


async def test_pull_feeds_download_metrics(pulled: Any) -> None:
    """A real pull counts bytes per mirror, the mirror's speed, its errors by class, active,
    and the pull's end by its result."""
    d, mirror, registry = pulled
    label = f"127.0.0.1:{mirror.port}"
    before = await scrape(d.settings.socket_path)
    assert value(before, "modeld_download_errors_total", mirror=label, kind="transient") == 0
    assert value(before, "modeld_pulls_total", result="installed") == 0
    assert value(before, "modeld_pulls_total", result="failed") == 0
    async with d.client() as c:
        records = [r async for r in c.stream("POST", "/api/models/tiny-text/pull", {})]
    assert records[-1]["state"] == "installed", records[-1]
    # The job leaves the active set when its task has ended, a moment after it told its
    # waiters "installed": wait for that event, not for the reply.
    after = await until(d.settings.socket_path, lambda s: value(s, "modeld_downloads_active") == 0)
    assert value(after, "modeld_downloads_active") == 0
    assert value(after, "modeld_download_bytes_total", mirror=label) >= MODEL.stat().st_size
    assert value(after, "modeld_download_errors_total", mirror=label, kind="transient") >= 1
    assert value(after, "modeld_download_mirror_bytes_per_second", mirror=label) > 0
    assert ("modeld_download_repaired_pieces_total", ()) in after
    # The pull's end is counted by its result (once its job is done, just after its record).
    ended = await until(
        d.settings.socket_path, lambda s: value(s, "modeld_pulls_total", result="installed") >= 1
    )
    assert value(ended, "modeld_pulls_total", result="installed") == 1
    # A registry file that does not validate is counted (live reload, no restart).
    (registry / "broken.toml").write_text('id = "broken"\nsize = "big"\n')
    samples = await until(d.settings.socket_path, lambda s: value(s, "modeld_registry_errors") >= 1)
    assert value(samples, "modeld_registry_errors") == 1


async def test_generate_feeds_pool_and_request_metrics(pulled: Any) -> None:
    """Loads, PSS, budget, phase timings, tokens, latency; then a crash and an eviction."""
    d, _, _ = pulled
    sock = d.settings.socket_path
    async with d.client() as c:
        async for _ in c.stream("POST", "/api/models/tiny-text/pull", {}):
            pass
        final = await generate(c)
        assert final["done"] and final["tokens"] >= 1
        # PSS is measured off the request path, and a request is counted once its handler
        # has returned, after the client read the last record: wait for both.
        samples = await until(
            sock,
            lambda s: (
                value(s, "modeld_engine_pss_bytes", engine="tiny-text:cpu") > 0
                and value(s, "modeld_http_request_seconds_count", route="/api/generate") == 1
            ),
        )
        assert value(samples, "modeld_engine_loads_total", model="tiny-text", result="ok") == 1
        assert value(samples, "modeld_engine_pss_bytes", engine="tiny-text:cpu") > 0
        assert value(samples, "modeld_memory_budget_used_bytes") > 0
        assert value(samples, "modeld_memory_budget_bytes") > 0
        for phase in ("load", "queue", "prefill", "first_token", "total"):
            assert value(samples, "modeld_generate_phase_seconds_count", phase=phase) >= 1, phase
        assert value(samples, "modeld_generated_tokens_total", model="tiny-text") >= 1
        assert (
            value(samples, "modeld_http_request_seconds_count", route="/api/modeld/generate") == 1
        )
        assert total(samples, "modeld_http_requests_total", route="/api/modeld/generate") == 1

        # A runner killed from outside is a crash, counted by model and signal.
        pid = (await c.request("GET", "/api/engines"))["engines"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        samples = await until(
            sock, lambda s: total(s, "modeld_engine_crashes_total", model="tiny-text") >= 1
        )
        assert (
            value(samples, "modeld_engine_crashes_total", model="tiny-text", signal="SIGKILL") == 1
        )
        await generate(c)
        await c.request("DELETE", "/api/engines/tiny-text")
    samples = await scrape(sock)
    assert value(samples, "modeld_engine_loads_total", model="tiny-text", result="ok") == 2
    assert value(samples, "modeld_engine_evictions_total", reason="unloaded") >= 1


async def test_queue_depth_and_create_decode_phases(pulled: Any) -> None:
    """Requests queued on a busy engine show in the queue gauge; create and decode are timed."""
    d, _, _ = pulled
    sock = d.settings.socket_path
    seen = 0.0
    async with d.client() as c:
        async for _ in c.stream("POST", "/api/models/tiny-text/pull", {}):
            pass
        tasks = [asyncio.ensure_future(generate(c, max_tokens=64)) for _ in range(8)]
        while not all(t.done() for t in tasks):
            seen = max(seen, value(await scrape(sock), "modeld_queue_depth", model="tiny-text"))
            await asyncio.sleep(0.005)  # sampling a gauge while the requests run, not waiting
        await asyncio.gather(*tasks)
    samples = await scrape(sock)
    assert seen >= 1
    assert value(samples, "modeld_queue_depth", model="tiny-text") == 0
    assert value(samples, "modeld_generate_phase_seconds_count", phase="engine_create") == 1
    assert value(samples, "modeld_generate_phase_seconds_count", phase="decode") == 8
