"""The runner child process on the real LiteRT-LM runtime with the tiny test models."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from modeld.config import default_cpu_threads
from modeld.engine.runner.client import Runner, RunnerDied, RunnerError, StderrLog, crash_reason
from modeld.engine.runner.generate import (
    DEFAULT_TOP_K,
    KEPT_THREADS,
    PlainSession,
    _stream_async,
    classify_json,
    conversation_args,
    parse_chunk,
    render,
    sampler_defaults,
    sampler_fields,
    stream_reply,
    text_of,
)
from modeld.engine.runner.job import (
    Done,
    EmbedJob,
    Finish,
    GenerateJob,
    Job,
    Options,
    Record,
    Shape,
    Token,
    record_to_wire,
)
from modeld.modelfile.runtime import CreateSpec, create_engine
from tests.support.state import MODELS
from tests.support.wait import process_gone, until, wait_sync, wait_until

TINY = MODELS / "tiny-text.litertlm"
EMBED = MODELS / "tiny-embed.litertlm"
LONG = MODELS / "tiny-text-long.litertlm"


def spec(tmp: Path, path: Path = TINY, **extra: Any) -> CreateSpec:
    return CreateSpec(path=str(path), backend="cpu", cache_dir=str(tmp / "cache"), **extra)


def ask(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], **extra}


_OPTIONS = {f.name for f in dataclasses.fields(Options)}


def typed(job: dict[str, Any]) -> Job:
    """A job written as the flat dict these tests use (messages, options and shape fields
    side by side; ``"format": "json"``), as the runner's typed job."""
    if job.get("op") == "embed":
        return EmbedJob(tuple(job["inputs"]), job.get("dimensions"))
    rest = {k: v for k, v in job.items() if k != "messages"}
    options = {k: rest.pop(k) for k in list(rest) if k in _OPTIONS}
    if rest.pop("format", None) == "json":
        rest["json"] = True
    return GenerateJob(tuple(job["messages"]), Options(**options), Shape.from_wire(rest))


def generate(
    runner: Runner, job: dict[str, Any], sent: Callable[[], None] | None = None
) -> AsyncGenerator[Record, None]:
    return runner.generate(typed(job), sent)


async def collect(
    runner: Runner, job: dict[str, Any], sent: Callable[[], None] | None = None
) -> tuple[str, dict[str, Any]]:
    """The reply's streamed text, and its final record as the runner sent it; ``sent`` is
    called once the job is on its way."""
    text: list[str] = []
    final: dict[str, Any] = {}
    async for rec in generate(runner, job, sent):
        if isinstance(rec, Token):
            text.append(rec.text)
        else:
            final = record_to_wire(rec)
    return "".join(text), final


async def idle(runner: Runner) -> None:
    """Wait until the runner has closed its last job. One sent the moment a reply ends may
    find it still closing that job, and then has its conversation (or bare session) made
    ahead, as a job that waits does."""

    async def quiet() -> bool:
        return not (await runner.call("stats"))["busy"]

    await until(quiet, every=0.005)


