"""Heavier real clients over TCP with a key: ``openai-agents`` (its default Responses model)
and ``litellm``. Not in the default run; see docs/development.md#heavy-clients:

    pip install -c constraints.txt -e '.[test,clients]' && pytest -m clients
"""

from __future__ import annotations

import os
from typing import Any

import openai
import pytest

from tests.api.conftest import KeyedTcp

pytestmark = [
    pytest.mark.clients,
    # These clients' own imports warn (pydantic on their types); not modeld's to fix.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# litellm reads its model price list from the network at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
agents: Any = pytest.importorskip("agents")
litellm: Any = pytest.importorskip("litellm")


async def test_an_agent_with_a_function_tool_runs_on_the_responses_api(
    keyed_tcp: KeyedTcp,
) -> None:
    """An ``openai-agents`` agent (its default Responses model) with one function tool runs
    on tiny-text: the model's words are noise, so what is held is the protocol: the run ends
    with a final output, or with the daemon's own words, never a protocol error."""
    agents.set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=keyed_tcp.base_url + "/v1", api_key=keyed_tcp.key)

    @agents.function_tool  # type: ignore[untyped-decorator]
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model="tiny-text", openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=12),
    )
    for streamed in (False, True):
        try:
            if streamed:
                run = agents.Runner.run_streamed(agent, "weather in Paris?", max_turns=3)
                async for _ in run.stream_events():
                    pass
                output = run.final_output
            else:
                output = (
                    await agents.Runner.run(agent, "weather in Paris?", max_turns=3)
                ).final_output
        except agents.MaxTurnsExceeded:
            continue  # the model kept calling the tool: the protocol held each turn
        except agents.ModelBehaviorError as e:
            # Random weights never end their turn: the reply runs to the limit, and the
            # daemon says so as OpenAI does (``incomplete``, ``max_output_tokens``).
            assert "response.incomplete" in str(e) and "max_output_tokens" in str(e), e
            continue
        except openai.APIStatusError as e:
            # A refusal is the daemon's own (an error body in OpenAI's shape), not a parse.
            assert isinstance(e.body, dict) and "message" in e.body, e
            continue
        assert isinstance(output, str)


def test_litellm_maps_overflow_and_a_bad_key(keyed_tcp: KeyedTcp) -> None:
    """litellm turns a prompt over the window into ``ContextWindowExceededError`` (so its
    context-window fallbacks fire) and a bad key into ``AuthenticationError``; a plain chat
    goes through."""
    base = {"model": "openai/tiny-text", "api_base": keyed_tcp.base_url + "/v1"}
    ok = litellm.completion(
        **base, api_key=keyed_tcp.key, max_tokens=3, messages=[{"role": "user", "content": "hi"}]
    )
    assert ok.usage.completion_tokens == 3
    long = [{"role": "user", "content": "zq " * 2700}]
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(**base, api_key=keyed_tcp.key, messages=long, num_retries=0)
    with pytest.raises(litellm.AuthenticationError):
        litellm.completion(
            **base, api_key="nope", messages=[{"role": "user", "content": "hi"}], num_retries=0
        )
