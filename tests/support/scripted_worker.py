"""A worker that answers with a script of frames, for tests that pin the gateway's output to exact frames.

Speaks the real wire protocol over TCP. Once `expect` GenerateRequests arrived, it plays `script`: each
step is one TokenOutputs frame (several requests' increments, as an engine step sends them), given as
(request number, TokenOutput fields) pairs, where the number is the order the requests arrived in; a
float step is a pause of that many seconds. Aborts are recorded and answered as the real worker does.
"""
from __future__ import annotations

import asyncio
import contextlib

from shared.protocol import (AbortRequest, FinishAbort, GenerateRequest, InfoRequest, InfoResult, PingRequest,
                             PongResult, TokenOutput, TokenOutputs)
from shared.wire import encode_frame, read_message


class ScriptedWorker:
    def __init__(self, script: list, expect: int = 1):
        self.script, self.expect = script, expect
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.played = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                msg = await read_message(reader)
                if isinstance(msg, PingRequest):
                    writer.write(encode_frame(PongResult(call_id=msg.call_id)))
                elif isinstance(msg, InfoRequest):
                    writer.write(encode_frame(InfoResult(call_id=msg.call_id, info={
                        "max_context_len": 4096, "max_total_tokens": 1 << 16, "model_path": "tiny-random",
                        "num_running": 0, "num_waiting": 0, "kv_usage": 0.0})))
                elif isinstance(msg, GenerateRequest):
                    if msg.rid.startswith("health-"):  # the health monitor's probes: answered at once
                        writer.write(encode_frame(TokenOutput(rid=msg.rid, token_ids=[], text="", finished=True,
                                                              finish_reason=FinishAbort(message="probe"))))
                        continue
                    self.requests.append(msg)
                    if len(self.requests) == self.expect:
                        task = asyncio.create_task(self._play(writer))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
                elif isinstance(msg, AbortRequest):
                    self.aborted.append(msg.rid)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _play(self, writer: asyncio.StreamWriter) -> None:
        for step in self.script:
            if isinstance(step, (int, float)):
                await asyncio.sleep(step)
                continue
            outs = [TokenOutput(rid=self.requests[k].rid, **fields) for k, fields in step
                    if self.requests[k].rid not in self.aborted]
            if outs:
                writer.write(encode_frame(TokenOutputs(outputs=outs)))
                await writer.drain()
        self.played.set()
