"""The worker's wire: garbage and malformed frames drop that connection only; the worker keeps serving,
and requests of a dropped connection are aborted (their KV freed). Outputs leave as one frame per engine
step per connection."""
from __future__ import annotations

import asyncio
import os
import signal
import struct
from types import SimpleNamespace

import msgpack
import pytest

from services.worker.server import WorkerServer
from shared.protocol import FinishLength, GenerateRequest, Hello, InfoRequest, TokenOutput, TokenOutputs
from shared.sampling_params import SamplingParams
from shared.wire import encode_frame, read_message
from tests.support.stack import spawn, wait_line


async def _info(host: str, port: int) -> dict:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode_frame(Hello()) + encode_frame(InfoRequest(call_id=1)))
    msg = await asyncio.wait_for(read_message(reader), 10)
    writer.close()
    return msg.info


async def _scenario(host: str, port: int) -> None:
    bad_frames = [
        b"\x00\x00\x00\x05hello",  # not msgpack
        struct.pack("!I", 2 ** 31) + b"x",  # absurd length
        struct.pack("!I", 3) + msgpack.packb([1, 2]),  # not a map
        encode_frame(InfoRequest(call_id=1))[:4] + msgpack.packb({"type": "generate", "rid": 5}),  # bad field
        (lambda b: struct.pack("!I", len(b)) + b)(msgpack.packb({"type": "exec", "code": "1"})),  # unknown type
    ]
    for frame in bad_frames:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(encode_frame(Hello()) + frame)
        await writer.drain()
        # The worker drops this connection (EOF), and only this one.
        assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
    info = await _info(host, port)
    assert info["num_running"] == 0
    assert info["gc_frozen_objects"] > 10_000  # torch & co. out of every full collection (shared/gc_freeze.py)
    # A connection that disappears mid-request gets its request aborted.
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode_frame(Hello()) + encode_frame(GenerateRequest(rid="orphan", input_ids=[5, 6, 7],
                                              sampling=SamplingParams(max_new_tokens=3000, ignore_eos=True))))
    msg = await asyncio.wait_for(read_message(reader), 20)  # one frame per engine step
    assert isinstance(msg, TokenOutputs) and [o.rid for o in msg.outputs] == ["orphan"]
    writer.transport.abort()
    for _ in range(100):
        info = await _info(host, port)
        if info["num_running"] == 0:
            break
        await asyncio.sleep(0.1)
    assert info["num_running"] == 0 and info["kv_usage"] == 0.0


@pytest.mark.e2e
def test_worker_survives_bad_frames_and_aborts_orphans():
    proc = spawn("services.worker", "--model-path", "tiny-random")
    try:
        host, port = wait_line(proc, "WORKER READY").split()[2].rsplit(":", 1)
        asyncio.run(_scenario(host, int(port)))
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _StubEngine:
    """What WorkerServer needs of an engine: requests in, aborts in, outputs out (through on_output)."""

    def __init__(self):
        self.submitted, self.aborted = [], []
        self.steps = 0
        self.scheduler = SimpleNamespace(num_running=lambda: 0)
        self.on_output = None

    def submit(self, msg):
        self.submitted.append(msg.rid)

    def abort(self, rid):
        self.aborted.append(rid)


def _out(rid: str, finished: bool = False) -> TokenOutput:
    return TokenOutput(rid=rid, token_ids=[7], text=rid, finished=finished,
                       finish_reason=FinishLength(length=1) if finished else None)


async def _batching_scenario() -> None:
    engine = _StubEngine()
    server = WorkerServer(engine)
    port = await server.start("127.0.0.1", 0)
    conns = {}
    for name in ("x", "y"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        requests = [GenerateRequest(rid=f"{name}{i}", input_ids=[1], sampling=SamplingParams()) for i in range(3)]
        writer.write(encode_frame(Hello()) + b"".join(encode_frame(r) for r in requests))
        conns[name] = (reader, writer)
    for _ in range(200):
        if len(engine.submitted) == 6:
            break
        await asyncio.sleep(0.01)

    async def frames(name: str) -> list:
        return [o.text for o in (await asyncio.wait_for(read_message(conns[name][0]), 5)).outputs]

    # One engine step (from the engine thread): one frame per connection with its requests' outputs, in order.
    await asyncio.to_thread(engine.on_output, [_out("x0", finished=True), _out("y0"), _out("x1"), _out("y1"),
                                               _out("x2"), _out("zzz"), _out("y2")])
    assert await frames("x") == ["x0", "x1", "x2"]
    assert await frames("y") == ["y0", "y1", "y2"]
    # x0 finished: it left its connection, so a late output for it goes nowhere.
    await asyncio.to_thread(engine.on_output, [_out("x0"), _out("y0")])
    assert await frames("y") == ["y0"]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(read_message(conns["x"][0]), 0.3)
    # A connection that drops aborts the requests it still owns, and only those.
    conns["x"][1].close()
    for _ in range(200):
        if engine.aborted:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert sorted(engine.aborted) == ["x1", "x2"]
    conns["y"][1].close()
    await server.close()


def test_worker_sends_one_frame_per_step_per_connection():
    asyncio.run(_batching_scenario())


async def _stop_with_a_connection_open(engine: _StubEngine, errors: list) -> None:
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx.get("message")))
    server = WorkerServer(engine)
    port = await server.start("127.0.0.1", 0)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_frame(Hello()) + encode_frame(
        GenerateRequest(rid="r", input_ids=[1], sampling=SamplingParams())))
    for _ in range(200):
        if engine.submitted:
            break
        await asyncio.sleep(0.01)
    assert engine.submitted == ["r"]
    # Returning with the connection open: asyncio.run cancels its handler, as a worker's shutdown does.


def test_worker_stopping_with_connections_open_aborts_their_requests_quietly():
    """No "Exception in callback" at ERROR on a clean stop (Python 3.11's start_server asked the cancelled
    handler task for its exception), and what the connection still owned is aborted."""
    engine, errors = _StubEngine(), []
    asyncio.run(_stop_with_a_connection_open(engine, errors))
    assert errors == []
    assert engine.aborted == ["r"]
