"""The memory budget, the estimate and a cold load on real-size models (``-m realsize``).

They need the real-size fixtures that ``tests/models/build.py --real-size`` builds into
``$MODELD_TEST_MODEL_CACHE`` (default ``~/.cache/modeld-test-models``; minutes and ~1 GB
each); each test skips, saying so, where one is missing. Not in the default run:
``.venv/bin/python -m pytest -m realsize tests/engine/test_realsize.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.config import load_settings
from modeld.engine.runner.client import Runner
from modeld.engine.runner.job import Created
from modeld.modelfile import probe as probe_mod
from modeld.modelfile.runtime import CreateSpec
from tests.support.daemon import running_daemon
from tests.support.memory import fadvise_dontneed, pss_sampler, rollup
from tests.support.state import install_fixture

pytestmark = [pytest.mark.realsize, pytest.mark.timeout(900)]

CACHE = Path(
    os.environ.get("MODELD_TEST_MODEL_CACHE", Path.home() / ".cache" / "modeld-test-models")
)
REAL_B = CACHE / "gemma3-1b-real-pattern.litertlm"
# The pattern variant stands in where only it was shipped (a GPU host builds nothing).
REAL = next(
    (p for p in (CACHE / "gemma3-1b-real.litertlm", REAL_B) if p.is_file()),
    CACHE / "gemma3-1b-real.litertlm",
)
HAS_GPU = Path("/dev/dri").exists() or Path("/dev/nvidia0").exists()
# About 1,100 words of prompt: 1,500 tokens or so, a long context for the 4,096 window.
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog, and the sea is calm."] * 85)


def cached(*paths: Path) -> None:
    """Skip the test where a real-size fixture is not built."""
    for path in paths:
        if not path.is_file():
            pytest.skip(
                f"{path} is not cached: build it with `.venv-models/bin/python "
                "tests/models/build.py --real-size` (docs/development.md#fixtures)"
            )


async def reply(c: AsyncClient, model: str, prompt: str, tokens: int = 8) -> dict[str, Any]:
    final: dict[str, Any] = {}
    async for rec in c.stream(
        "POST", "/api/modeld/generate", {"model": model, "prompt": prompt, "max_tokens": tokens}
    ):
        if rec.get("done"):
            final = rec
    return final


def settings(root: Path, models: dict[str, Path], **kw: Any) -> Any:
    home, registry = root / "home", root / "registry"
    for name, path in models.items():
        install_fixture(home, name, path, registry=registry)
    kw.setdefault("main_backend", "cpu")
    return load_settings(home=home, socket=home / "modeld.sock", registry=[registry], **kw)


async def test_estimate_holds_the_measured_peak_within_its_bound(clean_env: Path) -> None:
    """The pool's estimate before the first load of a real-size model is within 15 % of the
    peak PSS its runner reaches over a reply and a long prompt, never more than 15 % under;
    the peak is learned (SQLite) and the view shows it at once."""
    cached(REAL)
    s = settings(clean_env, {"real": REAL})
    async with running_daemon(s) as d, d.client() as c:
        view = await c.request("POST", "/api/engines", {"model": "real"})
        estimate, pid = view["pss_file_estimate"], view["pid"]
        assert (await reply(c, "real", "Tell me a story."))["done"]
        first = rollup(pid)["Pss"]
        long = await reply(c, "real", LONG_PROMPT)
        assert long["prompt_tokens"] > 1000, long
        peak = max(first, rollup(pid)["Pss"])
        await asyncio.sleep(1.5)  # a watcher round, which learns what it read
        view = (await c.request("GET", "/api/engines"))["engines"][0]
    assert 0.85 <= estimate / peak <= 1.15, (estimate, peak)
    with contextlib.closing(sqlite3.connect(s.home / "modeld.db")) as db:
        (learned,) = db.execute("SELECT pss FROM memory").fetchone()
    assert learned == pytest.approx(peak, rel=0.05)
    assert view["pss_learned"] == learned


async def test_two_real_size_models_under_a_budget_that_holds_one(clean_env: Path) -> None:
    """With a budget that holds one real-size engine, requests that alternate between two
    models each evict the other: the runners' PSS never sums past the budget, every reply
    completes, and no runner ends but by the pool's eviction."""
    cached(REAL, REAL_B)
    budget = int(REAL.stat().st_size * 2.1)
    s = settings(clean_env, {"real": REAL, "real-b": REAL_B}, memory_budget=budget)
    async with running_daemon(s) as d, d.client() as c:
        async with pss_sampler(c) as seen:
            for model in ("real", "real-b", "real", "real-b"):
                assert (await reply(c, model, "Tell me a story."))["finish"] in ("stop", "length")
        doc = await c.request("GET", "/api/engines")
    assert 0 < seen[0] <= budget, (seen[0], budget)
    assert doc["max_used"] <= budget
    reasons = [ev["reason"] for ev in doc["recent_evictions"]]
    assert len(reasons) == 3 and all(r.startswith("evicted to load") for r in reasons), reasons


async def test_cold_load_after_the_page_cache_is_dropped(clean_env: Path) -> None:
    """With the model's and its XNNPACK cache's pages dropped from the page cache, a load
    reads them from disk again and the engine answers."""
    cached(REAL)
    s = settings(clean_env, {"real": REAL})
    async with running_daemon(s) as d, d.client() as c:
        await c.request("POST", "/api/engines", {"model": "real"})  # builds the XNNPACK cache
        await c.request("DELETE", "/api/engines/real")
        await asyncio.to_thread(fadvise_dontneed, [REAL, s.home / "cache", s.home / "blobs"])
        view = await c.request("POST", "/api/engines", {"model": "real"})
        assert view["state"] == "ready" and view["create_seconds"] > 0
        final = await reply(c, "real", "Tell me a story.")
    assert final["done"] and final["tokens"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU device on this host")
async def test_first_gpu_load_creates_its_engine_once(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first gpu load of a real-size model creates its gpu engine once: the runner that
    found out the GPU works is the engine's runner, and no probe child runs."""
    cached(REAL)
    created: list[tuple[int, str]] = []
    real_create = Runner.create

    async def create(self: Runner, spec: CreateSpec) -> Created:
        created.append((self.pid, spec.backend))
        return await real_create(self, spec)

    async def no_probe_child(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the GPU probe ran a child")

    monkeypatch.setattr(Runner, "create", create)
    monkeypatch.setattr(probe_mod, "probe_spec", no_probe_child)
    s = settings(clean_env, {"real": REAL}, main_backend="gpu")
    async with running_daemon(s) as d, d.client() as c:
        view = await c.request("POST", "/api/engines", {"model": "real"})
        final = await reply(c, "real", "Tell me a story.")
    assert view["plan"]["main"] == "gpu", view
    assert created == [(view["pid"], "gpu")]
    assert final["done"] and final["engine"] == "real:gpu"
