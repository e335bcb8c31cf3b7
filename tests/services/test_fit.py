"""Fit before download, through a real daemon: entries whose sizes straddle a small budget.

The budget is set between the estimates of a small and a big entry (computed with the
engine pool's own formula), and loopback mirrors count every request they get: a pull
that can never fit must be refused before the first one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modeld.client import AsyncClient
from modeld.config import load_settings
from modeld.engine.engines import DEFAULT_MAX_TOKENS, estimate_from_size
from modeld.errors import OverBudget
from tests.support.daemon import InProcessDaemon, running_daemon
from tests.support.mirror import Faults, Mirror
from tests.support.state import MODELS, install_fixture, model_bytes, write_entry
from tests.support.wait import until

SMALL = model_bytes(256 * 1024, 3)
BIG = model_bytes(2 * 1024 * 1024, 4)
NEEDS_SMALL = estimate_from_size(len(SMALL), DEFAULT_MAX_TOKENS)
NEEDS_BIG = estimate_from_size(len(BIG), DEFAULT_MAX_TOKENS)
BUDGET = (NEEDS_SMALL + NEEDS_BIG) // 2


@dataclass
class Env:
    daemon: InProcessDaemon
    small: Mirror
    big: Mirror

    def client(self) -> AsyncClient:
        return self.daemon.client()


@pytest.fixture
async def env(clean_env: Path) -> AsyncIterator[Env]:
    """Entries ``small`` (fits), ``big`` (never fits), ``big-v`` (big, with variants)."""
    assert NEEDS_SMALL < BUDGET < NEEDS_BIG
    home, registry = clean_env / "home", clean_env / "registry"
    small = await Mirror(SMALL, Faults(throttle=4_000_000)).start()
    big = await Mirror(BIG, Faults(throttle=4_000_000)).start()
    sha = {d: hashlib.sha256(d).hexdigest() for d in (SMALL, BIG)}
    write_entry(registry, "small", size=len(SMALL), sha256=sha[SMALL], urls=[small.url])
    write_entry(registry, "big", size=len(BIG), sha256=sha[BIG], urls=[big.url])
    write_entry(
        registry,
        "big-v",
        size=len(BIG),
        sha256=sha[BIG],
        urls=[big.url],
        extra='variants = ["gone", "big", "small"]\n',
    )
    install_fixture(home, "tiny", MODELS / "tiny-text.litertlm", registry=registry)
    settings = load_settings(
        home=home,
        socket=home / "modeld.sock",
        registry=[registry],
        main_backend="cpu",
        memory_budget=BUDGET,
        piece_size="64KiB",
    )
    try:
        async with running_daemon(settings) as d:
            yield Env(d, small, big)
    finally:
        await small.stop()
        await big.stop()


async def _pull(c: AsyncClient, model_id: str, **body: Any) -> list[dict[str, Any]]:
    return [r async for r in c.stream("POST", f"/api/models/{model_id}/pull", body)]


async def test_a_pull_that_never_fits_is_refused_before_any_byte(env: Env) -> None:
    """over_budget with both figures and the fixes; the mirror never hears of it."""
    async with env.client() as c:
        with pytest.raises(OverBudget) as info:
            await _pull(c, "big")
        with pytest.raises(OverBudget):
            await c.request("POST", "/api/models/big/pull", {"detach": True})
        downloads = await c.request("GET", "/api/downloads")
    message = info.value.message
    assert "MODELD_MEMORY_BUDGET" in message and "--force" in message
    assert info.value.details["needs"] == NEEDS_BIG
    assert info.value.details["budget"] == BUDGET
    assert env.big.requests == []
    assert downloads["downloads"] == []
    assert not list((env.daemon.settings.home / "partial").glob("big*"))


async def test_list_and_show_say_whether_each_entry_fits(env: Env) -> None:
    """Entry figures before a download, the file's header once installed."""
    async with env.client() as c:
        listing = await c.request("GET", "/api/models")
        shown = await c.request("GET", "/api/models/big")
    fits = {m["id"]: m["fit"] for m in listing["models"]}
    assert (fits["small"]["fits"], fits["big"]["fits"]) == (True, False)
    assert fits["big"] == {
        "model": "big",
        "fits": False,
        "needs": NEEDS_BIG,
        "budget": BUDGET,
        "source": "entry",
        "max_tokens": DEFAULT_MAX_TOKENS,
    }
    # Installed: its sections and its header's token window, not the whole file and 4096.
    assert fits["tiny"]["source"] == "file"
    assert fits["tiny"]["max_tokens"] == 256
    assert fits["tiny"]["fits"] is True
    assert shown["fit"] == fits["big"]
    assert env.big.requests == []


async def test_pull_with_variants_takes_the_largest_that_fits(env: Env) -> None:
    """big-v does not fit; of its variants (one unknown, big, small) only small does."""
    async with env.client() as c:
        records = await _pull(c, "big-v")
        installed = await c.request("GET", "/api/models/small")
    choice = records[0]["choice"]
    assert (choice["asked"], choice["chosen"]) == ("big-v", "small")
    assert "over the memory budget" in choice["reason"] and "small" in choice["reason"]
    assert choice["fit"]["needs"] == NEEDS_SMALL
    assert records[-1]["state"] == "installed" and records[-1]["id"] == "small"
    assert records[-1]["choice"] == choice
    assert installed["state"] == "installed"
    assert env.big.requests == []
    assert env.small.requests


async def test_a_pull_that_joins_the_download_says_its_choice_too(env: Env) -> None:
    """A pull of a model whose download runs joins it, and says what was chosen as the pull
    that started it does."""
    env.small.faults.throttle = 200_000  # 1.3 s for the file: the second pull joins it
    async with env.client() as a, env.client() as b:
        first = asyncio.create_task(_pull(a, "small"))

        async def running() -> bool:
            return bool((await b.request("GET", "/api/downloads"))["downloads"])

        await until(running)
        second = await _pull(b, "small")
        for records in (await first, second):
            assert records[-1]["state"] == "installed"
            assert records[-1]["choice"]["chosen"] == "small", records[-1]


async def test_force_downloads_anyway(env: Env) -> None:
    """--force pulls the model that cannot fit, and says so in its records."""
    async with env.client() as c:
        records = await _pull(c, "big", force=True)
    assert records[-1]["state"] == "installed"
    assert records[0]["choice"]["reason"] == "forced (--force)"
    assert records[0]["choice"]["fit"]["fits"] is False
    assert env.big.requests


async def _cli(env: Env, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "modeld",
        "--socket",
        str(env.daemon.settings.socket_path),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200"},
    )
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_cli_pull_refusal_and_list(env: Env) -> None:
    """`modeld pull big` exits 1 with the figures on stderr; `list` says which fit."""
    code, _, err = await _cli(env, "pull", "big")
    assert code == 1
    assert "can never load here" in err and "--force" in err
    code, out, _ = await _cli(env, "list")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert "no" in rows["big"] and "yes" not in rows["big"]
    assert "yes" in rows["small"]
    assert env.big.requests == []
