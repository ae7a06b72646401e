"""CPU micro-benchmark of the worker wire: encode + frame + read + validate per message, through a real
asyncio.StreamReader (what the worker and the gateway run for every frame).

    python -m bench.wire [--iters 20000]

Prints microseconds per message for a one-token TokenOutput (the per-token cost of every stream), a
4k-token GenerateRequest (every request), and, where the protocol has it, one TokenOutputs frame
carrying 256 one-token outputs (one engine step at 256 streams) per output.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared import protocol  # noqa: E402
from shared.protocol import GenerateRequest, TokenOutput  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.wire import encode_frame, read_message  # noqa: E402


def _messages() -> dict[str, tuple[object, int]]:
    """name -> (message, outputs it carries)"""
    params = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.9, stop=["\n\n"], seed=3)
    # The protocol before typed sampling parameters carried them as a dict: measure what it sent.
    sampling = params if "sampling" in getattr(GenerateRequest, "__struct_fields__", ()) else params.to_dict()
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    args = ap.parse_args()
    for name, (msg, count) in _messages().items():
        iters = max(20, args.iters // count)
        best = min((asyncio.run(_time(msg, iters)) for _ in range(3)), key=sum)
        enc, dec = (v / count for v in best)
        print(f"{name:45s} encode {enc:8.2f} us  decode {dec:8.2f} us  total {enc + dec:8.2f} us")


if __name__ == "__main__":
    main()
