"""State dirs and registries for tests: entries, installed fixtures, the real store."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from modeld.config import Settings, load_settings
from modeld.store.store import Store, sha256_file

REPO = Path(__file__).resolve().parent.parent.parent
MODELS = REPO / "tests" / "models"


@functools.cache
def model_head() -> bytes:
    """A LiteRT-LM file of one small LlmMetadata section (built once per process)."""
    from litert_lm_builder import litertlm_builder as lb
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    with tempfile.TemporaryDirectory() as d:
        meta, out = Path(d) / "meta.pb", Path(d) / "head.litertlm"
        msg = llm_metadata_pb2.LlmMetadata()
        msg.max_num_tokens = 64
        meta.write_bytes(msg.SerializeToString())
        builder = lb.LitertLmFileBuilder()
        builder.add_llm_metadata(str(meta))
        with out.open("wb") as f:
            builder.build(f)
        return out.read_bytes()


def model_bytes(size: int, seed: int) -> bytes:
    """``size`` bytes of a file a pull installs: a small LiteRT-LM header (a pull refuses a
    file that is not one), then random bytes from ``seed``."""
    head = model_head()
    assert size >= len(head), f"a model file is at least {len(head)} bytes"
    return head + random.Random(seed).randbytes(size - len(head))


def write_entry(
    registry: Path,
    model_id: str,
    *,
    size: int,
    sha256: str | None = None,
    urls: list[str] | None = None,
    extra: str = "",
) -> Path:
    """Write ``registry/<model_id>.toml``; URLs default to a dead loopback port (no download)."""
    import json as _json

    registry.mkdir(parents=True, exist_ok=True)
    urls = urls or [f"http://127.0.0.1:9/{model_id}.litertlm"]
    lines = [
        f'id = "{model_id}"',
        f'display_name = "{model_id}"',
        f'file_name = "{model_id}.litertlm"',
        f"urls = {_json.dumps(urls)}",
        f"size = {size}",
    ]
    if sha256 is not None:
        lines.append(f'sha256 = "{sha256}"')
    path = registry / f"{model_id}.toml"
    # Write then rename, so a live-reloading catalog never reads half a file.
    tmp = registry / f".{model_id}.toml.tmp"
    tmp.write_text("\n".join(lines) + "\n" + extra)
    tmp.replace(path)
    return path


def install_fixture(
    home: Path,
    model_id: str,
    path: Path,
    *,
    verified_by: str | None = "registry sha256",
    registry: Path | None = None,
) -> Any:
    """Install a copy of ``path`` as ``model_id`` into the state dir ``home``, as a pull would.

    Runs the real Store on its own event loop in a thread, so it works from sync and async
    tests alike, BEFORE the daemon starts (one daemon per state dir). With ``registry``,
    also writes a matching entry (real size and sha256). Returns the ``Installed`` record.
    """
    import threading

    digest, size = sha256_file(path)
    if registry is not None:
        write_entry(registry, model_id, size=size, sha256=digest)
    staged = home / "partial" / f"fixture-{model_id}"
    staged.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, staged)
    result: list[Any] = []

    async def go() -> None:
        async with open_store(home) as store:
            result.append(await store.install(model_id, staged, digest, size, verified_by))

    def run_it() -> None:
        try:
            asyncio.run(go())
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=run_it)
    t.start()
    t.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


@contextlib.asynccontextmanager
async def open_store(home: Path) -> AsyncIterator[Store]:
    """The real ``Store`` of ``home``, opened, and closed afterwards (no daemon running)."""
    store = Store(home)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def registry_settings(home: Path, registry: Path, **extra: Any) -> Settings:
    """Settings for a daemon on ``home`` with the ``registry`` dir, on the CPU backend."""
    values: dict[str, Any] = {"main_backend": "cpu", **extra}
    return load_settings(home=home, socket=home / "modeld.sock", registry=[registry], **values)
