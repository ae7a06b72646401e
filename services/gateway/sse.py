"""Server-sent events: `data: <json>\n\n` per event, `data: [DONE]\n\n` at the end, one error event in place
of the rest when something fails after the headers went out."""
from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.gateway.errors import APIError, error_body
from services.gateway.json_out import dumps

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def encode_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


async def stream_events(request: web.Request, events: AsyncIterator[dict],
                        headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", **(headers or {})})
    await resp.prepare(request)
    try:
        async with aclosing(events) as it:
            async for event in it:
                await resp.write(encode_event(event))
        await resp.write(DONE)
    except APIError as e:
        await _write_quietly(resp, encode_event(e.body()))
    except ConnectionError:
        # The client hung up; closing `events` above already aborted its requests on the workers.
        return resp
    except Exception:
        log.exception("stream failed")
        await _write_quietly(resp, encode_event(error_body("internal error while streaming", "internal_error")))
    await _write_quietly(resp, None)
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes | None) -> None:
    try:
        if data is None:
            await resp.write_eof()
        else:
            await resp.write(data)
    except ConnectionError:
        pass
