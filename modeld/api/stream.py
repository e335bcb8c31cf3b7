"""NDJSON streaming shared by every streaming route (pull progress, generation)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from aiohttp import web

from modeld.api.connections import client_left
from modeld.errors import ModeldError

NDJSON = "application/x-ndjson"
T = TypeVar("T")


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def as_is(record: dict[str, Any]) -> dict[str, Any]:
    """The ``as_json`` of records that are JSON objects already (pull progress)."""
    return record


async def ndjson(
    request: web.Request,
    records: AsyncGenerator[T, None],
    as_json: Callable[[T], dict[str, Any]],
) -> web.StreamResponse:
    """Stream ``records`` as NDJSON, each as ``as_json`` makes it a JSON object.

    An error before the first record becomes a plain error response with its status (the
    middleware maps it); an error after the stream started ends it with one
    ``{"error": {...}}`` record (the API's contract). A client that leaves closes the
    iterator, so the producer sees ``GeneratorExit`` / cancellation and can clean up, and
    the request ends with ``ClientLeft`` (499, logged as ``client_left``).
    """
    async with contextlib.aclosing(records):
        try:
            first = await anext(records)
        except StopAsyncIteration:
            first = None
        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
        try:
            await response.prepare(request)
            await _write_records(request, response, first, records, as_json)
            await response.write_eof()
        except ConnectionError as e:
            raise client_left(request) from e
    return response


async def _write_records(
    request: web.Request,
    response: web.StreamResponse,
    first: T | None,
    records: AsyncGenerator[T, None],
    as_json: Callable[[T], dict[str, Any]],
) -> None:
    try:
        if first is not None:
            await response.write(_line(as_json(first)))
            async for record in records:
                await response.write(_line(as_json(record)))
    except ModeldError as e:
        await response.write(_line(e.to_dict()))
    except ConnectionError:
        raise  # the client left: no record can reach it
    except Exception:
        logging.getLogger("modeld").exception("stream failed on %s", request.path)
        await response.write(
            _line(
                {"error": {"code": "internal", "message": "internal error; see the daemon's log"}}
            )
        )