@contextlib.asynccontextmanager
async def decoding(runner: Runner, job: dict[str, Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """``job`` streamed, entered once its first token is here: the runner has begun it, so a
    job sent in the block comes while it runs, or after its end if the client read its
    tokens late (a loaded machine); never before it. Yields the task that ends its reply."""
    records = generate(runner, {**job, "stream": True})
    first = await anext(records)
    assert isinstance(first, Token), first

    async def rest() -> tuple[str, dict[str, Any]]:
        text, final = [first.text], {}
        async for rec in records:
            if isinstance(rec, Token):
                text.append(rec.text)
            else:
                final = record_to_wire(rec)
        return "".join(text), final

    task = asyncio.ensure_future(rest())
    try:
        yield task
    finally:
        await task


async def test_create_and_generate_reports_phases_and_memory(short_tmp: Path) -> None:
    """A real engine streams tokens and ends with finish, token counts, timings and PSS."""
    runner = await Runner.start()
    try:
        created = await runner.create(spec(short_tmp, max_tokens=256))
        assert created.seconds > 0 and created.pss > 0
        text, final = await collect(runner, ask(max_tokens=12, seed=1, top_k=5, temperature=0.7))
        assert final["done"] and final["finish"] == "length" and final["tokens"] == 12
        assert text
        t = final["timings"]
        assert t["first_token"] > 0 and t["generate"] >= t["first_token"]
        assert t["decode_tokens_per_second"] > 0 and t["prefill"] is not None
        assert runner.memory()[0] > 0
        # No cache next to the model: the runtime wrote it into cache_dir.
        assert list((short_tmp / "cache").iterdir())
        assert not list(MODELS.glob("*xnnpack_cache"))
    finally:
        await runner.close()
    assert not runner.alive


async def test_multi_turn_system_and_stop_string(short_tmp: Path) -> None:
    """Messages with a system turn work, and a stop string cuts the reply before it."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp))
        job = {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"},
            ],
            "max_tokens": 40,
            "seed": 3,
        }
        full, _ = await collect(runner, job)
        assert len(full) > 4
        stop = full[2:4]
        cut, final = await collect(runner, {**job, "stop": [stop]})
        assert stop not in cut and full.startswith(cut)
        assert final["finish"] == "stop"
    finally:
        await runner.close()


async def test_cancel_mid_generation_then_next_request(short_tmp: Path) -> None:
    """Leaving a stream cancels it in the child; the same engine then serves the next one."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp))
        gen = generate(runner, ask(max_tokens=200))
        async for _ in gen:
            break
        await gen.aclose()
        _, final = await collect(runner, ask(max_tokens=3))
        assert final["tokens"] == 3
    finally:
        await runner.close()


async def test_jobs_sent_while_one_runs_wait_in_order_and_a_cancelled_one_never_runs(
    short_tmp: Path,
) -> None:
    """Jobs sent while another runs wait in the child and run in the order they were sent;
    one cancelled while it waits never runs: its end counts no tokens, and no token of it
    is ever sent."""
    runner = await Runner.start()
    seen: list[dict[str, Any]] = []
    route = runner._route

    def spy(msg: dict[str, Any]) -> None:
        seen.append(msg)
        route(msg)

    runner._route = spy  # type: ignore[method-assign]  # every record the child sends
    try:
        await runner.create(spec(short_tmp, MODELS / "tiny-text-long.litertlm"))
        # A reply of 1,024 tokens: hundreds of ms, while the two below are sent and one leaves.
        first = generate(runner, ask("Write a long story about the sea.", max_tokens=1024))
        await anext(first)
        sent = asyncio.Event()
        leaver = asyncio.ensure_future(anext(generate(runner, ask(max_tokens=5), sent.set)))
        await sent.wait()
        last = asyncio.ensure_future(collect(runner, ask(max_tokens=3)))
        leaver.cancel()
        rest = [rec async for rec in first]
        with pytest.raises(asyncio.CancelledError):
            await leaver
        _, final = await last
    finally:
        await runner.close()
    end = rest[-1]
    assert isinstance(end, Done) and end.tokens == 1024 and final["tokens"] == 3
    ends = [m for m in seen if m.get("done")]
    assert [m["id"] for m in ends] == sorted(m["id"] for m in ends)  # in the order sent
    (left,) = [m for m in ends if m["finish"] == "cancelled"]
    assert left.get("tokens", 0) == 0
    assert not [m for m in seen if m["id"] == left["id"] and "token" in m]


async def test_non_streamed_reply_comes_whole_in_the_final_record(short_tmp: Path) -> None:
    """``stream: false`` sends no token frames: the final record carries the same text."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, max_tokens=256))
        job = ask("hello there", max_tokens=8, seed=2)
        streamed, _ = await collect(runner, job)
        tokens, final = await collect(runner, {**job, "stream": False})
        assert tokens == "" and final["text"] == streamed
        assert final["finish"] == "length" and final["tokens"] == 8
        t = final["timings"]
        assert t["first_token"] > 0 and t["generate"] >= t["first_token"]
        assert t["decode_tokens_per_second"] > 0 and final["prompt_tokens"] > 0
        # With a stop string the reply is still cut before it, and still sent whole.
        stop = streamed[2:4]
        tokens, final = await collect(runner, {**job, "stream": False, "stop": [stop]})
        assert tokens == "" and streamed.startswith(final["text"]) and stop not in final["text"]
        assert final["finish"] == "stop"
    finally:
        await runner.close()


def conversation_reply(made: CreateSpec, job: dict[str, Any]) -> tuple[str, int, int]:
    """The reply a conversation made as the runner makes one gives ``job``, in this process
    on an engine of its own: text, prompt tokens, reply tokens."""
    engine = create_engine(made)
    try:
        asked = typed(job)
        assert isinstance(asked, GenerateJob)
        kwargs, last, _, send = conversation_args(asked, sampler_defaults(made.path))
        conversation = engine.create_conversation(**kwargs)
        parts: list[str] = []

        def on_message(message: dict[str, Any]) -> bool:
            parts.append(text_of(message))
            return False

        stream_reply(conversation, last, send, on_message)
        info = conversation.get_benchmark_info()
        conversation.close()
        return "".join(parts), info.last_prefill_token_count, info.last_decode_token_count
    finally:
        engine.close()


@pytest.mark.parametrize(
    "model", ["tiny-text", "tiny-text-b", "tiny-text-f32", "tiny-text-long", "gemma3n-like"]
)
async def test_a_plain_reply_on_a_bare_session_is_the_conversations(
    short_tmp: Path, model: str
) -> None:
    """A reply to one plain user turn, whole or streamed, is made on a bare session: the same
    text and token counts as a conversation gives (made in this process, on an engine of its
    own), with the runtime's default sampler, with a seeded one, for text parts, and cut at
    a stop string."""
    made = spec(short_tmp, MODELS / f"{model}.litertlm", max_tokens=256)
    runner = await Runner.start()
    try:
        await runner.create(made)
        parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
        jobs = [
            ask("hello there", max_tokens=8),
            ask("Tell me about the sea.", max_tokens=40, seed=5, top_k=8, temperature=0.9),
            {"messages": [{"role": "user", "content": parts}], "max_tokens": 3},
        ]
        for job in jobs:
            text, prompt_tokens, tokens = conversation_reply(made, job)
            await idle(runner)
            streamed_text, streamed = await collect(runner, {**job, "stream": True})
            await idle(runner)
            none, whole = await collect(runner, {**job, "stream": False})
            assert streamed["conversation"] == whole["conversation"] == "none" and none == ""
            assert streamed_text == whole["text"] == text
            for final in (streamed, whole):
                assert (final["prompt_tokens"], final["tokens"]) == (prompt_tokens, tokens)
            assert streamed["finish"] == whole["finish"]
        # A stop string: the reply is cut before it, on the session, streamed or not.
        text = conversation_reply(made, jobs[1])[0]
        stop = text[3:6]
        assert stop and text.index(stop) >= 1
        for stream in (True, False):
            await idle(runner)
            got, final = await collect(runner, {**jobs[1], "stop": [stop], "stream": stream})
            cut = got if stream else final["text"]
            assert cut == text[: text.index(stop)] and final["finish"] == "stop"
            assert final["conversation"] == "none"
        # A system message (or any other history) still gets a conversation.
        system = {"role": "system", "content": "be brief"}
        job = {**jobs[0], "stream": False}
        _, told = await collect(runner, {**job, "messages": [system, *job["messages"]]})
        assert told.get("conversation") != "none" and told["tokens"] == 8
    finally:
        await runner.close()


async def test_a_whole_reply_to_a_turn_holding_a_nul_is_the_streamed_ones(
    short_tmp: Path,
) -> None:
    """A turn whose text holds a NUL gets the same prompt whole as streamed: the bare
    session's prompt comes back from the runtime as a C string, which ended at the NUL (7
    prompt tokens against 24, and another reply), so such a turn gets a conversation."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, max_tokens=256))
        parts = [{"type": "text", "text": "abc\x00def "}, {"type": "text", "text": "ghi jkl"}]
        for content in ("abc\x00def ghi jkl", parts):
            job = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "seed": 2}
            streamed_text, streamed = await collect(runner, {**job, "stream": True})
            _, whole = await collect(runner, {**job, "stream": False})
            assert whole["prompt_tokens"] == streamed["prompt_tokens"]
            assert whole["text"] == streamed_text and whole.get("conversation") != "none"
    finally:
        await runner.close()


