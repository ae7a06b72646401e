"""Batch-1 decode alone, for A/B runs of a change to the decode path: the engine's step (wall, overlap on)
and its CUDA graph's replay, Llama-3.1-8B shape with dummy weights, bf16 and/or FP8, each in a fresh
engine. One JSON line per engine, so a shell loop can alternate code versions between processes.

    python -m bench.b1 [--quantization none,fp8] [--steps 400] [--label NAME]

The figures are bench.offline's and bench.fp8's batch-1 figures (same drive, same replay timing) without
their throughput runs; the floor and the goals stay theirs.
"""
from __future__ import annotations

import argparse
import json

from bench.common import engine_figures, log, model_dir
from shared.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="none", help="comma-separated: none, fp8")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    path = model_dir("llama-3.1-8b")
    tok = Tokenizer.load(path)
    for q in args.quantization.split(","):
        extra = {} if q == "none" else {"quantization": q}
        fig = engine_figures(path, tok, True, 400, 0, args.steps, max_running_requests=8, cuda_graph_max_bs=8,
                             **extra)
        log(f"{args.label} {q}: step {fig['b1_step_ms']:.3f} ms, replay {fig.get('b1_graph_ms', 0):.3f} ms")
        print(json.dumps({"label": args.label, "quantization": q, **fig}), flush=True)


if __name__ == "__main__":
    main()
