"""Conversations a runner keeps after a reply (``modeld.engine.runner.kept``), on the real
runtime with the tiny test models: a turn that continues one gets the reply a fresh
conversation gives, and a turn that differs anywhere from what was kept is never continued."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import litert_lm
import pytest

from modeld.engine.runner.client import Runner
from modeld.engine.runner.generate import can_keep
from modeld.engine.runner.job import Done, GenerateJob, Message, Options, Shape, Token
from modeld.engine.runner.kept import Kept, KeptConversations, chain, root, settings_of
from modeld.modelfile.runtime import create_engine
from tests.engine.test_realsize import CACHE, cached
from tests.engine.test_runner import spec
from tests.support.wait import until

SYSTEM: Message = {"role": "system", "content": "be brief"}
GREEDY: dict[str, Any] = {"max_tokens": 10, "temperature": 0.0}
PLAIN = Shape()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


# The real-size fixture whose random weights give the reply the test needs (not the
# pattern variant).
REAL_SIZE = CACHE / "gemma3-1b-real.litertlm"


@contextlib.asynccontextmanager
async def runner(tmp: Path, kept: int, model: Path | None = None) -> AsyncIterator[Runner]:
    """A runner on tiny-text (or ``model``) that keeps ``kept`` conversations (0: none)."""
    r = await Runner.start()
    try:
        made = spec(tmp, max_tokens=512, kept_conversations=kept)
        if model is not None:
            made = spec(tmp, model, max_tokens=4096, kept_conversations=kept)
        await r.create(made)
        yield r
    finally:
        await r.close()


async def reply(
    r: Runner,
    messages: list[Message],
    *,
    scope: str | None = "uid:1",
    shape: Shape = PLAIN,
    **options: Any,
) -> tuple[str, Done]:
    """The reply's text (streamed or whole, as ``shape`` says) and its final record."""
    job = GenerateJob(tuple(messages), Options(**(GREEDY | options)), shape, scope)
    text: list[str] = []
    async for rec in r.generate(job):
        if isinstance(rec, Token):
            text.append(rec.text)
        else:
            assert isinstance(rec, Done)
            return rec.text if rec.text is not None else "".join(text), rec
    raise AssertionError("no final record")


async def settled(r: Runner, kept: int = 1) -> None:
    """Wait until the runner keeps ``kept`` conversations (the last reply's is kept after
    its final record) with every reply prefilled (``_settle``)."""

    async def done() -> bool:
        stats = await r.call("stats")
        return bool(stats["kept"] == kept and stats["settling"] == 0)

    await until(done)


