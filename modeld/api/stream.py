"""NDJSON streaming shared by every streaming route (pull progress, generation)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from modeld.errors import ModeldError

NDJSON = "application/x-ndjson"


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


async def ndjson(
    request: web.Request, records: AsyncGenerator[dict[str, Any], None]
) -> web.StreamResponse:
    """Stream ``records`` as NDJSON.

    An error before the first record becomes a plain error response with its status (the
    middleware maps it); an error after the stream started ends it with one
    ``{"error": {...}}`` record (the API's contract). A client that leaves closes the
    iterator, so the producer sees ``GeneratorExit`` / cancellation and can clean up.
    """
    try:
        first = await anext(records)
    except StopAsyncIteration:
        first = None
    response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-store"})
    await response.prepare(request)
    try:
        if first is not None:
            await response.write(_line(first))
            async for record in records:
                await response.write(_line(record))
    except ModeldError as e:
        await response.write(_line(e.to_dict()))
    except (ConnectionResetError, ConnectionError):
        # The client left; closing the iterator below cancels the work it was waiting on.
        pass
    except Exception:
        logging.getLogger("modeld").exception("stream failed on %s", request.path)
        await response.write(
            _line(
                {"error": {"code": "internal", "message": "internal error; see the daemon's log"}}
            )
        )
    finally:
        await records.aclose()
    await response.write_eof()
    return response
