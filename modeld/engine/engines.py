"""From a model id to an engine ``Target``: install check, header, plan, probe, memory estimate.

This is the glue between the catalog/store, the plan resolver and the pool; the pool itself
knows nothing of models. Plans are resolved here only (``Engines.plan``): for a load or a
request (``target``) and for ``show`` (``plans``). The daemon's composition root
(``modeld.daemon.root``) builds the pool and hands it in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from modeld import logs
from modeld.catalog.catalog import Catalog, Entry
from modeld.config import Settings
from modeld.engine.pool import Pool, Target
from modeld.engine.runner.client import RunnerDied, RunnerError
from modeld.engine.runner.job import Created
from modeld.engine.types import Journal
from modeld.errors import (
    CorruptModel,
    ImageProbeFailed,
    ModeldError,
    ModelNotInstalled,
    NotEmbeddingModel,
    NotTextModel,
    RuntimeTooOld,
    Unverified,
)
from modeld.hostinfo import RUNTIME_PACKAGE, at_least, runtime_version
from modeld.modelfile.header import Kind, ModelInfo, read_header
from modeld.modelfile.plan import Plan, Prefs, needs_probe, resolve
from modeld.modelfile.probe import ProbeResult, extract_adapter, extract_reason
from modeld.modelfile.runtime import CreateSpec
from modeld.store.scan import sha256_file
from modeld.store.store import Installed, Store

# (model id, digest) -> what can make that install verified (``services.verification``).
ExplainUnverified = Callable[[str, str], Awaitable[str]]

MiB = 1024 * 1024
# PSS of a runner with the runtime loaded and no engine, above what was measured (see
# docs/benchmarks.md#engine-memory); a spare runner's real PSS replaces it once one started.
RUNNER_BASE = 48 * MiB
# What an engine allocates whatever its weights (tokenizer, executor, XNNPACK arenas and
# thread pool). Weights are mmapped and only count once touched, so the first generation is
# what brings them in (docs/benchmarks.md#engine-memory).
ENGINE_OVERHEAD = 16 * MiB
_VISION_TYPES = ("tf_lite_vision_encoder", "tf_lite_vision_adapter")
_AUDIO_TYPES = ("tf_lite_audio_encoder_hw", "tf_lite_audio_adapter")
# Beside the weights (XNNPACK's packed copy, mapped from its cache file, is about the
# decoder's size), a CPU engine holds anonymous memory that grows with the decoder: the
# prefill's logits and activation arenas, and, on the first load of a file, the buffers
# XNNPACK packed the weights in, which the allocator keeps. Counted as this fraction of
# the decoder's weights; fitted on the real-size models (docs/benchmarks.md#real-size-models).
_RUNTIME_FRACTION = 0.6
# KV cache per token, as a fraction of the main weights: a rough rule (what it gives a real
# decoder: docs/benchmarks.md#engine-memory). It only decides the first load: after one
# run the measured peak PSS for (digest, plan, max_tokens) replaces the whole estimate.
_KV_FRACTION_PER_TOKEN = 1 / 40_000
_KV_MIN_PER_TOKEN = 2048
DEFAULT_MAX_TOKENS = 4096
TOUCH_INTERVAL = 30.0  # seconds between last_used writes
# The GPU probe is the creation of a runner's gpu engine and its warm-up reply: a
# real-size model uploads its weights and compiles its shaders first, so be generous; a
# timeout is recorded as a failure.
GPU_PROBE_TIMEOUT = 300.0
# An image probe creates a whole engine and encodes an image: on a CPU plan of a
# multi-GB model the first run also builds the XNNPACK cache, which takes far longer
# than a GPU probe's text reply. A timeout is recorded as a failure, so be generous.
IMAGE_PROBE_TIMEOUT = 300.0
# A probe child's stderr kept with its result (head and tail): the runtime's GPU set-up
# and its failure both fit; a bug report quotes it.
PROBE_LOG_LIMIT = 64 * 1024


def clip_log(text: str, limit: int) -> str:
    """``text`` whole up to ``limit`` characters, else its head and tail with a marker."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped} characters left out ...]\n{text[-tail:]}"


def estimate_memory(info: ModelInfo, plan: Plan, max_tokens: int, base: int = RUNNER_BASE) -> int:
    """Bytes of PSS an engine for ``plan`` is expected to take.

    The runner's base (the runtime loaded), the engine's own overhead, the weights of the
    sections the plan loads, the runtime's memory beside the decoder's weights, and a
    KV-cache term for ``max_tokens``. Only the first load uses it: the peak measured then
    replaces it (``Engines.learned``).
    """
    weights = main = 0
    for s in info.sections:
        if s.model_type in _VISION_TYPES and plan.vision is None:
            continue
        if s.model_type in _AUDIO_TYPES and plan.audio is None:
            continue
        weights += s.size
        if s.model_type and s.model_type not in _VISION_TYPES + _AUDIO_TYPES:
            main += s.size
    return base + ENGINE_OVERHEAD + weights + _beside_weights(main, max_tokens)


