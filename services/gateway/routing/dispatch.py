"""Sending GenerateRequests to workers and handing what comes back to the API route.

Increments are pushed: each worker request is a `Generation`, its WorkerClient's sink, so the read loop
calls through it into the route's `Consumer` (an SSE response writes the event right there; a
non-streaming answer collects). `Generation.accept` does every increment's bookkeeping and raises failures
as APIError (503 unreachable, 400 refused); `Run.close` aborts whatever did not finish.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

import msgspec

from services.gateway.http.access_log import CURRENT as ACCESS_RECORD
from services.gateway.http.errors import (APIError, WorkerUnavailable, bad_request, overloaded, unavailable,
                                         worker_refused)
from services.gateway.http.metrics import GatewayMetrics, RequestTimer
from services.gateway.routing.pd import pd_serve
from services.gateway.routing.router import Router
from services.gateway.routing.worker_client import Lost, WorkerClient
from shared.protocol import FinishReason, GenerateRequest, TokenOutput


@dataclass(slots=True)
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
    spec_verify_ct: int = 0
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    e2e_latency: float = 0.0

    @property
    def text(self) -> str:
        """The output so far, joined when read (not per increment: quadratic in a long generation)."""
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
        self.spec_verify_ct = out.spec_verify_ct or self.spec_verify_ct
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason


class Consumer(Protocol):
    """Where a Run's increments go."""

    def deliver(self, gen: "Generation", item: TokenOutput | Exception) -> None:
        """An increment of gen's request or its failure, from a read loop: must not raise or block; the
        consumer calls `gen.accept(item)` when it takes it."""


class Generation:
    """One worker request in flight: the sink its worker's read loop feeds, and its bookkeeping."""

    __slots__ = ("index", "consumer", "result", "last", "_d", "_record", "_salt", "req", "_timer", "_served_by",
                 "_client", "_relay_task", "_counted")

    waiting = True  # for the worker's silence limit: this stream always waits on the worker

    def __init__(self, dispatcher: "Dispatcher", req: GenerateRequest, index: int, consumer: Consumer):
        self.index = index  # the request's place in its Run
        self.consumer = consumer
        self.result = GenerationResult(rid=req.rid)
        self.last = time.monotonic()
        self._d = dispatcher
        self._record = ACCESS_RECORD.get()  # the API request's access record (read in its task, here)
        if self._record is not None and req.request_id is None:
            req.request_id = self._record.request_id
        self._salt = req.cache_salt
        # Workers see the tenant's namespace in the id, so two tenants' equal ids never collide there.
        wire_rid = tenant_rid(req.rid, self._salt)
        self.req = msgspec.structs.replace(req, rid=wire_rid) if wire_rid != req.rid else req
        self._timer: RequestTimer | None = None
        self._served_by: list[WorkerClient] = []
        self._client: WorkerClient | None = None  # whose read loop feeds us, until the request ends there
        self._relay_task: asyncio.Task | None = None  # PD: the task relaying pd_serve's increments
        self._counted = False  # in the dispatcher's inflight set

    async def start(self) -> None:
        d, req = self._d, self.req
        d.check_rids([self.result.rid], self._salt)
        # Input logprobs come from the prompt's forward pass: such requests run whole on one worker.
        pair = None if req.wants_input_logprobs else d.router.pick_pair(req.input_ids, self._salt)
        client = d.router.pick(req.input_ids, self._salt) if pair is None else None
        self._timer = RequestTimer(d.metrics)
        d.inflight.add(req.rid)
        d.metrics.gateway_inflight.inc()
        self._counted = True
        if client is None:
            if pair[0] is None:
                d.metrics.pd_bypassed.inc()
            source = pd_serve(req, d.router, self._salt, *pair, served_by=self._served_by,
                              on_retry=d.metrics.pd_retried.inc)
            self._relay_task = asyncio.create_task(self._relay(source))
            return
        self._served_by.append(client)
        self._client = client  # before the send: increments may arrive while it waits to drain
        try:
            await client.open_stream(req, self)
        except WorkerUnavailable as e:
            self._client = None
            d.metrics.aborted_requests.inc()
            raise unavailable(str(e)) from None

    async def _relay(self, source: AsyncIterator[TokenOutput]) -> None:
        """PD: pd_serve (a generator of its own, for its failover) handed on as a read loop would."""
        try:
            async with aclosing(source) as outs:
                async for out in outs:
                    self.put(out)
                    if out.finished:
                        return
            self.put(APIError(502, "a worker ended a request without a result", type="internal_error"))
        except Exception as e:  # APIError, WorkerUnavailable: raised to the route by accept
            self.put(e)

    def put(self, item: TokenOutput | Lost | Exception) -> None:
        self.last = time.monotonic()
        if type(item) is TokenOutput:
            if item.finished:
                self._detach(abort=False)
        elif type(item) is Lost:
            self._detach(abort=item.abort)  # a lost connection: nothing to abort there
            item = WorkerUnavailable(item.reason)
        self.consumer.deliver(self, item)

    def accept(self, item: TokenOutput | Exception) -> GenerationResult:
        """Take an increment (maybe several merged) into the result and the metrics; raise a failure."""
        if type(item) is not TokenOutput:
            if isinstance(item, WorkerUnavailable):
                self._d.metrics.aborted_requests.inc()
                raise unavailable(str(item))
            raise item
        out = item
        timer = self._timer
        now = timer.observe(out)
        if out.error:
            raise overloaded(out.error) if out.overloaded else worker_refused(out.error)
        result = self.result
        result.absorb(out)
        result.e2e_latency = now - timer.start
        record = self._record
        if record is not None and record.ttft is None and out.token_ids:
            record.first_token()
        if out.finished:
            self._finished(result)
        return result

    def _finished(self, result: GenerationResult) -> None:
        router, worker = self._d.router, self._served_by[-1]
        if result.output_ids and router.remembers(worker):
            # Its tree now holds prompt + output: a next turn that extends them is routed back there.
            req = self.req
            router.remember(worker, list(req.input_ids) + result.output_ids[:-1], self._salt, prompt=req.input_ids,
                            cached_tokens=result.cached_tokens)
        if self._record is not None:
            self._record.finished(result.prompt_tokens, result.cached_tokens, result.completion_tokens)

    def _detach(self, abort: bool) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close_stream(self.req.rid, abort)

    async def close(self) -> None:
        """The request is over for the route: aborted on its worker(s) unless it finished there."""
        self._detach(abort=True)
        task, self._relay_task = self._relay_task, None
        if task is not None:  # cancelling pd_serve aborts on both PD workers
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._counted:
            self._counted = False
            self._d.inflight.discard(self.req.rid)
            self._d.metrics.gateway_inflight.dec()


