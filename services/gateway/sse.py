"""Server-sent events: `data: <json>\n\n` per event, `data: [DONE]\n\n` at the end, one error event in place
of the rest when something fails after the headers went out.

Each event is its own socket write (a client waits for it), except those a producer wraps in `Tail`: the
events it knows the next ones follow at once (a stream's last increment, then its usage summary). Those
are held and go out with what follows - the end marker and the chunked-encoding terminator included - in
one write: three syscalls fewer per streamed request, a sizeable share of the gateway's CPU per request.

The response headers go out with the first event too (`hold_headers`, as aiohttp's own Response does
with its body): one write fewer per stream. The client sees the status line when the first event (or an
error) is ready instead of at once - the same bytes, in the same order. Streams whose first event may
take long for another reason than the model's first token (a program's) send them at once.
"""
from __future__ import annotations

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from aiohttp import web

from services.gateway.errors import APIError, error_body
from services.gateway.json_out import dumps

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class Tail:
    """An event its producer follows at once with more (or the end): sent together with those."""

    __slots__ = ("event",)

    def __init__(self, event: Any):
        self.event = event


def encode_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class _ChunkWriter:
    """Writes an SSE response's events as HTTP/1.1 chunks. The first goes through aiohttp (it carries the
    held headers); later ones, while the client keeps up (nothing left in the transport's buffer), go to
    the transport at once, framed as aiohttp frames them: StreamResponse.write's four Python layers were
    ~1 us of every event. When the client falls behind, or the response is not plain chunked, aiohttp's
    write takes over, with its flow control (it waits while the transport is paused) and its errors."""

    __slots__ = ("_request", "_resp", "_transport")

    def __init__(self, request: web.Request, resp: web.StreamResponse):
        self._request, self._resp = request, resp
        self._transport: Any = None  # set once the headers are out

    async def write(self, data: bytes) -> None:
        transport = self._transport
        if transport is not None and not transport.get_write_buffer_size() and not transport.is_closing():
            transport.write(b"%x\r\n%b\r\n" % (len(data), data))
            return
        await self._resp.write(data)
        headers = self._resp.headers
        if headers.get("Transfer-Encoding") == "chunked" and "Content-Encoding" not in headers:
            self._transport = self._request.transport


class _HeldHeadersResponse(web.StreamResponse):
    """Headers buffered at prepare() and sent in the first write (aiohttp 3.14's switch, set by Response)."""

    _send_headers_immediately = False


async def stream_events(request: web.Request, events: AsyncIterator[Any],
                        headers: dict[str, str] | None = None, hold_headers: bool = True) -> web.StreamResponse:
    kind = _HeldHeadersResponse if hold_headers else web.StreamResponse
    resp = kind(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                         "X-Accel-Buffering": "no", **(headers or {})})
    await resp.prepare(request)
    out = _ChunkWriter(request, resp)
    held: list[bytes] = []  # encoded Tail events not yet written
    try:
        async with aclosing(events) as it:
            async for event in it:
                if type(event) is Tail:
                    held.append(encode_event(event.event))
                    continue
                data = encode_event(event)
                if held:
                    held.append(data)
                    data = b"".join(held)
                    held.clear()
                await out.write(data)
        held.append(DONE)
        await resp.write_eof(b"".join(held))
        return resp
    except APIError as e:
        held.append(encode_event(e.body()))
    except ConnectionError:
        # The client hung up; closing `events` above already aborted its requests on the workers.
        return resp
    except Exception:
        log.exception("stream failed")
        held.append(encode_event(error_body("internal error while streaming", "internal_error")))
    try:
        await resp.write_eof(b"".join(held))
    except ConnectionError:
        pass
    return resp
