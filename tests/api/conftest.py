"""Fixtures of the OpenAI-format tests: a module defines ``daemon`` (an ``InProcessDaemon``
with the models it needs); these give an httpx client on its socket and the real ``openai``
client over that."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.support.daemon import InProcessDaemon, openai_over, socket_http


@pytest.fixture
async def http(daemon: InProcessDaemon) -> AsyncIterator[httpx.AsyncClient]:
    async with socket_http(daemon) as client:
        yield client


@pytest.fixture
def oa(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai_over(http)