async def test_a_conversation_is_made_ahead_for_a_job_like_the_last(short_tmp: Path) -> None:
    """After a reply the idle runner makes the next conversation with the same settings; a
    job like the last one gets it (and the same reply for the same seed), another job a
    fresh one, and a job with history or a system message never one made ahead. (Its jobs
    name a penalty: a reply to one plain turn goes on a bare session, and nothing is made
    ahead for it.)"""
    runner = await Runner.start()

    async def prepared() -> bool:
        # A job sent before the idle runner made it finds none: wait until it has.
        return bool((await runner.call("stats"))["ready"])

    try:
        await runner.create(spec(short_tmp, max_tokens=256))
        job = ask("hello there", max_tokens=8, seed=3, stream=True, frequency_penalty=0.5)
        first_text, first = await collect(runner, job)
        await until(prepared)
        again_text, again = await collect(runner, job)
        assert "conversation" not in first and again["conversation"] == "ready"
        assert again_text == first_text and again["tokens"] == 8
        # Other settings: the one made ahead does not fit, a fresh one is made.
        await until(prepared)
        _, other = await collect(runner, {**job, "max_tokens": 6})
        assert "conversation" not in other and other["tokens"] == 6
        # A system message: made for the job alone, and nothing is made ahead after it.
        system = {"role": "system", "content": "be brief"}
        with_system = {**job, "messages": [system, *job["messages"]]}
        await until(prepared)
        _, told = await collect(runner, with_system)
        assert "conversation" not in told
        assert not await prepared()
        await idle(runner)
        plain_text, plain = await collect(runner, job)
        assert "conversation" not in plain and plain_text == first_text
        await until(prepared)
        plain_text, plain = await collect(runner, job)
        assert plain["conversation"] == "ready"
        # The same turn with no penalty, whole or streamed: a bare session; the conversation
        # made ahead waits on for the next job like the last.
        await until(prepared)
        bare = {k: v for k, v in job.items() if k != "frequency_penalty"}
        for stream in (False, True):
            await idle(runner)
            _, final = await collect(runner, {**bare, "stream": stream})
            assert final["conversation"] == "none"
        _, plain = await collect(runner, job)
        assert plain["conversation"] == "ready" and await collect(runner, job)
    finally:
        await runner.close()


