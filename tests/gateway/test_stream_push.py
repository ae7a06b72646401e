"""Streams fed straight from worker frames (services/gateway/api/sse.py's GenerationStream): for a scripted
sequence of frames the client gets exactly the SSE bytes the routes promise, written by the worker
connection's read loop while the client keeps up and by the response's task otherwise (the same bytes);
a client that stops reading holds the gateway's writes back without losing a token; a formatting bug
ends its own stream only."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.api import sse
from shared.protocol import FinishLength, FinishStop
from shared.tokenizer import Tokenizer
from tests.support.scripted_worker import ScriptedWorker

TOK = Tokenizer.load("tiny-random")


def ev(obj) -> bytes:
    """The standard library's compact JSON (the gateway's encoder matches it byte for byte)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def out(ids, text, finish=None, done=None, **kw) -> dict:
    fields = {"token_ids": ids, "text": text, "prompt_tokens": 3, "completion_tokens": done or len(ids), **kw}
    if finish is not None:
        fields.update(finished=True, finish_reason=finish)
    return fields


@contextlib.asynccontextmanager
async def scripted_gateway(script: list, expect: int = 1, on_prepare=None):
    """A gateway over a ScriptedWorker; yields (client, worker, state, writes): `writes` gets (task name,
    bytes) for every write to a client's transport that aiohttp prepared. `on_prepare(request)`: called as
    each response starts."""
    from services.gateway.app import create_app
    from services.gateway.routing.router import Router
    from services.gateway.state import GatewayState
    from services.gateway.routing.worker_client import WorkerClient

    worker = ScriptedWorker(script, expect)
    port = await worker.start()
    wc = WorkerClient("127.0.0.1", port, connect_timeout=2.0, call_timeout=2.0, token_timeout=5.0)
    state = GatewayState(tokenizer=TOK, served_model_name="tiny", model_path="tiny-random", router=Router([wc]),
                         context_length=4096)
    state.health.interval = 0.02
    app = create_app(state)
    writes: list[tuple[str, bytes]] = []

    async def record_writes(request: web.Request, response: web.StreamResponse) -> None:
        transport = request.transport
        real = transport.write
        transport.write = lambda data: (writes.append((asyncio.current_task().get_name(), bytes(data))),
                                        real(data))[1]
        if on_prepare is not None:
            on_prepare(request)

    app.on_response_prepare.append(record_writes)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        for _ in range(250):
            if state.health.healthy:
                break
            await asyncio.sleep(0.02)
        assert state.health.healthy
        writes.clear()
        yield client, worker, state, writes
    finally:
        await client.close()
        await worker.stop()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _from_read_loop(writes) -> list[bytes]:
    return [data for task, data in writes if task.startswith("worker-")]


COMPLETIONS_SCRIPT = [
    [(0, out([65], "A", cached_tokens=1)), (1, out([66], "B"))], 0.03,
    [(0, out([67, 68], "CD"))], 0.03,
    [(1, out([69], ""))], 0.03,  # text held back (a partial stop string): no event
    [(1, out([70], "E", FinishLength(length=3), done=3))], 0.03,
    [(0, out([71], "F", FinishStop(matched="."), done=4))],
]


async def _completions(client) -> tuple[bytes, dict]:
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "n": 2, "max_tokens": 8, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    body = await r.read()
    first = json.loads(body.split(b"\n\n")[0][len(b"data: "):])
    return body, {"id": first["id"], "object": "text_completion", "created": first["created"], "model": "tiny"}


def _completions_expected(head: dict) -> bytes:
    def chunk(i, text, finish=None):
        return ev({**head, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": finish}],
                   "usage": None})
    usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 1}}
    return (chunk(0, "A") + chunk(1, "B") + chunk(0, "CD") + chunk(1, "E", "length") + chunk(0, "F", "stop")
            + ev({**head, "choices": [], "usage": usage}) + sse.DONE)


