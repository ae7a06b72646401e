"""Sending GenerateRequests to workers and gathering what comes back, shared by every API flavour.

Every stream here is closed deterministically (`aclosing`), so leaving early - a client that hung up, a
sibling that failed - reaches WorkerClient.generate's cleanup, which aborts the request on its worker.
Failures surface as APIError: 503 when the worker is unreachable, 400 when it refused the request.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

import msgspec

from services.gateway.access_log import CURRENT as ACCESS_RECORD
from services.gateway.errors import APIError, WorkerUnavailable, bad_request, unavailable, worker_refused
from services.gateway.metrics import GatewayMetrics, RequestTimer
from services.gateway.pd import pd_serve, wants_local_prefill
from services.gateway.router import Router
from services.gateway.worker_client import WorkerClient
from shared.protocol import FinishReason, GenerateRequest, TokenOutput


@dataclass
class GenerationResult:
    """Everything one request produced so far; `absorb` folds in each increment."""
    rid: str
    _text_parts: list[str] = field(default_factory=list, repr=False)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    e2e_latency: float = 0.0

    @property
    def text(self) -> str:
        """The output so far, joined when read (appending to one string per increment copied the whole
        text every time: quadratic in a long generation)."""
        parts = self._text_parts
        if len(parts) > 1:
            parts[:] = ["".join(parts)]
        return parts[0] if parts else ""

    def absorb(self, out: TokenOutput) -> None:
        if out.text:
            self._text_parts.append(out.text)
        self.output_ids.extend(out.token_ids)
        if out.output_logprobs:  # most requests ask for none
            self.output_logprobs.extend(out.output_logprobs)
        if out.output_top_logprobs:
            self.output_top_logprobs.extend(out.output_top_logprobs)
        if out.input_logprobs:
            self.input_logprobs = list(out.input_logprobs)
        if out.input_top_logprobs:
            self.input_top_logprobs = list(out.input_top_logprobs)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.completion_tokens = out.completion_tokens or len(self.output_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


class Dispatcher:
    def __init__(self, router: Router, metrics: GatewayMetrics):
        self.router = router
        self.metrics = metrics
        self.inflight: set[str] = set()

    def check_rids(self, rids: Sequence[str], salt: str | None = None) -> None:
        """Request ids are unique per tenant: one tenant learns nothing about another's ids."""
        if len(set(rids)) != len(rids):
            raise bad_request("request ids must be unique", "rid")
        for rid in rids:
            if tenant_rid(rid, salt) in self.inflight:
                raise bad_request(f"request id {rid!r} is already running", "rid")

    async def stream(self, req: GenerateRequest, salt: str | None = None, index: int = 0
                     ) -> AsyncIterator[tuple[int, TokenOutput, GenerationResult]]:
        """Yield (index, increment, accumulated result) until the request finishes; `index` is the
        request's place in a stream_many."""
        record = ACCESS_RECORD.get()
        if record is not None and req.request_id is None:
            req.request_id = record.request_id
        salt = salt if salt is not None else req.cache_salt
        self.check_rids([req.rid], salt)
        result = GenerationResult(rid=req.rid)
        # Workers see the tenant's namespace in the id, so two tenants' equal ids never collide there.
        wire_rid = tenant_rid(req.rid, salt)
        req = msgspec.structs.replace(req, rid=wire_rid) if wire_rid != req.rid else req
        pair = None if wants_local_prefill(req) else self.router.pick_pair(req.input_ids, salt)
        served_by: list[WorkerClient] = []
        if pair is None:
            served_by.append(self.router.pick(req.input_ids, salt))
            source = served_by[0].generate(req)
        else:
            if pair[0] is None:
                self.metrics.pd_bypassed.inc()
            source = pd_serve(req, self.router, salt, *pair, served_by=served_by,
                              on_retry=self.metrics.pd_retried.inc)
        timer = RequestTimer(self.metrics)
        self.inflight.add(req.rid)
        self.metrics.gateway_inflight.inc()
        try:
            async with aclosing(source) as outputs:
                async for out in outputs:
                    timer.observe(out)
                    if out.error:
                        raise worker_refused(out.error)
                    result.absorb(out)
                    result.e2e_latency = timer.elapsed()
                    if out.finished and result.output_ids:
                        # Its tree now holds prompt + output (but the last token's KV): a next turn
                        # that extends them is routed back there, and may bypass prefill in PD.
                        self.router.remember(served_by[-1], list(req.input_ids) + result.output_ids[:-1], salt,
                                             prompt=req.input_ids)
                    if record is not None:
                        if out.token_ids:
                            record.first_token()
                        if out.finished:
                            record.finished(result.prompt_tokens, result.cached_tokens, result.completion_tokens)
                    yield index, out, result
        except WorkerUnavailable as e:
            self.metrics.aborted_requests.inc()
            raise unavailable(str(e)) from None
        finally:
            self.inflight.discard(req.rid)
            self.metrics.gateway_inflight.dec()

    def stream_many(self, reqs: Sequence[GenerateRequest]
                    ) -> AsyncIterator[tuple[int, TokenOutput, GenerationResult]]:
        """Run requests concurrently, yielding (index, increment, result) in arrival order. The first
        failure cancels (and so aborts) the others and is raised. One request is its own stream (no
        relaying generator in between: one resumption fewer per event)."""
        return self.stream(reqs[0]) if len(reqs) == 1 else self._stream_concurrently(reqs)

    async def _stream_concurrently(self, reqs: Sequence[GenerateRequest]
                                   ) -> AsyncIterator[tuple[int, TokenOutput, GenerationResult]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, req: GenerateRequest) -> None:
            try:
                async with aclosing(self.stream(req, index=i)) as events:
                    async for item in events:
                        queue.put_nowait(item)
                queue.put_nowait((i, done, None))
            except Exception as e:  # handed to the consumer, which raises it
                queue.put_nowait((i, e, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item, res = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item, res
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect_many(self, reqs: Sequence[GenerateRequest]) -> list[GenerationResult]:
        results: list[GenerationResult | None] = [None] * len(reqs)
        async with aclosing(self.stream_many(reqs)) as events:
            async for i, out, res in events:
                if out.finished:
                    results[i] = res
        if any(r is None for r in results):  # a worker that ended a stream without finishing it
            raise APIError(502, "a worker ended a request without a result", type="internal_error")
        return results  # type: ignore[return-value]


def tenant_rid(rid: str, salt: str | None) -> str:
    return f"{salt}.{rid}" if salt else rid


def new_rid(prefix: str = "") -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def created_timestamp() -> int:
    return int(time.time())
