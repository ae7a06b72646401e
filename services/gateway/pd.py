"""One request across a prefill/decode pair (PD mode), seen from the gateway.

Both workers get the request at once: the decode worker reserves KV slots for what its tree lacks and
waits; the prefill worker computes the prompt, samples the first token and pushes both over UCX
straight to the decode worker (the gateway never touches KV). The client's stream is the decode
worker's. Either side failing ends the request at once with a clear error, and leaving (client gone,
error) aborts it on both workers, so neither holds KV slots for a request nobody waits for.
"""
from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from services.gateway.errors import WorkerUnavailable, unavailable, worker_refused
from services.gateway.worker_client import WorkerClient
from shared.protocol import GenerateRequest, TokenOutput

_DONE = object()


def wants_local_prefill(req: GenerateRequest) -> bool:
    """Input logprobs come from the prompt's forward pass: such requests run whole on one worker."""
    return req.return_logprob and 0 <= req.logprob_start_len < len(req.input_ids)


async def pd_generate(req: GenerateRequest, prefill: WorkerClient, decode: WorkerClient
                      ) -> AsyncIterator[TokenOutput]:
    """The decode worker's increments, like WorkerClient.generate; raises APIError when the prefill
    side fails and WorkerUnavailable when the decode side does."""
    transfer_id = uuid.uuid4().hex
    host, port = decode.transfer_addr
    d_req = dataclasses.replace(req, transfer={"role": "decode", "id": transfer_id})
    p_req = dataclasses.replace(req, rid=f"{req.rid}-prefill", stream=False,
                                transfer={"role": "prefill", "id": transfer_id, "host": host, "port": port})
    events: asyncio.Queue = asyncio.Queue()

    async def prefill_side() -> None:
        try:
            async with aclosing(prefill.generate(p_req)) as outs:
                async for out in outs:
                    if out.error:  # the request's own fault (e.g. larger than the pool) is a 400, as unified
                        error = worker_refused if out.refused else unavailable
                        events.put_nowait(("prefill", error(f"prefill worker {prefill.address}: {out.error}")))
        except WorkerUnavailable as e:
            events.put_nowait(("prefill", unavailable(f"prefill worker: {e}")))

    async def decode_side() -> None:
        try:
            async with aclosing(decode.generate(d_req)) as outs:
                async for out in outs:
                    events.put_nowait(("decode", out))
            events.put_nowait(("decode", _DONE))
        except Exception as e:  # WorkerUnavailable: re-raised to the caller as is
            events.put_nowait(("decode", e))

    tasks = [asyncio.create_task(prefill_side()), asyncio.create_task(decode_side())]
    decoding = False  # the decode side has the pages: what happens on the prefill side no longer matters
    try:
        while True:
            side, item = await events.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                if side == "prefill" and decoding:
                    continue  # after the hand-over (e.g. the decode side's ack was lost): moot
                raise item
            decoding = True
            yield item
            if item.finished:
                return
    finally:
        # Cancelling a side closes its generate() early, which aborts the request on that worker.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