def _beside_weights(main: int, max_tokens: int) -> int:
    """What an engine holds beyond its weights for a decoder of ``main`` bytes: the
    runtime's arenas and buffers, and the KV cache of ``max_tokens``."""
    kv = max_tokens * max(_KV_MIN_PER_TOKEN, int(main * _KV_FRACTION_PER_TOKEN))
    return int(main * _RUNTIME_FRACTION) + kv


def estimate_from_size(size: int, max_tokens: int, base: int = RUNNER_BASE) -> int:
    """``estimate_memory`` for a file whose header is not known yet: all of it is weights.

    Before a download only the entry's size and limits are known. Counting the whole file
    as the decoder's weights over-counts a vision or audio section a text plan leaves out
    (a few % of a Gemma file); once the header is read, ``estimate_memory`` replaces it.
    """
    return base + ENGINE_OVERHEAD + size + _beside_weights(size, max_tokens)


def entry_max_tokens(entry: Entry | None, info: ModelInfo | None, *, vision: bool = False) -> int:
    """The token window an engine of ``entry`` gets (the runner's ``max_tokens``)."""
    limits = entry.limits if entry is not None else None
    return (
        ((limits.vision_max_tokens if vision else None) if limits else None)
        or (limits.max_tokens if limits else None)
        or (info.llm_metadata.max_num_tokens if info and info.llm_metadata else None)
        or DEFAULT_MAX_TOKENS
    )


def _file_missing(model_id: str, how: str, path: Path | None = None) -> ModelNotInstalled:
    """The refusal of a model whose installed file is gone (it counts as missing); ``how``
    installs it again (``Catalog.how_to_install``)."""
    where = f" {path}" if path is not None else ""
    return ModelNotInstalled(
        f"model {model_id}: its file{where} is missing, so it no longer counts as installed; "
        f"run {how} to install it again"
    )


def error_brief(e: ModeldError) -> dict[str, Any]:
    """An error as a field of a document (``show``'s plans): its code and message."""
    return {"code": e.code, "message": e.message}


def check_runtime(model_id: str, entry: Entry | None, info: ModelInfo, runtime: str | None) -> None:
    """Refuse a file that needs a newer runtime than ``runtime`` (the installed one).

    Both the registry entry's ``min_runtime_version`` and the file's own LlmMetadata
    field count; the refusal names which one asked, and what to do.
    """
    file_needs = info.llm_metadata.min_runtime_version if info.llm_metadata else None
    for needed, where in (
        (entry.min_runtime_version if entry else None, "its registry entry's min_runtime_version"),
        (file_needs, "the file's own LlmMetadata"),
    ):
        if needed and not at_least(runtime, needed):
            have = f"{RUNTIME_PACKAGE} {runtime}" if runtime else f"no {RUNTIME_PACKAGE}"
            raise RuntimeTooOld(
                f"model {model_id} needs {RUNTIME_PACKAGE} >= {needed} ({where}); this host "
                f"has {have}. Upgrade it in modeld's environment (`pip install -U "
                f"'{RUNTIME_PACKAGE}>={needed}'`) and restart the daemon, or choose another "
                "model",
                model=model_id,
                installed=runtime,
                needed=needed,
            )


def check_kind(model_id: str, info: ModelInfo, kind: Kind) -> None:
    """Refuse a request for ``kind`` (text or embedding) of a file of the other kind."""
    if info.kind == kind:
        return
    if kind == "embedding":
        raise NotEmbeddingModel(
            f"model {model_id} is not an embedding model (it generates text: its file has a "
            "prefill/decode section); use /v1/chat/completions with it, or send an "
            "embedding model's id"
        )
    raise NotTextModel(
        f"model {model_id} is an embedding model (its file has a text encoder and no "
        "decoder), so it cannot generate text; use /v1/embeddings with it, or choose a "
        "text model"
    )


# A measured peak above this many times the file's estimate is learned only once confirmed:
# a second engine of the same file and plan (another runner) measures that much too. One
# odd runner (a runtime leak, a request that got through every bound) then cannot make the
# model refuse to load for everyone; a model that truly needs it pays one more eviction.
LEARN_CONFIRM_FACTOR = 3.0

MemoryKey = tuple[str, str, int]  # (digest, plan key, max_tokens)


