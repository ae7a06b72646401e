"""Block-scaled FP8 linear layers alone on the GPU (kernels/fp8_block_gemm.py and the block GEMV), against the
same shapes in bf16 (cuBLAS through torch) and with per-channel FP8 (torch._scaled_mm), in one process: Llama-3.1-8B's
four decode-layer linears at batch sizes from one row (the GEMV) to a prefill chunk. With --sweep also the GEMM's
tiles and K splits at each shape (what default_tiles and MIN_PROGRAMS_PER_SM should be).

    python -m bench.fp8_block_gemm [--sweep] [--out DIR]

Each figure is one call's median time from CUDA-graph replays of many calls (eager CUDA-event timing where a
call cannot be captured), weights cycled through more than L2 holds.
Prints the block path's time against bf16 and per-channel FP8 at each shape (no goal: it tells where the block
path stands; the batch-1 and throughput goals are bench.fp8's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 32, 64, 256, 2048, 8192)
SWEEP_SHAPES, SWEEP_ROWS = ("gate_up", "down"), (8, 64, 2048)  # --sweep: ~200 compiles, one device call


def _time(fn, reps: int = 30) -> float:
    """Median µs of one fn() call (its own argument cycling inside), from CUDA-graph replays of many calls
    (bench.kernels.graph_time_ms): without the host's launch cost, which eager event timing adds to every small
    batch (the 2026-12-05 run timed bf16 F.linear at 8 rows at 44 µs that way). A call that cannot be captured
    is timed eagerly instead, and says so."""
    from bench.kernels import graph_time_ms
    try:
        return graph_time_ms(lambda i: fn(), reps=max(5, reps // 3), target_ms=5.0) * 1e3
    except RuntimeError as e:
        print(f"    (not capturable, timed eagerly: {type(e).__name__}: {str(e)[:80]})", flush=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also the GEMM's tiles and K splits at each shape")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args()
    import kernels.fp8_block_gemm as fbg
    from kernels.ops import fp8_linear
    from kernels.quant import quantize_per_group
    from shared.models.quantization import quantize_blocks, quantize_per_channel

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "gpu": torch.cuda.get_device_name(), "rows": {}}
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(400e6 // (n * k)))  # FP8 copies cycled: more bytes than L2 holds
        w = torch.randn(n, k, device=dev, generator=gen) * 0.02
        blocks = [quantize_blocks(w, (128, 128)) for _ in range(copies)]
        chans = [quantize_per_channel(w) for _ in range(copies)]
        bf16 = [w.to(torch.bfloat16) for _ in range(max(2, copies // 2))]
        del w
        for m in ROWS:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            i = [0]

            def cycle(pool):
                i[0] = (i[0] + 1) % len(pool)
                return pool[i[0]]

            row = {
                "bf16_us": _time(lambda: torch.nn.functional.linear(x, cycle(bf16))),
                "fp8_channel_us": _time(lambda: fp8_linear(x, *cycle(chans))),
                "fp8_block_us": _time(lambda: fp8_linear(x, *cycle(blocks))),
            }
            if m > 1:
                xq, xs = quantize_per_group(x, 128)
                row["block_gemm_only_us"] = _time(lambda: fbg.block_fp8_gemm(xq, xs, *cycle(blocks), None,
                                                                              torch.bfloat16))
                if args.sweep and name in SWEEP_SHAPES and m in SWEEP_ROWS:
                    row["sweep"] = _sweep(fbg, xq, xs, blocks, cycle)
            row["block_vs_bf16"] = row["fp8_block_us"] / row["bf16_us"]
            row["block_vs_channel"] = row["fp8_block_us"] / row["fp8_channel_us"]
            res["rows"][f"{name} M={m}"] = row
            print(f"{name:8s} M={m:5d}  bf16 {row['bf16_us']:8.1f}  fp8/channel {row['fp8_channel_us']:8.1f}  "
                  f"fp8/block {row['fp8_block_us']:8.1f} us  block/bf16 {row['block_vs_bf16']:.2f}  "
                  f"block/channel {row['block_vs_channel']:.2f}", flush=True)
            if "sweep" in row:
                best = min(row["sweep"], key=row["sweep"].get)
                print(f"    sweep best {best}: {row['sweep'][best]:.1f} us (default {row['block_gemm_only_us']:.1f})")
        del blocks, chans, bf16
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fp8_block_gemm.json"), "w") as f:
        json.dump(res, f, indent=1)


def _sweep(fbg, xq, xs, blocks, cycle) -> dict:
    """The GEMM at each tile (BLOCK_M, BLOCK_N, warps, stages) and split of K, default_tiles patched."""
    out = {}
    saved = fbg.default_tiles
    m = xq.shape[0]
    tiles = [(bm, bn, w, s) for bm in (16, 64, 128) if bm <= max(16, 2 * m) for bn in (64, 128, 256)
             for w, s in ((4, 3), (4, 4), (8, 3)) if not (bm * bn >= 128 * 256 and w == 4)]
    try:
        for t in tiles:
            fbg.default_tiles = lambda _m, t=t: t
            for splits in ((1, 2, 4) if m <= 64 else (1,)):
                try:
                    out[f"{t} split {splits}"] = _time(lambda: fbg.block_fp8_gemm(
                        xq, xs, *cycle(blocks), None, torch.bfloat16, splits=splits), reps=10)
                except Exception as e:  # noqa: BLE001 — a tile that does not compile or fit: recorded, not fatal
                    out[f"{t} split {splits}"] = float("inf")
                    print(f"    {t} split {splits}: {type(e).__name__}: {str(e)[:80]}")
    finally:
        fbg.default_tiles = saved
    return out


if __name__ == "__main__":
    main()