class Run:
    """The worker requests of one API request, all feeding one consumer; index i is reqs[i]."""

    __slots__ = ("generations",)

    def __init__(self, dispatcher: "Dispatcher", reqs: Sequence[GenerateRequest], consumer: Consumer):
        self.generations = [Generation(dispatcher, r, i, consumer) for i, r in enumerate(reqs)]

    async def start(self) -> None:
        """Route and send every request (APIError if one cannot start: close() ends the others)."""
        for gen in self.generations:
            await gen.start()

    async def close(self) -> None:
        for gen in self.generations:
            await gen.close()


class _Collector:
    """A consumer for a non-streaming answer: every request's final result, or the first failure."""

    def __init__(self, count: int):
        self.results: list[GenerationResult | None] = [None] * count
        self.error: Exception | None = None
        self.done = asyncio.get_running_loop().create_future()
        self._left = count

    def deliver(self, gen: Generation, item: TokenOutput | Exception) -> None:
        if self.done.done():
            return
        try:
            res = gen.accept(item)
        except Exception as e:
            self.error = e
            self.done.set_result(None)
            return
        if item.finished:
            self.results[gen.index] = res
            self._left -= 1
            if not self._left:
                self.done.set_result(None)


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

    def run(self, reqs: Sequence[GenerateRequest], consumer: Consumer) -> Run:
        """The caller starts the run and closes it whatever happens (closing aborts what did not finish)."""
        return Run(self, reqs, consumer)

    async def collect_many(self, reqs: Sequence[GenerateRequest]) -> list[GenerationResult]:
        """Run requests concurrently to their end; the first failure aborts the others and is raised."""
        collector = _Collector(len(reqs))
        run = self.run(reqs, collector)
        try:
            await run.start()
            await collector.done
        finally:
            await run.close()
        if collector.error is not None:
            raise collector.error
        return collector.results  # type: ignore[return-value]


def tenant_rid(rid: str, salt: str | None) -> str:
    return f"{salt}.{rid}" if salt else rid