class LearnedMemory:
    """The measured peaks that admission reserves instead of the estimate (``memory`` rows)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # Valid while the store's write generation is unchanged (rm, a reset write).
        self._cache: dict[MemoryKey, tuple[int, int | None]] = {}
        # A peak above LEARN_CONFIRM_FACTOR x the estimate, waiting for a second engine.
        self._unconfirmed: dict[MemoryKey, tuple[Target, int]] = {}

    async def expected(self, key: MemoryKey) -> int | None:
        generation = self.store.generation
        hit = self._cache.get(key)
        if hit is not None and hit[0] == generation:
            return hit[1]
        value: int | None = await self.store.measured_memory(*key)
        if self.store.generation == generation:
            self._cache[key] = (generation, value)
        return value

    async def offer(self, target: Target, pss: int) -> bool:
        """Learn ``pss`` for ``target``'s file and plan, unless it still needs confirming."""
        key = (target.digest, target.plan.key, target.max_tokens)
        if pss > target.estimate * LEARN_CONFIRM_FACTOR:
            first = self._unconfirmed.get(key)
            if first is None or first[0] is target:
                self._unconfirmed[key] = (target, max(pss, first[1] if first else 0))
                logs.event(
                    "memory_unconfirmed",
                    engine=target.engine_id,
                    pss=pss,
                    estimate=target.estimate,
                    factor=LEARN_CONFIRM_FACTOR,
                )
                return False
            del self._unconfirmed[key]
            pss = min(pss, first[1])  # both engines took at least this much
        await self.store.record_memory(*key, pss)
        logs.event("memory_learned", engine=target.engine_id, pss=pss, estimate=target.estimate)
        return True

    async def forget(self, digest: str) -> int:
        for key in [k for k in self._unconfirmed if k[0] == digest]:
            del self._unconfirmed[key]
        forgot: int = await self.store.forget_memory(digest)
        logs.event("memory_forgotten", digest=digest, rows=forgot)
        return forgot

    async def learned(self, target: Target, pss: int) -> bool:
        """The pool's ``on_learned``: a grown peak of one of its engines; True if recorded."""
        return await self.offer(target, pss)


def journal_to(store: Store) -> Journal:
    """The pool's journal: events into the store's, never failing a load over it."""

    async def journal(kind: str, fields: dict[str, Any]) -> None:
        try:
            await store.event(kind, **fields)
        except Exception as e:  # the journal is for reports: never fail a load over it
            logs.event("journal_failed", kind=kind, error=str(e))

    return journal


