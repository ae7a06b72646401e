"""Tensor parallelism on the GPUs of one host: the same engine figures at TP=1 and TP=N, same run.

    python -m bench.tp [--shape llama-3.1-8b] [--tp 2] [--steps 200] [--reqs 128]

Reported per degree: batch-1 decode ms/step (wall) and graph replay, and output tok/s of reqs × (512 in,
128 out). Goal (issue 15): TP=2 on the 8B shape steps at ≤ 0.6 of TP=1's batch-1 step. Dummy weights are
drawn per rank, so this measures speed only; parity is tests/engine/test_tp.py's job (run it on the GPUs too).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import SHAPES, engine_figures, log, model_dir
from shared.tokenizer import Tokenizer

GOAL_TP2 = 0.6


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reqs", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    if cuda and torch.cuda.device_count() < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} GPUs; this host has {torch.cuda.device_count()}")
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape,
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    for tp in (1, args.tp):
        log(f"engine tp_size={tp}")
        res[f"tp{tp}"] = engine_figures(path, tok, cuda, 400, args.reqs, args.steps, tp_size=tp)
        log(f"  {res[f'tp{tp}']}")
    with open(os.path.join(args.out, "tp.json"), "w") as f:
        json.dump(res, f, indent=2)
    a, b = res["tp1"], res[f"tp{args.tp}"]
    print(f"\n{res['gpu']}, {args.shape}")
    print(f"{'metric':16s} {'tp1':>10s} {'tp' + str(args.tp):>10s} {'ratio':>7s}")
    for key in ("b1_step_ms", "b1_graph_ms", "tput_tok_s"):
        if a.get(key) and b.get(key):
            print(f"{key:16s} {a[key]:10.2f} {b[key]:10.2f} {b[key] / a[key]:7.3f}")
    ratio = b["b1_step_ms"] / a["b1_step_ms"]
    if args.tp == 2:
        print(f"{'PASS' if ratio <= GOAL_TP2 else 'FAIL'}: TP=2 batch-1 step {ratio:.3f} x TP=1 (goal <= {GOAL_TP2})")


if __name__ == "__main__":
    main()
