"""The generation routes' HTTP front: a protocol-level HTTP/1.1 server in front of aiohttp.

aiohttp's request and response objects and its writer cost ~105-160 us of every generation request
(bench/RESULTS.md, "The HTTP stack's floor"): a third of the gateway's CPU per streamed request. The front
serves the routes that carry that traffic (POST /v1/completions, /v1/chat/completions, /generate; the
table is app.py's) straight from the socket: it reads the request head and body itself, runs the same
translator with a `FrontRequest` in place of aiohttp's request, and writes the response, or its SSE
chunks, to the transport.

Everything else goes to aiohttp, unchanged: at a message boundary, a request the front does not serve
(another route, a query string, HTTP/1.0, chunked or oversized bodies, an Upgrade, a header it does not
read exactly, a head that is not yet whole after 64 KiB) hands the connection over. Once the requests
before it are answered, the front switches the transport's protocol to an aiohttp request handler and
gives it every byte from that request on; the connection stays with aiohttp. The front's parser is
strict (one Content-Length of digits, one Host, token header names, printable ASCII values, CRLF line
ends: a head with a bare LF goes to aiohttp as soon as one arrives) and anything it would have to be
lenient about is aiohttp's to judge, so both never disagree on where a message ends.

What aiohttp's handler does for a request, the front does too: the access-log line and X-Request-Id,
API-key checks (auth.py), OpenAI-style errors, `Expect: 100-continue`, keep-alive with aiohttp's idle
timeout, pipelining (answered in order), write flow control, the handler cancelled when the client hangs
up (its requests are aborted on the workers), and draining on shutdown (requests in flight finish, up to
the runner's shutdown timeout).
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from http import HTTPStatus
from email.utils import formatdate
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.tcp_helpers import tcp_keepalive

from services.gateway.access_log import CURRENT, HEADER as REQUEST_ID, AccessRecord, log_access, request_id_from
from services.gateway.auth import authorize
from services.gateway.errors import APIError, internal_error
from services.gateway.json_out import dumps
from services.gateway.sse import chunk
from services.gateway.tenancy import CACHE_SALT
from shared.errors import InvalidRequest

if TYPE_CHECKING:
    from services.gateway.state import GatewayState

log = logging.getLogger(__name__)

Route = Callable[["GatewayState", Any], Awaitable[Any]]

MAX_HEAD = 65536  # request line and headers: a longer head goes to aiohttp (which answers 431/400)
MAX_LINE = 8190  # aiohttp's max_line_size / max_field_size
MAX_HEADERS = 100  # aiohttp's max_headers is 128
_QUEUED = 16  # pipelined requests read ahead before reading pauses
_HELD_COLD = 1 << 20  # bytes read ahead of a handover before reading pauses

# A header line exactly as the front reads it: a token name, optional spaces or tabs, a value of
# printable ASCII (VCHAR, SP, HTAB; no obs-text, no obs-fold), CRLF.
_HEADER_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+):[ \t]*((?:[\x21-\x7e][\x20-\x7e\t]*)?)\r\n")
# Headers whose second copy the front would have to merge or choose between: aiohttp's to judge.
_SINGLE = frozenset({b"content-length", b"authorization", b"x-request-id", b"expect", b"connection", b"host",
                     b"content-type"})
_COLD_HEADERS = frozenset({b"transfer-encoding", b"upgrade", b"content-encoding"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNK_END = b"0\r\n\r\n"
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_REQUEST_ID = REQUEST_ID.encode()


class _Message:
    """One request the front serves: its route and what it read of the head; `body` once whole."""

    __slots__ = ("path", "route", "length", "close", "expect", "authorization", "request_id", "body", "_ready")

    def __init__(self, path: str, route: Route, length: int, close: bool, expect: bool, authorization: str,
                 request_id: str):
        self.path, self.route, self.length, self.close, self.expect = path, route, length, close, expect
        self.authorization, self.request_id = authorization, request_id
        self.body: bytes | None = None
        self._ready: asyncio.Future | None = None

    def complete(self, body: bytes) -> None:
        self.body = body
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def ready(self) -> asyncio.Future:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
        return self._ready


def _parse_head(head: bytes, routes: dict[bytes, tuple[str, Route]], max_body: int) -> _Message | None:
    """The request `head` (request line and header lines, each ending in CRLF; not the blank line) as a
    message the front serves, or None: the connection goes to aiohttp from this request on."""
    line_end = head.find(b"\r\n")
    hit = routes.get(head[:line_end])  # the whole request line: b"POST /generate HTTP/1.1"
    if hit is None:
        return None
    fields: dict[bytes, bytes] = {}
    pos, end, count = line_end + 2, len(head), 0
    match = _HEADER_LINE.match
    while pos < end:
        m = match(head, pos)
        if m is None or m.end() - pos > MAX_LINE:
            return None
        name = m.group(1).lower()
        if name in fields:
            if name in _SINGLE:
                return None
            fields[name] += b", " + m.group(2).rstrip()
        else:
            fields[name] = m.group(2).rstrip()
        count += 1
        pos = m.end()
    if count > MAX_HEADERS or not _COLD_HEADERS.isdisjoint(fields) or b"host" not in fields:
        return None  # (an HTTP/1.1 request without Host is aiohttp's to refuse, 400)
    length = 0
    raw_length = fields.get(b"content-length")
    if raw_length is not None:
        if not raw_length.isdigit() or len(raw_length) > 15:
            return None
        length = int(raw_length)
        if length > max_body:
            return None  # aiohttp answers 413 (its client_max_size is the same limit)
    expect = False
    raw_expect = fields.get(b"expect")
    if raw_expect is not None:
        if raw_expect.lower() != b"100-continue":
            return None
        expect = True
    close = False
    raw_conn = fields.get(b"connection")
    if raw_conn is not None:
        tokens = {t.strip() for t in raw_conn.lower().split(b",")}
        if b"upgrade" in tokens:
            return None
        close = b"close" in tokens
    path, route = hit
    return _Message(path, route, length, close, expect, fields.get(b"authorization", b"").decode("ascii"),
                    fields.get(b"x-request-id", b"").decode("ascii"))


_date_second = -1
_date_line = b""


def _date() -> bytes:
    """The Date header line, formatted once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second, _date_line = now, b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_line