class Engines:
    """Resolves requests to targets and hands them to the pool."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        store: Store,
        pool: Pool,
        memory: LearnedMemory,
        *,
        explain_unverified: ExplainUnverified | None = None,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.store = store
        self.pool = pool
        self.memory = memory
        # What can make an install verified; the parts that know (catalog, kept digests,
        # hubs) sit above the engine and are wired by the composition root.
        self.explain_unverified = explain_unverified
        self._probing: dict[str, asyncio.Task[dict[str, bool | None]]] = {}
        self.runtime = runtime_version()
        # Blobs are content-addressed and only this daemon writes probes and measurements
        # (one daemon per state dir), so these caches cannot go stale; they keep SQLite and
        # header parsing off the warm request path.
        self._headers: dict[str, ModelInfo] = {}
        # (model id, digest) -> why a blob that matches its digest is no LiteRT-LM file
        # (``header``: hashed once).
        self._diagnosed: dict[tuple[str, str], CorruptModel] = {}
        # digest -> backend -> the current probe row (ok, reason, adapter, ...).
        self._probe_cache: dict[str, dict[str, dict[str, Any]]] = {}
        # digest -> plan key -> the image probe's row (``Store.image_probes``).
        self._image_probes: dict[str, dict[str, dict[str, Any]]] = {}
        self._image_probing: dict[tuple[str, str], asyncio.Task[dict[str, Any]]] = {}
        # Installed rows, valid while the store's write generation is unchanged: any write
        # (install, remove, verify, scan, touch) invalidates them, so they are never stale.
        self._installed: dict[str, tuple[int, Installed | None]] = {}
        # digest -> the link cache/<digest>/model.litertlm once made, and it and its dir as
        # strings: a warm request builds no Path.
        self._linked: dict[str, tuple[Path, str, str]] = {}
        # The last target resolved for each kind of request (``target``).
        self._targets: dict[Any, _Resolved] = {}
        # last_used is written at most once per TOUCH_INTERVAL, off the request path.
        self._touch_pending: dict[str, float] = {}
        self._touch_task: asyncio.Task[None] | None = None
        self._touch_flushed = 0.0

    async def header(
        self, model_id: str, digest: str, path: Path, *, diagnose: bool = False
    ) -> ModelInfo:
        """The header of the installed blob ``digest`` (read once: blobs never change).

        A blob that is not a readable LiteRT-LM file is ``corrupt_model``, saying what to do.
        That depends on whether its bytes still match its digest, which only hashing the file
        tells: ``diagnose`` (a load, which may take long) hashes it, once; otherwise (``show``,
        a GET answered at once) the message says how ``modeld verify`` tells.
        """
        info = self._headers.get(digest)
        if info is not None:
            return info
        known = self._diagnosed.get((model_id, digest))
        if known is not None:  # a copy: the kept one gathers no tracebacks
            raise CorruptModel(known.message, problem=known.problem, **known.details)
        try:
            info = await asyncio.to_thread(read_header, path, model_id=model_id)
        except CorruptModel as e:
            if e.problem is None:  # a LiteRT-LM file of a format this runtime cannot read
                raise
            raise await self._corrupt_install(model_id, digest, path, e, diagnose) from None
        self._headers[digest] = info
        return info

    async def _corrupt_install(
        self, model_id: str, digest: str, path: Path, err: CorruptModel, diagnose: bool
    ) -> CorruptModel:
        """``err`` (an installed blob that is not a LiteRT-LM file) with the fix that applies.

        Bytes that no longer match the digest they were installed with were damaged on disk:
        ``verify`` sets them aside and a new copy fixes it. Bytes that still match are what
        the entry names (its sha256, or its URLs' file): a new download gives them again, so
        the entry is what to fix (for an imported file: import a real model).
        """
        entry = self.catalog.find(model_id)
        local = entry is not None and entry.local
        again = (
            "import the file again" if local else f"`modeld pull {model_id}` fetches a good copy"
        )
        if local:
            fix_entry = (
                "import a LiteRT-LM model (a .litertlm file) instead; "
                f"`modeld rm {model_id} --entry` removes this one"
            )
        else:
            source = self.catalog.source_of(model_id)
            where = f"entry {source}" if source is not None else "its catalog entry"
            fix_entry = (
                f"correct the `urls` and `sha256` of {where} (they name a file that is not a "
                f"LiteRT-LM model), then run `modeld pull {model_id}`"
            )
        keep = False
        if not diagnose:
            hint = (
                f"`modeld verify {model_id}` tells why. If the file no longer matches its "
                f"sha256, it was damaged on disk: verify sets it aside, then {again}. If it "
                f"matches, a new download gives the same bytes: {fix_entry}"
            )
        elif (await asyncio.to_thread(sha256_file, path))[0] != digest:
            # Not kept: once verify sets the blob aside, a good copy of the digest comes back.
            hint = (
                f"its bytes no longer match the sha256 it was installed with ({digest}): it "
                f"was damaged on disk; `modeld verify {model_id}` sets it aside, then {again}"
            )
        else:
            hint = (
                f"its bytes match the sha256 it was installed with ({digest}), so a new "
                f"download gives the same bytes: {fix_entry}"
            )
            keep = True  # any blob of this digest has these very bytes
        found = CorruptModel(
            f"model {model_id}: {err.problem}; {hint}", problem=err.problem, **err.details
        )
        if keep:
            self._diagnosed[(model_id, digest)] = found
        return found

    async def _installed_row(self, model_id: str) -> Installed | None:
        generation = self.store.generation
        hit = self._installed.get(model_id)
        if hit is not None and hit[0] == generation:
            return hit[1]
        row: Installed | None = await self.store.installed(model_id)
        if self.store.generation == generation:
            self._installed[model_id] = (generation, row)
        return row

    def touch(self, model_id: str) -> None:
        """Note a use of ``model_id`` (a load, or a request that was served: a refused one
        is none); ``last_used`` reaches SQLite in the background."""
        self._touch_pending[model_id] = time.time()
        if self._touch_task is None or self._touch_task.done():
            self._touch_task = asyncio.ensure_future(self._flush_touches())

    async def flush_uses(self) -> None:
        """Write the uses not yet written (``touch``) now: for a reader of ``last_used``."""
        if self._touch_pending:
            await self._write_touches()

    def used_at(self, model_id: str) -> float | None:
        """The last use of ``model_id`` not yet written (``touch``), else None."""
        return self._touch_pending.get(model_id)

    async def _flush_touches(self) -> None:
        wait = self._touch_flushed + TOUCH_INTERVAL - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        await self._write_touches()

    async def _write_touches(self) -> None:
        rows = [(at, m) for m, at in self._touch_pending.items()]
        self._touch_pending = {}
        self._touch_flushed = time.monotonic()
        if not rows:
            return
        try:
            await self.store.write(
                lambda c: c.executemany("UPDATE installed SET last_used = ? WHERE id = ?", rows)
            )
        except Exception as e:  # last_used is advisory (prune's "unused for"): never fail
            logs.event("touch_failed", error=str(e))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stop the probes still running (their children killed and reaped, nothing
        recorded) and write the pending ``last_used`` times, before the pool stops and the
        store closes. A probe outlives the request that started it (it is shielded), so a
        daemon stopping mid-probe would otherwise leave it to the closing event loop."""
        probes = [*self._probing.values(), *self._image_probing.values()]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        task, self._touch_task = self._touch_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self._write_touches()

    async def _probe_rows(self, digest: str) -> dict[str, dict[str, Any]]:
        if digest not in self._probe_cache:
            rows = await self.store.probes(digest)
            # A result of an older probe method or runtime decides nothing: probe again.
            self._probe_cache[digest] = {b: r for b, r in rows.items() if r["current"]}
        return self._probe_cache[digest]

    async def _probes(self, digest: str) -> dict[str, bool | None]:
        return {b: bool(r["ok"]) for b, r in (await self._probe_rows(digest)).items()}

    async def _probe_gpu(
        self, model_id: str, digest: str, spec: CreateSpec, plan_key: str
    ) -> dict[str, bool | None]:
        """Find out once (single-flight) whether the GPU works for this file, and record it.

        ``spec`` is the very ``create`` spec a runner gets for the plan ``plan_key`` that
        wants the GPU. A runner creates that engine (``_probe_in_runner``): where it works,
        the pool's load of that plan takes this runner, so the engine is created once.
        """
        task = self._probing.get(digest)
        if task is None:

            async def go() -> dict[str, bool | None]:
                result = await self._probe_in_runner(spec, (digest, plan_key))
                await self.store.record_probe(
                    digest,
                    "gpu",
                    result.ok,
                    result.reason,
                    adapter=result.adapter,
                    log=clip_log(result.log, PROBE_LOG_LIMIT),
                    runtime=self.runtime,
                )
                self._probe_cache.pop(digest, None)
                await self.store.event(
                    "gpu_probe",
                    model=model_id,
                    digest=digest,
                    ok=result.ok,
                    reason=result.reason,
                    signal=result.signal,
                    adapter=result.adapter,
                    seconds=round(result.seconds, 3),
                )
                return await self._probes(digest)

            task = asyncio.ensure_future(go())
            self._probing[digest] = task
            task.add_done_callback(lambda _: self._probing.pop(digest, None))
        return await asyncio.shield(task)

    async def _probe_in_runner(self, spec: CreateSpec, key: tuple[str, str]) -> ProbeResult:
        """Create ``spec``'s engine, and its warm-up reply, in a runner of the pool's own kind.

        A runner is a child process like the probe child, so a GPU that aborts the process
        costs the runner only. Where the engine works, the runner goes to the pool for the
        load of ``key`` (``Pool.hand_over``); where it fails, the runner's stderr gives the
        runtime's reason, as the probe child's did.
        """
        start = time.monotonic()
        runner = await self.pool.factory()
        error: BaseException | None = None
        reply: Created | None = None
        try:
            async with asyncio.timeout(GPU_PROBE_TIMEOUT):
                reply = await runner.create(dataclasses.replace(spec, warm_up=True))
        except (RunnerError, RunnerDied, TimeoutError, ConnectionError) as e:
            error = e
        except BaseException:
            await runner.kill()
            raise
        log = runner.stderr_text()[-PROBE_LOG_LIMIT:]
        seconds = time.monotonic() - start
        if reply is not None:
            self.pool.hand_over(key, runner, spec, reply)
            return ProbeResult(
                ok=True,
                backend=spec.backend,
                reason=None,
                seconds=seconds,
                vision=spec.vision,
                audio=spec.audio,
                adapter=extract_adapter(log),
                log=log,
            )
        if isinstance(error, TimeoutError):
            await runner.kill()
            why = f"timed out after {GPU_PROBE_TIMEOUT:g} s"
        elif isinstance(error, RunnerDied):
            why = f"runner {error.how}"
        else:
            await runner.kill()
            why = str(error)
        died = runner.died
        return ProbeResult(
            ok=False,
            backend=spec.backend,
            reason=extract_reason(log, why),
            seconds=seconds,
            signal=died.signal_name if died is not None else None,
            vision=spec.vision,
            audio=spec.audio,
            stage="engine",
            log=log,
        )

    async def _image_probe(self, digest: str, plan: Plan, spec: CreateSpec) -> dict[str, Any]:
        """This file's image probe row for ``plan``: the recorded one, else run once.

        Every plan with a vision backend is probed, not only vision=gpu: the first image
        prefill is where a vision plan fails (a GPU delegate can abort the process there,
        and on either backend a vision encoder that does not fit the decoder fails only
        then). A throwaway child keeps such a failure out of a runner, and image requests
        get a clear refusal instead of a failed generation. The cost is one extra engine
        creation per (file, plan), once: the result is kept in the store.
        """
        if digest not in self._image_probes:
            self._image_probes[digest] = await self.store.image_probes(digest)
        row = self._image_probes[digest].get(plan.key)
        if row is not None:
            return row
        key = (digest, plan.key)
        task = self._image_probing.get(key)
        if task is None:

            async def go() -> dict[str, Any]:
                from modeld.modelfile.probe import probe_spec

                # The runner's own create spec, plus one image: same path, cache dir,
                # max_tokens and max_images as the engine that will serve the requests.
                result = await probe_spec(spec, IMAGE_PROBE_TIMEOUT, image=True)
                await self.store.record_image_probe(
                    digest,
                    plan.key,
                    ok=result.ok,
                    stage=result.stage,
                    reason=result.reason,
                    signal=result.signal,
                    seconds=result.seconds,
                )
                logs.event(
                    "image_probe",
                    digest=digest[:12],
                    plan=plan.key,
                    ok=result.ok,
                    stage=result.stage,
                    reason=result.reason,
                )
                self._image_probes[digest] = await self.store.image_probes(digest)
                return self._image_probes[digest][plan.key]

            task = asyncio.ensure_future(go())
            self._image_probing[key] = task
            task.add_done_callback(lambda _: self._image_probing.pop(key, None))
        return await asyncio.shield(task)

    @staticmethod
    def _image_refusal(
        model_id: str, info: ModelInfo, plan: Plan, row: dict[str, Any], gpu_ok: bool | None
    ) -> ImageProbeFailed:
        where = "at the image prefill" if row["stage"] == "image" else "creating its engine"
        fix = "Send a text-only request"
        other = "cpu" if plan.vision == "gpu" else "gpu"
        allowed = info.constraint_for("vision")
        # Only a backend the file allows and this host has not already failed on.
        if (allowed is None or other in allowed) and (other == "cpu" or gpu_ok is not False):
            fix += f" or ask for vision backend {other}"
        return ImageProbeFailed(
            f"model {model_id}: plan {plan.key} failed {where} when probed with an image on "
            f"this host: {row['reason']}. Images are refused with this plan; text still runs. "
            f"{fix} (`modeld show {model_id}` lists the image probes).",
            model=model_id,
            plan=plan.key,
            stage=row["stage"],
        )

    async def runtime_info(self) -> dict[str, Any]:
        """The runtime's version and the host's GPU adapter (``Store.latest_adapter``)."""
        latest = await self.store.latest_adapter()
        return {
            "package": RUNTIME_PACKAGE,
            "version": self.runtime,
            "adapter": latest["adapter"] if latest and latest["ok"] else None,
            "gpu_probe": latest,
        }

    async def runtime_status(self) -> dict[str, Any]:
        """The ``runtime`` section of ``/api/status``."""
        doc = await self.runtime_info()
        latest = doc["gpu_probe"]
        if doc["adapter"]:
            gpu = f"GPU adapter {doc['adapter']}"
        elif latest is None:
            gpu = "GPU not probed yet"
        else:
            # The first line of the reason says it; show and bug-report have all of it.
            why = (latest["reason"] or "probe failed").split(" | ", 1)[0]
            gpu = f"no usable GPU ({why})"
        version = doc["version"] or "not installed"
        problems = [] if doc["version"] else [f"{RUNTIME_PACKAGE} is not installed"]
        return {**doc, "summary": f"{RUNTIME_PACKAGE} {version}; {gpu}", "problems": problems}

    def plan(
        self,
        model_id: str,
        entry: Entry | None,
        info: ModelInfo,
        modalities: Iterable[str],
        *,
        probes: dict[str, bool | None],
        backends: dict[str, Any] | None = None,
    ) -> Plan:
        """The backend plan for ``modalities``: the settings, the entry's, then the request's."""
        return resolve(
            info,
            model=model_id,
            settings=Prefs.from_settings(self.settings),
            entry=Prefs.from_mapping(entry.backends.model_dump() if entry else None),
            request=Prefs.from_mapping(backends),
            modalities=tuple(modalities),
            probes=probes,
        )

    def plans(
        self,
        model_id: str,
        entry: Entry | None,
        info: ModelInfo,
        *,
        probes: dict[str, dict[str, Any]],
        image_probes: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        """``show``'s plans: text and vision, each a plan (and what it still needs) or why none.

        Nothing is probed here: ``probes`` are the recorded rows, and only current ones decide
        (a stale one is probed again at the next load).
        """
        results: dict[str, bool | None] = {b: p["ok"] for b, p in probes.items() if p["current"]}
        try:
            check_runtime(model_id, entry, info, self.runtime)
        except ModeldError as e:
            return {name: {"plan": None, "error": error_brief(e)} for name in ("text", "vision")}
        out: dict[str, Any] = {}
        for name, modalities in (("text", ("text",)), ("vision", ("text", "image"))):
            try:
                p = self.plan(model_id, entry, info, modalities, probes=results)
            except ModeldError as e:
                out[name] = {"plan": None, "error": error_brief(e)}
            else:
                unprobed = sorted(needs_probe(p, results))
                out[name] = {"plan": p.to_dict(), "error": None, "needs_probe": unprobed}
                if p.vision is not None:
                    # None: not probed with an image yet (the first image request or load does).
                    out[name]["image_probe"] = image_probes.get(p.key)
        return out

    async def target(
        self,
        model_id: str,
        *,
        modalities: Iterable[str] = ("text",),
        backends: dict[str, Any] | None = None,
        allow_unverified: bool = False,
        images: bool = False,
        kind: Kind | None = "text",
    ) -> Target:
        """The engine target for ``model_id``, or a clear refusal (before any runner starts).

        ``kind`` is what the request needs (text generation or embeddings): a file of the
        other kind is refused. None (a load) takes the file's own kind.

        A plan with a vision backend is probed with an image first (``_image_probe``);
        with ``images`` (the request carries some) a failed image probe refuses it. An
        explicit load is not refused: its view shows the probe.

        A warm request reuses the target it resolved last time while nothing it came from
        changed (``_Resolved``); the file and its ``.litertlm`` link are still checked
        every time.
        """
        modalities = tuple(modalities)
        try:
            key: Any = (model_id, modalities, _frozen(backends), allow_unverified, images, kind)
            hash(key)
        except TypeError:
            key = None  # an odd backends value: resolved (and refused) the long way
        hit = self._targets.get(key) if key is not None else None
        if hit is not None and hit.stamp.matches(self._stamp(model_id)) and hit.path.is_file():
            # The runtime's .litertlm link too: made again if something removed it.
            self._runtime_path(hit.target.digest, hit.path)
            return hit.target
        stamp = self._stamp(model_id)
        target, path = await self._resolve(
            model_id,
            modalities=modalities,
            backends=backends,
            allow_unverified=allow_unverified,
            images=images,
            kind=kind,
        )
        # Kept only when nothing it came from changed while it was resolved.
        # (The file's probe rows may have been read just now: the ones after are the ones
        # it used, and a probe recorded meanwhile was a write.)
        after = self._stamp(model_id)
        if key is not None and target.plan.vision is None and stamp.matches(after, probes=False):
            self._targets[key] = _Resolved(after, target, path)
        return target

    async def _resolve(
        self,
        model_id: str,
        *,
        modalities: Iterable[str],
        backends: dict[str, Any] | None,
        allow_unverified: bool,
        images: bool,
        kind: Kind | None,
    ) -> tuple[Target, Path]:
        """``target``'s work, from the catalog, SQLite (cached), the header and the probes."""
        entry = self.catalog.get(model_id)
        installed = await self._installed_row(model_id)
        if installed is None:
            if model_id in await self.store.missing():
                raise _file_missing(model_id, self.catalog.how_to_install(model_id))
            raise self.catalog.not_installed(model_id)
        if not installed.verified and not allow_unverified:
            explain = self.explain_unverified
            hint = (
                await explain(model_id, installed.digest)
                if explain is not None
                else f"`modeld verify {model_id}` says what can"
            )
            raise Unverified(
                f"model {model_id}: no source vouched for its file's sha256 "
                f"({installed.digest}). To make it verified: {hint}. Or load it anyway "
                "with --allow-unverified (allow_unverified: true in an API request)"
            )
        path = installed.path
        if not path.is_file():
            # `list` and `pull` then see it missing too: a pull fetches the file again.
            await self.store.mark_missing(model_id, installed.digest)
            raise _file_missing(model_id, self.catalog.how_to_install(model_id), path)
        info = await self.header(model_id, installed.digest, path, diagnose=True)
        if kind is not None:
            check_kind(model_id, info, kind)
        modalities = tuple(modalities)
        check_runtime(model_id, entry, info, self.runtime)
        probes = await self._probes(installed.digest)
        plan = self.plan(model_id, entry, info, modalities, probes=probes, backends=backends)
        if needs_probe(plan, probes):
            probe_spec, _ = self._spec(entry, info, installed, plan)
            probes = await self._probe_gpu(model_id, installed.digest, probe_spec, plan.key)
            plan = self.plan(model_id, entry, info, modalities, probes=probes, backends=backends)
        spec, max_tokens = self._spec(entry, info, installed, plan)
        budget = self.pool.budget
        base = budget.spare_reserved if budget.spare is not None else RUNNER_BASE
        learned = await self.memory.expected((installed.digest, plan.key, max_tokens))
        adapter = None
        if "gpu" in plan.backends():
            adapter = (await self._probe_rows(installed.digest)).get("gpu", {}).get("adapter")
        image_probe = None
        if plan.vision is not None:
            image_probe = await self._image_probe(installed.digest, plan, spec)
            if images and not image_probe["ok"]:
                raise self._image_refusal(model_id, info, plan, image_probe, probes.get("gpu"))
        target = Target(
            model_id=model_id,
            digest=installed.digest,
            plan=plan,
            spec=spec,
            # An embedding engine keeps no KV cache: its window term is nought.
            estimate=estimate_memory(
                info, plan, max_tokens if info.kind == "text" else 0, base or RUNNER_BASE
            ),
            max_tokens=max_tokens,
            learned=learned,
            file_max_tokens=info.llm_metadata.max_num_tokens if info.llm_metadata else None,
            runtime=self.runtime,
            adapter=adapter,
            image_probe=image_probe,
            warm_up=self._warm_up(entry, plan),
        )
        return target, path

    def _spec(
        self, entry: Entry, info: ModelInfo, installed: Installed, plan: Plan
    ) -> tuple[CreateSpec, int]:
        """The runner's ``create`` spec for ``plan`` (the GPU probe gets the same one)."""
        limits = entry.limits
        link, cache_dir = self._runtime_path(installed.digest, installed.path)
        max_tokens = entry_max_tokens(entry, info, vision=plan.vision is not None)
        max_images = (
            (limits.max_images if limits.max_images is not None else 1) if plan.vision else None
        )
        spec = CreateSpec(
            path=link,
            backend=plan.main,
            vision=plan.vision,
            audio=plan.audio,
            max_tokens=max_tokens,
            max_images=max_images,
            # Without it the runtime writes its xnnpack cache next to the blob.
            cache_dir=cache_dir,
            # The entry's [limits] speculative_decoding as is: true and false reach the
            # runtime as True and False; absent (None) leaves it to the runtime's default.
            speculative=limits.speculative_decoding,
            # Always an explicit count: the runtime's own default ignores the machine.
            threads=entry.runtime.threads or self.settings.cpu_threads,
            kind=info.kind,
            kept_conversations=self.settings.kept_conversations,
        )
        return spec, max_tokens

    def _warm_up(self, entry: Entry, plan: Plan) -> bool | None:
        """Whether loads of ``plan`` warm up: True every load, False never, None when asked.

        A gpu plan pays its shader compilation at the first generation, far more than a
        generation afterwards (docs/benchmarks.md#engine-memory), so every load of one warms
        up; a cpu plan's first
        request costs far less, so only loads that promise a quick first reply (pinned,
        preloaded) ask for it. The entry's ``[runtime] warm_up`` wins, then the setting.
        """
        if entry.runtime.warm_up is not None:
            return entry.runtime.warm_up
        if not self.settings.warm_up:
            return False
        return True if "gpu" in plan.backends() else None

    def _stamp(self, model_id: str) -> _Stamp:
        """What a target for ``model_id`` comes from, for ``target``'s kept targets."""
        settings, budget = self.settings, self.pool.budget
        installed = self._installed.get(model_id)
        digest = installed[1].digest if installed is not None and installed[1] else None
        return _Stamp(
            generation=self.store.generation,
            entry=self.catalog.find(model_id),
            settings=(
                settings.main_backend,
                settings.vision_backend,
                settings.cpu_threads,
                settings.warm_up,
                settings.kept_conversations,
            ),
            probes=self._probe_cache.get(digest) if digest else None,
            spare=budget.spare_reserved if budget.spare is not None else None,
        )

    def _runtime_path(self, digest: str, blob: Path) -> tuple[str, str]:
        """A ``.litertlm`` name for the blob (the runtime picks the format by file extension)
        and the blob's cache dir, as strings."""
        made = self._linked.get(digest)
        # The blob of a digest never moves: once made, the link only needs to still exist.
        if made is not None and made[0].is_symlink():
            return made[1], made[2]
        cache_dir = self.store.cache_dir_for(digest)
        link = cache_dir / "model.litertlm"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not (link.is_symlink() and link.resolve() == blob.resolve()):
            tmp = link.with_name(f".model.{os.getpid()}.tmp")
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(blob)
            tmp.replace(link)
        self._linked[digest] = (link, str(link), str(cache_dir))
        return str(link), str(cache_dir)

    def max_images(self, model_id: str) -> int:
        limit = self.catalog.get(model_id).limits.max_images
        return 1 if limit is None else int(limit)

    async def forget_memory(self, model_id: str) -> dict[str, Any]:
        """Forget the peaks learned for ``model_id``'s file (an admin's reset)."""
        installed = await self._installed_row(model_id)
        if installed is None:
            raise ModelNotInstalled(
                f"model {model_id} is not installed; nothing was learned about it"
            )
        forgot = await self.memory.forget(installed.digest)
        return {"id": model_id, "digest": installed.digest, "forgot": forgot}


def _frozen(backends: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(backends.items())) if backends else ()


@dataclass(frozen=True)
class _Stamp:
    """What a resolved target came from, as ``Engines._stamp`` reads it.

    SQLite's rows (the installed row, verification, learned peaks: any write bumps
    ``Store.generation``), the catalog entry (a reload makes new objects), the settings
    that choose backends and threads (changed in place by a reload), the file's current
    probe rows (replaced when a probe is recorded) and the spare runner's size (in the
    estimate). The entry and the probe rows are compared by identity.
    """

    generation: int
    entry: Entry | None
    settings: tuple[Any, ...]
    probes: dict[str, dict[str, Any]] | None
    spare: int | None

    def matches(self, other: _Stamp, *, probes: bool = True) -> bool:
        return (
            (self.generation, self.settings, self.spare)
            == (other.generation, other.settings, other.spare)
            and self.entry is other.entry
            and (self.probes is other.probes or not probes)
        )


@dataclass(frozen=True)
class _Resolved:
    """A resolved target, valid while what it came from (``stamp``) is unchanged. Plans
    with vision are never kept: their image probe may still be running."""

    stamp: _Stamp
    target: Target
    path: Path
