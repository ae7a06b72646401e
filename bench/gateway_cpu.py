"""The gateway's generation path in one process, without sockets: what a request costs in Python alone,
as a number that does not move with the machine's load.

    python -m bench.gateway_cpu [--route completions|generate] [--streams 256] [--tokens 128]
                                [--stream-interval 16] [--rounds 4] [--callgrind]

The gateway's aiohttp server protocol, routes, dispatcher and worker client run on fake transports:
each round, `--streams` requests (the bench clients' bodies: 512 prompt ids) arrive on fresh connections,
the worker client's read loop is fed TokenOutputs frames as the engine sends them (one per step, `--stream-
interval` tokens an increment after the first), every stream ends and its connection closes. Printed: the
process's CPU per request over the rounds (harness included, ~10% of it) and its young garbage collections.
`bench.gateway_overhead` measures the same path with sockets and a worker process, where a shared machine's
noise is ±15% a run; here, under callgrind, the count is the same to 0.1% from run to run:

    valgrind --tool=callgrind --instr-atstart=no python -m bench.gateway_cpu --callgrind --rounds 4

(instrumentation is switched on for the measured rounds only; divide the dump's `totals` by streams x
rounds for instructions a request).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import time

from bench.serving import MODEL, request_body


class _Transport:
    """A client connection that takes every write at once."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default=None):
        return default


class _WorkerWriter:
    """The worker connection's writer: frames are dropped (the requests are known by their streams)."""

    def __init__(self) -> None:
        self.transport = _Transport()

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return False


async def _settle(turns: int = 6) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def run(route: str, streams: int, tokens: int, interval: int, rounds: int, callgrind: bool) -> None:
    from aiohttp import web

    from services.gateway.app import create_app
    from services.gateway.router import Router
    from services.gateway.state import GatewayState
    from services.gateway.worker_client import WorkerClient
    from shared.protocol import FinishLength, TokenOutput, TokenOutputs
    from shared.tokenizer import Tokenizer
    from shared.wire import encode_frame

    worker = WorkerClient("127.0.0.1", 1)
    reader = asyncio.StreamReader()
    worker._writer = _WorkerWriter()
    worker._connected.set()
    worker.role = "unified"
    worker._task = asyncio.get_running_loop().create_task(worker._read_loop(reader))
    state = GatewayState(tokenizer=Tokenizer.load("tiny-random"), served_model_name="tiny-random",
                         model_path="tiny-random", router=Router([worker]), context_length=1 << 20)
    app = create_app(state)
    app.on_startup.clear()  # the worker connection is this harness's, already "connected"
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    protocol = runner.server
    MODEL["id"] = "tiny-random"
    rng = random.Random(0)
    requests = []
    for _ in range(streams):
        path, body = request_body(route, [rng.randrange(10, 400) for _ in range(512)], tokens, True)
        data = json.dumps(body).encode()
        requests.append(b"POST %b HTTP/1.1\r\nHost: 127.0.0.1:30000\r\nAccept: */*\r\nContent-Length: %d\r\n"
                        b"Content-Type: application/json\r\n\r\n%b" % (path.encode(), len(data), data))
    next_token = iter(range(1 << 62)).__next__

    async def one_round() -> None:
        conns = []
        for data in requests:
            conn, transport = protocol(), _Transport()
            conn.connection_made(transport)
            conn.data_received(data)
            conns.append((conn, transport))
        await _settle()
        assert len(worker._streams) == streams, "not every request reached the worker"
        running = {rid: [0, []] for rid in worker._streams}  # rid -> [tokens emitted, not yet sent]
        while running:
            outs = []
            for rid, st in list(running.items()):
                st[0] += 1
                st[1].append(next_token() % 390 + 10)
                done = st[0] >= tokens
                if not done and st[0] > 1 and len(st[1]) < interval:
                    continue
                outs.append(TokenOutput(rid=rid, token_ids=st[1], text=" x" * len(st[1]), finished=done,
                                        finish_reason=FinishLength(length=tokens) if done else None,
                                        prompt_tokens=512, completion_tokens=st[0]))
                st[1] = []
                if done:
                    del running[rid]
            if outs:
                reader.feed_data(bytes(encode_frame(TokenOutputs(outputs=outs))))
                await _settle()
        await _settle()
        for conn, transport in conns:
            assert transport.out and transport.out[-1].endswith(b"0\r\n\r\n"), "a stream did not end"
            conn.connection_lost(None)
        await _settle()

    await one_round()  # warm-up
    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))
    if callgrind:
        for cmd in (["-i", "on"], ["-z"]):
            subprocess.run(["callgrind_control", *cmd, str(os.getpid())], check=True, capture_output=True)
    t0 = time.process_time()
    for _ in range(rounds):
        await one_round()
    cpu = time.process_time() - t0
    if callgrind:
        subprocess.run(["callgrind_control", "-d", str(os.getpid())], check=True, capture_output=True)
    print(f"{route}: {streams} streams x {tokens} tokens at interval {interval}, {rounds} rounds: "
          f"{cpu * 1e6 / (rounds * streams):.1f} us/request of process CPU (harness included), "
          f"{collections[0]} garbage collections")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--route", default="completions", choices=["completions", "generate"])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--stream-interval", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--callgrind", action="store_true",
                    help="under valgrind --tool=callgrind --instr-atstart=no: instrument the measured rounds only")
    args = ap.parse_args()
    from shared import event_loop
    from shared.gc_freeze import space_young_collections

    space_young_collections()  # as the gateway process
    event_loop.run(run(args.route, args.streams, args.tokens, args.stream_interval, args.rounds, args.callgrind))


if __name__ == "__main__":
    main()