@pytest.mark.parametrize("pause", [False, True], ids=["at once", "after a pause"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    "options", [GREEDY, {"max_tokens": 10}], ids=["temperature 0", "the file's sampler"]
)
async def test_a_continued_turn_gets_the_reply_a_fresh_conversation_gets(
    short_tmp: Path, stream: bool, options: dict[str, Any], pause: bool
) -> None:
    """Over six turns of one chat (the whole history sent each time), every turn after the
    first continues the conversation kept after the last reply, and gets the same text and
    token counts as a runner that keeps none. The kept one holds at least the last prompt;
    after a pause, from the third turn on (once the chat has continued), the last reply too,
    prefilled meanwhile."""
    async with runner(short_tmp, 4) as keeping, runner(short_tmp, 0) as fresh:
        messages = [SYSTEM, user("hello there")]
        last_prompt = 0
        for n in range(6):
            if pause and n:
                await settled(keeping)
            shape = Shape(stream=stream)
            text, done = await reply(keeping, messages, shape=shape, **options)
            want, plain = await reply(fresh, messages, shape=shape, **options)
            assert (text, done.prompt_tokens, done.tokens) == (
                want,
                plain.prompt_tokens,
                plain.tokens,
            )
            assert done.finish == plain.finish == "length"
            assert plain.conversation != "continued" and plain.kept == 0
            assert plain.restart == ("first" if n == 0 else "off")
            if n == 0:
                assert done.restart == "first" and done.continued_tokens == 0
            else:
                assert done.conversation == "continued" and done.restart is None
                assert last_prompt <= done.continued_tokens < done.prompt_tokens
                if pause and n >= 2:
                    assert done.continued_tokens > last_prompt
            assert done.kept == 1
            last_prompt = done.prompt_tokens
            messages += [assistant(text), user(f"and then {n}?")]


@pytest.mark.realsize
@pytest.mark.timeout(900)
async def test_a_reply_sent_back_as_decoded_continues_as_a_fresh_conversation(
    short_tmp: Path,
) -> None:
    """On the real-size fixture, whose first reply to this chat is sixteen newlines: a
    rewound session kept the newlines its decode processed, and a prefill of the reply sent
    back took their cache entries as the decode had computed them, so the next reply was
    not a fresh conversation's. Continued at once (the second turn), and after its reply
    was prefilled in a pause (the third), the kept conversation gives the fresh replies."""
    questions = [
        "Question 1: island machine river question bread travel forest window memory market "
        "winter bread story reason story morning question history window morning city friend "
        "memory morning market language letter winter memory number question mountain the "
        "light?",
        "Question 2: forest the travel friend journey letter city garden summer journey "
        "history number light light letter bread travel morning window reason evening friend "
        "winter reason number light island letter journey?",
        "Question 3: and then?",
    ]
    cached(REAL_SIZE)
    async with (
        runner(short_tmp, 4, REAL_SIZE) as keeping,
        runner(short_tmp, 0, REAL_SIZE) as fresh,
    ):
        system = "You are a helpful assistant. Answer the user's questions in plain words."
        messages: list[Message] = [{"role": "system", "content": system}]
        for n, question in enumerate(questions):
            if n == 2:
                await settled(keeping)
            messages.append(user(question))
            text, done = await reply(keeping, messages, max_tokens=16)
            want, _ = await reply(fresh, messages, max_tokens=16)
            assert text == want, n
            assert (done.conversation == "continued") == (n > 0)
            if n == 0:
                assert text == "\n" * 16
            messages.append(assistant(text))


def _variants(first: str) -> list[tuple[str, list[Message], dict[str, Any], str | None]]:
    """Second turns after ``[SYSTEM, user("hello there")]`` answered ``first``: (what
    differs, messages, what else the job sets, the reason it is not continued)."""
    turn = [SYSTEM, user("hello there"), assistant(first), user("more")]
    return [
        ("nothing", turn, {}, None),
        ("an earlier turn", [SYSTEM, user("hello there!"), *turn[2:]], {}, "history"),
        ("the reply", [*turn[:2], assistant(first + " "), turn[3]], {}, "history"),
        ("the system prompt", [{"role": "system", "content": "be long"}, *turn[1:]], {}, "history"),
        # Its history digest is the kept one's, but the system prompt (hoisted to the top)
        # is not: the rendered prompt does not extend what the kept session holds.
        ("a system prompt added later", [*turn[:3], SYSTEM, turn[3]], {}, "prompt"),
        ("max_tokens", turn, {"max_tokens": 9}, "options"),
        ("the temperature", turn, {"temperature": 0.5, "top_k": 1}, "options"),
        ("a fixed seed that samples", turn, {"temperature": 0.9, "seed": 7}, "seeded"),
        ("a penalty", turn, {"frequency_penalty": 0.5}, "shape"),
        ("tools", turn, {"shape": Shape(tools=(WEATHER_TOOL,))}, "shape"),
        ("JSON", turn, {"shape": Shape(json=True)}, "shape"),
        ("the caller", turn, {"scope": "uid:2"}, "unknown"),
        ("no caller", turn, {"scope": None}, "anonymous"),
    ]


async def test_a_turn_that_differs_from_the_kept_conversation_is_never_continued(
    short_tmp: Path,
) -> None:
    """A second turn continues the kept conversation only when all it sent before its new
    turn is exactly the kept history and reply, with the same settings and caller: an edited
    earlier turn, a changed reply, another system prompt, other options, a seeded sampler,
    tools, JSON or a penalty, another caller or none each get a fresh conversation (with
    the reason counted), and the reply a runner that keeps none gives."""
    async with runner(short_tmp, 16) as keeping, runner(short_tmp, 0) as fresh:
        first = [SYSTEM, user("hello there")]
        base, _ = await reply(fresh, first)
        for what, messages, extra, reason in _variants(base):
            # The first turn again (kept again; the variant before may have used it).
            again, kept = await reply(keeping, first)
            assert again == base and kept.restart == "first"
            text, done = await reply(keeping, messages, **extra)
            want, _ = await reply(fresh, messages, **extra)
            assert text == want, what
            assert done.restart == reason, what
            assert (done.conversation == "continued") == (reason is None), what


async def test_a_reply_cut_by_a_stop_string_or_left_by_its_client_is_not_continued(
    short_tmp: Path,
) -> None:
    """A reply whose decode was cancelled (cut at a stop string) is not kept: the next turn,
    sent with the text its client got, gets a fresh conversation; one whose client left
    gets the fresh reply whatever the cancel's timing. A reply cut at max_tokens ended by
    itself: it is kept and continued."""
    async with runner(short_tmp, 4) as keeping, runner(short_tmp, 0) as fresh:
        first = [user("tell me about the sea")]
        whole, done = await reply(fresh, first, max_tokens=40)
        assert done.finish == "length"
        stop = whole[3:6]
        assert stop and whole.index(stop) >= 1
        cut, done = await reply(keeping, first, max_tokens=40, shape=Shape(stop=(stop,)))
        assert cut == whole[: whole.index(stop)] and done.finish == "stop"
        second = [*first, assistant(cut), user("more")]
        text, done = await reply(keeping, second, max_tokens=40)
        assert done.restart == "unknown" and text == (await reply(fresh, second, max_tokens=40))[0]

        # Left after its first token: cancelled in the runner (not kept), or, when the
        # decode ended before the cancel came, kept with the whole reply: its next turn,
        # sent with what the client got, continues only if that was the whole reply. Either
        # way it gets the fresh reply.
        options = Options(max_tokens=100, temperature=0.0)
        job = GenerateJob((user("a long story"),), options, Shape(), "uid:1")
        got = ""
        records = keeping.generate(job)
        async for rec in records:
            assert isinstance(rec, Token)
            got = rec.text
            break
        await records.aclose()
        second = [user("a long story"), assistant(got), user("more")]
        text, done = await reply(keeping, second, max_tokens=100)
        assert text == (await reply(fresh, second, max_tokens=100))[0]

        # Cut at max_tokens: kept, and the next turn continues it.
        first = [user("hello there")]
        short, done = await reply(keeping, first, max_tokens=3)
        assert done.finish == "length"
        second = [*first, assistant(short), user("more")]
        text, done = await reply(keeping, second, max_tokens=3)
        assert done.conversation == "continued"
        assert text == (await reply(fresh, second, max_tokens=3))[0]


async def test_kept_conversations_are_bounded_chats_last(short_tmp: Path) -> None:
    """An engine keeps at most MODELD_KEPT_CONVERSATIONS: to make room it drops the least
    recently used of those that never continued (one-shot requests between a chat's turns
    do not push the chat out), else the least recently used; the next turn of one dropped
    is not continued."""
    async with runner(short_tmp, 2) as keeping:
        chats: dict[str, list[Message]] = {}

        async def turn(name: str) -> Done:
            messages = chats.setdefault(name, [user(f"tell me about {name}")])
            text, done = await reply(keeping, messages)
            messages += [assistant(text), user("more")]
            return done

        assert (await turn("a")).kept == 1
        assert (await turn("b")).kept == 2
        assert (await turn("a")).conversation == "continued"  # a chat now
        assert (await turn("c")).kept == 2  # b goes, not the older chat
        assert (await turn("b")).restart == "history"  # kept again, in place of c
        assert (await turn("a")).conversation == "continued"
        assert (await turn("c")).restart == "history"
        # With only chats kept, the least recently used goes.
        assert (await turn("c")).conversation == "continued"  # a chat too: b goes
        assert (await turn("b")).restart == "history"  # b is kept again, in place of a
        assert (await turn("a")).restart == "history"


def test_the_digests_are_what_the_docs_say(short_tmp: Path) -> None:
    """A kept conversation is filed under sha256 chained over the caller's scope and each
    message in canonical JSON, and under the sha256 of its session's settings; a job finds
    it only with the same scope, messages and settings."""
    start = hashlib.sha256(b"modeld-kept-1\x00" + json.dumps("uid:1").encode()).digest()
    assert root("uid:1") == start
    message: Message = {"role": "user", "content": "héllo"}
    canonical = json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert chain(start, [message]) == [hashlib.sha256(start + canonical.encode()).digest()]

    job = GenerateJob((user("héllo"), assistant("hi"), user("more")), Options(**GREEDY))
    kept = KeptConversations(1)
    filed = Kept(None, "", (), 0, start, chain(start, job.messages[:2])[-1], settings_of(job))
    assert kept.keep(filed) == []
    assert kept.take(job, "uid:2") == (None, "unknown")
    other = GenerateJob(job.messages, Options(max_tokens=3))
    assert kept.take(other, "uid:1") == (None, "options")
    assert kept.take(job, "uid:1") == (filed, None) and len(kept) == 0


def test_the_pinned_runtime_still_has_the_private_checkpoint_api(short_tmp: Path) -> None:
    """Kept conversations use the runtime's private C API (a session's checkpoints, a
    conversation's preface render): a runtime upgrade that moves them fails here, not as
    engines that silently keep nothing."""
    engine = create_engine(spec(short_tmp))
    try:
        assert can_keep(engine)
        session = engine.create_session(
            apply_prompt_template=False, sampler_config=litert_lm.SamplerConfig(top_k=1)
        )
        try:
            assert session._lib.litert_lm_session_save_checkpoint(session._ptr, b"kept") == 0
        finally:
            session.close()
    finally:
        engine.close()