@pytest.mark.skipif(default_cpu_threads() < 2, reason="needs 2 cores: one for the engine")
async def test_the_waiting_jobs_conversation_is_made_while_one_runs(short_tmp: Path) -> None:
    """With a core left by the engine's threads, a job sent while another decodes starts on
    a conversation made during that decode, whatever its settings; its reply is the one a
    conversation made for it alone gives. A cancelled waiting job leaves the next one a
    working engine. An engine whose threads take every core makes it during the decode for
    a streamed job only; a whole reply's job makes its own when its turn comes."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, LONG, max_tokens=1280, threads=1))
        # The replies each job gets alone. The first job finds the runner idle: one sent the
        # moment a reply ends finds it still closing that job, and gets its session made
        # ahead as a job that waits ("none ready").
        plain_job = ask("hello there", max_tokens=5, seed=7, stream=True)
        plain_text, plain = await collect(runner, plain_job)
        assert plain["conversation"] == "none"
        # A NUL in the turn keeps the job on a conversation (a reply to one plain turn goes on a
        # bare session). A penalty would do as well, but this model fails one ("Invalid token
        # id").
        alone_job = ask("hello\x00there", max_tokens=5, seed=7, stream=True)
        alone_text, _ = await collect(runner, alone_job)
        # Long enough (~1,000 tokens, 100 ms or more) that the second job arrives while the
        # first one decodes.
        long_job = ask("Write a long story about the sea.", max_tokens=1000, stream=False)
        for waiting_job in (alone_job, {**alone_job, "max_tokens": 6}):
            first, second = await asyncio.gather(
                collect(runner, long_job), collect(runner, waiting_job)
            )
            assert first[1]["finish"] in ("stop", "length")
            assert second[1]["conversation"] == "ready"
            assert second[1]["tokens"] == waiting_job["max_tokens"]
            assert second[0].startswith(alone_text)
        # A plain turn waits too: its bare session is made, and its prompt rendered, during
        # that decode; the reply is the one a session made in line gives.
        for stream in (True, False):
            job = {**plain_job, "stream": stream}
            first, second = await asyncio.gather(collect(runner, long_job), collect(runner, job))
            assert second[1]["conversation"] == "none ready"
            assert (second[0] if stream else second[1]["text"]) == plain_text
        # A waiting job cancelled (its caller left) once sent: the runner claimed its
        # conversation when it came, the long one decoding (or it came after that one's end).
        async with decoding(runner, long_job) as running:
            sent = asyncio.Event()
            left = asyncio.ensure_future(
                collect(runner, {**alone_job, "max_tokens": 7}, sent=sent.set)
            )
            await sent.wait()
            left.cancel()
            with pytest.raises(asyncio.CancelledError):
                await left
        after_text, after = await collect(runner, alone_job)
        assert (await running)[1]["finish"] in ("stop", "length")
        assert after_text == alone_text and after["tokens"] == 5
        # A waiting job the runtime cannot take fails alone; the one running is unharmed.
        async with decoding(runner, long_job) as running:
            with pytest.raises(RunnerError, match="from the user"):
                bad = {"messages": [{"role": "assistant", "content": "hi"}], "stream": False}
                await collect(runner, bad)
        assert (await running)[1]["finish"] in ("stop", "length")
        # A malformed frame (the daemon never sends one) is refused as it arrives.
        async with decoding(runner, long_job) as running:
            with pytest.raises(RunnerError, match="malformed generate job"):
                await runner.call("generate", messages=5)
        assert (await running)[1]["finish"] in ("stop", "length")
        assert (await collect(runner, alone_job))[0] == alone_text
    finally:
        await runner.close()
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, LONG, max_tokens=1280, threads=default_cpu_threads()))
        # A whole reply that needs a conversation (a stop string: it is cut while streamed).
        waiting_job = {**alone_job, "max_tokens": 6, "stream": False, "stop": ["never said"]}
        both = await asyncio.gather(collect(runner, long_job), collect(runner, waiting_job))
        whole = both[1][1]
        assert "conversation" not in whole and whole["tokens"] == 6
        streamed_job = {**waiting_job, "stream": True}
        both = await asyncio.gather(collect(runner, long_job), collect(runner, streamed_job))
        text, streamed = both[1]
        assert streamed["conversation"] == "ready" and streamed["tokens"] == 6
        assert text == whole["text"]
        # A plain turn: its session is made ahead for a streamed job only.
        plain_job = ask("hello there", max_tokens=5, seed=7)
        for stream, made in ((True, "none ready"), (False, "none")):
            job = {**plain_job, "stream": stream}
            both = await asyncio.gather(collect(runner, long_job), collect(runner, job))
            assert both[1][1]["conversation"] == made
    finally:
        await runner.close()


async def test_leaving_a_non_streamed_reply_cancels_it(short_tmp: Path) -> None:
    """A caller that leaves a non-streamed reply cancels it; the engine serves the next one."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, max_tokens=4000))
        for delay in (0.0, 0.002, 0.005):
            task = asyncio.ensure_future(collect(runner, ask(max_tokens=3000, stream=False)))
            # The delay is what is tested: leaving before the reply starts, and while it runs.
            await asyncio.sleep(delay)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            text, final = await collect(runner, ask(max_tokens=3, stream=False))
            assert final["tokens"] == 3 and final["finish"] == "length" and text == ""
    finally:
        await runner.close()


async def test_a_cancel_that_comes_as_the_reply_ends_leaves_the_runner_alive(
    short_tmp: Path,
) -> None:
    """A client that leaves as its reply ends sends a cancel while the runner closes the
    reply's conversation (or bare session): the runner cancels it or finds it gone, and
    lives on. Here cancels for the running job come without pause from its start to its
    end, so that some land during the close (the runner died of SIGSEGV within a few jobs)."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, max_tokens=256))
        for stream in (False, True):
            for _ in range(100):
                job = asyncio.ensure_future(collect(runner, ask(max_tokens=8, stream=stream)))
                await asyncio.sleep(0)  # the job has its id, and is on its way
                targets = list(runner._pending)
                assert targets
                while not job.done():
                    for target in targets:
                        await runner._send({"op": "cancel", "id": 0, "target": target})
                    await asyncio.sleep(0)
                assert job.result()[1]["finish"] in ("cancelled", "length")
        _, final = await collect(runner, ask(max_tokens=3, stream=False))
        assert final["tokens"] == 3 and runner.alive
    finally:
        await runner.close()


async def test_non_streamed_failure_carries_the_runtime_reason(short_tmp: Path) -> None:
    """A prompt over the engine's window fails as it does streamed: the runtime's own words."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp, max_tokens=8))
        reasons = []
        for stream in (True, False):
            with pytest.raises(RunnerError) as info:
                await collect(runner, ask("hello there", stream=stream))
            reasons.append(info.value.message)
        assert "too long" in reasons[1] and reasons[0] == reasons[1]
    finally:
        await runner.close()


async def test_runtime_failure_carries_runtime_reason(short_tmp: Path) -> None:
    """A damaged file fails create with the runtime's own words, not a generic error."""
    bad = short_tmp / "trunc.litertlm"
    bad.write_bytes(TINY.read_bytes()[:100_000])
    runner = await Runner.start()
    try:
        with pytest.raises(RunnerError) as info:
            await runner.create(spec(short_tmp, path=bad))
        assert info.value.code == "engine_error"
        assert "tf_lite_prefill_decode" in info.value.message
    finally:
        await runner.close()


