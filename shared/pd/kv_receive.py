"""Decode worker's half of PD: a UCX listener that takes KV pages for requests the engine has reserved
slots for, and hands them to the engine thread.

Request life here: the gateway's request arrives with transfer {"role": "decode"} -> the engine matches
its tree, reserves slots for the rest and announces (transfer id, start) -> the prefill worker's push is
accepted from `start` -> pages and first token land -> the engine scatters them into its pool and decodes.
"""
from __future__ import annotations

import asyncio

from shared.engine.engine_loop import Engine
from shared.pd import kv_pages
from shared.pd.ucx import KvReceiver, use_device


class KvReceive:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, key: str = ""):
        self.engine, self.loop = engine, loop
        runner = engine.runner
        staging = engine.config.kv_transfer_staging
        use_device(runner.device)
        self.receiver = KvReceiver(
            runner.kv_layout(), kv_pages.dtype_name(runner.kv_dtype),
            alloc=lambda n: runner.empty_kv_buffer(n, staging),
            on_arrival=engine.kv_arrived, on_failure=engine.kv_failed, on_offer=engine.kv_offered,
            expect_timeout=engine.config.kv_transfer_timeout, key=key)
        side = engine.decode_side
        side.on_kv_expect = lambda tid, start, n: loop.call_soon_threadsafe(self.receiver.expect, tid, start, n)
        side.on_kv_cancel = lambda tid: loop.call_soon_threadsafe(self.receiver.cancel, tid)

    async def start(self, port: int = 0) -> int:
        return await self.receiver.start(port)

    def close(self) -> None:
        self.receiver.close()

    def stats(self) -> dict:
        r = self.receiver
        return {"received_tokens": r.received_tokens, "skipped_tokens": r.skipped_tokens, "failures": r.failures,
                "cancelled": r.cancelled, "refused": r.refused,
                "received_bytes": r.received_bytes, "handover_ms": self.engine.decode_side.times.summary(),
                "budget": self.engine.decode_side.stages.budget.stats()}
