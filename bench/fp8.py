"""FP8 weights vs bf16 on the same GPU in one run: batch-1 decode step (wall and graph replay), and a small
throughput run. Random Llama-3.1-8B-shape weights; the FP8 engine
quantizes the same shape per channel at load (`--quantization fp8`, what an FP8 checkpoint holds). With
--block also block-scaled FP8 ([128, 128] blocks, a Qwen3-FP8 / DeepSeek-style config, dummy weights drawn
per block): the block GEMV and GEMM.

    python -m bench.fp8 [--shape llama-3.1-8b|tiny] [--block] [--out DIR]

Goal (issue "GPU path, round two"): FP8 batch-1 step <= 0.6 x the bf16 step, the medians of --rounds alternated
engine builds (3). Prints PASS/FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import (SHAPES, engine_figures, kv_bytes_per_token, log, measure_copy_bandwidth, median,
                          model_dir, param_bytes)
from shared.tokenizer import Tokenizer

GOAL_RATIO = 0.6


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--reqs", type=int, default=128, help="requests of the throughput run (512 in, 128 out)")
    ap.add_argument("--steps", type=int, default=200, help="batch-1 decode steps")
    ap.add_argument("--rounds", type=int, default=3,
                    help="batch-1 rounds, the engines alternated (the throughput run in the first only); medians")
    ap.add_argument("--block", action="store_true", help="also block-scaled FP8 weights ([128, 128])")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
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
    variants = {"none": (path, {"quantization": "none"}), "fp8": (path, {"quantization": "fp8"})}
    if args.block:
        block_dir = model_dir(args.shape, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic",
                                                                "weight_block_size": [128, 128]}, suffix="-fp8-block")
        variants["fp8-block"] = (block_dir, {})
    rounds: dict = {q: [] for q in variants}
    for r in range(args.rounds):
        for q, (where, extra) in variants.items():
            log(f"engine {q}, round {r + 1}")
            rounds[q].append(engine_figures(where, tok, cuda, 400, args.reqs if r == 0 else 0, args.steps, **extra))
            log(f"  {rounds[q][-1]}"[:300])
    for q, figs in rounds.items():  # each figure's median over the rounds that have it
        res[q] = {k: median([f[k] for f in figs if k in f]) for k in figs[0]}
        res[q]["rounds"] = figs
    ratio = res["fp8"]["b1_step_ms"] / res["none"]["b1_step_ms"]
    res["b1_ratio"] = ratio
    with open(os.path.join(args.out, "fp8.json"), "w") as f:
        json.dump({k: v for k, v in res.items()}, f, indent=2, default=str)
    print(f"\n{res['gpu']}  copy {bw / 1e12:.2f} TB/s")
    print(f"{'metric':28s} {'bf16':>10s} {'fp8':>10s} {'ratio':>7s}" + ("  fp8-block  ratio" if args.block else ""))
    for key in ("b1_step_ms", "b1_graph_ms", "tput_tok_s"):
        a, b = res["none"].get(key), res["fp8"].get(key)
        if a and b:
            c = res.get("fp8-block", {}).get(key)
            print(f"{key:28s} {a:10.2f} {b:10.2f} {b / a:7.3f}" + (f" {c:10.2f} {c / a:6.3f}" if c else ""))
    print(f"{'weight-stream floor ms':28s} {res['floor_bf16_ms']:10.2f} {res['floor_fp8_ms']:10.2f}")
    per_round = [f["b1_step_ms"] / b["b1_step_ms"] for f, b in zip(rounds["fp8"], rounds["none"])]
    print(f"{'PASS' if ratio <= GOAL_RATIO else 'FAIL'}: fp8 batch-1 step {ratio:.3f} x bf16 (goal <= {GOAL_RATIO}; "
          f"medians of {args.rounds} alternated rounds, each round's ratio {', '.join(f'{x:.3f}' for x in per_round)})")
    a, b = res["none"].get("b1_period_ms"), res["fp8"].get("b1_period_ms")
    if a and b:
        print(f"info  batch-1 decode step without the prompt's prefill (median between launches): fp8 {b:.3f} ms, "
              f"bf16 {a:.3f} ms, {b / a:.3f} x (the goal's figure spreads each 512-token prefill over the steps)")
        pa, pb = res["none"].get("b1_prefill_ms"), res["fp8"].get("b1_prefill_ms")
        print(f"info  the 512-token prompt's prefill, beyond the decode steps: fp8 ~{pb:.1f} ms, bf16 ~{pa:.1f} ms")


if __name__ == "__main__":
    main()
