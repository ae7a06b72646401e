"""cuBLAS bf16 GEMM rate by row count on the Llama-3.1-8B linear shapes: is an extend pass of ~750 tokens
(a jump-forward catch-up pass) slow because of its M, and would padding M to a tile multiple pay?

    python -m bench.gemm_m_sweep [--out DIR]

Each (M, shape) is timed with CUDA events over 21 back-to-back launches (three weight copies in turn) after
a warm-up, as torch's
F.linear runs it in the engine; reported in TFLOP/s with the same run's square-GEMM ceiling
(bench.common.measure_matmul_tflops) beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import measure_matmul_tflops

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
ROWS = [16, 64, 256, 512, 740, 748, 756, 768, 1000, 1024, 2400, 2416, 2432, 4096, 8192]


def rate(m: int, k: int, n: int, reps: int = 21) -> float:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    # Three weight copies in turn (> 50 MB of L2 for every shape): the small-M rows stream from memory.
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for w in ws:
        torch.nn.functional.linear(x, w)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(reps):
        torch.nn.functional.linear(x, ws[i % 3])
    b.record()
    torch.cuda.synchronize()
    return 2 * m * k * n * reps / (a.elapsed_time(b) * 1e-3) / 1e12


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args()
    ceiling = measure_matmul_tflops()
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "ceiling_tflops": ceiling, "rows": {}}
    print(f"{torch.cuda.get_device_name()}, square-GEMM ceiling {ceiling:.0f} TFLOP/s")
    print("M      " + "".join(f"{name:>10}" for name in SHAPES) + "   (TFLOP/s)")
    for m in ROWS:
        r = {name: rate(m, k, n) for name, (k, n) in SHAPES.items()}
        res["rows"][m] = r
        print(f"{m:<7}" + "".join(f"{v:10.0f}" for v in r.values()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemm_m_sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
