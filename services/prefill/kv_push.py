"""Prefill worker's half of PD: push each prompt's KV and first token over UCX to the decode worker named
in the request, then release the request (its KV stays in this worker's tree).

Request life here: taken by the engine -> open: header to the decode worker, its accept(start) (while
the prompt is still being computed) -> the engine computes the prompt and, knowing `start`, gathers
[start, prompt_len) at once -> one UCX send, the first token, the ack -> end_transfer. A failed push ends
the request with the error, which the gateway turns into the client's error.
"""
from __future__ import annotations

import asyncio
import logging

from shared.engine.disagg import HandOff
from shared.engine.engine import Engine
from shared.protocol import KvHeader
from shared.transfer.ucx import KvSender, TransferError

log = logging.getLogger(__name__)


class KvPush:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, sender: KvSender | None = None,
                 key: str = ""):
        self.engine, self.loop = engine, loop
        self.sender = sender or KvSender(key=key)
        self._ready: dict[str, asyncio.Future] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        # Prompts computed before the decode side had answered the handshake: their pages wait for a
        # gather through the engine thread (an extra step boundary on the way to the first token).
        self.late_handshakes = 0
        self.side = engine.prefill_side
        self.side.on_transfer_open = lambda *a: loop.call_soon_threadsafe(self._open, *a)
        self.side.on_kv_ready = lambda *a: loop.call_soon_threadsafe(self._ready_set, *a)

    # Both hooks run on the event loop in the order the engine called them: open before ready.
    def _open(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        self._ready[transfer_id] = self.loop.create_future()
        self._tasks[transfer_id] = self.loop.create_task(self._transfer(transfer_id, target, header))

    def _ready_set(self, transfer_id: str, hand_off: HandOff | None) -> None:
        if hand_off is None:  # the request ended before its prompt was computed: drop the transfer
            self._ready.pop(transfer_id, None)
            task = self._tasks.pop(transfer_id, None)  # (a task cancelled before it ran never cleans up)
            if task is not None:
                task.cancel()
            return
        fut = self._ready.get(transfer_id)
        if fut is not None and not fut.done():
            fut.set_result(hand_off)

    async def _engine(self, fn):
        return await asyncio.wrap_future(self.engine.call(fn))

    async def _transfer(self, transfer_id: str, target: dict, header: KvHeader) -> None:
        opened, error = None, None
        try:
            opened = await self.sender.open(target["host"], target["port"], header)
            self.side.starts[transfer_id] = opened.start
            hand_off: HandOff = await self._ready[transfer_id]
            buf, event = hand_off.buf, hand_off.event
            if buf is None or hand_off.start != opened.start:  # handed off before the handshake ended
                self.late_handshakes += 1
                buf, event = await self._engine(lambda: self.side.gather_kv(transfer_id, opened.start))
            if event is not None:
                await asyncio.to_thread(event.synchronize)
            await self.sender.finish(opened, buf, hand_off.done)
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
            self._ready.pop(transfer_id, None)
            self._tasks.pop(transfer_id, None)
            self.side.starts.pop(transfer_id, None)
        await self._engine(lambda: self.side.end_transfer(transfer_id, error))

    def stats(self) -> dict:
        s = self.sender
        return {"sent_tokens": s.sent_tokens, "sent_bytes": s.sent_bytes, "send_seconds": round(s.send_seconds, 6),
                "transfers": s.transfers, "in_flight": len(self._tasks), "late_handshakes": self.late_handshakes,
                "connects": s.connects, "endpoint_reuses": s.reuses}