async def test_scripted_frames_give_the_exact_completion_chunks():
    async with scripted_gateway(COMPLETIONS_SCRIPT, expect=2) as (client, worker, state, writes):
        body, head = await _completions(client)
        assert body == _completions_expected(head)
        # Headers and the first frame's two events in one write (the response's task: the headers go
        # with them); the next increments straight from the read loop, one write each; the last one,
        # the usage chunk, [DONE] and the chunked terminator in one write.
        assert len(writes) == 4
        assert writes[0][1].startswith(b"HTTP/1.1 200 OK\r\n") and not writes[0][0].startswith("worker-")
        assert _from_read_loop(writes) == [_chunk(body.split(b"\n\n")[2] + b"\n\n"),
                                           _chunk(body.split(b"\n\n")[3] + b"\n\n")]
        assert writes[3][1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n") and b'"choices":[],"usage"' in writes[3][1]
        await asyncio.sleep(0.05)
        assert not worker.aborted and not state.dispatcher.inflight and state.router.load == 0


async def test_queued_increments_give_the_same_bytes(monkeypatch):
    """With every write through the response's task (as for a client that does not keep up), the same
    frames give the same bytes: the two paths share the formatting."""
    monkeypatch.setattr(sse._ChunkWriter, "ready", lambda self: False)
    async with scripted_gateway(COMPLETIONS_SCRIPT, expect=2) as (client, worker, state, writes):
        body, head = await _completions(client)
        assert body == _completions_expected(head)
        assert not _from_read_loop(writes)


async def test_scripted_frames_give_the_exact_chat_chunks():
    script = [[(0, out([65], "Hel"))], 0.03, [(0, out([66], "lo"))], 0.03,
              [(0, out([], "", FinishStop(matched=2), done=2))]]
    async with scripted_gateway(script) as (client, worker, state, writes):
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}})
        body = await r.read()
        first = json.loads(body.split(b"\n\n")[0][len(b"data: "):])
        head = {"id": first["id"], "object": "chat.completion.chunk", "created": first["created"], "model": "tiny"}

        def chunk(delta, finish=None):
            return ev({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
                       "usage": None})
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body == (chunk({"role": "assistant", "content": ""}) + chunk({"content": "Hel"})
                        + chunk({"content": "lo"}) + chunk({}, "stop") + ev({**head, "choices": [], "usage": usage})
                        + sse.DONE)
        # The role chunk goes with the headers before any output; every increment but the last from the
        # read loop; the last (nothing but the finish), the usage and [DONE] in one write.
        assert len(writes) == 4 and len(_from_read_loop(writes)) == 2


async def test_scripted_frames_give_the_exact_native_events():
    script = [[(0, out([65], "A")), (1, out([66], "B"))], 0.03,
              [(1, out([67], "C", FinishLength(length=2), done=2))], 0.03,
              [(0, out([68], "D", FinishLength(length=2), done=2))]]
    async with scripted_gateway(script, expect=2) as (client, worker, state, writes):
        r = await client.post("/generate", json={"input_ids": [[5, 6], [7]], "stream": True, "rid": ["a", "b"],
                                                 "sampling_params": {"max_new_tokens": 2}})
        body = await r.read()
        events = [json.loads(e[len(b"data: "):]) for e in body.split(b"\n\n")[:-2]]
        assert body.endswith(b"\n\n" + sse.DONE)

        def event(rid, i, text, ids, finish):
            return {"text": text, "output_ids": ids, "meta_info": {
                "id": rid, "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
                "cached_tokens": 0, "e2e_latency": None}, "index": i}
        length = {"type": "length", "length": 2}
        for e in events:
            assert e["meta_info"]["e2e_latency"] > 0
            e["meta_info"]["e2e_latency"] = None
        assert events == [event("a", 0, "A", [65], None), event("b", 1, "B", [66], None),
                          event("b", 1, "BC", [66, 67], length), event("a", 0, "AD", [65, 68], length)]
        assert len(_from_read_loop(writes)) == 1  # b's end; a's is the last, written with [DONE]


