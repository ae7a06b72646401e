"""The worker's wire: garbage and malformed frames drop that connection only; the worker keeps serving,
and requests of a dropped connection are aborted (their KV freed)."""
from __future__ import annotations

import asyncio
import os
import signal
import struct

import msgpack

from shared.protocol import GenerateRequest, Hello, InfoRequest, TokenOutput
from shared.wire import encode_frame, read_message
from tests.test_redis_discovery import spawn, wait_line


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
    # A connection that disappears mid-request gets its request aborted.
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(encode_frame(Hello()) + encode_frame(GenerateRequest(rid="orphan", input_ids=[5, 6, 7],
                                              sampling={"max_new_tokens": 3000, "ignore_eos": True})))
    msg = await asyncio.wait_for(read_message(reader), 20)
    assert isinstance(msg, TokenOutput) and msg.rid == "orphan"
    writer.transport.abort()
    for _ in range(100):
        info = await _info(host, port)
        if info["num_running"] == 0:
            break
        await asyncio.sleep(0.1)
    assert info["num_running"] == 0 and info["kv_usage"] == 0.0


def test_worker_survives_bad_frames_and_aborts_orphans():
    proc = spawn("services.worker", "--model-path", "tiny-random")
    try:
        host, port = wait_line(proc, "WORKER READY").split()[2].rsplit(":", 1)
        asyncio.run(_scenario(host, int(port)))
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
