"""Sweep GEMV variants for FP8 weights at batch 1 on the Llama-8B shapes, timed inside CUDA graphs
(no launch overhead), weights rotated through copies larger than L2.

    python -m bench.fp8_gemv_sweep
"""
from __future__ import annotations

import torch

from kernels.gemv import GemvConfig, gemv
from kernels.reference import quantize_fp8_per_token
from shared.gc_freeze import collections_paused
from shared.models.quantization import quantize_per_channel

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
COPIES = 8


def graph_time(fns) -> float:
    """Seconds per call of a list of closures (one per weight copy), replayed in a CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with collections_paused(), torch.cuda.graph(g):  # a collection mid-capture can invalidate it (shared/gc_freeze.py)
        for _ in range(4):
            for f in fns:
                f()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3 / (10 * 4 * len(fns))


def main():
    for n, k in SHAPES:
        w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        w8 = [quantize_per_channel(w.float()) for w in w16]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_fp8_per_token(x)
        t16 = graph_time([lambda w=w: gemv(x, w) for w in w16])
        print(f"N={n} K={k}  bf16 gemv {t16 * 1e6:6.1f} us {n * k * 2 / t16 / 1e9:5.0f} GB/s")
        res = []
        for bn in (8, 16, 32, 64):
            for bk in (128, 256, 512, 1024, 2048):
                for warps in (2, 4, 8):
                    cfg = GemvConfig(bn, bk, 1, warps)
                    for dot in (False, True):
                        if not dot and bn * bk // (32 * warps) > 128:
                            continue
                        if dot and bn < 16:
                            continue
                        xin = xq if dot else x
                        try:
                            t = graph_time([lambda w=w, s=s: gemv(xin, w, config=cfg, scale=s, tensor_cores=dot)
                                            for w, s in w8])
                        except Exception:  # noqa: BLE001
                            continue
                        res.append((t, dot, cfg))
        for dot in (False, True):
            sub = sorted(r for r in res if r[1] == dot)
            if sub:
                t, _, cfg = sub[0]
                print(f"   fp8 {'dot ' if dot else 'fma '} best {cfg}: {t * 1e6:6.1f} us {n * k / t / 1e9:5.0f} GB/s"
                      f"  ratio to bf16 {t / t16:.2f}")
        try:
            t = graph_time([lambda w=w, s=s: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=s.view(1, -1),
                                                               out_dtype=torch.bfloat16) for w, s in w8])
            print(f"   fp8 _scaled_mm M=1: {t * 1e6:6.1f} us  ratio to bf16 {t / t16:.2f}")
        except Exception as e:  # noqa: BLE001
            print(f"   _scaled_mm failed: {e!r}"[:200])
        t = graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in w16])
        print(f"   bf16 cuBLAS {t * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
