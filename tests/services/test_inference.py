"""``modeld.services.inference``: preparing, admitting and running generation requests, and
loads, on the real parts of a ``Root`` (the real runtime on the tiny fixture models)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from PIL import Image

from modeld.daemon.root import Root
from modeld.errors import (
    BackendConstraint,
    BadRequest,
    ContextLengthExceeded,
    ModeldError,
    ModelNotInstalled,
    TooLarge,
)
from modeld.services.inference import (
    PROMPT_BYTES_PER_TOKEN,
    Final,
    Generation,
    Options,
    Token,
    Turn,
)
from modeld.services.parts import Services
from tests.support.state import MODELS, install_fixture, registry_settings, write_entry
from tests.support.wait import wait_until

TINY = MODELS / "tiny-text.litertlm"
GEMMA3N = MODELS / "gemma3n-like.litertlm"


@pytest.fixture
async def started(clean_env: Path) -> AsyncIterator[Services]:
    """A started ``Root`` with tiny-text and gemma3n-like installed, ``absent`` not."""
    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    install_fixture(home, "gemma3n-like", GEMMA3N, registry=registry)
    write_entry(registry, "absent", size=123, sha256="a" * 64)
    async with Root(registry_settings(home, registry), spare=False) as services:
        yield services


def _png(width: int = 1280, height: int = 320) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


async def test_check_refuses_the_request_before_any_engine(started: Services) -> None:
    """The last turn must be the user's, images within the entry's limit, keep_alive valid."""
    inference = started.inference
    with pytest.raises(BadRequest, match="role user"):
        inference.check(Generation("tiny-text", [Turn("assistant", "hi")]))
    two = [Turn("user", "look", [_png(), _png()])]
    with pytest.raises(TooLarge, match="at most 1"):
        inference.check(Generation("tiny-text", two))
    with pytest.raises(BadRequest):
        inference.check(Generation("tiny-text", [Turn("user", "hi")], keep_alive="x"))
    assert inference.check(Generation("tiny-text", [Turn("user", "hi")], keep_alive="30s")) == 30
    assert started.pool.list() == []


async def test_prepare_reencodes_images_into_the_runners_job(started: Services) -> None:
    """An image reaches the job as a JPEG at most 640 px on its long side, text kept."""
    gen = Generation("tiny-text", [Turn("user", "what is it?", [_png()])])
    prepared = await started.inference.prepare(gen)
    assert prepared.image_prepare > 0
    content = prepared.job.messages[0]["content"]
    assert isinstance(content, list) and content[0] == {"type": "text", "text": "what is it?"}
    assert content[1]["type"] == "image"
    with Image.open(io.BytesIO(base64.b64decode(content[1]["blob"]))) as img:
        assert img.format == "JPEG" and max(img.size) == 640


async def test_admit_refuses_before_any_runner_starts(started: Services) -> None:
    """Not installed, a vision encoder that needs gpu with vision=cpu, or a prompt far over
    the engine's window: refused, and no engine started."""
    with pytest.raises(ModelNotInstalled, match="modeld pull absent"):
        await started.inference.admit(Generation("absent", [Turn("user", "hi")]))
    images = Generation("gemma3n-like", [Turn("user", "see", [_png()])])
    with pytest.raises(BackendConstraint):
        await started.inference.admit(images)
    text = Generation("tiny-text", [Turn("user", "hi")])
    window = (await started.inference.admit(text)).max_tokens
    huge = Generation("tiny-text", [Turn("user", "x" * (window * PROMPT_BYTES_PER_TOKEN + 1))])
    with pytest.raises(ContextLengthExceeded, match="over"):
        await started.inference.admit(huge)
    assert started.pool.list() == []


async def test_generate_streams_tokens_then_the_final_record(started: Services) -> None:
    """A text request on the real runtime: token records, then one final record with timings."""
    gen = Generation("tiny-text", [Turn("user", "hello")], Options(max_tokens=3))
    engine_id, records = await started.inference.generate(gen, may_shorten_keep_alive=True)
    out = [r async for r in records]
    final = out[-1]
    assert isinstance(final, Final) and final.engine == engine_id
    assert final.result.tokens == 3
    assert all(isinstance(r, Token) for r in out[:-1])
    assert [v["id"] for v in (await started.inference.loaded())["engines"]] == [engine_id]
    unloaded = await started.inference.unload("tiny-text")
    assert [v["id"] for v in unloaded] == [engine_id]


