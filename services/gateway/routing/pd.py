"""One request across a prefill/decode pair (PD mode), seen from the gateway.

Both workers get the request at once: the decode worker reserves KV slots for what its tree lacks and
waits; the prefill worker computes the prompt, samples the first token and pushes both over UCX
straight to the decode worker (the gateway never touches KV). The client's stream is the decode
worker's. Leaving (client gone, error) aborts the request on both workers, so neither holds KV slots
for a request nobody waits for.

Failures before the first token lose nothing (`pd_serve`): a prefill side that fails is replaced by
another prefill worker, or by the decode worker computing the prompt itself; a decode worker that dies
is replaced by another one (the prefill worker's tree keeps the prompt's KV, so the retry is a cache
hit there). After the first token the client's stream ends with a clear error.
"""
from __future__ import annotations

import asyncio
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import msgspec

from services.gateway.http.errors import WorkerUnavailable, unavailable, worker_refused
from services.gateway.routing.worker_client import WorkerClient
from shared.protocol import GenerateRequest, TokenOutput, Transfer

_DONE = object()
MAX_ATTEMPTS = 4


class PrefillFailed(Exception):
    """The prefill side failed before the decode side produced anything: the request can start over."""


async def pd_generate(req: GenerateRequest, prefill: WorkerClient, decode: WorkerClient
                      ) -> AsyncIterator[TokenOutput]:
    """The decode worker's increments, like WorkerClient.generate; raises APIError when the prefill
    side fails and WorkerUnavailable when the decode side does."""
    transfer_id = uuid.uuid4().hex
    host, port = decode.transfer_addr
    d_req = msgspec.structs.replace(req, transfer=Transfer(role="decode", id=transfer_id))
    p_req = msgspec.structs.replace(req, rid=f"{req.rid}-prefill", stream=False,
                                    transfer=Transfer(role="prefill", id=transfer_id, host=host, port=port))
    events: asyncio.Queue = asyncio.Queue()

    async def prefill_side() -> None:
        try:
            async with aclosing(prefill.generate(p_req)) as outs:
                async for out in outs:
                    if out.error:  # the request's own fault (e.g. larger than the pool) is a 400, as unified
                        events.put_nowait(("prefill", worker_refused(out.error) if out.refused  # the client's, as unified
                                           else unavailable(f"prefill worker {prefill.address}: {out.error}")))
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
                if side == "prefill" and getattr(item, "code", None) == "worker_refused":
                    raise item  # the request itself cannot run (e.g. larger than the pool): no retry, a 400
                if side == "prefill":
                    raise PrefillFailed(str(item))
                raise item  # the decode side's WorkerUnavailable: pd_serve starts over if nothing went out
            decoding = True
            yield item
            if item.finished:
                return
    finally:
        # Cancelling a side closes its generate() early, which aborts the request on that worker.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pd_serve(req: GenerateRequest, router, salt: str | None, prefill: WorkerClient | None,
                   decode: WorkerClient, served_by: list | None = None, on_retry=lambda: None
                   ) -> AsyncIterator[TokenOutput]:
    """A PD request with failover before its first token (see the module docstring). `prefill` None: the
    decode worker computes the prompt itself (short-suffix bypass, or no prefill worker left). The
    decode worker that serves it is appended to `served_by`."""
    failed: set[str] = set()
    for attempt in range(MAX_ATTEMPTS):
        started = False
        if served_by is not None:
            served_by.append(decode)
        # A retry is a new request on the workers (the failed attempt's abort may still be on its way).
        r = req if attempt == 0 else msgspec.structs.replace(req, rid=f"{req.rid}-retry{attempt}")
        try:
            source = pd_generate(r, prefill, decode) if prefill is not None else decode.generate(r)
            async with aclosing(source) as outs:
                async for out in outs:
                    started = True
                    yield out
            return
        except PrefillFailed as e:
            if attempt == MAX_ATTEMPTS - 1:
                raise unavailable(f"prefill worker {prefill.address}: {e}") from None
            if not (prefill.connected and prefill.responsive):
                failed.add(prefill.address)  # gone: another prefill worker, or the decode worker itself
            if not decode.connected:  # the push failed because the decode worker died
                failed.add(decode.address)
                decode = router.pick_side("decode", req.input_ids, salt, exclude=failed)
                if decode is None:
                    raise unavailable(f"no decode worker left: {e}") from None
            prefill = router.pick_side("prefill", req.input_ids, salt, exclude=failed, peer=decode)
        except WorkerUnavailable:
            if started or attempt == MAX_ATTEMPTS - 1:
                raise  # tokens went out already: the client's stream ends with the error
            failed.add(decode.address)
            nxt = router.pick_side("decode", req.input_ids, salt, exclude=failed, peer=prefill)
            if nxt is None and prefill is not None:  # none takes this prefill worker's pages: computed there whole
                nxt = router.pick_side("decode", req.input_ids, salt, exclude=failed)
                prefill = None
            if nxt is None:
                raise
            decode = nxt
        on_retry()
