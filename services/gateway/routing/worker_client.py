"""One persistent connection to a worker, multiplexing every request by rid.

A background task owns the socket: it (re)connects with backoff, reads frames and hands each increment to
the *sink* registered under its rid (`open_stream`) by a plain `sink.put(item)` in the loop's own turn;
when the connection drops every pending stream and call fails at once (WorkerUnavailable). One watchdog
task per client keeps the streams' silence limit (`token_timeout`), not a timer per wait. Frames to the
worker are written once per loop turn, together, in order (`_outbox`). Timeouts use `asyncio.timeout`:
3.11's `wait_for` can swallow a cancellation, and a swallowed one is a request that never aborts.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import deque
from typing import AsyncIterator, Callable, NamedTuple, Protocol

from services.gateway.http.errors import WorkerUnavailable
from shared.protocol import (AbortRequest, FlushCacheRequest, FlushCacheResult, GenerateRequest, Hello, InfoRequest,
                             InfoResult, Message, PingRequest, PongResult, ProtocolError, TokenOutput,
                             TokenOutputs, merge_outputs)
from shared import wire
from shared.wire import encode_frame, read_message

log = logging.getLogger(__name__)


class Lost(NamedTuple):
    """A stream's end without a result: the connection died (nothing to abort), or the worker went silent
    (`abort`: it may still hold the request)."""
    reason: str
    abort: bool = False


class Sink(Protocol):
    """What a stream registered with `open_stream` is to the read loop."""
    last: float  # when the stream last got something (or started): the silence watchdog reads it

    def put(self, item: TokenOutput | Lost) -> None:
        """One increment (or the stream's loss), called from the read loop: must not raise or block."""

    @property
    def waiting(self) -> bool:
        """Whether the stream's consumer waits on the worker (the silence limit applies)."""


class _Mailbox:
    """One stream's increments: filled by the read loop, drained by its one consumer task."""

    __slots__ = ("items", "waiter", "last")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None
        self.last = time.monotonic()  # when the stream last got something (or started)

    @property
    def waiting(self) -> bool:
        return self.waiter is not None

    def put(self, item) -> None:
        self.items.append(item)
        self.last = time.monotonic()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something is in the box (returns at once if something is)."""
        if not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None


class WorkerClient:
    def __init__(self, host: str, port: int, *, connect_timeout: float = 10.0, call_timeout: float = 10.0,
                 token_timeout: float = 600.0, max_backoff: float = 5.0, internal_key: str | None = None):
        self.host, self.port = host, port
        self._key = wire.internal_key(internal_key)
        self.connect_timeout = connect_timeout  # how long a request waits for a (re)connection
        self.call_timeout = call_timeout  # info / flush_cache answers
        self.token_timeout = token_timeout  # longest silence tolerated inside a stream (queueing included)
        self.max_backoff = max_backoff
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames for the current connection, written at the end of this turn
        self._connected = asyncio.Event()
        self._streams: dict[str, Sink] = {}
        self._watchdog: asyncio.Task | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._task: asyncio.Task | None = None
        self._closed = False
        self.last_error: str | None = None
        self.responsive = True  # cleared by the health monitor when pings go unanswered
        # Learned from the pongs (the first opens every connection): role, a decode worker's KV receiver,
        # the KV format PD pairs agree on, draining, and the cache identity whose change (a flush, a
        # restart) the router hears of.
        self.role: str | None = None
        self.transfer_addr: tuple[str, int] | None = None
        self.kv_format = ""
        self.draining = False
        self.cache_id: str | None = None
        self.on_cache_reset: Callable[[str], None] | None = None
        self._kick = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def load(self) -> int:
        """Requests in flight on this worker (the router's load signal)."""
        return len(self._streams)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def routable(self) -> bool:
        """Connected, answering pings and not draining: may take new requests."""
        return self.connected and self.responsive and not self.draining

    def kick(self) -> None:
        """The worker is (back) up, says its supervisor: dial now instead of waiting out the backoff."""
        self._kick.set()

    async def _backoff(self, delay: float) -> None:
        self._kick.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._kick.wait()

    def __repr__(self) -> str:
        return f"WorkerClient({self.address}, load={self.load}, connected={self.connected})"

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._task is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._task = loop.create_task(self._run(), name=f"worker-{self.address}")
            self._watchdog = loop.create_task(self._watch_silence(), name=f"watchdog-{self.address}")

    async def close(self) -> None:
        self._closed = True
        for task in (self._task, self._watchdog):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = self._watchdog = None
        self._fail_pending("gateway shutting down")

    async def _watch_silence(self) -> None:
        """End every stream that has waited longer than `token_timeout` since its last delivery."""
        while True:
            await asyncio.sleep(min(1.0, self.token_timeout / 4))
            now = time.monotonic()
            for box in list(self._streams.values()):
                if box.waiting and now - box.last > self.token_timeout:
                    box.put(Lost(f"worker {self.address} sent nothing for {self.token_timeout:.0f} s",
                                 abort=True))

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            writer = None
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                await self._hello(reader, writer)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ProtocolError) as e:
                if writer is None:
                    self.last_error = f"cannot connect to worker {self.address}: {e}"
                else:
                    writer.close()
                    self.last_error = f"worker {self.address} did not answer the opening ping: {e!r}"
                await self._backoff(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            backoff = 0.05
            self._writer = writer
            self._connected.set()
            self.last_error = None
            log.info("connected to worker %s", self.address)
            try:
                await self._read_loop(reader)
                reason = "worker closed the connection"
            except (OSError, asyncio.IncompleteReadError) as e:
                reason = f"connection to worker lost: {e!r}"
            except ProtocolError as e:
                # A frame we cannot trust leaves the stream misaligned: start over on a fresh connection.
                reason = f"worker sent an invalid frame: {e}"
            finally:
                self._connected.clear()
                self._writer = None
                self._outbox.clear()  # the dead connection's frames: their streams fail just below
                writer.close()
            self.last_error = reason
            log.warning("worker %s: %s", self.address, reason)
            self._fail_pending(f"worker {self.address}: {reason}")

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with asyncio.timeout(self.connect_timeout):
            writer.write(encode_frame(Hello(key=self._key)) + encode_frame(PingRequest(call_id=0)))
            await writer.drain()
            pong = await read_message(reader)
        if not isinstance(pong, PongResult):
            raise ProtocolError(f"expected a pong, got {pong.TYPE!r}")
        self.role = pong.role
        self.kv_format = pong.kv_format
        self._take_pong(pong)
        self.transfer_addr = ((pong.transfer_host, pong.transfer_port)
                              if pong.transfer_host and pong.transfer_port else None)

    def _take_pong(self, pong: PongResult) -> None:
        self.draining = pong.draining
        cache_id = pong.cache_id
        if not cache_id:
            return
        if self.cache_id is not None and cache_id != self.cache_id and self.on_cache_reset is not None:
            self.on_cache_reset(self.address)
        self.cache_id = cache_id

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        streams = self._streams
        while True:
            msg = await read_message(reader)
            if isinstance(msg, (TokenOutputs, TokenOutput)):
                for out in (msg.outputs if isinstance(msg, TokenOutputs) else (msg,)):
                    box = streams.get(out.rid)
                    if box is not None:  # else: output of a request we already gave up on
                        try:
                            box.put(out)
                        except Exception:  # a sink's bug ends its stream at worst, never the connection
                            log.exception("stream %s failed to take an increment", out.rid)
            elif isinstance(msg, (InfoResult, FlushCacheResult, PongResult)):
                if isinstance(msg, PongResult):
                    # call_id 0 (no call has it): unasked, the worker's readiness or its cache changed
                    self._take_pong(msg)
                fut = self._calls.get(msg.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            else:
                raise ProtocolError(f"unexpected message {msg.TYPE!r} from worker")

    def drop_connection(self, reason: str) -> None:
        """Give up on the current connection (every pending stream and call ends now); then reconnect."""
        writer = self._writer
        if writer is not None:
            self.last_error = reason
            writer.transport.abort()

    def _fail_pending(self, reason: str) -> None:
        for box in list(self._streams.values()):  # a sink may close its stream from put()
            box.put(Lost(reason))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(WorkerUnavailable(reason))

    # ---------------------------------------------------------------- sending
    async def _send(self, msg: Message) -> None:
        self.start()
        if not self._connected.is_set():  # the timer only when there is something to wait for
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await self._connected.wait()
            except TimeoutError:
                raise WorkerUnavailable(self.last_error or f"worker {self.address} is not connected") from None
        writer = self._writer
        if writer is None:
            raise WorkerUnavailable(f"worker {self.address} is not connected")
        try:
            if writer.is_closing():
                raise ConnectionResetError("connection closing")
            self._post(encode_frame(msg))
            if writer.transport.get_write_buffer_size():  # the worker reads slower than we write: wait
                async with asyncio.timeout(self.call_timeout):
                    await writer.drain()
        except (OSError, TimeoutError) as e:
            raise WorkerUnavailable(f"cannot send to worker {self.address}: {e!r}") from None

    def _send_nowait(self, msg: Message) -> None:
        """Best effort, never blocks: used from cleanup paths that may run inside a cancelled task."""
        writer = self._writer
        if writer is not None and not writer.is_closing():
            self._post(encode_frame(msg))

    def _post(self, frame: bytes) -> None:
        """Queue a frame for the current connection; the first of a turn schedules the write of all."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(frame)

    def _flush(self) -> None:
        frames, writer = self._outbox, self._writer
        if not frames:  # sent by an earlier flush, or dropped with their connection
            return
        self._outbox = []
        if writer is not None and not writer.is_closing():
            writer.write(frames[0] if len(frames) == 1 else b"".join(frames))

    # ---------------------------------------------------------------- API
    async def open_stream(self, req: GenerateRequest, sink: Sink) -> None:
        """Register `sink` for req's increments (or a Lost) until `close_stream`, and send the request;
        WorkerUnavailable, with nothing left registered, when it cannot be sent."""
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid!r} is already running on {self.address}")
        self._streams[req.rid] = sink
        try:
            await self._send(req)
        except BaseException:  # the frame may be queued already (a drain that timed out): abort it too
            self.close_stream(req.rid, abort=True)
            raise

    def close_stream(self, rid: str, abort: bool) -> None:
        """Forget the stream; `abort`: it has not finished on the worker, which is told to drop it."""
        if self._streams.pop(rid, None) is not None and abort:
            self._send_nowait(AbortRequest(rid=rid))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenOutput]:
        """Yield the worker's increments until one has `finished`. Raises WorkerUnavailable when the
        connection drops or the worker goes silent; leaving early (break, cancel) aborts on the worker."""
        box = _Mailbox()
        await self.open_stream(req, box)
        items = box.items
        finished = False
        lost: Lost | None = None
        try:
            while True:
                if lost is not None:
                    finished = not lost.abort  # a lost connection: nothing to abort there
                    raise WorkerUnavailable(lost.reason)
                await box.wait()  # the silence limit: _watch_silence
                item = items.popleft()
                if isinstance(item, Lost):
                    lost = item
                    continue
                # A consumer that fell behind gets what queued up as one increment.
                while not item.finished and items:
                    nxt = items.popleft()
                    if isinstance(nxt, Lost):
                        lost = nxt
                        break
                    item = merge_outputs(item, nxt)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.close_stream(req.rid, abort=not finished)

    async def _call(self, msg_type: type, timeout: float | None = None) -> Message:
        timeout = timeout or self.call_timeout
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._send(msg_type(call_id=call_id))
            async with asyncio.timeout(timeout):
                return await fut
        except TimeoutError:
            raise WorkerUnavailable(f"worker {self.address} did not answer in {timeout} s") from None
        finally:
            self._calls.pop(call_id, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # failed by a lost connection while we still waited to send: retrieved

    async def ping(self, timeout: float) -> PongResult:
        return await self._call(PingRequest, timeout)

    async def info(self) -> dict:
        return (await self._call(InfoRequest)).info

    async def flush_cache(self) -> FlushCacheResult:
        return await self._call(FlushCacheRequest)


def parse_worker_list(spec: str) -> list[tuple[str, int]]:
    """'host:port,host:port' -> [(host, port), ...]"""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"worker address {item!r} is not host:port")
        out.append((host.strip("[]") or "127.0.0.1", int(port)))
    if not out:
        raise ValueError("no worker addresses given")
    return out
