"""LM programs end to end through the real stack: tree-of-thought and the branch-solve-merge judge, run
(1) through the program endpoint (/v1/programs: the gateway executes the traced program, forks
admitted together after one prefix warm-up), (2) in interpreter mode (the SDK sends each call, with
fork prefix hints), and (3) as the same calls against a server with the radix cache off.

    python -m bench.programs [--shape llama-3.1-8b|tiny] [--instances 32] [--context-words 600]

Like the paper's runs, each program carries a long input of its own (the essay to judge, the passage the
question is about: `--context-words` pseudo-random words), shared by all of that program's calls and forks.

Each mode runs `--instances` programs concurrently (run_batch threads); prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import requests  # noqa: E402

from bench.common import SHAPES, model_dir  # noqa: E402
from bench.stack import start_stack, stop_stack  # noqa: E402
from lang_client import RuntimeEndpoint, set_default_backend  # noqa: E402
from lang_client.examples.branch_solve_merge import multi_dimensional_judge  # noqa: E402
from lang_client.examples.tree_of_thought import tree_search  # noqa: E402


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cache_stats(url: str) -> dict:
    info = requests.get(url + "/server_info", timeout=10).json()
    w = [x["info"] for x in info["workers"] if x["info"]]
    return {"prompt_tokens": sum(x["prompt_tokens"] for x in w), "cached_tokens": sum(x["cached_tokens"] for x in w)}


WORDS = ("tree shade city street summer energy water park policy cost budget health heat study data "
         "people council year plan road roof garden noise air carbon school evidence growth risk").split()


def passage(i: int, words: int) -> str:
    """Deterministic pseudo-text, different for every instance (so reuse is within a program only)."""
    rng = random.Random(i)
    sentences, n = [], 0
    while n < words:
        k = rng.randint(6, 14)
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n += k
    return " ".join(sentences)


def run_mode(url: str, program, args_list: list[dict], remote: bool, threads: int) -> dict:
    set_default_backend(RuntimeEndpoint(url))
    before = cache_stats(url)
    t0 = time.perf_counter()
    states = program.run_batch(args_list, num_threads=threads, progress_bar=False, remote=remote)
    wall = time.perf_counter() - t0
    for s in states:
        s.sync()
    after = cache_stats(url)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    return {"wall_s": wall, "programs_per_s": len(args_list) / wall, "prompt_tokens": prompt,
            "cache_hit_rate": cached / prompt if prompt else 0.0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--instances", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--context-words", type=int, default=600)
    ap.add_argument("--port", type=int, default=31990)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = model_dir(args.shape)
    workloads = {
        "tree-of-thought": (tree_search, [{"question": passage(i, args.context_words) +
                                           f"\nPuzzle {i}: by the passage, how many trees does the plan add?"}
                                          for i in range(args.instances)]),
        "judge": (multi_dimensional_judge, [{"essay": passage(10_000 + i, args.context_words)}
                                            for i in range(args.instances)]),
    }
    warmup = {name: [{k: v.replace("Puzzle", "Warm-up") + " (warm-up)" for k, v in a.items()} for a in arglist[:4]]
              for name, (_, arglist) in workloads.items()}
    url = f"http://127.0.0.1:{args.port}"
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "shape": args.shape, "instances": args.instances,
                 "context_words": args.context_words}
    for cache_on in (True, False):
        log(f"starting the stack, radix cache {'on' if cache_on else 'off'}")
        proc = start_stack(path, args.port, *([] if cache_on else ["--disable-radix-cache"]))
        try:
            for name, (program, arglist) in workloads.items():
                modes = [("program endpoint", True), ("interpreter", False)] if cache_on else [("cache off", False)]
                # Untimed warm-up (first grammar compiles, first batch shapes), then `--repeats` rounds with
                # the modes in alternating order; the best round of each mode is reported.
                run_mode(url, program, warmup[name], remote=True, threads=len(warmup[name]))
                run_mode(url, program, warmup[name], remote=False, threads=len(warmup[name]))
                for rep in range(args.repeats):
                    for mode, remote in (modes if rep % 2 == 0 else modes[::-1]):
                        requests.post(url + "/flush_cache", timeout=30)
                        r = run_mode(url, program, arglist, remote, threads=args.instances)
                        key = f"{name} / {mode}"
                        r["rounds_s"] = res.get(key, {}).get("rounds_s", []) + [round(r["wall_s"], 3)]
                        if key not in res or r["wall_s"] < res[key]["wall_s"]:
                            res[key] = r
                        else:
                            res[key]["rounds_s"] = r["rounds_s"]
                        log(f"{key}: {r['wall_s']:.2f}s, hit rate {r['cache_hit_rate']:.2f}")
        finally:
            stop_stack(proc)
    with open(os.path.join(args.out, "programs.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{args.instances} concurrent programs, {args.shape}")
    print(f"{'workload / mode':36s} {'best s':>8s} {'prog/s':>8s} {'cache hit':>9s}  rounds s")
    for key, r in res.items():
        if isinstance(r, dict):
            print(f"{key:36s} {r['wall_s']:8.2f} {r['programs_per_s']:8.2f} {r['cache_hit_rate']:9.2f}  "
                  f"{r['rounds_s']}")


if __name__ == "__main__":
    main()