async def test_embedding_engine_embeds_and_refuses_what_is_not_its_kind(
    short_tmp: Path,
) -> None:
    """A ``kind: embedding`` create makes an EmbeddingEngine: ``embed`` gives one vector per
    input in order, its options name the vector length, a ``generate`` is a bad_request, as
    is an ``embed`` on a text engine; a crash of the embedding runner is noticed as any."""
    runner, text = await Runner.start(), await Runner.start()
    try:
        created = await runner.create(spec(short_tmp, EMBED, kind="embedding", warm_up=True))
        assert created.options["embedding_dimension"] == 32
        assert created.warm_up is not None and created.warm_up["seconds"] > 0
        _, final = await collect(runner, {"op": "embed", "inputs": ["a b", "c d", "a b"]})
        first, second, third = final["embeddings"]
        assert final["done"] and final["dimensions"] == 32
        assert first == third != second
        _, short = await collect(runner, {"op": "embed", "inputs": ["a b"], "dimensions": 4})
        assert len(short["embeddings"][0]) == 4
        with pytest.raises(RunnerError) as info:
            await collect(runner, ask())
        assert info.value.code == "bad_request"
        assert "generate asked of an embedding engine" in info.value.message
        await text.create(spec(short_tmp))
        with pytest.raises(RunnerError) as info:
            await collect(text, {"op": "embed", "inputs": ["a"]})
        assert info.value.code == "bad_request"
        assert "embed asked of a text engine" in info.value.message
        os.kill(runner.pid, signal.SIGKILL)
        with pytest.raises(RunnerDied) as died:
            await collect(runner, {"op": "embed", "inputs": ["a"]})
        assert died.value.signal_name == "SIGKILL"
    finally:
        await runner.kill()
        await text.kill()


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGKILL])
async def test_signal_mid_request_is_noticed(short_tmp: Path, sig: signal.Signals) -> None:
    """A runner killed while a request waits on it fails that request with the signal."""
    runner = await Runner.start()
    try:
        await runner.create(spec(short_tmp))
        os.kill(runner.pid, signal.SIGSTOP)  # the request is surely in flight when it dies
        task = asyncio.ensure_future(collect(runner, ask(max_tokens=50)))
        await wait_until(lambda: bool(runner._pending))  # the request is sent (or queued)
        os.kill(runner.pid, sig)
        with contextlib.suppress(ProcessLookupError):  # after SIGKILL it may be reaped already
            os.kill(runner.pid, signal.SIGCONT)
        with pytest.raises(RunnerDied) as info:
            await task
        assert info.value.signal_name == sig.name
        # Nobody called kill(): the dead child's socket is closed all the same.
        assert runner._writer is not None and runner._writer.is_closing()
    finally:
        await runner.kill()


async def test_a_start_cancelled_at_any_point_leaves_no_runner() -> None:
    """Cancelling ``Runner.start`` (a load whose callers all left) kills the child it made."""
    for delay in (0.0, 0.001, 0.01, 0.05, 0.3):
        before = {p.pid for p in psutil.Process().children()}
        task = asyncio.ensure_future(Runner.start())
        await asyncio.sleep(delay)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            runner = await task
            await runner.close()  # it started before the cancel came
        made = [p.pid for p in psutil.Process().children() if p.pid not in before]
        for pid in made:
            wait_sync(functools.partial(process_gone, pid), what=f"runner {pid} gone")
    gc.collect()


