"""Prefill worker's half of PD: when the engine has a prompt's KV and first token, push them over UCX to
the decode worker named in the request, then release the request (its KV stays in this worker's tree).

Request life here: engine hand-off (engine thread) -> push on the event loop: header, the decode side's
accept(start), gather [start, prompt_len) on the engine thread, one UCX send, ack -> end_transfer.
A failed push ends the request with the error, which the gateway turns into the client's error.
"""
from __future__ import annotations

import asyncio
import logging

from shared.engine.engine import Engine
from shared.protocol import KvHeader
from shared.transfer.ucx import KvSender

log = logging.getLogger(__name__)


class KvPush:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, sender: KvSender | None = None):
        self.engine, self.loop = engine, loop
        self.sender = sender or KvSender()
        self._tasks: set[asyncio.Task] = set()
        engine.on_kv_ready = self._ready_threadsafe

    def _ready_threadsafe(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        self.loop.call_soon_threadsafe(self._start, transfer_id, target, header)

    def _start(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        task = self.loop.create_task(self._push(transfer_id, target, header))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _engine(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    async def _push(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        async def gather(start: int):
            buf, event = await self._engine(lambda: self.engine.gather_kv(transfer_id, start))
            if event is not None:
                await asyncio.to_thread(event.synchronize)
            return buf

        error = None
        try:
            await self.sender.push(target["host"], target["port"], header, gather)
        except Exception as e:
            error = str(e) or type(e).__name__
            log.warning("KV push %s failed: %s", transfer_id, error)
        await self._engine(lambda: self.engine.end_transfer(transfer_id, error))

    def stats(self) -> dict:
        return {"sent_tokens": self.sender.sent_tokens, "transfers": self.sender.transfers,
                "in_flight": len(self._tasks)}
