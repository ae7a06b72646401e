"""The engine on its default attention backend against the engine on FlashInfer's, in one run: batch-1 decode step,
256 x (512 in, 128 out) throughput, prefill in 8k-token passes, and the time to first token of a batch-1 request
whose 4k prompt is a cached 3.5k prefix and 512 new tokens. Random Llama-3.1-8B-shape weights.

    python -m bench.backends [--shape llama-3.1-8b|tiny] [--backends auto,flashinfer] [--rounds 3] [--out DIR]

The engines are built one at a time, alternated over --rounds (the throughput run in the second only, the first
having compiled every kernel); backends.json is written after each engine;
each figure is the median over the rounds that have it. Goals (issue 64), each a PASS/FAIL line for every backend
after the first: the first (the default) is at least as fast on batch-1 step, throughput, prefill and the cached
prefill's TTFT (1% tolerance: the run-to-run spread); FlashInfer serving the workloads without an error is the
other goal, met when this finishes. Writes backends.json.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.common import SHAPES, engine_figures, log, median, model_dir
from shared.engine.config import ATTENTION_BACKENDS, attention_backend_error
from shared.tokenizer import Tokenizer

TOLERANCE = 0.01  # the default may be this much slower and still pass: single runs spread ~1%
# figure -> (label, higher is better)
FIGURES = {"b1_step_ms": ("batch-1 decode ms/step", False), "b1_period_ms": ("  its step between launches ms", False),
           "b1_graph_ms": ("  its graph replay ms", False), "tput_tok_s": ("256x(512,128) out tok/s", True),
           "prefill_tok_s": ("prefill tok/s (8k passes)", True),
           "cached_prefill_ttft_ms": ("TTFT, cached prefix + 512 new ms", False)}
GOALS = ("b1_step_ms", "tput_tok_s", "prefill_tok_s", "cached_prefill_ttft_ms")


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.backends", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--backends", default="auto,flashinfer",
                    help=f"comma-separated, of {', '.join(ATTENTION_BACKENDS)}; the first is the reference")
    ap.add_argument("--rounds", type=int, default=3, help="batch-1 rounds, the engines alternated")
    ap.add_argument("--reqs", type=int, default=256, help="requests of the throughput run (512 in, 128 out)")
    ap.add_argument("--steps", type=int, default=200, help="batch-1 decode steps")
    ap.add_argument("--prefill-len", type=int, default=4096, help="prompt tokens of the prefill figures")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if len(backends) < 2 or len(set(backends)) != len(backends):
        ap.error("--backends: two or more different backends, the reference first")
    for b in backends:
        if error := attention_backend_error(b):
            ap.error(error)
    os.makedirs(args.out, exist_ok=True)
    cuda = torch.cuda.is_available()
    path = model_dir(args.shape)
    tok = Tokenizer.load(path)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "backends": backends,
                 "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    config = dict(max_context_len=args.prefill_len + 64, chunked_prefill_size=8192, max_prefill_tokens=8192,
                  max_running_requests=256, cuda_graph_max_bs=256)
    rounds: dict = {b: [] for b in backends}
    for r in range(args.rounds):
        # The throughput run in the second round (every kernel compiled by the first; a call cut short in a later
        # round still has it); the rest, a few seconds each, in every round.
        tput = r == min(1, args.rounds - 1)
        for b in backends:
            log(f"engine on {b}, round {r + 1}")
            rounds[b].append(engine_figures(path, tok, cuda, 400, args.reqs if tput else 0, args.steps,
                                            prefill=args.prefill_len, attention_backend=b, **config))
            log(f"  {rounds[b][-1]}"[:300])
            summarize(res, rounds, os.path.join(args.out, "backends.json"))  # after each engine: a cut run keeps it
    ref = backends[0]
    print(f"\n{res['gpu']}  {args.shape}  medians of {args.rounds} alternated rounds (throughput: the second)")
    print(f"{'metric':32s}" + "".join(f"{b:>12s}" for b in backends) + "".join(f"  {b}/{ref}" for b in backends[1:]))
    for key, (label, _) in FIGURES.items():
        vals = [res[b].get(key) for b in backends]
        if vals[0] is None:
            continue
        print(f"{label:32s}" + "".join(f"{v:12.2f}" if v is not None else f"{'-':>12s}" for v in vals)
              + "".join(f"  {v / vals[0]:>{len(b) + len(ref) + 1}.3f}" if v else "" for b, v in zip(backends[1:], vals[1:])))
    for verdict, text in verdicts(res, backends, judged=cuda):
        print(f"{verdict}  {text}")


def summarize(res: dict, rounds: dict, path: str) -> None:
    """Each backend's medians over the rounds run so far, into res and written to `path`."""
    for b, figs in rounds.items():
        if figs:
            res[b] = {k: median([f[k] for f in figs if k in f]) for k in FIGURES if any(k in f for f in figs)}
            res[b]["rounds"] = figs
    with open(path, "w") as f:
        json.dump(res, f, indent=2)


def verdicts(res: dict, backends: list[str], judged: bool) -> list[tuple[str, str]]:
    """(PASS / FAIL, or INFO where the figures are not judged: the CPU's, text) for each goal and backend."""
    ref, out = backends[0], []
    for b in backends[1:]:
        for key in GOALS:
            mine, theirs = res[ref].get(key), res[b].get(key)
            if mine is None or theirs is None:
                continue
            label, higher = FIGURES[key]
            ok = mine >= theirs * (1 - TOLERANCE) if higher else mine <= theirs * (1 + TOLERANCE)
            out.append((("PASS" if ok else "FAIL") if judged else "INFO",
                        f"{label.strip()}: {ref} {mine:.2f}, {b} {theirs:.2f} ({ref} at least as "
                        f"{'fast' if higher else 'quick'}, {100 * TOLERANCE:.0f}% spread allowed)"))
        out.append(("PASS", f"the engine on {b} ran every workload without an error"))
    return out


if __name__ == "__main__":
    main()
