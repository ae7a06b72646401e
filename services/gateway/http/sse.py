"""Server-sent events: `data: <json>\n\n` per event, `data: [DONE]\n\n` at the end, one error event in place
of the rest when something fails after the headers went out.

Two producers share the response: `stream_generation` (the generation routes: events formatted from
worker frames as they arrive) and `stream_events` (an async iterator of events: the program endpoint).

Each event is its own socket write (a client waits for it), except the events of a generation's last
increment and its usage summary: they go out with the end marker and the chunked-encoding terminator in
one write (three syscalls fewer per streamed request, a sizeable share of the gateway's CPU per request).
The response headers go out with the first event too (`hold_headers`, as aiohttp's own Response does
with its body): one write fewer per stream. The client sees the status line when the first event (or an
error) is ready instead of at once - the same bytes, in the same order. Streams whose first event may
take long for another reason than the model's first token (a program's) send them at once.

A generation stream (`GenerationStream`) is the consumer of its requests' Run: the worker connection's
read loop hands it each increment, and while the client keeps up (nothing left in the transport's
buffer) it formats, encodes and writes the event in that same call - no task wake-up and no generator
chain per event. Whenever the client falls behind (and before the first event), increments
queue up instead and the response's own task writes them, with flow control (it waits while the
transport is paused); what queued meanwhile is merged into one increment per choice, so a slow client
gets fewer, larger events: no unbounded buffer, no lost token.
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
    """The event of a choices list around one choice, encoded once per stream: `event(choice)` is
    `encode_event({**fields, "choices": [choice], **extra})`, byte for byte, at the cost of encoding the
    choice alone (an OpenAI chunk repeats its id, object, created and model in every event)."""

    __slots__ = ("_head", "_tail")

    def __init__(self, fields: dict, **extra: Any):
        # In the encoding, `"choices":[0]` can only be that key: quotes inside strings are escaped.
        head, sep, tail = encode_event({**fields, "choices": [0], **extra}).partition(b'"choices":[0]')
        assert sep, "the envelope's fields hold no choices list"
        self._head, self._tail = head + b'"choices":[', b"]" + tail

    def event(self, choice: Any) -> bytes:
        return b"".join((self._head, dumps(choice), self._tail))


class EventFormat(Protocol):
    """A generation route's SSE events, encoded (`encode_event`, `Envelope`), for its Run's increments.
    Called in the read loop's turn: plain, quick functions."""

    def head(self) -> bytes:
        """Events before any output."""

    def on_output(self, index: int, out: TokenOutput, result: "GenerationResult") -> bytes:
        """Events for one increment of request `index` (`result`: everything it produced so far); b"" for
        none."""

    def tail(self) -> bytes:
        """Events after the last request ended (the usage summary)."""


SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class _ChunkWriter:
    """Where an SSE response's events go: HTTP/1.1 chunks of an aiohttp StreamResponse. The first chunk goes through aiohttp (it carries the
    held headers); later ones, while the client keeps up (`ready`: nothing left in the transport's
    buffer), may go to the transport at once, framed as aiohttp frames them: StreamResponse.write's four
    Python layers were ~1 us of every event. When the client falls behind, or the response is not plain
    chunked, aiohttp's write takes over, with its flow control (it waits while the transport is paused)
    and its errors."""

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
    """An SSE response whose events `produce(writer, held)` writes; `held`: encoded events that go out
    with the end (the end marker, or an error event in its place)."""
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
    """The Run's consumer for an SSE response: formats and writes increments from the read loop while the
    client keeps up, queues them for the response's task (`follow`) otherwise."""

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
        """The response's task: waits while the read loop writes; writes what queued up; returns when
        every request ended (the end's events in `held`), raises the first failure."""
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
        """Account and format one increment: its encoded events, or b"" (nothing to say, or the end's
        events, which are held)."""
        result = gen.accept(item)  # raises a failure
        self._running -= item.finished
        data = self._fmt.on_output(gen.index, item, result)
        if not self._running:
            self._held.append(data + self._fmt.tail())
            return b""
        return data

    def _take_backlog(self) -> bytes:
        """What queued up, each request's increments merged into one (up to a failure, raised after the
        increments before it are formatted); the encoded events, or b"" when they end the stream (then
        held with the end)."""
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
