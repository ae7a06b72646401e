"""Server-sent events: `data: <json>\n\n` per event, `data: [DONE]\n\n` at the end, one error event in place
of the rest when something fails after the headers went out.

`stream_generation` (generation routes) and `stream_events` (an async iterator: programs) share the
response machinery. The headers go out with the first event, and a generation's last events with the end
marker and the chunk terminator, in one write. A `GenerationStream` is its Run's consumer: while the
client keeps up, the worker connection's read loop formats and writes each event in its own turn (no task
wake-up per event); when the client falls behind, increments queue up and the response's task writes them
with flow control, merged into one per choice (fewer, larger events; no unbounded buffer).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

from aiohttp import web

from services.gateway.http.errors import APIError, error_body
from services.gateway.http.json_out import dumps
from shared.protocol import GenerateRequest, TokenOutput, merge_outputs

if TYPE_CHECKING:
    from services.gateway.routing.dispatch import Dispatcher, Generation, GenerationResult

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    """`data` framed as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def encode_event(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


class Envelope:
    """`event(choice)` == `encode_event({**fields, "choices": [choice], **extra})`, with the fields encoded
    once per stream."""

    __slots__ = ("_head", "_tail")

    def __init__(self, fields: dict, **extra: Any):
        # In the encoding, `"choices":[0]` can only be that key: quotes inside strings are escaped.
        head, sep, tail = encode_event({**fields, "choices": [0], **extra}).partition(b'"choices":[0]')
        assert sep, "the envelope's fields hold no choices list"
        self._head, self._tail = head + b'"choices":[', b"]" + tail

    def event(self, choice: Any) -> bytes:
        return b"".join((self._head, dumps(choice), self._tail))


class EventFormat(Protocol):
    """A generation route's encoded SSE events, called in the read loop's turn: before any output, for one
    increment of request `index` (`result`: all it produced so far; b"" for none), after the last ended."""

    def head(self) -> bytes: ...

    def on_output(self, index: int, out: TokenOutput, result: "GenerationResult") -> bytes: ...

    def tail(self) -> bytes: ...


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class _ChunkWriter:
    """An SSE response's chunks: through aiohttp's write (flow control, errors), except while a plain chunked
    response's client keeps up (`ready`: the transport's buffer is empty), when they go to the transport
    at once, framed as aiohttp frames them."""

    __slots__ = ("_request", "_resp", "_transport")

    def __init__(self, request: web.Request, resp: web.StreamResponse):
        self._request, self._resp = request, resp
        self._transport: Any = None  # set once the headers are out

    def ready(self) -> bool:
        transport = self._transport
        return transport is not None and not transport.get_write_buffer_size() and not transport.is_closing()

    def write_now(self, data: bytes) -> None:
        self._transport.write(chunk(data))

    async def write(self, data: bytes) -> None:
        if self.ready():
            self.write_now(data)
            return
        await self._resp.write(data)
        headers = self._resp.headers
        if headers.get("Transfer-Encoding") == "chunked" and "Content-Encoding" not in headers:
            self._transport = self._request.transport

    async def write_eof(self, data: bytes) -> None:
        await self._resp.write_eof(data)


class _HeldHeadersResponse(web.StreamResponse):
    """Headers buffered at prepare() and sent in the first write (aiohttp 3.14's switch, set by Response)."""

    _send_headers_immediately = False


async def _respond(request: web.Request, produce: Callable[[_ChunkWriter, list[bytes]], Awaitable[None]],
                   headers: dict[str, str] | None, hold_headers: bool) -> web.StreamResponse:
    """An SSE response whose events `produce(writer, held)` writes; `held`: events that go out with the end."""
    resp = (_HeldHeadersResponse if hold_headers else web.StreamResponse)(headers={**SSE_HEADERS, **(headers or {})})
    await resp.prepare(request)
    out = _ChunkWriter(request, resp)
    held: list[bytes] = []
    try:
        await produce(out, held)
        held.append(DONE)
        await out.write_eof(b"".join(held))
        return resp
    except APIError as e:
        held.append(encode_event(e.body()))
    except ConnectionError:
        # The client hung up; the producer's cleanup already aborted its requests on the workers.
        return resp
    except Exception:
        log.exception("stream failed")
        held.append(encode_event(error_body("internal error while streaming", "internal_error")))
    try:
        await out.write_eof(b"".join(held))
    except ConnectionError:
        pass
    return resp


async def stream_events(request: web.Request, events: AsyncIterator[Any],
                        headers: dict[str, str] | None = None, hold_headers: bool = True) -> Any:
    """An SSE response of an async iterator's events, each written as it comes."""
    async def produce(out: _ChunkWriter, held: list[bytes]) -> None:
        async with aclosing(events) as it:  # leaving early (client gone) closes, and so aborts, its source
            async for event in it:
                await out.write(encode_event(event))

    return await _respond(request, produce, headers, hold_headers)


async def stream_generation(request: web.Request, dispatcher: "Dispatcher", reqs: Sequence[GenerateRequest],
                            fmt: EventFormat, headers: dict[str, str] | None = None) -> Any:
    """An SSE response of the requests' increments as `fmt` formats them (see the module docstring)."""
    async def produce(out: _ChunkWriter, held: list[bytes]) -> None:
        stream = GenerationStream(out, fmt, len(reqs), held)
        run = dispatcher.run(reqs, stream)
        try:
            head = fmt.head()
            if head:
                await out.write(head)
            await run.start()
            await stream.follow()
        finally:
            await run.close()  # aborts on the workers whatever did not finish (a failure, a client gone)

    return await _respond(request, produce, headers, True)


class GenerationStream:
    """The Run's consumer for an SSE response (module docstring)."""

    __slots__ = ("_out", "_fmt", "_held", "_running", "_backlog", "_waiter", "_error")

    def __init__(self, out: _ChunkWriter, fmt: EventFormat, count: int, held: list[bytes]):
        self._out, self._fmt, self._held = out, fmt, held
        self._running = count  # requests that have not ended
        self._backlog: list[tuple["Generation", Any]] = []  # increments the task has yet to take, in order
        self._waiter: asyncio.Future | None = None  # while the task waits in follow(): direct writes allowed
        self._error: Exception | None = None

    def deliver(self, gen: "Generation", item: TokenOutput | Exception) -> None:
        if self._error is not None or not self._running:
            return  # the stream is ending already
        if self._waiter is not None and not self._backlog and self._out.ready():
            try:
                data = self._take(gen, item)
            except Exception as e:  # the API's error (a worker's refusal, a lost worker) or a bug
                self._error = e
                self._wake()
                return
            if data:
                self._out.write_now(data)
            if not self._running:
                self._wake()  # the end: the task writes it, with the held events
            return
        self._backlog.append((gen, item))
        self._wake()

    async def follow(self) -> None:
        """The response's task: writes what queued up until every request ended; raises the first failure."""
        loop = asyncio.get_running_loop()
        while True:
            if self._error is not None:
                raise self._error
            if self._backlog:
                data = self._take_backlog()
                if data:
                    await self._out.write(data)
                continue
            if not self._running:
                return
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self, gen: "Generation", item: TokenOutput | Exception) -> bytes:
        """One increment's encoded events; b"" when there are none or they end the stream (then held)."""
        result = gen.accept(item)  # raises a failure
        self._running -= item.finished
        data = self._fmt.on_output(gen.index, item, result)
        if not self._running:
            self._held.append(data + self._fmt.tail())
            return b""
        return data

    def _take_backlog(self) -> bytes:
        """What queued up, merged per request (up to a failure, raised after what came before it)."""
        items, self._backlog = self._backlog, []
        merged: dict["Generation", TokenOutput] = {}
        failure = None
        for gen, item in items:
            if type(item) is not TokenOutput:
                failure = gen, item
                break
            prev = merged.get(gen)
            merged[gen] = item if prev is None else merge_outputs(prev, item)
        parts = []
        try:
            for gen, out in merged.items():
                parts.append(self._take(gen, out))
            if failure is not None:
                self._take(*failure)
        except Exception:
            self._held[:0] = parts  # what came before the failure goes out before its error event
            raise
        data = b"".join(parts)
        if not self._running:  # this increment ended the stream: one write with the end
            self._held.insert(0, data)
            return b""
        return data