_LINES: dict[tuple[str, str], bytes] = {}  # header lines already encoded (the routes' few fixed ones)
_MAX_LINES = 256


def _header_line(name: str, value: str) -> bytes:
    line = _LINES.get((name, value))
    if line is None:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"newline in response header {name!r}")
        line = f"{name}: {value}\r\n".encode("utf-8")
        if len(_LINES) < _MAX_LINES:  # past the first 256 (Warnings naming a client's keys): encoded each time
            _LINES[(name, value)] = line
    return line


def _response_head(status: int, headers: Iterable[tuple[str, str]], request_id: str, close: bool,
                   framing: bytes) -> bytes:
    """Status line and headers; `framing`: the Content-Length or Transfer-Encoding line."""
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown")), framing, _date()]
    for name, value in headers:
        parts.append(_header_line(name, value))
    parts.append(b"%b: %b\r\n" % (_REQUEST_ID, request_id.encode()))
    parts.append(b"Connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(parts)


class FrontRequest:
    """What a translator reads of its request on the front (aiohttp's web.Request on every other path):
    the body, the tenant's cache salt (`request.get(CACHE_SALT)`), and an SSE response to open."""

    __slots__ = ("_conn", "_msg", "request_id", "salt", "stream")

    def __init__(self, conn: "FrontProtocol", msg: _Message, request_id: str):
        self._conn, self._msg, self.request_id = conn, msg, request_id
        self.salt: str | None = None
        self.stream: _FrontEventWriter | None = None

    def get(self, key: Any, default: Any = None) -> Any:
        if key is CACHE_SALT and self.salt is not None:
            return self.salt
        return default

    async def read(self) -> bytes:
        msg = self._msg
        if msg.body is None:
            if msg.expect:
                msg.expect = False
                self._conn.write(_CONTINUE)
            await msg.ready()
        return msg.body  # type: ignore[return-value]

    def open_event_stream(self, headers: dict[str, str], hold_headers: bool) -> "_FrontEventWriter":
        """sse.py's EventWriter for this request: a chunked 200 response on the connection."""
        self.stream = _FrontEventWriter(self._conn, _response_head(
            200, headers.items(), self.request_id, self._conn.closing_after(self._msg),
            b"Transfer-Encoding: chunked\r\n"), hold_headers)
        return self.stream


class _FrontEventWriter:
    """sse.py's EventWriter on the front: HTTP/1.1 chunks written to the transport; the headers with the
    first chunk when held (from the read loop too: a stream's first event needs no wake-up of its task)."""

    __slots__ = ("_conn", "_transport", "_head")

    def __init__(self, conn: "FrontProtocol", head: bytes, hold: bool):
        self._conn, self._transport = conn, conn.transport
        self._head: bytes | None = head
        if not hold:
            self._send(b"")

    def _send(self, data: bytes) -> None:
        head, self._head = self._head, None
        self._conn.write(head + data if head is not None else data)

    def ready(self) -> bool:
        transport = self._transport
        return not transport.get_write_buffer_size() and not transport.is_closing()

    def write_now(self, data: bytes) -> None:
        head = self._head
        if head is None:
            self._transport.write(chunk(data))
        else:
            self._head = None
            self._transport.write(head + chunk(data))

    async def write(self, data: bytes) -> None:
        self._send(chunk(data))
        await self._conn.drain()

    async def write_eof(self, data: bytes) -> None:
        self._send((chunk(data) if data else b"") + _CHUNK_END)


class FrontProtocol(asyncio.Protocol):
    """One client connection while the front serves it (see the module docstring)."""

    __slots__ = ("transport", "_server", "_loop", "_buf", "_filling", "_queue", "_cold", "_task", "_wake", "_busy",
                 "_closing", "_read_paused", "_write_paused", "_drain", "_idle_since", "_idle_handle",
                 "__weakref__")

    def __init__(self, server: "FrontServer"):
        self._server = server
        self._loop = server.loop
        self.transport: Any = None
        self._buf = bytearray()
        self._filling: tuple[_Message, int] | None = None  # a message whose body is still coming, its offset
        self._queue: deque[_Message] = deque()  # parsed, not yet answered (the first may be in progress)
        self._cold = False  # the buffer starts with a request for aiohttp: hand over once the queue is done
        self._task: asyncio.Task | None = None  # serves the requests; started with the first one
        self._wake: asyncio.Future | None = None  # the serving task waits here for a request
        self._busy = False  # a request is being answered
        self._closing = False  # close once the request in progress is answered (shutdown, Connection: close)
        self._read_paused = False
        self._write_paused = False
        self._drain: asyncio.Future | None = None
        self._idle_since = 0.0
        self._idle_handle: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        tcp_keepalive(transport)
        self._server.connections.add(self)
        self._idle_since = self._loop.time()
        timeout = self._server.keepalive_timeout
        if timeout > 0:
            self._idle_handle = self._loop.call_at(self._idle_since + timeout, self._check_idle)

    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._cold:
            if len(self._buf) > _HELD_COLD:
                self._pause_reading()
            return
        self._parse()

    def eof_received(self) -> None:
        return None  # as aiohttp: the transport closes (a half-closed client is a gone client)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._server.connections.discard(self)
        self._closing = True
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("connection lost"))
            self._drain.exception()  # retrieved: nobody may be waiting
        if self._task is not None and not self._task.done():
            if self._busy:
                self._task.cancel()  # the handler's cleanup aborts its requests on the workers
            else:
                # Between requests (every client that closes its connection): the task sees the
                # connection closing and returns. A cancellation would leave a CancelledError whose
                # traceback holds this protocol and its task in a cycle, garbage only the cyclic
                # collector frees.
                self._wake_task()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ------------------------------------------------------------------ reading
    def _parse(self) -> None:
        buf = self._buf
        while True:
            if self._filling is not None:
                msg, start = self._filling
                end = start + msg.length
                if len(buf) < end:
                    return
                body = bytes(buf[start:end])
                del buf[:end]
                self._filling = None
                msg.complete(body)
                continue
            if not buf:
                return
            head_end = buf.find(b"\r\n\r\n", 0, MAX_HEAD)
            if head_end < 0:
                # A head that will not end in CRLF CRLF (bare LF line ends) or will not fit: aiohttp's,
                # now; waiting for more would leave the client unanswered.
                if len(buf) >= MAX_HEAD or buf.count(b"\n") != buf.count(b"\r\n"):
                    self._go_cold()
                return
            msg = _parse_head(bytes(buf[:head_end + 2]), self._server.routes, self._server.max_body)
            if msg is None:
                self._go_cold()
                return
            self._filling = msg, head_end + 4
            self._queue.append(msg)
            if len(self._queue) >= _QUEUED:
                self._pause_reading()
            self._wake_task()

    def _go_cold(self) -> None:
        self._cold = True
        self._wake_task()

    def _pause_reading(self) -> None:
        if not self._read_paused and not self.transport.is_closing():
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._read_paused:
            self._read_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    # ------------------------------------------------------------------ writing
    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if self._write_paused:
            if self._drain is None:
                self._drain = self._loop.create_future()
            await asyncio.shield(self._drain)

    def closing_after(self, msg: _Message) -> bool:
        """Whether the connection closes once `msg` is answered (the response says Connection: close)."""
        return msg.close or self._closing

    # ------------------------------------------------------------------ serving
    def _wake_task(self) -> None:
        """The serving task has something to do: started with the connection's first request (one task
        step and one wait less for the many clients that send one request a connection), woken when it
        waits for the next."""
        if self._task is None:
            self._task = self._loop.create_task(self._serve())
            self._server.track(self._task)
            return
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _check_idle(self) -> None:
        timeout, now = self._server.keepalive_timeout, self._loop.time()
        due = self._idle_since + timeout
        if self._busy or self._queue:
            self._idle_handle = self._loop.call_at(now + timeout, self._check_idle)
        elif now < due:
            self._idle_handle = self._loop.call_at(due, self._check_idle)
        else:
            self._idle_handle = None
            self.transport.close()

    def close_when_idle(self) -> None:
        """Shutdown: answer the request in progress, then close (pipelined requests behind it are not
        started, as aiohttp does)."""
        self._closing = True
        if not self._busy:
            self.transport.close()
        if self._task is not None:
            self._wake_task()

    async def _serve(self) -> None:
        queue = self._queue
        while True:
            while not queue:
                if self._closing or self.transport.is_closing():
                    self.transport.close()
                    return
                if self._cold:
                    self._hand_over()
                    return
                self._wake = self._loop.create_future()
                try:
                    await self._wake
                finally:
                    self._wake = None
            if self._closing:
                self.transport.close()
                return
            msg = queue[0]
            self._busy = True
            try:
                await self._handle(msg)
            finally:
                queue.popleft()
                self._busy = False
                self._idle_since = self._loop.time()
            if len(queue) < _QUEUED // 2 and not self._cold:
                self._resume_reading()
            if msg.close or msg.body is None or self._closing:
                # Connection: close, or answered before its body came (it may never come: a refused
                # Expect: 100-continue): the stream cannot be trusted for another request.
                self.transport.close()
                return

    def _hand_over(self) -> None:
        """From the buffer's first byte on, the connection is aiohttp's."""
        handler = self._server.web_server()
        self._server.handed_over += 1
        transport = self.transport
        self._server.connections.discard(self)
        if self._idle_handle is not None:
            self._idle_handle.cancel()
            self._idle_handle = None
        self._resume_reading()
        data = bytes(self._buf)
        self._buf.clear()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._write_paused:
            handler.pause_writing()
        if data:
            handler.data_received(data)

    async def _handle(self, msg: _Message) -> None:
        server = self._server
        server.served += 1
        record = AccessRecord(request_id_from(msg.request_id))
        token = CURRENT.set(record)
        req = FrontRequest(self, msg, record.request_id)
        status = 499  # the client went away (the handler cancelled)
        try:
            try:
                req.salt = authorize(server.state, msg.path, msg.authorization)
                resp = await msg.route(server.state, req)
                if req.stream is None:
                    status = resp.status
                    self._respond(msg, req, status, resp.headers.items(), resp.body or b"")
                else:
                    status = 200
            except ConnectionError:
                pass
            except Exception as e:
                if isinstance(e, InvalidRequest):
                    e = APIError.from_invalid(e)
                elif not isinstance(e, APIError):
                    log.exception("unhandled error on POST %s", msg.path)
                    e = internal_error()
                status = e.status
                self._respond_json(msg, req, status, e.body())
        finally:
            CURRENT.reset(token)
            log_access(record, "POST", msg.path, status)

    def _respond_json(self, msg: _Message, req: FrontRequest, status: int, body: Any) -> None:
        self._respond(msg, req, status, (("Content-Type", "application/json; charset=utf-8"),), dumps(body))

    def _respond(self, msg: _Message, req: FrontRequest, status: int, headers: Iterable[tuple[str, str]],
                 body: bytes) -> None:
        if req.stream is not None:
            # The stream's headers went out: nothing else can be said on this connection.
            self._closing = True
            return
        if self.transport.is_closing():
            return
        close = self.closing_after(msg) or msg.body is None
        self.transport.write(_response_head(status, headers, req.request_id, close,
                                            b"Content-Length: %d\r\n" % len(body)) + body)


