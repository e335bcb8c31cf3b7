"""The typed generation job: every option reaches every path that needs it, by construction."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from modeld.engine.runner.generate import conversation_args
from modeld.engine.runner.job import (
    DESTINATIONS,
    SESSION_TAKES,
    Done,
    Embedded,
    EmbedJob,
    GenerateJob,
    Message,
    Options,
    RunnerTimings,
    Shape,
    job_of,
    record_of,
    record_to_wire,
)

USER: tuple[Message, ...] = ({"role": "user", "content": "hi"},)
# A value for each option that is valid for the runtime and unlike the default (None).
SAMPLE: dict[str, Any] = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_k": 3,
    "top_p": 0.9,
    "seed": 11,
    "presence_penalty": 0.25,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.5,
}
OPTION_FIELDS = [f.name for f in dataclasses.fields(Options)]


def test_every_option_has_a_destination_and_a_sample() -> None:
    """Each option says where it goes in the runtime; a new one needs a sample here too."""
    for f in dataclasses.fields(Options):
        assert f.metadata["to"] in DESTINATIONS, f.name
    assert set(SAMPLE) == set(OPTION_FIELDS)


@pytest.mark.parametrize("name", OPTION_FIELDS)
def test_an_option_survives_the_wire(name: str) -> None:
    """A job with one option set reaches the runner with it (the frame and back)."""
    job = GenerateJob(USER, Options(**{name: SAMPLE[name]}), Shape(stop=("x",), json=True))
    wire = {"op": job.op, "id": 1, **job.to_wire()}
    again = job_of(wire.pop("op"), wire)
    assert again == job


@pytest.mark.parametrize("name", OPTION_FIELDS)
def test_an_option_reaches_the_runtime_and_the_keys_that_depend_on_it(name: str) -> None:
    """Set alone, an option lands in the runtime object of its destination; one the bare
    session takes is part of the made-ahead key, one it does not take keeps the job off
    the bare session."""
    field = next(f for f in dataclasses.fields(Options) if f.name == name)
    to = field.metadata["to"]
    runtime_name = field.metadata["name"] or name
    job = GenerateJob(USER, Options(**{name: SAMPLE[name]}))
    kwargs, _, _, send = conversation_args(job, {})
    if to == "sampler":
        assert getattr(kwargs["sampler_config"], runtime_name) == SAMPLE[name]
    elif to == "conversation":
        assert kwargs[runtime_name] == SAMPLE[name]
    else:
        assert getattr(send["repetition_penalty_config"], runtime_name) == SAMPLE[name]
    plain = GenerateJob(USER)
    if to in SESSION_TAKES:
        assert job.session_plain() and job.conversation_key() != plain.conversation_key()
        assert job.kept_settings() != plain.kept_settings()
    else:
        assert not job.session_plain() and job.conversation_key() == plain.conversation_key()
        assert not job.session_turns()


def test_an_added_option_reaches_every_derived_path() -> None:
    """An option added to the list is carried by each derivation with no other edit: the
    runtime arguments of its destination, the made-ahead key, the bare-session test."""
    for to in DESTINATIONS:
        extended = dataclasses.make_dataclass(
            "Extended",
            [
                (
                    "novel",
                    float | None,
                    dataclasses.field(default=None, metadata={"to": to, "name": None}),
                )
            ],
            bases=(Options,),
            frozen=True,
        )
        options = extended(novel=0.5)
        assert options.to(to) == {"novel": 0.5}
        job, plain = GenerateJob(USER, options), GenerateJob(USER, extended())
        if to in SESSION_TAKES:
            assert job.session_plain() and job.conversation_key() != plain.conversation_key()
            assert job.kept_settings() != plain.kept_settings()
        else:
            assert not job.session_plain() and not job.session_turns()


@pytest.mark.parametrize(
    ("shape", "plain"),
    [
        (Shape(), True),
        (Shape(stop=("x",), stream=False), True),
        (Shape(json=True), False),
        (Shape(schema={"type": "object"}), False),
        (Shape(tools=({"type": "function", "function": {"name": "f"}},)), False),
        (Shape(raw=True), False),
    ],
)
def test_what_shapes_a_conversation_keeps_a_job_from_made_ahead_paths(
    shape: Shape, plain: bool
) -> None:
    """Tools, a constraint or the raw template make a conversation for the job alone."""
    job = GenerateJob(USER, Options(seed=1), shape)
    assert (job.conversation_key() is not None) is plain
    assert job.session_plain() is plain


def test_history_or_a_nul_keeps_a_job_off_the_bare_session() -> None:
    """A second turn or a NUL in the text needs a conversation; text parts alone do not."""
    history = GenerateJob(({"role": "system", "content": "be brief"}, *USER))
    assert not history.session_plain() and history.conversation_key() is None
    assert not GenerateJob(({"role": "user", "content": "a\x00b"},)).session_plain()
    parts = GenerateJob(({"role": "user", "content": [{"type": "text", "text": "a"}]},))
    assert parts.session_plain()
    image = GenerateJob(({"role": "user", "content": [{"type": "image", "blob": "AA=="}]},))
    assert not image.session_plain()


def test_turns_of_text_go_on_a_bare_session_with_their_prompt_rendered() -> None:
    """A whole conversation of text from the system, the user and the assistant, ending
    with the user, is what a kept conversation is made of; a tool turn or tool call, an
    image, a NUL, or a last turn not the user's is not."""
    system: Message = {"role": "system", "content": "be brief"}
    hi: Message = {"role": "assistant", "content": "hi"}
    assert GenerateJob((system, *USER, hi, *USER)).session_turns()
    calls = {**hi, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    tool = {"role": "tool", "content": [{"type": "tool_response", "name": "f", "response": "1"}]}
    image = {"role": "user", "content": [{"type": "image", "blob": "AA=="}]}
    for messages in (
        (*USER, calls, *USER),
        (*USER, calls, tool),
        (image, hi, *USER),
        ({"role": "user", "content": "a\x00b"}, hi, *USER),
        (*USER, hi),
    ):
        assert not GenerateJob(messages).session_turns(), messages  # type: ignore[arg-type]


def test_records_survive_the_wire() -> None:
    """The runner's final records read back as they were sent."""
    done = Done(
        "length",
        prompt_tokens=4,
        tokens=9,
        timings=RunnerTimings(prefill=0.5, first_token=0.75, generate=1.0),
        constrained=True,
        text="{}",
        tool_calls=({"name": "f", "arguments": {"a": 1}},),
        json={"status": "complete", "raw": "{}", "error": None},
        conversation="ready",
        continued_tokens=3,
        restart="history",
        kept=2,
    )
    assert record_of(record_to_wire(done)) == done
    scoped = GenerateJob(USER, scope="key:webui:2026-12-05T07:00:00Z")
    assert job_of("generate", scoped.to_wire()) == scoped
    embedded = Embedded([[0.5, 0.25]], 2, RunnerTimings(prefill=0.125, embed=0.125))
    assert record_of(record_to_wire(embedded)) == embedded
    counted = Embedded([[0.5], [0.25]], 1, RunnerTimings(embed=0.125), tokens=(3, 4))
    assert record_of(record_to_wire(counted)) == counted
    assert counted.prompt_tokens == 7 and embedded.prompt_tokens is None
    job = EmbedJob(("a", "b"), 2)
    assert job_of("embed", job.to_wire()) == job


def test_a_malformed_frame_is_refused() -> None:
    """What the daemon never sends is a ValueError, never a half-read job."""
    with pytest.raises(ValueError, match="messages"):
        job_of("generate", {"messages": 5})
    with pytest.raises(ValueError, match="unknown job op"):
        job_of("dance", {})
    with pytest.raises(ValueError, match="finish"):
        record_of({"done": True, "finish": "maybe"})
