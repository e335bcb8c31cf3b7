"""NDJSON streaming shared by every streaming route (pull progress, generation), and the
deadline of a request on a model (``Deadline``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from aiohttp import web

from modeld import logs
from modeld.api.connections import client_left
from modeld.api.dialects import NATIVE, Dialect
from modeld.config import format_duration
from modeld.errors import DeadlineExceeded, ModeldError

NDJSON = "application/x-ndjson"
T = TypeVar("T")
# What the record that ends a stream (an error, the deadline's own) may take past the deadline.
LAST_WRITE_GRACE = 1.0


class Deadline:
    """The end of a request on a model: ``MODELD_REQUEST_TIMEOUT`` after it began.

    It covers every phase the request waits on: the engine's queue and load, the content
    checks, the prefill and decode (``records``), and the client's reading (``write``). Past
    it, a phase that waits for the model ends with ``DeadlineExceeded`` (its job is cancelled
    in the runner, which goes on with the next one); a write the client does not read closes
    the connection. A client that stops reading so loses its request, never the model.
    """

    def __init__(self, request: web.Request, seconds: float) -> None:
        self.request = request
        self.seconds = seconds
        self.at = asyncio.get_running_loop().time() + seconds

    def error(self) -> DeadlineExceeded:
        logs.event(
            "request_deadline",
            logging.WARNING,
            method=self.request.method,
            path=self.request.path,
            seconds=self.seconds,
        )
        return DeadlineExceeded(
            f"the request ran past MODELD_REQUEST_TIMEOUT ({format_duration(self.seconds)}) "
            "and was stopped; the model goes on with the next one. Ask for fewer tokens "
            "(max_tokens), or have the daemon's admin raise MODELD_REQUEST_TIMEOUT"
        )

    @contextlib.asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """Run the block until the deadline, then ``DeadlineExceeded``."""
        try:
            async with asyncio.timeout_at(self.at):
                yield
        except TimeoutError:
            raise self.error() from None

    async def records(self, records: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
        """``records`` until the deadline, then ``DeadlineExceeded`` (the producer closed)."""
        async with contextlib.aclosing(records):
            while True:
                async with self.bound():
                    rec = await anext(records, None)
                if rec is None:
                    return
                yield rec

    async def write(self, response: web.StreamResponse, data: bytes, *, last: bool = False) -> None:
        """Write ``data`` before the deadline (``last``: the stream's last record, which may
        take ``LAST_WRITE_GRACE`` past it); a client that does not read it by then is dropped
        (``ClientLeft``): nothing can reach it."""
        at = self.at
        if last:
            at = max(at, asyncio.get_running_loop().time() + LAST_WRITE_GRACE)
        try:
            async with asyncio.timeout_at(at):
                await response.write(data)
        except TimeoutError:
            self.error()
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise client_left(self.request) from None


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def as_is(record: dict[str, Any]) -> dict[str, Any]:
    """The ``as_json`` of records that are JSON objects already (pull progress)."""
    return record


async def ndjson(
    request: web.Request,
    records: AsyncGenerator[T, None],
    as_json: Callable[[T], dict[str, Any]],
    deadline: Deadline | None = None,
    dialect: Dialect = NATIVE,
) -> web.StreamResponse:
    """Stream ``records`` as NDJSON, each as ``as_json`` makes it a JSON object (within
    ``deadline``, when given).

    An error before the first record becomes a plain error response with its status (the
    middleware maps it); an error after the stream started ends it with one record, the
    error in ``dialect``'s shape (the native API's ``{"error": {...}}`` by default). A client
    that leaves closes the iterator, so the producer sees ``GeneratorExit`` / cancellation
    and can clean up, and the request ends with ``ClientLeft`` (499, logged as ``client_left``).
    """
    if deadline is not None:
        records = deadline.records(records)
    async with contextlib.aclosing(records):
        try:
            first = await anext(records)
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
        try:
            await response.prepare(request)
            await _write_records(
                request,
                response,
                first,
                records,
                as_json=as_json,
                deadline=deadline,
                dialect=dialect,
            )
            await response.write_eof()
        except ConnectionError as e:
            raise client_left(request) from e
    return response


async def _write_records(
    request: web.Request,
    response: web.StreamResponse,
    first: T | None,
    records: AsyncGenerator[T, None],
    *,
    as_json: Callable[[T], dict[str, Any]],
    deadline: Deadline | None,
    dialect: Dialect,
) -> None:
    async def write(data: bytes, last: bool = False) -> None:
        if deadline is None:
            await response.write(data)
        else:
            await deadline.write(response, data, last=last)

    try:
        if first is not None:
            await write(_line(as_json(first)))
            async for record in records:
                await write(_line(as_json(record)))
    except ConnectionError:
        raise  # the client left (or stopped reading): no record can reach it
    except ModeldError as e:
        await write(_line(dialect.shape(e)[1]), last=True)
    except Exception:
        logging.getLogger("modeld").exception("stream failed on %s", request.path)
        internal = ModeldError("internal error; see the daemon's log")
        await write(_line(dialect.shape(internal)[1]), last=True)