class FrontServer:
    """The protocol factory a site listens with (in place of aiohttp's web.Server, which it wraps: every
    connection the front hands over is that server's, and so is its shutdown)."""

    def __init__(self, web_server: web.Server, state: "GatewayState", routes: dict[str, Route],
                 keepalive_timeout: float = 3630.0):
        self.web_server = web_server
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.routes = {f"POST {path} HTTP/1.1".encode(): (path, route) for path, route in routes.items()}
        self.max_body = state.limits.max_body_bytes
        self.keepalive_timeout = keepalive_timeout  # aiohttp's default
        self.connections: set[FrontProtocol] = set()
        self.served = 0  # requests the front answered itself (the rest were aiohttp's)
        self.handed_over = 0  # connections given to aiohttp
        self._tasks: set[asyncio.Task] = set()  # connections' serving tasks that have not ended

    def __call__(self) -> FrontProtocol:
        return FrontProtocol(self)

    def track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def pre_shutdown(self) -> None:
        self.web_server.pre_shutdown()
        for conn in list(self.connections):
            conn.close_when_idle()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Requests in flight get `timeout` s to finish (aiohttp's and the front's alike), then are
        cancelled."""
        await asyncio.gather(self.web_server.shutdown(timeout), self._drain(timeout))

    async def _drain(self, timeout: float | None) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self.connections):
            conn.transport.close()
