"""FP8 weights vs bf16 on the same GPU in one run: batch-1 decode step (wall and graph replay), and a small
throughput run. Random Llama-3.1-8B-shape weights; the FP8 engine
quantizes the same shape per channel at load (`--quantization fp8`, what an FP8 checkpoint holds).

    python -m bench.fp8 [--shape llama-3.1-8b|tiny] [--out DIR] [--gemv-picks FILE]

--gemv-picks FILE (bench.gemv_chain_sweep --mma-study's gemv_picks.json): instead, batch-1 only, both
engines with the default GEMV configs and with those picks (kernels.gemv.set_batch1_tuned), alternated.

Goal (issue "GPU path, round two"): FP8 batch-1 step <= 0.6 x the bf16 step. Prints PASS/FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import (SHAPES, engine_figures, kv_bytes_per_token, log, measure_copy_bandwidth,
                          model_dir, param_bytes)
from shared.tokenizer import Tokenizer

GOAL_RATIO = 0.6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--reqs", type=int, default=128, help="requests of the throughput run (512 in, 128 out)")
    ap.add_argument("--steps", type=int, default=200, help="batch-1 decode steps")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    ap.add_argument("--gemv-picks", default="", help="a gemv_picks.json to compare with the default GEMV configs")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    cfg = SHAPES[args.shape]
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    bw = measure_copy_bandwidth() if cuda else 50e9
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "copy_bw_GBps": bw / 1e9,
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    w = param_bytes(cfg) - cfg["vocab_size"] * cfg["hidden_size"] * 2
    lm_head = cfg["vocab_size"] * cfg["hidden_size"] * 2
    kv = 600 * kv_bytes_per_token(cfg)
    res["floor_bf16_ms"] = (w + kv) / bw * 1e3
    res["floor_fp8_ms"] = ((w - lm_head) / 2 + lm_head + kv) / bw * 1e3  # lm_head stays bf16
    if args.gemv_picks:
        compare_picks(args, path, tok, cuda, res)
        return
    for q in ("none", "fp8"):
        log(f"engine quantization={q}")
        res[q] = engine_figures(path, tok, cuda, 400, args.reqs, args.steps, quantization=q)
        log(f"  {res[q]}"[:300])
    ratio = res["fp8"]["b1_step_ms"] / res["none"]["b1_step_ms"]
    res["b1_ratio"] = ratio
    with open(os.path.join(args.out, "fp8.json"), "w") as f:
        json.dump({k: v for k, v in res.items()}, f, indent=2, default=str)
    print(f"\n{res['gpu']}  copy {bw / 1e12:.2f} TB/s")
    print(f"{'metric':28s} {'bf16':>10s} {'fp8':>10s} {'ratio':>7s}")
    for key in ("b1_step_ms", "b1_graph_ms", "tput_tok_s"):
        a, b = res["none"].get(key), res["fp8"].get(key)
        if a and b:
            print(f"{key:28s} {a:10.2f} {b:10.2f} {b / a:7.3f}")
    print(f"{'weight-stream floor ms':28s} {res['floor_bf16_ms']:10.2f} {res['floor_fp8_ms']:10.2f}")
    print(f"{'PASS' if ratio <= GOAL_RATIO else 'FAIL'}: fp8 batch-1 step {ratio:.3f} x bf16 (goal <= {GOAL_RATIO})")


def compare_picks(args, path, tok, cuda, res) -> None:
    """Batch-1 steps with the default GEMV configs and with a sweep's picks, alternated (default, picks,
    default, picks) for both weight types."""
    from kernels.gemv import GemvConfig, set_batch1_tuned
    with open(args.gemv_picks) as f:
        raw = json.load(f)
    table = {}
    for dtype, shapes in raw.items():
        wb = 1 if dtype == "fp8" else 2
        for nk, cfg in shapes.items():
            n, k = (int(v) for v in nk.split(","))
            table[(n, k, wb)] = GemvConfig(**cfg)
    runs: dict = {}
    for use in (False, True, False, True):
        set_batch1_tuned(table if use else {})
        for q in ("none", "fp8"):
            fig = engine_figures(path, tok, cuda, 400, 0, args.steps, quantization=q, cuda_graph_max_bs=1,
                                 max_running_requests=4)
            runs.setdefault(f"{q} {'picks' if use else 'default'}", []).append(fig)
            log(f"  {q} {'picks' if use else 'default'}: {fig}")
    set_batch1_tuned({})
    res["picks"] = {"table": {f"{n},{k},{wb}": vars(c) for (n, k, wb), c in table.items()}, "runs": runs}
    with open(os.path.join(args.out, "fp8_picks.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    best = {key: min(r["b1_step_ms"] for r in v) for key, v in runs.items()}
    print(f"\nbatch-1 step ms, best of 2 (default -> picks): bf16 {best['none default']:.3f} -> {best['none picks']:.3f}, "
          f"fp8 {best['fp8 default']:.3f} -> {best['fp8 picks']:.3f}")
    r_def, r_pick = best["fp8 default"] / best["none default"], best["fp8 picks"] / best["none picks"]
    print(f"{'PASS' if r_pick <= GOAL_RATIO else 'FAIL'}: fp8 / bf16 batch-1 with the picks {r_pick:.3f} "
          f"(defaults {r_def:.3f}, goal <= {GOAL_RATIO})")


if __name__ == "__main__":
    main()
