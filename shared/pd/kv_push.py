"""Prefill worker's half of PD: push each prompt's KV and first token over UCX to the decode worker named
in the request, then release the request (its KV stays in this worker's tree).

Request life here: admitted by the engine -> open: header to the decode worker, its accept(start) while
the prompt is computed -> the engine enqueues the gather of the pages right behind the pass that
completes the prompt (Pages) -> they leave as soon as that pass is done -> the first token (HandOff) once
the host has it, then the ack -> end_transfer. No engine round trip on the way: a handshake that
answered after the gather just sends a suffix of the gathered buffer (token-major: contiguous).
A failed push ends the request with the error, which the gateway turns into a retry or the client's error.
"""
from __future__ import annotations

import asyncio
import logging
import time

from shared.pd.sides import HandOff, Pages, PartTimes
from shared.engine.engine_loop import Engine
from shared.protocol import KvHeader
from shared.pd.ucx import KvSender, TransferError, use_device

log = logging.getLogger(__name__)


class KvPush:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, sender: KvSender | None = None,
                 key: str = ""):
        self.engine, self.loop = engine, loop
        use_device(engine.runner.device)
        self.sender = sender or KvSender(key=key)
        self._pages: dict[str, asyncio.Future] = {}
        self._ready: dict[str, asyncio.Future] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        # Prompts whose pages were gathered before the decode side had answered the handshake (the
        # whole prompt is gathered then, and the suffix it asks for is sent).
        self.late_handshakes = 0
        self.times = PartTimes()
        self.side = engine.prefill_side
        self.side.on_transfer_open = lambda *a: loop.call_soon_threadsafe(self._open, *a)
        self.side.on_kv_gathered = lambda *a: loop.call_soon_threadsafe(self._set, self._pages, *a)
        self.side.on_kv_ready = lambda *a: loop.call_soon_threadsafe(self._ready_set, *a)

    # The hooks run on the event loop in the order the engine called them: open, gathered, ready.
    def _open(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        self._pages[transfer_id] = self.loop.create_future()
        self._ready[transfer_id] = self.loop.create_future()
        self._tasks[transfer_id] = self.loop.create_task(self._transfer(transfer_id, target, header))

    @staticmethod
    def _set(futures: dict[str, asyncio.Future], transfer_id: str, value) -> None:
        fut = futures.get(transfer_id)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _ready_set(self, transfer_id: str, hand_off: HandOff | None) -> None:
        if hand_off is None:  # the request ended before its prompt was computed: drop the transfer
            self._pages.pop(transfer_id, None)
            self._ready.pop(transfer_id, None)
            task = self._tasks.pop(transfer_id, None)  # (a task cancelled before it ran never cleans up)
            if task is not None:
                task.cancel()
            return
        self._set(self._ready, transfer_id, hand_off)

    async def _engine(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    async def _transfer(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        opened, error = None, None
        try:
            t_open = time.monotonic()
            opened = await self.sender.open(target["host"], target["port"], header)
            t_accepted = time.monotonic()
            self.side.starts[transfer_id] = opened.start
            pages: Pages = await self._pages[transfer_id]
            if pages.start != opened.start:
                self.late_handshakes += 1
            buf = pages.buf[opened.start - pages.start:]  # pages.start is 0 or opened.start
            if pages.event is not None:
                await asyncio.to_thread(pages.event.synchronize)
            await self.sender.send_pages(opened, buf)
            hand_off: HandOff = await self._ready[transfer_id]
            await self.sender.complete(opened, hand_off.done)
            acked = time.monotonic()
            self.times.add(queue=hand_off.admitted - hand_off.arrival, handshake=t_accepted - t_open,
                           prefill=hand_off.computed - hand_off.admitted,
                           wire=opened.wire_seconds, first_token_to_ack=acked - hand_off.computed)
        except asyncio.CancelledError:
            if opened is not None:
                self.sender.abort(opened)
            return  # the engine already ended the request
        except Exception as e:
            if opened is not None:
                self.sender.abort(opened)
            error = str(e) if isinstance(e, TransferError) else f"KV transfer failed: {e!r}"
            log.warning("KV push %s failed: %s", transfer_id, error)
        finally:
            self._pages.pop(transfer_id, None)
            self._ready.pop(transfer_id, None)
            self._tasks.pop(transfer_id, None)
            self.side.starts.pop(transfer_id, None)
        await self._engine(lambda: self.side.end_transfer(transfer_id, error))

    def stats(self) -> dict:
        s = self.sender
        return {"sent_tokens": s.sent_tokens, "sent_bytes": s.sent_bytes, "send_seconds": round(s.send_seconds, 6),
                "transfers": s.transfers, "in_flight": len(self._tasks), "late_handshakes": self.late_handshakes,
                "connects": s.connects, "endpoint_reuses": s.reuses, "handover_ms": self.times.summary(),
                "budget": self.side.stages.budget.stats()}