async def test_a_warm_target_is_reused_until_what_it_came_from_changes(
    started: Services, clean_env: Path
) -> None:
    """The second request's target is the first's; a catalog reload, a settings change, a
    write to SQLite or a vanished file each make (or refuse) a fresh one."""
    engines = started.engines
    # The first use's last_used write goes out at once (later ones wait 30 s): let it land
    # first, behind which a write of ours completes (one writer thread, in order).
    await engines.target("tiny-text")
    await asyncio.sleep(0)
    await started.store.write(lambda conn: conn.execute("SELECT 1"))
    first = await engines.target("tiny-text")
    assert await engines.target("tiny-text") is first
    # Another request shape is its own target.
    assert await engines.target("tiny-text", backends={"main": "cpu"}) is not first

    # The entry changes on disk: the reloaded catalog's entry decides.
    digest, size = first.digest, TINY.stat().st_size
    registry = clean_env / "registry"
    write_entry(registry, "tiny-text", size=size, sha256=digest, extra="[runtime]\nthreads = 1\n")
    started.catalog.reload()
    one = await engines.target("tiny-text")
    assert one is not first
    assert (first.spec.threads, one.spec.threads) == (started.settings.cpu_threads, 1)
    assert await engines.target("tiny-text") is one

    # A setting changed in place (a SIGHUP reload does that).
    started.settings.warm_up = not started.settings.warm_up
    assert await engines.target("tiny-text") is not one
    warm = await engines.target("tiny-text")

    # Any write to SQLite (here a touch of another model's last_used) may change a row.
    await started.store.write(lambda conn: conn.execute("SELECT 1"))
    again = await engines.target("tiny-text")
    assert again is not warm
    assert again == warm

    # The runtime's link is made again if something removed it, kept target or not.
    link = Path(again.spec.path)
    link.unlink()
    assert await engines.target("tiny-text") is again
    assert link.is_symlink()

    # The file is checked every time, kept target or not: gone, the model is missing.
    installed = await started.store.installed("tiny-text")
    assert installed is not None
    installed.path.unlink()
    with pytest.raises(ModelNotInstalled, match="missing"):
        await engines.target("tiny-text")


async def test_stopping_mid_probe_reaps_the_probe_and_records_nothing(clean_env: Path) -> None:
    """A GPU probe (a runner creating the gpu engine) outlives the request that started it;
    stopping the parts kills and reaps its child, and no probe row is written for the file."""
    import psutil

    home, registry = clean_env / "home", clean_env / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)

    def runners() -> list[psutil.Process]:
        kids = psutil.Process().children(recursive=True)
        return [p for p in kids if "modeld.engine.runner.child" in " ".join(p.cmdline())]

    async with Root(registry_settings(home, registry, main_backend="gpu"), spare=False) as parts:
        request = asyncio.ensure_future(parts.engines.target("tiny-text"))
        await wait_until(lambda: bool(runners()) and not request.done())
        running = runners()
        request.cancel()  # the client left; the probe goes on
        with contextlib.suppress(asyncio.CancelledError):
            await request
        assert all(p.is_running() for p in running)
        digest = (await parts.store.installed("tiny-text")).digest  # type: ignore[union-attr]
    for p in running:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    async with Root(registry_settings(home, registry), spare=False) as parts:
        assert await parts.store.probes(digest) == {}


