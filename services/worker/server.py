"""The worker's network side: accepts gateway connections, feeds the engine, streams outputs back.

Outputs leave as one TokenOutputs frame per engine step per connection, however many of its requests
the step advanced. A connection that drops aborts every request it sent, so a dead gateway never pins
KV slots.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

from shared import event_loop, gc_freeze
from shared.engine.engine_loop import Engine
from shared.protocol import (AbortRequest, FinishAbort, FlushCacheRequest, FlushCacheResult, GenerateRequest,
                             InfoRequest, InfoResult, PingRequest, PongResult, ProtocolError, TokenOutput,
                             TokenOutputs)
from shared.log_limit import LimitedWarning
from shared.wire import WORKER_MAX_FRAME, accept_hello, encode_frame, read_message

log = logging.getLogger(__name__)
_peer_warnings = LimitedWarning(log)  # per-connection warnings: a flood of connections is no log flood
_CALL_TIMEOUT_S = 30.0


class _Connection:
    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.rids: set[str] = set()

    def send(self, frame: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(frame)


class WorkerServer:
    def __init__(self, engine: Engine, role: str = "unified", transfer: object | None = None,
                 transfer_addr: tuple[str, int] | None = None, internal_key: str = "",
                 max_frame: int = WORKER_MAX_FRAME):
        """`transfer`: the PD glue (shared/pd/kv_push.py or shared/pd/kv_receive.py), whose
        stats join the info answer; `transfer_addr`: where a decode worker's KV receiver listens;
        `internal_key`: what every connection's opening Hello must carry; `max_frame`: the largest frame
        taken from an authenticated peer."""
        self.engine = engine
        self.internal_key = internal_key
        self.max_frame = max_frame
        self.role = role
        self.transfer = transfer
        self.transfer_addr = transfer_addr
        self._owner: dict[str, _Connection] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Connection] = set()
        self._request_ids: dict[str, str] = {}  # rid -> the client's X-Request-Id, for log lines
        self.draining = False
        self.cache_id = uuid.uuid4().hex  # PongResult.cache_id
        self.kv_events = None  # the KV event publisher (shared/metadata/kv_events.py), whose stats join info
        runner = getattr(engine, "runner", None)  # (test doubles of the engine have none)
        self.kv_format = runner.kv_format() if runner is not None else ""  # PongResult.kv_format

    def start_draining(self) -> None:
        """Not ready from now on: every gateway hears it at once (a pong it did not ask for) and stops
        routing here; requests already accepted run to the end."""
        self.draining = True
        self._tell_everyone()

    def _tell_everyone(self) -> None:
        """A pong nobody asked for, to every connection: what it says changed."""
        for conn in list(self._conns):
            conn.send(encode_frame(self._pong(0)))

    def _pong(self, call_id: int) -> PongResult:
        host, port = self.transfer_addr or (None, None)
        return PongResult(call_id=call_id, steps=self.engine.steps, num_running=self.engine.policy.num_running(),
                          role=self.role, transfer_host=host, transfer_port=port, draining=self.draining,
                          cache_id=self.cache_id, kv_format=self.kv_format)

    async def start(self, host: str, port: int) -> int:
        self._loop = asyncio.get_running_loop()
        self.engine.on_output = self._on_output_threadsafe
        self._server = await asyncio.start_server(self._serve, host, port, limit=2 ** 24)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    # Called on the engine thread.
    def _on_output_threadsafe(self, outputs: list[TokenOutput]) -> None:
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[TokenOutput]) -> None:
        """One engine step's outputs: grouped by the connection that owns each request, one frame each."""
        owner = self._owner
        by_conn: dict[_Connection, list[TokenOutput]] = {}
        for out in outputs:
            conn = owner.get(out.rid)
            if conn is None:
                continue  # aborted, or its connection dropped
            if out.finished:
                self._finished(out, conn)
            batch = by_conn.get(conn)
            if batch is None:
                by_conn[conn] = [out]
            else:
                batch.append(out)
        for conn, batch in by_conn.items():
            conn.send(encode_frame(TokenOutputs(outputs=batch)))

    def _finished(self, out: TokenOutput, conn: _Connection) -> None:
        """The request is over: it leaves its connection, and the log gets one line for it."""
        self._owner.pop(out.rid, None)
        conn.rids.discard(out.rid)
        request_id = self._request_ids.pop(out.rid, None)
        if out.error:
            log.warning("request %s [request_id=%s] failed: %s", out.rid, request_id, out.error)
        else:
            log.info("request %s [request_id=%s] finished: %s, %d prompt (%d cached), %d output tokens",
                     out.rid, request_id, out.finish_reason.TYPE if out.finish_reason else None,
                     out.prompt_tokens, out.cached_tokens, out.completion_tokens)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Connection(writer)
        self._conns.add(conn)
        try:
            try:
                await accept_hello(reader, self.internal_key)
            except (ProtocolError, TimeoutError) as e:
                _peer_warnings.warning(f"refused: {e}", "refusing a connection from %s: %s",
                                       writer.get_extra_info("peername"), e)
                return
            while True:
                try:
                    msg = await read_message(reader, self.max_frame)
                except ProtocolError as e:
                    _peer_warnings.warning(f"bad frame: {e}", "dropping connection after a bad frame: %s", e)
                    break
                if isinstance(msg, GenerateRequest):
                    if msg.rid in self._owner:
                        conn.send(encode_frame(TokenOutput(
                            rid=msg.rid, token_ids=[], text="", finished=True,
                            finish_reason=FinishAbort(message="duplicate request id"),
                            error="duplicate request id")))
                        continue
                    self._owner[msg.rid] = conn
                    conn.rids.add(msg.rid)
                    if msg.request_id:
                        self._request_ids[msg.rid] = msg.request_id
                    log.debug("request %s [request_id=%s]: %d prompt tokens%s", msg.rid, msg.request_id,
                              len(msg.input_ids), f", transfer {msg.transfer.role}" if msg.transfer else "")
                    self.engine.submit(msg)
                elif isinstance(msg, AbortRequest):
                    if self._owner.get(msg.rid) is conn:
                        self.engine.abort(msg.rid)
                elif isinstance(msg, FlushCacheRequest):
                    ok, text = await self._call(self.engine.flush_cache)
                    conn.send(encode_frame(FlushCacheResult(call_id=msg.call_id, ok=ok, message=text)))
                    if ok:
                        self.cache_id = uuid.uuid4().hex
                        self._tell_everyone()
                elif isinstance(msg, PingRequest):
                    conn.send(encode_frame(self._pong(msg.call_id)))
                elif isinstance(msg, InfoRequest):
                    info = await self._call(self.engine.info)
                    info["role"] = self.role
                    info["event_loop"] = event_loop.current_loop_name()
                    info["gc_frozen_objects"] = gc_freeze.frozen_count()  # start-up heap (shared/gc_freeze.py)
                    if self.transfer is not None:
                        info["kv_transfer"] = self.transfer.stats()
                    if self.transfer_addr is not None:
                        info["transfer_addr"] = list(self.transfer_addr)
                    if self.kv_events is not None:
                        info["kv_events"] = dict(self.kv_events.stats)
                    conn.send(encode_frame(InfoResult(call_id=msg.call_id, info=info)))
                else:
                    _peer_warnings.warning(f"unexpected: {type(msg).__name__}", "unexpected message %s",
                                           type(msg).__name__)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # The server is stopping. Python 3.11's start_server callback asks a cancelled handler task
            # for its exception, which raises and logs "Exception in callback" at ERROR on every clean
            # shutdown (3.12 checks cancelled() first); nothing awaits this task, so it ends quietly.
            pass
        finally:
            self._conns.discard(conn)
            if conn.rids:
                log.info("gateway connection closed: aborting %d requests", len(conn.rids))
            for rid in list(conn.rids):
                self._owner.pop(rid, None)
                self._request_ids.pop(rid, None)
                self.engine.abort(rid)
            writer.close()

    async def _call(self, fn):
        return await asyncio.wait_for(asyncio.wrap_future(self.engine.call(fn)), _CALL_TIMEOUT_S)