def test_runner_dies_with_its_parent(short_tmp: Path) -> None:
    """kill -9 of the process that started a runner leaves no runner behind."""
    script = (
        "import asyncio, sys\n"
        "from modeld.engine.runner.client import Runner\n"
        "async def main():\n"
        "    r = await Runner.start()\n"
        "    print(r.pid, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert Path(f"/proc/{pid}").exists()
    parent.kill()
    parent.wait()
    parent.stdout.close()
    wait_sync(lambda: process_gone(pid), 10.0, "the orphaned runner gone")


@pytest.mark.parametrize(
    ("text", "finish", "status"),
    [
        ('{"a": 1}', "stop", "complete"),
        ("", "stop", "empty"),
        ('{"a": [1, 2', "length", "truncated"),
        ("sure! here", "stop", "not_json"),
        ("", "length", "truncated"),
    ],
)
def test_classify_json(text: str, finish: Finish, status: str) -> None:
    """JSON diagnostics tell complete, empty, truncated and not_json apart, keeping the raw text."""
    result = classify_json(text, finish)
    assert result["status"] == status and result["raw"] == text


def test_classify_json_with_a_schema_tells_a_mismatch_apart() -> None:
    """With a strict schema, complete JSON that does not match is *schema_mismatch*, naming
    where and why; matching JSON stays complete, and a cut reply stays truncated."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9}},
        "required": ["n"],
    }
    bad = classify_json('{"n": 12}', "stop", schema)
    assert bad["status"] == "schema_mismatch" and bad["raw"] == '{"n": 12}'
    assert str(bad["error"]).startswith(
        "complete but does not match the schema at n: 12 is greater"
    )
    missing = classify_json("{}", "stop", schema)
    assert missing["status"] == "schema_mismatch" and "'n' is a required property" in str(
        missing["error"]
    )
    assert classify_json('{"n": 3}', "stop", schema)["status"] == "complete"
    assert classify_json('{"n": 3', "length", schema)["status"] == "truncated"


def test_crash_reason_keeps_tflite_errors_and_the_first_cause() -> None:
    """TFLite's ``ERROR: `` lines count, and the first one (the cause) survives a long tail."""
    tail = [
        "INFO: Created TensorFlow Lite XNNPACK delegate for CPU.",
        "ERROR: third_party/tensorflow/lite/delegates/xnnpack/weight_cache.cc:151: could not "
        "write initial cache header in /x/model.xnnpack_cache: No space left on device.",
        "ERROR: third_party/tensorflow/lite/delegates/xnnpack/weight_cache.cc:172: could not "
        "read cache file header.",
        "ERROR: XNNPack delegate failed to start cache build step.",
        "W0000 00:00:1796005495.406052    8811 litert_lm_loader.cc:391] Section not found",
        "F0000 00:00:1730000000.123456   12345 weight_cache.cc:750] Inserting data failed.",
    ]
    reason = crash_reason(tail)
    assert reason is not None
    parts = reason.split(" | ")
    assert len(parts) == 3
    assert "No space left on device" in parts[0]
    assert parts[1] == "ERROR: XNNPack delegate failed to start cache build step."
    assert parts[2] == "Inserting data failed."
    assert crash_reason(["INFO: fine", "W0000 00:00:1.0    1 a.cc:1] warn"]) is None


def test_stderr_log_keeps_everything_up_to_its_limit_then_head_and_tail() -> None:
    """A runner's stderr is kept whole while small; past the limit, its start and its end."""
    log = StderrLog(limit=400)
    lines = [f"line {i:03d} " + "x" * 10 for i in range(5)]
    for line in lines:
        log.append(line)
    assert log.text() == "\n".join(lines)
    for i in range(5, 200):
        log.append(f"line {i:03d} " + "x" * 10)
    text = log.text()
    assert len(text) <= 450
    assert text.startswith("line 000 ")
    assert text.endswith("line 199 " + "x" * 10)
    kept = text.splitlines()
    marker = next(ln for ln in kept if ln.startswith("[..."))
    dropped = int(marker.split()[1])
    assert len(kept) - 1 + dropped == 200


def test_runner_gets_no_secrets_no_descriptors_and_a_data_limit(short_tmp: Path) -> None:
    """A real daemon's runner has a scrubbed environment (no token, no MODELD_* but
    MODELD_HOME), only its socket besides stdio, and an RLIMIT_DATA of twice the budget."""
    from tests.support.daemon import DaemonProcess, daemon_env
    from tests.support.state import install_fixture

    home, registry = short_tmp / "home", short_tmp / "registry"
    install_fixture(home, "tiny-text", TINY, registry=registry)
    budget = 3 << 30
    d = DaemonProcess(
        home=home,
        env=daemon_env(
            home,
            MODELD_REGISTRY=str(registry),
            MODELD_MEMORY_BUDGET=str(budget),
            MODELD_HF_TOKEN="hf_modeldsecret",
            HF_TOKEN="hf_hubsecret",
            GITHUB_TOKEN="ghp_othersecret",
        ),
    )
    d.start()
    try:
        d.cli_json("load", "tiny-text")
        (engine,) = d.cli_json("ps")["engines"]
        pid = engine["pid"]
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        # MODELD_HOME alone is kept: it names whose runner this is; no other MODELD_ variable.
        names = {kv.split(b"=", 1)[0] for kv in environ.split(b"\0") if kv}
        assert b"secret" not in environ, environ
        assert {n for n in names if n.startswith(b"MODELD_")} == {b"MODELD_HOME"}, names
        assert b"PATH=" in environ
        limits = Path(f"/proc/{pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max data size")]
        assert line.split()[3:5] == [str(2 * budget), str(2 * budget)], line
        fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        sockets = [n for n, target in fds.items() if n > 2 and target.startswith("socket:")]
        assert len(sockets) == 1, fds
        # Past stdio and the socket: only what the child opened itself (the model, /dev).
        assert all(
            not t.startswith(("socket:", "pipe:", str(home / "modeld.db")))
            for n, t in fds.items()
            if n > 2 and n not in sockets
        ), fds
    finally:
        d.stop()


def test_the_pinned_runtime_still_has_the_private_error_api() -> None:
    """Runners read the runtime's own failure text through ``litert_lm._ffi``, a private API:
    this fails when an upgraded runtime moved it, and says what to do."""
    import importlib.metadata
    import socket

    from modeld.engine.runner.child import _Child

    version = importlib.metadata.version("litert-lm-api")
    try:
        from litert_lm._ffi import _get_lib

        lib = _get_lib()
        for name in ("litert_lm_get_last_error_message", "litert_lm_clear_last_error"):
            getattr(lib, name)
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"litert-lm-api {version} moved the private error API that runners use ({e}). "
            "Runners still work, but their errors carry the exception text alone and may lose "
            "the backend_constraint code. Find the new place of the error text and update "
            "_bind_errors in modeld/engine/runner/child.py, or keep litert-lm-api below "
            f"{version} in pyproject.toml and constraints.txt."
        )
    a, b = socket.socketpair()
    with a, b:
        child = _Child(a)
        child._bind_errors()
        assert child._last_error is not None and child._clear_error is not None


