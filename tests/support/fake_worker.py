"""A worker that speaks the real wire protocol over real TCP, with deterministic output, for gateway tests.

Output tokens cycle through a fixed phrase, starting at an offset derived from the prompt and the seed, so
tests can predict text. Knobs: `token_delay` (slow streams), `refuse` (every generate answers an error;
with `overloaded`, one saying the worker is too busy),
`error_after` (error mid-stream after k tokens), `silent` (reads but never answers), `script` (answer this
text instead, ending with eos when it fits in max_new_tokens: forced outputs for output parsers).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from aiohttp.test_utils import TestClient, TestServer

from shared.protocol import (AbortRequest, FinishAbort, FinishLength, FinishStop, FlushCacheRequest,
                             FlushCacheResult, GenerateRequest, InfoRequest, InfoResult, Message, PingRequest,
                             PongResult, TokenOutput)
from shared.tokenizer import Tokenizer
from shared.wire import encode_frame, read_message

PHRASE = " the quick brown fox jumps over the lazy dog."


def fake_logprob(position: int) -> float:
    return -0.25 - 0.01 * position


class FakeWorker:
    def __init__(self, tokenizer: Tokenizer, *, max_context_len: int = 256, token_delay: float = 0.0):
        self.tok = tokenizer
        self.max_context_len = max_context_len
        self.token_delay = token_delay
        self.refuse: str | None = None
        self.overloaded = False
        self.error_after: int | None = None
        self.silent = False
        self.script: str | None = None
        self.flush_ok = True
        self.cycle = tokenizer.encode(PHRASE, add_special_tokens=False)
        self.received: list[Message] = []
        self.seen_prompts: list[list[int]] = []
        self.running: dict[str, asyncio.Task] = {}
        self.finished_rids: list[str] = []
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    # ---------------------------------------------------------------- server
    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()  # stop accepting first, so clients cannot reconnect in between
        await self.drop_connections()
        if self._server is not None:
            await self._server.wait_closed()

    async def drop_connections(self) -> None:
        for task in list(self.running.values()):
            task.cancel()
        for w in list(self._writers):
            w.close()
        await asyncio.sleep(0.01)

    def aborted(self) -> set[str]:
        return {m.rid for m in self.received if isinstance(m, AbortRequest)}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                msg = await read_message(reader)
                self.received.append(msg)
                if self.silent:
                    continue
                if isinstance(msg, PingRequest):
                    writer.write(encode_frame(PongResult(call_id=msg.call_id, num_running=len(self.running))))
                elif isinstance(msg, InfoRequest):
                    writer.write(encode_frame(InfoResult(call_id=msg.call_id, info=self.info())))
                elif isinstance(msg, FlushCacheRequest):
                    self.seen_prompts.clear()
                    writer.write(encode_frame(FlushCacheResult(call_id=msg.call_id, ok=self.flush_ok,
                                                               message="" if self.flush_ok else "busy")))
                elif isinstance(msg, GenerateRequest):
                    self.running[msg.rid] = asyncio.create_task(self._generate(msg, writer))
                elif isinstance(msg, AbortRequest):
                    task = self.running.pop(msg.rid, None)
                    if task is not None:
                        task.cancel()
                        writer.write(encode_frame(TokenOutput(rid=msg.rid, token_ids=[], text="", finished=True,
                                                              finish_reason=FinishAbort(message="aborted"))))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def info(self) -> dict:
        return {"max_context_len": self.max_context_len, "max_total_tokens": 4096, "model_path": "tiny-random",
                "num_running": len(self.running), "num_waiting": 0, "kv_usage": 0.25,
                "cache_hit_tokens": 0, "cache_query_tokens": 0}

    # ---------------------------------------------------------------- generation
    def expected_ids(self, input_ids: list[int], max_new_tokens: int, seed: int | None = None) -> list[int]:
        start = (sum(input_ids) + (seed or 0)) % len(self.cycle)
        return [self.cycle[(start + k) % len(self.cycle)] for k in range(max_new_tokens)]

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for prev in self.seen_prompts:
            n = 0
            while n < min(len(prev), len(ids) - 1) and prev[n] == ids[n]:
                n += 1
            best = max(best, n)
        self.seen_prompts.append(list(ids))
        return best

    async def _generate(self, req: GenerateRequest, writer: asyncio.StreamWriter) -> None:
        try:
            await self._run(req, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self.running.pop(req.rid, None)

    async def _run(self, req: GenerateRequest, writer: asyncio.StreamWriter) -> None:
        def send(**kw):
            writer.write(encode_frame(TokenOutput(rid=req.rid, **kw)))

        if self.refuse:
            send(token_ids=[], text="", finished=True, error=self.refuse, overloaded=self.overloaded,
                 finish_reason=FinishAbort(message=self.refuse))
            return
        sp = req.sampling
        sp.validate()
        ids = req.input_ids
        usage = {"prompt_tokens": len(ids), "cached_tokens": self._cached(ids)}
        first: dict = {"queue_time": 0.001}
        if req.wants_input_logprobs:
            positions = range(req.logprob_start_len, len(ids))
            first["input_logprobs"] = [[None if p == 0 else fake_logprob(p), ids[p]] for p in positions]
            first["input_top_logprobs"] = [None if p == 0 else self._tops(ids[p], req.top_logprobs_num, p)
                                           for p in positions]
        planned = self.expected_ids(ids, sp.max_new_tokens, sp.seed)
        finish = FinishLength(length=sp.max_new_tokens)
        if self.script is not None:
            scripted = self.tok.encode(self.script, add_special_tokens=False)
            planned = scripted[:sp.max_new_tokens]
            if len(scripted) <= sp.max_new_tokens:
                finish = FinishStop(matched=self.tok.eos_token_ids[0])
        hold = max((len(s) for s in sp.stop), default=1) - 1
        out_ids: list[int] = []
        sent = 0
        if not planned:
            send(token_ids=[], text="", finished=True, finish_reason=finish, completion_tokens=0, **usage, **first)
            self.finished_rids.append(req.rid)
            return
        for k, tid in enumerate(planned):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            if self.error_after is not None and k == self.error_after:
                send(token_ids=[], text="", finished=True, error="worker exploded",
                     finish_reason=FinishAbort(message="worker exploded"), **usage)
                return
            if tid in sp.stop_token_ids:
                finish = FinishStop(matched=tid)
                full, last = self.tok.decode(out_ids), True
            else:
                out_ids.append(tid)
                full = self.tok.decode(out_ids)
                hit = min(((full.find(s), s) for s in sp.stop if s in full), default=None)
                last = hit is not None or k == len(planned) - 1
                if hit is not None:
                    full = full[:hit[0]]
                    finish = FinishStop(matched=hit[1])
            upto = len(full) if last else max(sent, len(full) - hold)
            extra = {}
            if req.return_logprob:
                extra = {"output_logprobs": [[fake_logprob(k), tid]],
                         "output_top_logprobs": [self._tops(tid, req.top_logprobs_num, k)]}
            new_ids = [] if isinstance(finish, FinishStop) and finish.matched == tid else [tid]
            send(token_ids=new_ids, text=full[sent:upto], finished=last,
                 finish_reason=finish if last else None, completion_tokens=len(out_ids),
                 **usage, **(first if k == 0 else {}), **(extra if new_ids else {}))
            sent = upto
            if last:
                self.finished_rids.append(req.rid)
                return
            await asyncio.sleep(0)

    def _tops(self, tid: int, k: int, position: int) -> list:
        vocab = self.tok.vocab_size
        return [[fake_logprob(position) - j, (tid + j) % vocab] for j in range(k)]


@dataclass
class Stack:
    """A gateway over fake workers, served by a real TestServer."""
    workers: list[FakeWorker]
    state: object
    server: TestServer
    client: TestClient

    @property
    def worker(self) -> FakeWorker:
        return self.workers[0]

    @property
    def base_url(self) -> str:
        return str(self.server.make_url("/"))


@contextlib.asynccontextmanager
async def gateway_stack(num_workers: int = 1, *, context_length: int | None = 256, wait_healthy: bool = True,
                        token_delay: float = 0.0, tokenizer: Tokenizer | None = None,
                        **state_kwargs):
    from services.gateway.app import create_app
    from services.gateway.routing.router import Router
    from services.gateway.state import GatewayState
    from services.gateway.routing.worker_client import WorkerClient

    tok = tokenizer or Tokenizer.load("tiny-random")
    workers = [FakeWorker(tok, token_delay=token_delay) for _ in range(num_workers)]
    ports = [await w.start() for w in workers]
    clients = [WorkerClient("127.0.0.1", p, connect_timeout=2.0, call_timeout=2.0, token_timeout=5.0)
               for p in ports]
    state = GatewayState(tokenizer=tok, served_model_name="tiny", model_path="tiny-random",
                         router=Router(clients), context_length=context_length, **state_kwargs)
    state.health.interval = 0.02
    server = TestServer(create_app(state))
    client = TestClient(server)
    await client.start_server()
    try:
        if wait_healthy:
            for _ in range(200):
                if state.health.healthy:
                    break
                await asyncio.sleep(0.02)
            assert state.health.healthy, "gateway never became healthy"
        yield Stack(workers, state, server, client)
    finally:
        await client.close()
        for w in workers:
            await w.stop()


def sse_events(raw: str) -> list:
    """Split an SSE body, asserting the exact framing: only `data: ...` events, each ended by a blank line.
    Returns decoded JSON payloads, with the literal string "[DONE]" for the terminator."""
    import json

    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-50:]!r}"
    events = []
    for block in raw[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE block {block!r}"
        payload = block[len("data: "):]
        events.append("[DONE]" if payload == "[DONE]" else json.loads(payload))
    return events