async def test_list_and_show_give_a_use_not_yet_written_as_last_used(started: Services) -> None:
    """Uses after the first are written to SQLite at most every 30 s; `list` and `show` give
    the latest one at once (they said the first, or "never", until the write)."""
    started.engines.touch("tiny-text")
    await asyncio.sleep(0)
    await started.store.write(lambda conn: conn.execute("SELECT 1"))  # the first write landed
    written = await started.store.installed("tiny-text")
    assert written is not None and written.last_used is not None
    await asyncio.sleep(0.01)
    started.engines.touch("tiny-text")  # a second use: its write waits
    assert (await started.store.installed("tiny-text")).last_used == written.last_used  # type: ignore[union-attr]
    listed = {m["id"]: m for m in (await started.models.listing())["models"]}
    shown = await started.models.show("tiny-text")
    for doc in (listed["tiny-text"], shown):
        assert doc["installed"]["last_used"] > written.last_used, doc["installed"]


async def test_prune_counts_a_use_not_yet_written(started: Services) -> None:
    """A use written only 30 s later (after the first) still counts for `prune --unused-for`:
    the model used a moment ago is kept, not removed as unused since the first use."""
    from modeld.services.prune import Selection

    started.engines.touch("tiny-text")
    await asyncio.sleep(0)
    await started.store.write(lambda conn: conn.execute("SELECT 1"))  # the first write landed
    await asyncio.sleep(1.2)
    started.engines.touch("tiny-text")  # a second use: its write waits 30 s
    doc = await started.remover.prune(Selection(unused_for=1.0), dry_run=True)
    assert "tiny-text" not in [i["id"] for i in doc["items"]], doc["items"]


async def test_only_a_request_that_was_served_counts_as_a_use(started: Services) -> None:
    """A refused request (a prompt over the window, a model not installed) leaves the
    model's last use as it was; one served, or a load, sets it."""
    inference, engines = started.inference, started.engines

    async def last_used(model_id: str) -> float | None:
        # A first use is written at once, later ones wait: let the first write start, and
        # land behind it (one writer thread, in order); a later one is still pending.
        await asyncio.sleep(0)
        await started.store.write(lambda conn: conn.execute("SELECT 1"))
        inst = await started.store.installed(model_id)
        return engines.used_at(model_id) or (inst.last_used if inst is not None else None)

    window = (await inference.admit(Generation("tiny-text", [Turn("user", "hi")]))).max_tokens
    huge = "x" * (window * PROMPT_BYTES_PER_TOKEN + 1)
    with pytest.raises(ContextLengthExceeded):
        await inference.generate(
            Generation("tiny-text", [Turn("user", huge)]), may_shorten_keep_alive=True
        )
    with pytest.raises(ModelNotInstalled):
        await inference.generate(
            Generation("absent", [Turn("user", "hi")]), may_shorten_keep_alive=True
        )
    assert await last_used("tiny-text") is None
    gen = Generation("tiny-text", [Turn("user", "hello")], Options(max_tokens=2))
    _, records = await inference.generate(gen, may_shorten_keep_alive=True)
    assert isinstance([r async for r in records][-1], Final)
    served = await last_used("tiny-text")
    assert served is not None
    await inference.unload("tiny-text")
    await inference.load(
        "gemma3n-like",
        backends=None,
        keep_alive=None,
        pin=False,
        allow_unverified=False,
        may_shorten_keep_alive=True,
    )
    assert await last_used("gemma3n-like") is not None


async def test_ready_refuses_as_a_request_would_before_its_prompt(started: Services) -> None:
    """``ready`` (what `modeld run` asks before it prompts) refuses an unknown id, a model
    not installed, images a plan cannot take, as ``generate`` does; else names the engine.
    No engine starts."""
    inference = started.inference
    for model, images in (("tiny-txt", 0), ("absent", 0), ("gemma3n-like", 1), ("tiny-text", 2)):
        gen = Generation(model, [Turn("user", "hi", [_png()] * images)])
        with pytest.raises(ModeldError) as asked:
            await inference.ready(model, images=images)
        with pytest.raises(ModeldError) as sent:
            await inference.generate(gen, may_shorten_keep_alive=True)
        assert (asked.value.code, asked.value.message) == (sent.value.code, sent.value.message)
    ready = await inference.ready("tiny-text")
    assert ready["engine"] == "tiny-text:cpu" and ready["plan"]["main"] == "cpu"
    assert started.pool.list() == []