def test_a_runtime_without_the_private_error_api_falls_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``litert_lm._ffi`` a runner's errors carry the exception's own text, and its
    stderr says why."""
    import socket

    from modeld.engine.runner.child import _Child

    monkeypatch.setitem(sys.modules, "litert_lm._ffi", None)  # as a runtime without it
    a, b = socket.socketpair()
    with a, b:
        child = _Child(a)
        child._bind_errors()
        assert child._last_error is None
        child.clear_error()
        assert child.runtime_reason(RuntimeError("Failed to create engine")) == (
            "RuntimeError: Failed to create engine"
        )
    assert "error text API is missing" in capsys.readouterr().err


def _streamed(engine: Any, drive: Any, stop_after: int | None = None) -> tuple[str, int]:
    """The text and chunk count of one reply of ``engine``, driven by ``drive``."""
    conversation = engine.create_conversation(max_output_tokens=24)
    parts: list[str] = []

    def on_message(message: dict[str, Any]) -> bool:
        parts.append(text_of(message))
        return stop_after is not None and len(parts) >= stop_after

    try:
        drive(conversation, "hello", {}, on_message)
    finally:
        conversation.close()
    return "".join(parts), len(parts)


def test_stream_reply_gives_what_the_public_streaming_api_gives(short_tmp: Path) -> None:
    """The callback path (the runtime's private API, no ``Message`` per token) streams the
    same chunks as ``send_message_async``, and stops at once when asked to."""
    from modeld.modelfile.runtime import create_engine

    engine = create_engine(spec(short_tmp, max_tokens=256))
    fast, fast_chunks = _streamed(engine, stream_reply)
    public, public_chunks = _streamed(engine, _stream_async)
    assert fast and fast == public and fast_chunks == public_chunks > 3
    cut, chunks = _streamed(engine, stream_reply, stop_after=2)
    assert chunks == 2 and fast.startswith(cut)
    # The engine is quiet after a stop: the next reply is whole again.
    assert _streamed(engine, stream_reply)[0] == fast
    # The runtime's callback threads kept their Python thread state (made once per thread,
    # not once per token): more replies add no thread.
    kept = set(KEPT_THREADS)
    assert kept and threading.get_ident() not in kept
    for _ in range(3):
        assert _streamed(engine, stream_reply)[0] == fast
    assert kept == KEPT_THREADS


def test_a_bare_sessions_stream_is_its_whole_reply(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PlainSession`` streams the text its whole reply gives, through the runtime's callback
    and, where a runtime moved that private API, through the public ``run_decode_async``; it
    stops when asked. A cancel before its decode ends it with nothing: the runtime's streamed
    decode never called back after a cancel that came during the prefill."""
    import litert_lm._ffi

    engine = create_engine(spec(short_tmp, max_tokens=256))
    template = engine.create_conversation()
    kwargs = {"max_output_tokens": 24}
    message = {"role": "user", "content": "hello there"}

    def streamed(stop_after: int | None = None, cancel_first: bool = False) -> list[str]:
        session = PlainSession(engine, template, kwargs)
        parts: list[str] = []

        def on_message(chunk: dict[str, Any]) -> bool:
            parts.append(text_of(chunk))
            return stop_after is not None and len(parts) >= stop_after

        if cancel_first:
            session.cancel_process()
        session.stream(message, on_message)
        session.close()
        return parts

    try:
        whole_session = PlainSession(engine, template, kwargs)
        whole = text_of(whole_session.send_message(message))
        whole_session.close()
        fast = streamed()
        assert len(fast) > 3 and "".join(fast) == whole
        cut = streamed(stop_after=2)
        assert len(cut) == 2 and whole.startswith("".join(cut))
        assert streamed(cancel_first=True) == []
        monkeypatch.delattr(litert_lm._ffi, "STREAM_CALLBACK_TYPE")
        assert "".join(streamed()) == whole
        cut = streamed(stop_after=2)
        assert len(cut) == 2 and whole.startswith("".join(cut))
        assert streamed(cancel_first=True) == []
    finally:
        template.close()
        engine.close()


def test_prompts_rendered_on_two_threads_at_once_come_out_right(short_tmp: Path) -> None:
    """The runner renders a running job's prompt on its generate thread and a waiting job's on
    the ``ahead`` thread, with one template conversation. Two renders at once on it gave a
    wrong prompt or raised UnicodeDecodeError (6 to 8 times in 40,000 with two threads
    rendering in a loop, in ~4 s); ``render`` takes them one at a time."""
    engine = create_engine(spec(short_tmp, LONG))
    template = engine.create_conversation()
    turns = [
        {"role": "user", "content": "Write a long story about the sea."},
        {"role": "user", "content": "hello there"},
    ]
    wrong: list[str] = []

    def go(turn: dict[str, Any], want: str) -> None:
        for _ in range(20_000):
            try:
                got = render(template, turn)
            except Exception as e:
                got = repr(e)
            if got != want:
                wrong.append(got)

    try:
        threads = [
            threading.Thread(target=go, args=(turn, template.render_message_to_string(turn)))
            for turn in turns
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not wrong
    finally:
        template.close()
        engine.close()


def test_a_chunk_reads_as_json_loads_reads_it() -> None:
    """The plain-text shortcut of ``parse_chunk`` gives what ``json.loads`` gives, for text
    the runtime escapes (quotes, backslashes, newlines, control characters), text it does
    not (accents, emoji, replacement characters), and chunks that are not plain text."""
    texts = ["", " asking", 'say "hi"', "a\\b", "line\nnext\t", "\x01", "café 🌊", "\ufffd" * 3]
    chunks = [
        json.dumps(
            {"role": "assistant", "content": [{"type": "text", "text": t}]},
            separators=(",", ":"),
            ensure_ascii=ascii_only,
        ).encode()
        for t in texts
        for ascii_only in (False, True)
    ]
    chunks.append(
        b'{"role":"assistant","tool_calls":[{"type":"function","function":'
        b'{"name":"f","arguments":{"x":1}}}]}'
    )
    chunks.append(b'{"role":"assistant","content":[{"type":"text","text":"a"},{"type":"x"}]}')
    for raw in chunks:
        assert parse_chunk(raw) == json.loads(raw), raw
    # Not JSON at all: the text as it came.
    assert text_of(parse_chunk(b"plain")) == "plain"


def test_the_pinned_runtime_still_has_the_private_streaming_api(short_tmp: Path) -> None:
    """Streamed replies use the runtime's private callback API (``stream_reply``); this fails
    when an upgraded runtime moved it, and says what to do."""
    import importlib.metadata

    from modeld.modelfile.runtime import create_engine

    version = importlib.metadata.version("litert-lm-api")
    engine = create_engine(spec(short_tmp, max_tokens=256))
    conversation = engine.create_conversation()
    try:
        from litert_lm._ffi import STREAM_CALLBACK_TYPE  # noqa: F401
        from litert_lm.conversation import normalize_message  # noqa: F401

        for name in (
            "litert_lm_conversation_send_message_stream",
            "litert_lm_stream_chunk_get_error",
            "litert_lm_stream_chunk_get_text",
            "litert_lm_stream_chunk_is_final",
        ):
            getattr(conversation._lib, name)
        for name in ("_create_optional_args", "_delete_optional_args", "_resolve_response_format"):
            getattr(conversation, name)
        # A bare session's stream (``PlainSession.stream``).
        session = engine.create_session(apply_prompt_template=False)
        try:
            assert session._lib.litert_lm_session_run_decode_async and session._ptr
        finally:
            session.close()
    except (ImportError, AttributeError) as e:
        pytest.fail(
            f"litert-lm-api {version} moved the private streaming API that runners use ({e}). "
            "Runners still stream, through send_message_async, at ~0.1 ms more per token. "
            "Update stream_reply in modeld/engine/runner/generate.py, or keep litert-lm-api "
            f"below {version} in pyproject.toml and constraints.txt."
        )
    finally:
        conversation.close()


def test_token_batcher_sends_a_new_replys_first_token_at_once() -> None:
    """Tokens within the window of the last frame wait; the first token of the next reply
    does not, and the waiting ones go before it."""
    from modeld.engine.runner.child import _TokenBatcher, split_frames

    frames = bytearray()
    batcher = _TokenBatcher(frames.extend, window=3600.0)
    batcher.add(1, "a")  # the first of a burst: at once
    batcher.add(1, "b")  # within the window: waits
    assert [(m["id"], m["token"]) for m in split_frames(frames)] == [(1, "a")]
    batcher.add(2, "c")
    assert [(m["id"], m["token"]) for m in split_frames(frames)] == [(1, "b"), (2, "c")]
    batcher.add(2, "d")
    batcher.flush()
    assert [(m["id"], m["token"]) for m in split_frames(frames)] == [(2, "d")]


def test_token_batcher_window_grows_over_a_reply_and_starts_short_again() -> None:
    """A reply's first token leaves at once; after each frame the window grows four times,
    from the first window up to the longest; the next reply starts again from the first."""
    from modeld.engine.runner.child import _TokenBatcher, split_frames

    frames = bytearray()
    batcher = _TokenBatcher(frames.extend, window=1000.0, longest=20000.0)
    windows = []
    for i in range(5):
        batcher.add(1, str(i))
        if i:
            batcher.flush()  # what the flusher does once the window is over
        windows.append(batcher.window)
    assert windows == [1000.0, 4000.0, 16000.0, 20000.0, 20000.0]
    assert [m["token"] for m in split_frames(frames)] == ["0", "1", "2", "3", "4"]
    batcher.add(2, "x")  # a new reply: at once, whatever the last window was
    assert [(m["id"], m["token"]) for m in split_frames(frames)] == [(2, "x")]
    assert batcher.window == 1000.0


def test_a_requests_sampler_fields_go_over_the_files() -> None:
    """What a request names goes over the file's sampler; a request that samples gets a
    top-k and a seed where neither names one; none named: the engine's own sampler."""
    gemma = {"top_k": 64, "top_p": 0.95, "temperature": 1.0}
    assert sampler_fields(Options(), gemma) == {}
    assert sampler_fields(Options(max_tokens=4, presence_penalty=1.0), gemma) == {}
    got = sampler_fields(Options(seed=3), gemma)
    assert got == {"top_k": 64, "top_p": 0.95, "temperature": 1.0, "seed": 3}
    got = sampler_fields(Options(temperature=0.7), {})
    assert got["top_k"] == DEFAULT_TOP_K and got["temperature"] == 0.7 and "seed" in got
    assert sampler_fields(Options(seed=1), {"temperature": 0.0}) == {
        "temperature": 0.0,
        "seed": 1,
        "top_k": 1,
    }
    seeds = {sampler_fields(Options(temperature=1.0), None)["seed"] for _ in range(8)}
    assert len(seeds) > 1
    assert sampler_defaults(str(TINY)) == {"top_k": None, "top_p": None, "temperature": 0.0}


async def test_a_reader_that_stops_holds_no_later_request(short_tmp: Path) -> None:
    """A request whose caller stops after its first record (a client that stops reading: its
    handler waits in a write) holds nothing of the engine once the runner is done with it:
    the requests after it are served, and the engine is ready again between them, since a
    job's turn ends when the runner's last record arrives, read or not (the engine stayed
    busy until the reader read, so its keep-alive and eviction waited on that client)."""
    from modeld.engine.pool import Pool, PoolConfig, Target
    from modeld.modelfile.plan import Plan

    pool = Pool(PoolConfig(budget=8 * 1024**3, spare=False), Runner.start)
    await pool.start()
    t = Target(
        model_id="tiny-text",
        digest="ab" * 32,
        plan=Plan(main="cpu"),
        spec=spec(short_tmp, max_tokens=256),
        estimate=100,
        max_tokens=256,
    )

    def job(**extra: Any) -> GenerateJob:
        made = typed(ask(**extra))
        assert isinstance(made, GenerateJob)
        return made

    async def whole(**extra: Any) -> list[Any]:
        return [rec async for rec in pool.generate(t, job(**extra))]

    try:
        stalled = pool.generate(t, job(max_tokens=40, seed=1))
        assert isinstance(await anext(stalled), Token)
        for n in range(2):
            records = await asyncio.wait_for(whole(max_tokens=3, seed=n), 60)
            assert not isinstance(records[-1], Token), records
        assert pool.list()[0]["state"] == "ready"
        await stalled.aclose()
    finally:
        await pool.stop()