async def test_a_client_that_stops_reading_holds_writes_back_without_losing_tokens():
    """While the client reads nothing, the gateway's transport buffer stays bounded (the response's task
    waits on aiohttp's flow control; increments wait as outputs and merge) although the worker sends far
    more than that; once the client reads, every token arrives once, in order, in fewer events."""
    piece, steps = "x" * 1999 + "|", 500  # 1 MB of text, ~5 ms apart
    script = [[(0, out([65], "start"))], 0.05]
    for k in range(steps):
        last = k == steps - 1
        script += [[(0, out([66], piece, FinishLength(length=steps + 1) if last else None, done=k + 2))], 0.005]
    buffers: list[int] = []
    samplers: list[asyncio.Task] = []

    def watch(request):
        transport = request.transport
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)

        async def sample():
            while not transport.is_closing():
                buffers.append(transport.get_write_buffer_size())
                await asyncio.sleep(0.002)
        samplers.append(asyncio.create_task(sample()))

    async with scripted_gateway(script, on_prepare=watch) as (client, worker, state, writes):
        loop = asyncio.get_running_loop()
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
        raw.setblocking(False)
        await loop.sock_connect(raw, (client.host, client.port))
        payload = json.dumps({"prompt": [5], "max_tokens": steps + 1, "stream": True}).encode()
        await loop.sock_sendall(raw, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                     b"\r\nContent-Length: %d\r\n\r\n%b" % (len(payload), payload))
        await asyncio.sleep(1.5)  # reading nothing while the worker sends most of its 1 MB
        stalled = max(buffers)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = await asyncio.wait_for(loop.sock_recv(raw, 1 << 16), 10)
            assert chunk, "connection closed early"
            data += chunk
        raw.close()
        for task in samplers:
            task.cancel()
    assert stalled < 250_000, f"the gateway buffered {stalled} bytes for a client reading nothing"
    body = _unchunk(data.partition(b"\r\n\r\n")[2])
    events = body.split(b"\n\n")[:-1]
    assert events[-1] == b"data: [DONE]"
    texts = [json.loads(e[len(b"data: "):])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == "start" + piece * steps  # every token, once, in order
    # What queued while it read nothing came as one event (hundreds of increments), then one per step.
    assert max(len(t) for t in texts) > 100 * len(piece) and len(texts) < steps


def _unchunk(data: bytes) -> bytes:
    body = b""
    while True:
        size, _, rest = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return body
        body, data = body + rest[:n], rest[n + 2:]


async def test_a_formatting_bug_ends_its_own_stream_only(monkeypatch):
    """An exception while formatting (in the read loop's turn) becomes that stream's error event and
    aborts its request; the worker connection and the other stream carry on."""
    from services.gateway.api import openai as openai_api

    real = openai_api._CompletionFormat.on_output

    def on_output(self, i, o, res):
        if self.job.prompts[0].ids == [9] and len(res.output_ids) >= 2:
            raise RuntimeError("formatter bug")
        return real(self, i, o, res)
    monkeypatch.setattr(openai_api._CompletionFormat, "on_output", on_output)
    script = [[(0, out([65], "a")), (1, out([65], "a"))], 0.03]
    script += [[(0, out([66], "b")), (1, out([66], "b"))], 0.03] * 5
    script += [[(0, out([67], "c", FinishLength(length=7), done=7)), (1, out([67], "c", FinishLength(length=7), done=7))]]
    async with scripted_gateway(script, expect=2) as (client, worker, state, writes):
        async def call(prompt):
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 7, "stream": True})
            return await r.read()
        broken, fine = await asyncio.gather(call([9]), call([8]))
        connected = state.router.workers[0].connected
    assert b"internal error while streaming" in broken and not broken.endswith(sse.DONE)
    assert fine.endswith(sse.DONE) and fine.count(b"data: ") == 8
    broken_rid = next(r.rid for r in worker.requests if r.input_ids == [9])
    assert worker.aborted == [broken_rid] and connected
