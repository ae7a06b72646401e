"""CPU micro-benchmark of the worker wire.

    python -m bench.wire [--iters 20000] [--streams 256] [--steps 200]

1. Encode + frame + read + validate per message, through a real asyncio.StreamReader (what the worker
   and the gateway run for every frame): microseconds per one-token TokenOutput (the per-token cost of
   every stream), per 4k-token GenerateRequest (every request), and, where the protocol has it, per
   output of one TokenOutputs frame carrying 256 one-token outputs (one engine step at 256 streams).
2. One engine step at `--streams` concurrent streams through the real WorkerServer and WorkerClient over
   loopback TCP, both in this process: from the worker's dispatch of the step's outputs until every
   stream's consumer has its token (worker IO + gateway read, decode, fan-out). The engine is a stub.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.gateway.worker_client import WorkerClient  # noqa: E402
from services.worker.server import WorkerServer  # noqa: E402
from shared import protocol  # noqa: E402
from shared.protocol import GenerateRequest, TokenOutput  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.wire import encode_frame, read_message  # noqa: E402


def _sampling(**kw):
    params = SamplingParams(**kw)
    # The protocol before typed sampling parameters carried them as a dict: measure what it sent.
    return params if "sampling" in getattr(GenerateRequest, "__struct_fields__", ()) else params.to_dict()


def _messages() -> dict[str, tuple[object, int]]:
    """name -> (message, outputs it carries)"""
    sampling = _sampling(max_new_tokens=256, temperature=0.7, top_p=0.9, stop=["\n\n"], seed=3)
    out = dict(rid="req-0123456789abcdef", token_ids=[1234], text=" token", prompt_tokens=4096,
               cached_tokens=1024, completion_tokens=17)
    msgs = {
        "TokenOutput (1 token)": (TokenOutput(**out), 1),
        "GenerateRequest (4k tokens)": (GenerateRequest(rid="req-0123456789abcdef", input_ids=list(range(1000, 5096)),
                                                        sampling=sampling, request_id="abc"), 1),
    }
    if hasattr(protocol, "TokenOutputs"):
        batch = protocol.TokenOutputs(outputs=[TokenOutput(**{**out, "rid": f"req-{i:016x}"}) for i in range(256)])
        msgs["TokenOutputs (256 x 1 token), per output"] = (batch, 256)
    return msgs


async def _time(msg, iters: int) -> tuple[float, float]:
    """(encode µs, read+decode µs) per message."""
    reader = asyncio.StreamReader(limit=2 ** 26)
    t0 = time.perf_counter()
    for _ in range(iters):
        frame = encode_frame(msg)
    t1 = time.perf_counter()
    for _ in range(iters):
        reader.feed_data(frame)
        await read_message(reader)
    t2 = time.perf_counter()
    return (t1 - t0) / iters * 1e6, (t2 - t1) / iters * 1e6


class _StubEngine:
    steps = 0

    def __init__(self):
        self.submitted = 0
        self.scheduler = type("Sched", (), {"num_running": staticmethod(lambda: 0)})()

    def submit(self, msg) -> None:
        self.submitted += 1

    def abort(self, rid: str) -> None:
        pass


async def _steps(streams: int, steps: int) -> list[float]:
    """Seconds per engine step, from dispatch until every stream's consumer holds its token."""
    engine = _StubEngine()
    server = WorkerServer(engine)
    port = await server.start("127.0.0.1", 0)
    client = WorkerClient("127.0.0.1", port, token_timeout=60.0)
    got = 0
    target, step_done = 0, asyncio.Event()

    async def consume(i: int) -> None:
        nonlocal got
        req = GenerateRequest(rid=f"s{i}", input_ids=[1, 2, 3], sampling=_sampling(max_new_tokens=steps))
        async for _ in client.generate(req):
            got += 1
            if got == target:
                step_done.set()

    tasks = [asyncio.create_task(consume(i)) for i in range(streams)]
    while engine.submitted < streams:
        await asyncio.sleep(0.01)
    times = []
    for step in range(steps):
        last = step == steps - 1
        outs = [TokenOutput(rid=f"s{i}", token_ids=[1000 + step], text=" tok", finished=last,
                            prompt_tokens=3, completion_tokens=step + 1) for i in range(streams)]
        target, step_done = got + streams, asyncio.Event()
        t0 = time.perf_counter()
        server._dispatch(outs)
        await step_done.wait()
        times.append(time.perf_counter() - t0)
    await asyncio.gather(*tasks)
    await client.close()
    await asyncio.sleep(0.2)  # the worker sees the connection end and its handler returns
    await server.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    for name, (msg, count) in _messages().items():
        iters = max(20, args.iters // count)
        best = min((asyncio.run(_time(msg, iters)) for _ in range(3)), key=sum)
        enc, dec = (v / count for v in best)
        print(f"{name:45s} encode {enc:8.2f} us  decode {dec:8.2f} us  total {enc + dec:8.2f} us")
    times = sorted(asyncio.run(_steps(args.streams, args.steps))[5:])  # the first steps warm up
    p50, p90 = times[len(times) // 2], times[int(len(times) * 0.9)]
    print(f"engine step at {args.streams} streams, worker dispatch -> every consumer: p50 {p50 * 1e3:.2f} ms, "
          f"p90 {p90 * 1e3:.2f} ms ({p50 / args.streams * 1e6:.2f} us per token)")


if __name__ == "__main__":
    main()
