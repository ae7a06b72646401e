"""`POST /v1/programs`: the HTTP side of the server-side program executor (services/gateway/programs/__init__.py).
Its generate calls run the native /generate path in process, so they are routed, metered and aborted on
disconnect like any other request."""
from __future__ import annotations

import asyncio
import functools
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator

import orjson
from aiohttp import web

from services.gateway.http.tenancy import request_salt
from services.gateway.api import native
from services.gateway.programs.ir import ProgramRequest
from services.gateway.http.errors import APIError
from services.gateway.http.body import read_body
from services.gateway.programs.limits import ProgramMeter
from services.gateway.programs import ProgramError, execute_program, stream_program, validate_program
from services.gateway.api.sse import stream_events

if TYPE_CHECKING:
    from services.gateway.state import GatewayState


async def run_program(state: "GatewayState", request: web.Request) -> web.StreamResponse:
    body = await read_body(request, state.limits, ProgramRequest)
    # Checked in a thread: 4,096 nodes take tens of milliseconds, and a thread gives the GIL back to the
    # loop every few. InvalidRequest -> 400 in the error middleware.
    program, stream = await asyncio.to_thread(validate_program, body.program, None, body.args), body.stream
    salt = request_salt(request)
    meter = ProgramMeter(state.program_budget)  # work, time and answer bounds (limits.py)
    generate = meter.wrap(functools.partial(native.generate_json, state, cache_salt=salt))
    with state.program_slots.hold(salt):  # 429 when this key already runs its share
        if stream:
            # Headers at once: a program's first event may come only after whole generations.
            return await stream_events(request, _events(stream_program(program, generate, state.fork_hint, meter),
                                                        meter), hold_headers=False)
        try:
            result = await execute_program(program, generate, fork_hint=state.fork_hint, bounds=meter)
        except ProgramError as e:
            raise _failed(e) from None
        return web.Response(body=await meter.serialize(result), content_type="application/json",
                            charset="utf-8")


async def _events(events: AsyncIterator[dict], meter: ProgramMeter) -> AsyncIterator[Any]:
    try:
        async with aclosing(events) as it:
            async for event in it:
                # A variable or the whole answer may be megabytes: encoded a step at a time, size-checked.
                yield orjson.Fragment(await meter.serialize(event))
    except ProgramError as e:
        raise _failed(e) from None


def _failed(e: ProgramError) -> APIError:
    return APIError(400, f"program failed: {e}", code="program_failed")
